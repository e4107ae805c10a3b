"""The Jobs tab's run now, orphans and holders, argument search and charts in a real Flower, over HTTP."""

from __future__ import annotations

import json
import urllib.parse
from datetime import timedelta
from typing import Any

import pytest
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.summaries import Summaries
from tests.support.flower_process import ADMIN, AUTH_ARGS, HAS_READ_ONLY, NO_READ_ONLY, USERS, VIEWER, FlowerProcess
from tests.support.workers import wait_for


@pytest.fixture
def store(db: Database) -> JobStore:
    store = JobStore(db, Policy(max_attempts=3, stale_after=300.0))
    store.ensure_indexes()
    return store


def publish(
    store: JobStore, task_id: str, *, queue: str = "celery", in_seconds: float | None = None, **body: Any
) -> str:
    due = None if in_seconds is None else store.now() + timedelta(seconds=in_seconds)
    payload = {"args": body.get("args", [1, 2]), "kwargs": body.get("kwargs", {}), "options": {},
               "headers": {"id": task_id, "task": "app.add", **body.get("headers", {})}, "properties": {}}  # fmt: skip
    return store.publish(queue=queue, kind="app.add", task_id=task_id, payload=payload, priority=0, run_after=due,
                         is_retry=False)  # fmt: skip


def answer(flower: FlowerProcess, method: str, path: str, auth: str | None = None, **form: Any) -> tuple[int, Any]:
    """One request as `auth` ("name:password", else the process's own user); the JSON answer when there is one."""
    status, body = flower.request(method, path, form if method == "POST" else None, user=auth)
    return status, json.loads(body) if body.startswith("{") else body


def one(identifier: str) -> str:
    return "id=" + urllib.parse.quote(identifier, safe="")


# --- run now -------------------------------------------------------------------------------------------------------


def test_run_now_one_job_and_a_filter_with_the_rules_of_every_action(
    store: JobStore, db: Database, flower_factory
) -> None:
    later = publish(store, "later", in_seconds=3600)
    mail = [publish(store, f"mail-{n}", queue="mail", in_seconds=3600) for n in range(2)]
    due = publish(store, "due")
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)

    # Only a job that waits shows the button.
    assert 'data-action="run-now">Run now</button>' in flower.page(f"/jobs/job?{one(later)}")
    assert 'data-action="run-now"' not in flower.page(f"/jobs/job?{one(due)}")
    assert 'data-bulk="run-now"' in flower.page("/jobs")
    # A user --jobs_admins does not name reads, and is refused.
    refused = "viewer may read the jobs but not act on them (see --jobs_admins)"
    for path in (f"/api/jobs/job/run-now?{one(later)}", f"/jobs/job/run-now?{one(later)}",
                 "/api/jobs/bulk/run-now?queue=mail&expected=2"):  # fmt: skip
        assert answer(flower, "POST", path, auth=VIEWER) == (403, {"error": refused}), path
    assert "actions" not in db.jobs.find_one({"_id": later})

    status, body = answer(flower, "POST", "/api/jobs/job/run-now", id="later")  # by task id, in the form
    assert status == 200 and body["message"] == "run-now: done" and body["job"]["id"] == later
    doc = db.jobs.find_one({"_id": later})
    assert doc["status"] == "queued" and doc["runAfter"] <= store.now()
    assert [(a["action"], a["by"]) for a in doc["actions"]] == [("run-now", "admin")]
    assert answer(flower, "POST", f"/api/jobs/job/run-now?{one(later)}") == (
        409,
        {"error": f"job {later} is due already: a worker that consumes celery takes it next"},
    )
    assert answer(flower, "POST", f"/api/jobs/job/run-now?{one(due)}")[0] == 409
    assert answer(flower, "POST", "/api/jobs/job/run-now?id=nope")[0] == 404

    # Bulk: the count first, then the action with the count confirmed.
    status, counted = answer(flower, "GET", "/api/jobs/bulk/run-now?queue=mail")
    assert status == 200 and counted["count"] == 2
    assert answer(flower, "POST", "/jobs/bulk/run-now", queue="mail", expected=2, asOf=counted["asOf"]) == (
        200,
        {"message": "run-now: 2 jobs", "count": 2},
    )
    for job_id in mail:
        assert db.jobs.find_one({"_id": job_id})["actions"][-1]["by"] == "admin"
    assert answer(flower, "GET", "/api/jobs/bulk/run-now?queue=mail")[1]["count"] == 0


def test_run_now_and_chart_summaries_in_a_read_only_flower_and_run_now_without_the_pages_token(
    store: JobStore, db: Database, flower_factory
) -> None:
    later = publish(store, "later", in_seconds=3600)
    an_hour_ago = store.now() - timedelta(hours=1)  # a job as its settle left it, in a closed quarter hour
    db.jobs.insert_one({"_id": "done", "queue": "celery", "kind": "app.task", "status": "succeeded", "attempts": 1,
                        "runAfter": an_hour_ago, "startedAt": an_hour_ago, "finishedAt": an_hour_ago,
                        "updatedAt": an_hour_ago, "history": []})  # fmt: skip
    read_only = flower_factory(extra_args=("--read_only",))
    if not HAS_READ_ONLY:  # Flower 2.0: said as it started, and users may act (docs/compatibility.md)
        assert NO_READ_ONLY in read_only.log()
        assert answer(read_only, "POST", f"/api/jobs/job/run-now?{one(later)}")[0] == 200
        return
    error = {"error": "Flower is read-only (--read_only): no job or queue can be changed"}
    assert answer(read_only, "POST", f"/api/jobs/job/run-now?{one(later)}") == (403, error)
    assert answer(read_only, "POST", "/api/jobs/bulk/run-now?queue=celery&expected=1") == (403, error)
    assert 'data-action="run-now"' not in read_only.page(f"/jobs/job?{one(later)}")
    # A read-only Flower writes no summary of the charts' quarter hours, neither ahead nor for a day's chart.
    status, chart = answer(read_only, "GET", "/api/jobs/stats?window=1d")
    assert status == 200 and chart["summarizedUntil"] is not None and sum(chart["series"]["all"]["succeeded"]) == 1
    assert "bb_stats" not in db.list_collection_names()
    # Another summarizes them as it starts, before any chart asks; its charts read them.
    # --no-auth: the page's own endpoint wants the page's XSRF token, which another site's form cannot send.
    open_flower = flower_factory(env={"FLOWER_UNAUTHENTICATED_API": "false"})
    wait_for(lambda: db.bb_stats.find_one({"group": True, "succeeded": 1}), 60, "the finished job summarized ahead")
    passes = Summaries(db.jobs, store.now)
    wait_for(lambda: passes.summarizing_now() is None, 60, "the pass summarizing ahead over")
    assert answer(open_flower, "GET", "/jobs/stats?window=1d")[1]["series"] == chart["series"]  # the page's own
    status, body = open_flower.request("POST", "/jobs/job/run-now", {"id": later})
    assert status == 403 and "_xsrf" in body
    assert "actions" not in db.jobs.find_one({"_id": later})


# --- orphans and holders -------------------------------------------------------------------------------------------


def test_orphans_are_marked_counted_and_filtered_and_holders_listed(
    store: JobStore, db: Database, flower_factory
) -> None:
    now = store.now()
    owner = "box-a:101:01JOWNERA0000000000000000"
    for job_id, heartbeat_ago in (("01J0000000000000000000LIVE", 5), ("01J0000000000000000000LOST", 301)):
        db.jobs.insert_one({"_id": job_id, "taskId": f"t-{job_id}", "kind": "app.add", "queue": "celery",
                            "status": "running", "attempts": 1, "leaseOwner": owner, "createdAt": now,
                            "startedAt": now - timedelta(seconds=400),
                            "updatedAt": now - timedelta(seconds=heartbeat_ago)})  # fmt: skip
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS, user=VIEWER)  # a reader sees them all

    status, body = answer(flower, "GET", "/api/jobs?counts=1")
    assert status == 200 and body["orphaned"] == 1
    orphaned = {job["id"]: job.get("orphaned", False) for job in body["jobs"]}
    assert orphaned == {"01J0000000000000000000LIVE": False, "01J0000000000000000000LOST": True}
    (holder,) = body["holders"]
    assert (holder["owner"], holder["running"], holder["orphaned"], holder["worker"]) == (owner, 2, 1, None)
    assert holder["jobs"] == ["01J0000000000000000000LIVE", "01J0000000000000000000LOST"]
    status, listed = answer(flower, "GET", "/api/jobs?orphaned=1")
    assert [job["id"] for job in listed["jobs"]] == ["01J0000000000000000000LOST"]
    assert listed["filter"] == {"status": "running", "orphaned": "1"}
    assert answer(flower, "GET", "/api/jobs?orphaned=1&status=queued") == (
        400,
        {"error": "bad filter: orphaned jobs are running: status queued has none"},
    )
    assert 'id="job-orphaned"' in flower.page("/jobs/job?id=01J0000000000000000000LOST")
    assert 'id="job-orphaned"' not in flower.page("/jobs/job?id=01J0000000000000000000LIVE")
    # The orphans of a filter are what the bulk requeue takes.
    admin = ADMIN
    status, counted = answer(flower, "GET", "/api/jobs/bulk/requeue?orphaned=1", auth=admin)
    assert status == 200 and counted["count"] == 1
    assert answer(flower, "POST", "/api/jobs/bulk/requeue?orphaned=1&expected=1", auth=admin)[1]["count"] == 1
    assert answer(flower, "GET", "/api/jobs?counts=1")[1]["orphaned"] == 0


# --- search inside arguments ---------------------------------------------------------------------------------------


def test_argument_searches_over_http_take_values_as_text(store: JobStore, db: Database, flower_factory) -> None:
    awkward = ["$where", "a.b", 'O\'Brien "q"', "ünïcødé ✓", "x&y=z#"]
    ids = {value: publish(store, f"t-{n}", args=[value], kwargs={"account": value}) for n, value in enumerate(awkward)}
    invoice = publish(store, "t-invoice", queue="bills", kwargs={"invoice_id": 42}, headers={"tenant": "acme"})
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS)

    def listed(**query: str) -> list[str]:
        status, body = answer(flower, "GET", "/api/jobs?" + urllib.parse.urlencode(query))
        assert status == 200, body
        return [job["id"] for job in body["jobs"]]

    for value, job_id in ids.items():
        assert listed(**{"kwargs.account": value}) == [job_id], value
        assert listed(**{"args.0": value}) == [job_id], value
    assert listed(**{"kwargs.invoice_id": "42", "queue": "bills", "headers.tenant": "acme"}) == [invoice]
    assert listed(**{"kwargs.invoice_id": "42", "queue": "celery"}) == []
    status, body = answer(flower, "GET", "/api/jobs?" + urllib.parse.urlencode({"kwargs.$where": "1"}))
    assert (status, body) == (
        400,
        {"error": "bad filter: 'kwargs.$where': after kwargs. comes a keyword argument's name"},
    )
    status, body = answer(flower, "GET", "/jobs/data?" + urllib.parse.urlencode({"kwargs.account": "$where"}))
    assert (
        body["filter"] == {"kwargs.account": "$where"} and body["searchFrom"] is None and body["searchWindow"] == 10_000
    )

    # A bulk action on an argument search: counted, then confirmed, takes exactly those jobs.
    search = urllib.parse.urlencode({"kwargs.account": "a.b"})
    status, counted = answer(flower, "GET", f"/api/jobs/bulk/cancel?{search}")
    assert status == 200 and counted["count"] == 1 and counted["searchFrom"] is None
    assert (
        answer(flower, "POST", f"/api/jobs/bulk/cancel?{search}&expected=1&asOf={urllib.parse.quote(counted['asOf'])}")[
            1
        ]["count"]
        == 1
    )
    assert {doc["_id"] for doc in db.jobs.find({"status": "failed"})} == {ids["a.b"]}


def test_a_search_window_out_of_range_is_refused_with_its_reason(db: Database, flower_factory) -> None:
    flower = flower_factory(extra_args=("--jobs_search_window=0",))
    status, body = answer(flower, "GET", "/api/jobs?kwargs.account=a")
    assert status == 500 and "--jobs_search_window must be from 1 to 1000000, not 0" in str(body), (status, body)
