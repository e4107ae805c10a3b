"""Job documents written by hand (or by another program) next to real workers and a real Flower: each fails its own
job once, naming its field, or is shown as it is; no thread of ours dies of one, and one that dies is restarted."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bson import ObjectId
from playwright.sync_api import expect
from pymongo.database import Database

from bb_broker.beat import ScheduleStore
from bb_broker.clock import ServerClock
from bb_broker.jobs.store import JobStore
from bb_broker.server import capabilities
from tests.packaging.test_cli import run_cli
from tests.support.beat_process import OUT_OF_RANGE, add_out_of_range_entries
from tests.support.workers import job, send, settled, wait_for

#: A sweep every 5 s (and one as each worker starts): the queued jobs no claim can find are failed within a test.
SWEEPING = {"stale_after": 10.0}


def hand_written(
    db: Database, app: Any, edit: Callable[[dict[str, Any]], None] | None = None, **changes: Any
) -> dict[str, Any]:
    """A copy of a real job of task `add`, queued on `celery`, with `changes` (a `None` value removes the field) and
    then `edit(doc)` applied, inserted in one write as another program would: a running worker never sees it half
    made. Its task id is the one its payload's headers carry."""
    parked = send(app, "add", 1, 2, queue="parked")  # a queue no worker reads: the template never runs
    doc = db.jobs.find_one_and_delete({"taskId": parked})
    doc |= {"_id": f"hand-{parked}", "queue": "celery", "runAfter": datetime.now(UTC) - timedelta(seconds=1)}
    for name, value in changes.items():
        if value is None:
            doc.pop(name, None)
        else:
            doc[name] = value
    if edit is not None:
        edit(doc)
    db.jobs.insert_one(doc)
    return doc


def runs_of(db: Database, doc: dict[str, Any]) -> int:
    return db.runs.count_documents({"taskId": doc["taskId"]})


def live_threads(app: Any) -> list[str]:
    replies = app.control.broadcast("threads", reply=True, timeout=10, limit=1) or []
    return next((names for reply in replies for names in reply.values()), [])


# Each: the field, what it is set to. All are read where a worker claims, settles, releases, or is told of a job.
VARIANTS = {
    "_id an int": ("_id", 7),
    "_id an ObjectId": ("_id", ObjectId()),
    "_id an object": ("_id", {"job": 7}),
    "queue an array of it": ("queue", ["celery"]),
    "queue an array of two": ("queue", ["other", "celery"]),
    "queue an object": ("queue", {"name": "celery"}),
    "queue a number": ("queue", 5),
    "attempts a fraction": ("attempts", 1.5),
    "history an object": ("history", {"n": 1}),
    "runAfter a string": ("runAfter", "2026-01-01T00:00:00"),
    "runAfter missing": ("runAfter", None),
    "payload a string": ("payload", "add(1, 2)"),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_a_hand_written_job_fails_once_naming_its_field_and_the_worker_keeps_up(
    variant: str, app, db, worker_factory
) -> None:
    field, value = VARIANTS[variant]
    worker = worker_factory(options=SWEEPING)
    bad = hand_written(db, app, **{field: value})
    sentinel = send(app, "add", 2, 3)

    wait_for(settled(db, sentinel, "succeeded"), timeout=30, message="the sentinel ran after the bad document")
    failed = wait_for(
        lambda: (doc := db.jobs.find_one({"_id": bad["_id"]}) or {}).get("status") == "failed" and doc,
        message=f"the job with {variant} failed",
    )
    assert f"malformed job document: {field} must be" in failed["lastError"] or (
        field == "payload" and "payload is a str" in failed["lastError"]
    ), failed["lastError"]
    # Every thread of ours still alive, and none died on the way (the watcher was killed by a queue array). Without
    # change streams (a standalone mongod) there is no watcher: the worker polls.
    ours = {"bb-broker-leases"} | ({"bb-broker-wakeups"} if capabilities(db).change_streams else set())
    assert ours <= set(live_threads(app))
    assert "Exception in thread" not in worker.log() and "died; restarting" not in worker.log()

    # The job never ran, nor does it at the worker's stop (a job released there ran again).
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    after = db.jobs.find_one({"_id": bad["_id"]})
    assert after["status"] == "failed" and after["lastError"] == failed["lastError"] and runs_of(db, bad) == 0
    assert db.jobs.count_documents({"status": {"$ne": "succeeded"}}) == 1  # nothing else was held back


def test_the_stale_sweep_recovers_every_job_when_one_has_a_history_that_is_no_array(db: Database) -> None:
    store = JobStore(db)
    store.ensure_indexes()
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    lost = {"status": "running", "queue": "celery", "attempts": 1, "updatedAt": long_ago, "startedAt": long_ago}
    db.jobs.insert_many([{"_id": "odd", **lost, "history": {"n": 1}}, {"_id": "plain", **lost, "history": []}])
    assert store.requeue_stale() == (2, 0)
    odd, plain = db.jobs.find_one({"_id": "odd"}), db.jobs.find_one({"_id": "plain"})
    assert odd["status"] == plain["status"] == "queued"
    assert odd["history"] == {"n": 1}  # kept as it was written
    assert [entry["outcome"] for entry in plain["history"]] == ["lost"]


def test_flower_shows_hand_written_documents_and_counts_every_status(app, db, worker_factory, flower_factory) -> None:
    flower = flower_factory()
    odd = {
        "actions an object": hand_written(db, app, status="failed", actions={"action": "retry"}),
        "actions a string": hand_written(db, app, status="failed", actions="retried"),
        "history an object": hand_written(db, app, status="failed", history={"n": 1}),
        "taskId a number": hand_written(db, app, status="failed", taskId=12),
        "_id an int": hand_written(db, app, status="failed", _id=7),
        "_id an ObjectId": hand_written(db, app, status="failed", _id=ObjectId()),
        "status unknown": hand_written(db, app, status="pending"),
        "status missing": hand_written(db, app, status=None),
    }
    for variant, doc in odd.items():
        status, body = flower.request("GET", f"/jobs/job?id={doc['_id']}")
        assert status == 200, (variant, body[:2000])
        status, body = flower.request("GET", f"/api/jobs/job?id={doc['_id']}")
        assert status == 200, (variant, body[:2000])

    # An action on the job whose actions are no array (each is recorded with a $push): refused, naming the field.
    status, body = flower.request("POST", f"/api/jobs/job/retry?id={odd['actions an object']['_id']}")
    assert status == 409 and "actions field that is object, not an array" in body, body

    counts = flower.get("/api/jobs?counts=1")["statuses"]
    assert counts["pending"] == 1 and counts["(none)"] == 1 and counts["failed"] == 6
    assert sum(counts.values()) == db.jobs.count_documents({})

    # A queue array arriving while Flower watches its broker: its watcher lives on, and events still arrive.
    hand_written(db, app, queue=["celery"])
    worker_factory(extra_args=("-E",))
    sentinel = send(app, "add", 2, 3)
    wait_for(settled(db, sentinel, "succeeded"), timeout=60, message="the sentinel ran")
    wait_for(lambda: flower.task(sentinel).get("state") == "SUCCESS", message="Flower saw the sentinel succeed")
    assert "unhashable" not in flower.log() and "Exception in thread" not in flower.log()
    assert job(db, sentinel)["status"] == "succeeded"


def strict_json(text: str) -> Any:
    """JSON as a browser's `response.json()` reads it: no NaN or Infinity."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_job_whose_arguments_hold_nan_or_nest_deep_is_shown_as_strict_json(app, db, flower_factory) -> None:
    deep: list[Any] = [1]
    for _ in range(150):  # past what a page shows, as a hand-written document (or another server) can hold
        deep = [deep]

    def odd_arguments(doc: dict[str, Any]) -> None:
        doc["payload"]["args"] = [float("nan"), float("inf"), deep]

    doc = hand_written(db, app, odd_arguments, status="failed")
    flower = flower_factory()
    for path in (f"/api/jobs/job?id={doc['_id']}", f"/jobs/job?id={doc['_id']}"):
        status, body = flower.request("GET", path)
        assert status == 200, (path, body[:500])  # was: a RecursionError, 500
    answer = strict_json(flower.request("GET", f"/api/jobs/job?id={doc['_id']}")[1])
    nan, inf, shown = answer["payload"]["args"]
    assert (nan, inf) == ("nan", "inf") and "nested deeper than 100 levels" in json.dumps(shown)


def test_the_jobs_tab_shows_unknown_statuses_and_odd_ids_in_a_browser(app, db, flower_factory, browser) -> None:
    flower = flower_factory()
    hand_written(db, app, status="pending")
    hand_written(db, app, status=None)
    hand_written(db, app, status="failed", _id=7, actions={"action": "retry"})
    page = browser.new_page()
    page.goto(f"{flower.url}/jobs")
    expect(page.locator("#count-failed")).to_have_text("failed 1")
    expect(page.locator("#status-counts .count-unknown")).to_have_text(["(none) 1", "pending 1"])
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(3)
    page.goto(f"{flower.url}/jobs/job?id=7")
    expect(page.locator("#job-status")).to_have_text("failed")


def test_the_schedules_view_and_api_flag_entries_edited_into_numbers_no_date_holds(db, flower_factory) -> None:
    ScheduleStore(db, ServerClock(db)).add("nightly", "tests.support.e2e_app.add", {"crontab": "0 3 * * *"})
    add_out_of_range_entries(db)  # each made the view and the API answer 500
    flower = flower_factory()
    listed = {entry["name"]: entry for entry in flower.get("/api/schedules")["entries"]}
    assert listed["nightly"]["problem"] is None and listed["nightly"]["nextSlot"].startswith("20")
    for name in OUT_OF_RANGE:
        assert listed[name]["problem"].startswith(f"entry {name!r}: ") and listed[name]["nextSlot"] is None, name
    assert "got 9999-12-31T00:00:00+00:00" in listed["last-slot-9999"]["problem"]
    page = flower.page("/jobs/schedules")
    assert page.count('class="text-danger small entry-problem"') == len(OUT_OF_RANGE)


def test_the_schedules_view_shows_entries_whose_last_job_and_catch_ups_were_written_by_hand(db, flower_factory) -> None:
    # The page linked lastJob.taskId through url_escape: a number there made it answer 500 for every user.
    store = ScheduleStore(db, ServerClock(db))
    for name in ("numbered", "caught-up"):
        store.add(name, "tests.support.e2e_app.add", {"crontab": "0 3 * * *"})
    db.bb_schedules.update_one({"_id": "numbered"}, {"$set": {"lastJob": {"taskId": 42, "slot": 1}}})
    db.bb_schedules.update_one({"_id": "caught-up"}, {"$set": {"catchUps": {"from": "yesterday"}}})
    flower = flower_factory()
    listed = {entry["name"]: entry for entry in flower.get("/api/schedules")["entries"]}
    assert listed["numbered"]["lastTaskId"] is None and listed["numbered"]["problem"] is None
    assert listed["caught-up"]["catchUps"] == [] and "catchUps must be an array" in listed["caught-up"]["problem"]
    page = flower.page("/jobs/schedules")
    assert "numbered" in page and page.count('class="text-danger small entry-problem"') == 1


def test_kinds_no_publish_writes_are_counted_under_one_bounded_name_in_the_cli_and_the_tab(
    app, db, broker_url, flower_factory
) -> None:
    # A kind of 1 MB, and kinds that are no text: `status --by kind` printed the first whole on every line of its
    # table (two lines of 1 MB each), the tab's counts carried it, and the others were printed as names ("7").
    hand_written(db, app, status="failed", kind="k" * 1_000_000)
    hand_written(db, app, status="queued", kind=7, queue="parked")
    hand_written(db, app, status="failed", kind={"name": "add"})
    plain = hand_written(db, app, status="failed")
    expected = {plain["kind"]: 1, "(not a name)": 2}
    for command in (["status", "--by", "kind"], ["status"], ["failed"]):
        result = run_cli(*command, "--broker", broker_url)
        assert result.returncode == 0 and len(result.stdout) < 5000, (command, len(result.stdout), result.stderr[-999:])
    table = run_cli("status", "--by", "kind", "--broker", broker_url).stdout.splitlines()
    assert [line.split()[0] for line in table[1:]] == ["(not", plain["kind"]], table
    assert [line.split()[-1] for line in table[1:]] == ["2", "1"], table  # failed: the 1 MB kind and the document
    counted = json.loads(run_cli("status", "--by", "kind", "--json", "--broker", broker_url).stdout)
    assert {name: row["failed"] for name, row in counted.items()} == expected
    assert counted["(not a name)"]["queued"] == 1

    flower = flower_factory()
    status, body = flower.request("GET", "/api/jobs?counts=1")
    assert status == 200 and len(body) < 100_000, (status, len(body))
    assert {name: row["failed"] for name, row in json.loads(body)["byKind"].items()} == expected
