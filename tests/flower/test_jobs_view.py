"""The Jobs tab and its JSON API in a real Flower, over HTTP: every read, every action, every refusal."""

from __future__ import annotations

import base64
import html
import json
import re
import urllib.parse
import urllib.request
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import tornado.web
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.jobs.unique import FOREVER_MODE, Hold
from tests.support.flower_process import ADMIN, AUTH_ARGS, FLOWER, USERS, VIEWER, FlowerProcess, broker_rows
from tests.support.store import wait_past
from tests.support.workers import wait_for

#: The installed Flower's (major, minor): its own columns and options differ before 2.2 where the tests say.


@pytest.fixture
def store(db: Database) -> JobStore:
    store = JobStore(db, Policy(max_attempts=1, stale_after=60.0))
    store.ensure_indexes()
    return store


def publish(store: JobStore, task_id: str, *, queue: str = "celery", kind: str = "app.add") -> str:
    payload = {"args": [1, 2], "kwargs": {"x": "y"}, "options": {}, "headers": {"id": task_id}, "properties": {}}
    return store.publish(queue=queue, kind=kind, task_id=task_id, payload=payload, priority=0, run_after=None,
                         is_retry=False)  # fmt: skip


def settle(store: JobStore, queue: str, outcome: str) -> str:
    job = store.claim(queue, "worker-1")
    assert job is not None
    if outcome == "succeeded":
        store.succeed(job.id, job.attempts)
    elif outcome == "failed":
        store.fail(job.id, job.attempts, f"ValueError: {job.task_id} broke")
    return job.id


def seed(store: JobStore) -> dict[str, str]:
    """One job in each status, in two queues: their ids by what they are."""
    jobs = {}
    jobs["failed"] = publish(store, "task-failed", kind="app.flaky")
    settle(store, "celery", "failed")
    jobs["succeeded"] = publish(store, "task-succeeded")
    settle(store, "celery", "succeeded")
    jobs["running"] = publish(store, "task-running", queue="mail")
    settle(store, "mail", "running")
    jobs["queued"] = publish(store, "task-queued", queue="mail", kind="app.mail")
    return jobs


def call(flower: FlowerProcess, method: str, path: str, form: Any = None, auth: str | bool | None = True) -> Any:
    """One request as `auth` ("name:password"), as the process's own user (True), or without credentials (None)."""
    if auth is None:
        return flower.request(method, path, form, credentials=False)
    return flower.request(method, path, form, user=None if auth is True else auth)


def data(flower: FlowerProcess, path: str, *, auth: str | bool | None = True) -> tuple[int, Any]:
    status, body = call(flower, "GET", path, auth=auth)
    return status, json.loads(body) if body.startswith("{") else body


def act(flower: FlowerProcess, path: str, *, auth: str | bool | None = True, **form: Any) -> tuple[int, Any]:
    status, body = call(flower, "POST", path, form, auth=auth)
    return status, json.loads(body) if body.startswith("{") else body


def one(identifier: str) -> str:
    """The query naming one job: `id=<its job id or task id>`, quoted."""
    return "id=" + urllib.parse.quote(identifier, safe="")


def test_lists_counts_and_look_ups(store: JobStore, db: Database, flower_factory) -> None:
    jobs = seed(store)
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS, user=VIEWER)

    status, body = data(flower, "/api/jobs?counts=1")
    newest_first = [jobs[k] for k in ("queued", "running", "succeeded", "failed")]
    assert status == 200 and [job["id"] for job in body["jobs"]] == newest_first
    assert body["statuses"] == {"queued": 1, "running": 1, "succeeded": 1, "failed": 1}
    assert body["byQueue"]["mail"] == {"queued": 1, "running": 1, "succeeded": 0, "failed": 0}
    assert body["byKind"]["app.flaky"]["failed"] == 1 and body["next"] is None
    assert set(body["queues"]) == {"celery", "mail"} and body["queues"]["mail"]["running"] == 1
    # The page's live data: the breakdowns only when it shows them (a scan of an index on a large collection).
    live = data(flower, "/jobs/data")[1]
    assert live["statuses"] == body["statuses"] and "byQueue" not in live and live["canAct"] is False
    assert data(flower, "/jobs/data?breakdowns=1")[1]["byKind"] == body["byKind"]

    first = data(flower, "/api/jobs?limit=3")[1]
    rest = data(flower, f"/api/jobs?limit=3&after={first['next']}")[1]
    assert [j["id"] for j in first["jobs"] + rest["jobs"]] == [j["id"] for j in body["jobs"]]
    assert [j["id"] for j in data(flower, "/api/jobs?queue=mail&status=queued")[1]["jobs"]] == [jobs["queued"]]
    assert [j["id"] for j in data(flower, "/api/jobs?kind=app.flaky")[1]["jobs"]] == [jobs["failed"]]
    assert [j["id"] for j in data(flower, "/api/jobs?error=TASK-FAILED%20broke")[1]["jobs"]] == [jobs["failed"]]
    since = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert data(flower, f"/api/jobs?since={since.replace('+', '%2B')}")[1]["jobs"] == []
    assert len(data(flower, "/api/jobs?since=1h")[1]["jobs"]) == 4
    # An age reaching back before year 1 means since the beginning, not a server error.
    assert len(data(flower, "/api/jobs?since=100000000d")[1]["jobs"]) == 4
    assert data(flower, "/api/jobs?until=100000000d")[1]["jobs"] == []

    for identifier in (jobs["failed"], "task-failed"):
        status, job = data(flower, f"/api/jobs/job?{one(identifier)}")
        assert status == 200 and job["id"] == jobs["failed"] and job["status"] == "failed"
        assert job["arguments"] == {"args": [1, 2], "kwargs": {"x": "y"}} and job["lastError"].endswith("broke")
    assert data(flower, "/api/jobs/job?id=nope") == (404, {"error": "no job has the id or task id 'nope'"})
    assert data(flower, "/api/jobs/job") == (400, {"error": "id is required: a job id or a Celery task id"})


BAD_FILTERS = [
    ("status=done", "bad filter: status 'done' is not one of queued, running, succeeded, failed"),
    ("since=yesterday", "bad filter: 'yesterday' is neither an ISO 8601 time nor a duration like 30m or 7d"),
    ("since=1h&until=2h", "bad filter: since is after until"),
    ("limit=lots", "bad filter: limit 'lots' is not a number"),
    ("limit=1000", "bad filter: limit must be between 1 and 200"),
    ("after=" + "x" * 65, "bad filter: after must be a job id (the `next` of the previous page)"),
    ("queue=" + "q" * 201, "bad filter: queue is longer than 200 characters"),
    ("since=99999999999999d", "bad filter: '99999999999999d' is too long a duration"),
    # A long value is cut short in the answer, not sent back whole.
    (
        "since=" + "x" * 5000,
        "bad filter: 'xxxxxxxxxxxx...xxxxxxxxxxxxx' is neither an ISO 8601 time nor a duration like 30m or 7d",
    ),
]


def test_bad_filters_are_a_clear_400(store: JobStore, flower_factory) -> None:
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS, user=VIEWER)
    for query, error in BAD_FILTERS:
        assert data(flower, f"/api/jobs?{query}") == (400, {"error": error}), query
        assert data(flower, f"/jobs/data?{query}") == (400, {"error": error}), query
        status, page = flower.request("GET", f"/jobs?{query}")
        assert status == 400 and html.unescape(page) == error, (query, page)


def test_every_action_and_every_refusal(store: JobStore, db: Database, flower_factory) -> None:
    jobs = seed(store)
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)

    # No credentials: Flower's own 401, for the API and the pages.
    assert act(flower, f"/api/jobs/job/cancel?{one(jobs['queued'])}", auth=None)[0] == 401
    assert data(flower, "/api/jobs", auth=None)[0] == 401
    assert call(flower, "GET", "/jobs", auth=None)[0] == 401
    # A read-only user: reads, and a clear 403 for every action.
    assert data(flower, "/api/jobs", auth=VIEWER)[0] == 200
    refused = "viewer may read the jobs but not act on them (see --jobs_admins)"
    for path in (f"/api/jobs/job/cancel?{one(jobs['queued'])}", "/api/jobs/bulk/retry", "/api/queues/mail/pause",
                 f"/jobs/job/cancel?{one(jobs['queued'])}", "/jobs/queue/mail/pause", "/jobs/bulk/delete"):  # fmt: skip
        assert act(flower, path, auth=VIEWER) == (403, {"error": refused}), path
    assert db.jobs.find_one({"_id": jobs["queued"]})["status"] == "queued" and db.bb_queues.count_documents({}) == 0
    # Unknown id, wrong status, a live lease.
    assert act(flower, "/api/jobs/job/retry?id=nope") == (404, {"error": "no job has the id or task id 'nope'"})
    wrong = (409, {"error": f"job {jobs['succeeded']} is succeeded: retry needs it failed"})
    assert act(flower, f"/api/jobs/job/retry?{one(jobs['succeeded'])}") == wrong
    status, answer = act(flower, "/api/jobs/job/requeue", id=jobs["running"])  # the id in the form, as the page
    assert status == 409 and "live lease" in answer["error"]
    assert act(flower, f"/api/jobs/job/delete?{one(jobs['queued'])}")[0] == 409
    assert flower.request("POST", f"/api/jobs/job/explode?{one(jobs['queued'])}")[0] == 404
    assert act(flower, "/api/jobs/job/cancel") == (400, {"error": "id is required: a job id or a Celery task id"})

    # Each action, and what it left in the collection, with who did it.
    status, answer = act(flower, f"/api/jobs/job/cancel?{one(jobs['queued'])}")
    assert status == 200 and answer["job"]["status"] == "failed" and answer["job"]["lastError"] == "cancelled by admin"
    assert store.claim("mail", "w") is None
    assert act(flower, "/api/jobs/job/retry?id=task-failed")[1]["job"]["status"] == "queued"
    db.jobs.update_one({"_id": jobs["running"]}, {"$set": {"updatedAt": datetime.now(UTC) - timedelta(hours=1)}})
    assert act(flower, f"/api/jobs/job/requeue?{one(jobs['running'])}")[1]["job"]["status"] == "queued"
    deleted = act(flower, f"/api/jobs/job/delete?{one(jobs['succeeded'])}")[1]["job"]
    assert deleted == {"id": jobs["succeeded"], "deleted": True}
    assert db.jobs.find_one({"_id": jobs["succeeded"]}) is None
    for key, action in (("queued", "cancel"), ("failed", "retry"), ("running", "requeue")):
        record = db.jobs.find_one({"_id": jobs[key]})["actions"][-1]
        assert record["action"] == action and record["by"] == "admin" and record["at"]

    # Bulk on a filter: the count first; a count that no longer holds is refused.
    status, counted = data(flower, "/api/jobs/bulk/cancel?queue=mail")
    assert status == 200 and (counted["action"], counted["count"]) == ("cancel", 1) and counted["asOf"]
    assert act(flower, "/api/jobs/bulk/cancel?queue=mail&expected=5") == (
        409,
        {"error": "1 jobs match now, not 5: confirm again"},
    )
    assert act(flower, "/api/jobs/bulk/cancel?queue=mail&expected=1") == (
        200,
        {"message": "cancel: 1 job", "count": 1},
    )
    assert act(flower, "/jobs/bulk/retry?status=failed&expected=2")[1]["count"] == 2  # the page's own endpoint
    assert act(flower, "/api/jobs/bulk/retry?status=bogus&expected=0") == (
        400,
        {"error": "bad filter: status 'bogus' is not one of queued, running, succeeded, failed"},
    )

    # Queue pause and resume, kept in the database, shown in /api/queues/length and the Broker tab.
    assert act(flower, "/api/queues/mail/pause") == (
        200,
        {"message": "queue mail paused", "queue": "mail", "changed": True},
    )
    assert db.bb_queues.find_one({"_id": "mail"})["pausedBy"] == "admin"
    lengths = {row["name"]: row for row in flower.get("/api/queues/length")["active_queues"]}
    assert lengths["mail"]["paused"] is True and lengths["celery"]["paused"] is False
    assert broker_rows(flower.page("/broker"))["mail"][-1] == "paused by admin"
    assert act(flower, "/jobs/queue/mail/resume")[1]["message"] == "queue mail resumed"
    assert act(flower, "/api/queues/mail/resume")[1]["message"] == "queue mail was not paused"


#: Ids that are words of the Jobs tab's paths, or that a path would read as something else (a separator, a dot
#: segment, an escape, a query): as a Celery task id each may be anything (`apply_async(task_id="bulk")`).
AWKWARD_IDS = ["bulk", "data", "queue", "api", "job", "count", "a/b", "bulk/delete", "a%2Fb", "..", ".", "with space",
               "100%", "ünïcødé ✓", "x?y#z&expected=1"]  # fmt: skip


def finished(store: JobStore, task_id: str, outcome: str = "succeeded") -> str:
    publish(store, task_id, queue="done")
    return settle(store, "done", outcome)


def test_a_job_is_acted_on_alone_whatever_its_id(store: JobStore, db: Database, flower_factory) -> None:
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)
    others = {finished(store, f"other-{n}", outcome) for n, outcome in enumerate(["succeeded", "failed"] * 4)}

    def others_left() -> set[str]:
        return {doc["_id"] for doc in db.jobs.find({"_id": {"$in": list(others)}}, {"_id": 1})}

    for awkward in AWKWARD_IDS:
        # A job whose Celery task id is `awkward`: read and deleted through the API, by that task id.
        job_id = finished(store, awkward)
        status, body = data(flower, f"/api/jobs/job?{one(awkward)}")
        assert (status, body.get("id"), body.get("taskId")) == (200, job_id, awkward), awkward
        status, page = flower.request("GET", f"/jobs/job?{one(awkward)}")
        assert status == 200 and f'data-job="{job_id}"' in page, awkward
        assert act(flower, f"/api/jobs/job/delete?{one(awkward)}") == (
            200,
            {"message": "delete: done", "job": {"id": job_id, "deleted": True}},
        ), awkward
        assert db.jobs.find_one({"_id": job_id}) is None and others_left() == others, awkward

        # A document whose own _id is `awkward` (written by another program): deleted as its page's button does,
        # the id in the form.
        now = store.now()
        db.jobs.insert_one({"_id": awkward, "taskId": f"hand-{awkward}", "status": "succeeded", "queue": "done",
                            "kind": "app.add", "attempts": 1, "createdAt": now, "updatedAt": now})  # fmt: skip
        assert act(flower, "/jobs/job/delete", id=awkward) == (
            200,
            {"message": "delete: done", "job": {"id": awkward, "deleted": True}},
        ), awkward
        assert db.jobs.find_one({"_id": awkward}) is None and others_left() == others, awkward


def test_a_bulk_action_needs_a_filter_and_the_count_confirmed(store: JobStore, db: Database, flower_factory) -> None:
    jobs = seed(store)
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)
    no_filter = {
        "error": "bulk delete needs a filter (status, queue, kind, schedule, since, until, error, orphaned, root): "
        "without one it would take every job"
    }
    # The paths a job called `bulk` once took (`/jobs/bulk/delete` was its page's Delete), with and without a count.
    for path in ("/api/jobs/bulk/delete", "/jobs/bulk/delete", "/api/jobs/bulk/delete?expected=2",
                 "/jobs/bulk/delete?status=&queue=%20&expected=2"):  # fmt: skip
        assert act(flower, path) == (400, no_filter), path
    assert data(flower, "/api/jobs/bulk/delete") == (400, no_filter)
    assert data(flower, "/jobs/bulk/delete/count") == (400, no_filter)
    # A filter, but no count the operator confirmed.
    no_count = "bulk delete needs expected=<the count you confirmed>{}: count first (GET .../count)"
    assert act(flower, "/api/jobs/bulk/delete?status=succeeded") == (400, {"error": no_count.format("")})
    assert act(flower, "/jobs/bulk/delete?status=succeeded&expected=all") == (
        400,
        {"error": no_count.format(" ('all' is not a count)")},
    )
    # Counts int() refuses though str.isdigit() takes them (a superscript two; more digits than int() reads).
    for shape in ("%C2%B2", "9" * 5000, "-1", "1e3"):
        status, answer = act(flower, f"/api/jobs/bulk/delete?status=succeeded&expected={shape}")
        assert status == 400 and answer["error"].startswith("bulk delete needs expected="), (shape[:10], answer)
    assert db.jobs.count_documents({}) == len(jobs)
    assert act(flower, "/api/jobs/bulk/delete?status=succeeded&expected=1") == (
        200,
        {"message": "delete: 1 job", "count": 1},
    )
    assert db.jobs.find_one({"_id": jobs["succeeded"]}) is None and db.jobs.count_documents({}) == len(jobs) - 1


def beat_job(store: JobStore, entry: str, slot: str | None) -> str:
    """A job as a periodic entry's publish stores it: `schedule` its name, `uniqueKey` its slot (a run-now has none)."""
    task_id = f"{entry}-{slot or 'now'}"
    payload = {"args": [], "kwargs": {}, "options": {}, "headers": {"id": task_id, "bb_beat_entry": entry},
               "properties": {}}  # fmt: skip
    hold = None if slot is None else Hold(f"beat:{entry}:{slot}", FOREVER_MODE)
    return store.publish(queue="celery", kind="reports.nightly", task_id=task_id, payload=payload, priority=0,
                         run_after=None, is_retry=False, unique=hold, schedule=entry)  # fmt: skip


def test_the_jobs_of_one_periodic_entry_by_its_name_in_the_api(store: JobStore, db: Database, flower_factory) -> None:
    ours = [beat_job(store, "night & day", "2026-12-01T03:00:00.000+00:00"), beat_job(store, "night & day", None)]
    beat_job(store, "night", "2026-12-01T03:00:00.000+00:00")  # a name that is a prefix of the other
    beat_job(store, " night & day ", None)  # the same name with spaces is another entry
    publish(store, "by-hand", kind="reports.nightly")
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)
    query = "schedule=" + urllib.parse.quote("night & day")
    status, body = data(flower, f"/api/jobs?{query}")
    assert (
        status == 200
        and [job["id"] for job in body["jobs"]] == ours[::-1]
        and body["filter"] == {"schedule": "night & day"}
    )
    run_now, slot = body["jobs"]
    assert (slot["schedule"], slot["uniqueKey"]) == ("night & day", "beat:night & day:2026-12-01T03:00:00.000+00:00")
    assert run_now["schedule"] == "night & day" and "uniqueKey" not in run_now  # a run-now: no slot
    spaced = data(flower, "/api/jobs?schedule=" + urllib.parse.quote(" night & day "))[1]
    assert [job["taskId"] for job in spaced["jobs"]] == [" night & day -now"]
    assert data(flower, f"/api/jobs?{query}&status=failed")[1]["jobs"] == []
    assert len(data(flower, "/api/jobs?kind=reports.nightly")[1]["jobs"]) == 5  # the task's name mixes them all
    assert data(flower, "/api/jobs?schedule=" + "n" * 201) == (
        400,
        {"error": "bad filter: schedule is longer than 200 characters"},
    )
    # A bulk action on the entry's jobs: counted, confirmed, done; the other entries' and the hand-sent job stay.
    counted = data(flower, f"/api/jobs/bulk/cancel?{query}")[1]
    assert counted["count"] == 2
    done = act(flower, f"/api/jobs/bulk/cancel?{query}&expected=2&asOf={urllib.parse.quote(counted['asOf'])}")
    assert done == (200, {"message": "cancel: 2 jobs", "count": 2})
    assert sorted(doc["taskId"] for doc in db.jobs.find({"status": "queued"})) == [
        " night & day -now", "by-hand", "night-2026-12-01T03:00:00.000+00:00",
    ]  # fmt: skip


def test_a_bulk_action_leaves_jobs_that_arrived_or_changed_after_the_count(
    store: JobStore, db: Database, flower_factory
) -> None:
    first, second = publish(store, "task-1", queue="mail"), publish(store, "task-2", queue="mail")
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)
    status, counted = data(flower, "/api/jobs/bulk/cancel?queue=mail")
    assert status == 200 and counted["count"] == 2
    wait_past(store, datetime.fromisoformat(counted["asOf"]))

    # After the operator saw "cancel 2 jobs": a worker takes one, a producer publishes another. Still 2 queued,
    # but not the 2 the operator confirmed: refused, and the new job is left alone.
    taken = store.claim("mail", "worker-1")
    assert taken is not None and taken.id in (first, second)
    late = publish(store, "task-late", queue="mail")
    assert db.jobs.count_documents({"queue": "mail", "status": "queued"}) == 2
    confirm = {"queue": "mail", "expected": 2, "asOf": counted["asOf"]}
    assert act(flower, "/api/jobs/bulk/cancel", **confirm) == (
        409,
        {"error": "1 jobs match now, not 2: confirm again"},
    )
    assert db.jobs.find_one({"_id": late})["status"] == "queued"

    # Counted again: the late job is counted (and cancelled) only once the operator has seen it in a count.
    status, counted = data(flower, "/api/jobs/bulk/cancel?queue=mail")
    wait_past(store, datetime.fromisoformat(counted["asOf"]))
    newest = publish(store, "task-newest", queue="mail")
    confirm = {"queue": "mail", "expected": counted["count"], "asOf": counted["asOf"]}
    assert counted["count"] == 2 and act(flower, "/jobs/bulk/cancel", **confirm)[1]["count"] == 2
    assert db.jobs.find_one({"_id": late})["status"] == "failed"
    assert db.jobs.find_one({"_id": newest})["status"] == "queued"
    assert db.jobs.find_one({"_id": taken.id})["status"] == "running"
    assert act(flower, "/api/jobs/bulk/cancel", queue="mail", expected=1, asOf="soon")[0] == 400
    # A time no BSON date holds once in UTC (it was a 500 from the query's encoding).
    for as_of in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-23:59"):
        refused = act(flower, "/api/jobs/bulk/cancel", queue="mail", expected=1, asOf=as_of)
        assert refused == (400, {"error": f"bad filter: asOf {as_of!r} is not the asOf of a count"}), refused


def test_flowers_read_only_mode_stops_every_action(store: JobStore, db: Database, flower_factory) -> None:
    jobs = seed(store)
    flower = flower_factory(extra_args=("--read_only",))
    if FLOWER < (2, 1):  # Flower 2.0 has no read-only mode and drops the option: bb_broker says so as it starts
        wait_for(lambda: "this Flower has no --read_only" in flower.log(), message="the notice")
        return
    error = {"error": "Flower is read-only (--read_only): no job or queue can be changed"}
    assert act(flower, f"/api/jobs/job/cancel?{one(jobs['queued'])}") == (403, error)
    assert act(flower, "/api/queues/celery/pause") == (403, error)
    assert db.jobs.find_one({"_id": jobs["queued"]})["status"] == "queued"
    assert "read only" in flower.page("/jobs") and 'id="bulk"' not in flower.page("/jobs")


def test_the_pages_show_counts_attempts_and_links(store: JobStore, db: Database, flower_factory) -> None:
    jobs = seed(store)
    started = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    history = [
        {"n": n, "worker": "w1@host", "startedAt": started, "finishedAt": started + timedelta(seconds=n),
         "outcome": "failed", "error": f"RuntimeError: attempt {n}", "traceback": f"Traceback ... attempt {n}"}
        for n in (1, 2, 3)
    ]  # fmt: skip
    db.jobs.update_one({"_id": jobs["failed"]}, {"$set": {"history": history}})
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)

    page = flower.page("/jobs")
    assert 'href="/jobs"' in page and "Jobs</a>" in page and 'id="bulk"' in page  # the tab, and actions for admins
    viewer_page = call(flower, "GET", "/jobs", auth=VIEWER)[1]
    assert 'id="read-only"' in viewer_page and 'id="bulk"' not in viewer_page
    assert "Jobs</a>" in flower.page("/workers")  # the link is in Flower's own navigation bar

    detail = html.unescape(flower.page("/jobs/job?id=task-failed"))
    assert f"Job {jobs['failed']}" in detail and 'href="/task/task-failed"' in detail
    assert detail.count('<tr class="attempt">') == 3 and "RuntimeError: attempt 2" in detail and "3.000 s" in detail
    assert '"args": [1, 2]' in detail and 'data-action="retry"' in detail
    assert 'data-action="retry"' not in call(flower, "GET", f"/jobs/job?{one(jobs['failed'])}", auth=VIEWER)[1]
    missing = flower.request("GET", "/jobs/job?id=nope")
    assert missing[0] == 404 and "no job has the id or task id" in html.unescape(missing[1])


def test_the_jobs_pages_script_is_a_file_of_its_own_that_browsers_keep_until_it_changes(
    store: JobStore, flower_factory
) -> None:
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)
    page = flower.page("/jobs")
    (script,) = re.findall(r'<script src="(/jobs/static/bb_jobs\.js\?v=[0-9a-f]+)"></script>', page)
    inline = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert not [code for code in inline if "filterNames" in code or "uPlot" in code], "the page's code is inline"
    assert 'data-filter-names="[&quot;status&quot;' in page  # what the script reads from the page

    request = urllib.request.Request(flower.url + script)
    request.add_header("Authorization", "Basic " + base64.b64encode(ADMIN.encode()).decode())
    with urllib.request.urlopen(request, timeout=30) as answer:
        body, headers = answer.read().decode(), answer.headers
    assert "JSON.parse(root.dataset.filterNames)" in body and "new uPlot(" in body
    assert headers["Content-Type"].startswith(("application/javascript", "text/javascript"))
    assert f"max-age={tornado.web.StaticFileHandler.CACHE_MAX_AGE}" in headers["Cache-Control"]  # a new script: new v


def test_the_broker_tab_lists_the_collections_queues(store: JobStore, flower_factory) -> None:
    seed(store)
    publish(store, "task-reports", queue="reports")
    flower = flower_factory()  # no worker: Flower knows only the app's default queue
    names = [row["name"] for row in flower.get("/api/queues/length")["active_queues"]]
    assert names == ["celery", "mail", "reports"]
    rows = broker_rows(flower.page("/broker"))
    unknown = "—" if FLOWER >= (2, 2) else "N/A"  # what Flower's own columns show for no value
    assert rows["mail"] == ["mail", "2", "1", "1", unknown, unknown, "—"]
    assert rows["reports"][:4] == ["reports", "1", "0", "1"]


# Flower's internals the Jobs tab relies on, and the guard on each of Flower's actions:
# tests/unit/test_upstream_flower.py.


def test_the_flowerconfig_route_gets_the_jobs_tab_and_its_options(store: JobStore, tmp_path, flower_factory) -> None:
    seed(store)
    config = tmp_path / "flowerconfig.py"
    config.write_text(
        "import bb_broker.contrib.flower  # noqa: F401  (the Broker and Jobs tabs for bbmongo://)\n"
        "basic_auth = ['admin:s3cret', 'viewer:peek']\n"
        "jobs_admins = ['admin']\n"
    )
    flower = flower_factory(launcher="celery", extra_args=(f"--conf={config}",), user=VIEWER)
    assert data(flower, "/api/jobs")[0] == 200
    assert act(flower, "/api/queues/celery/pause")[0] == 403
    assert act(flower, "/api/queues/celery/pause", auth=ADMIN)[0] == 200
