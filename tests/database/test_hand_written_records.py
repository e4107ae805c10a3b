"""Documents written by hand (or by another client) in the fields the operator's actions, the queue controls, the
canvas and the job's page read and write, against the real server: each is data, shown or kept as it is; no action
stops half-way at one of them, and no read of them raises."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.queues import KnownControls, QueueControls, QueueLimits
from bb_broker.jobs.revokes import revoke_queued
from bb_broker.jobs.store import JobStore
from bb_broker.ops.canvas import canvas_of, tree_lines
from bb_broker.ops.filters import JobFilter
from bb_broker.ops.operations import Operations
from bb_broker.ops.present import attempts_of, describe_job
from bb_broker.ops.rerun import RerunRefused, plan, send
from bb_broker.ops.steering import cancel_canvas
from tests.support.store import FakeClock
from tests.support.workers import wait_for

ADD = "tests.support.e2e_app.add"


def publish(store: JobStore, task_id: str, *, queue: str = "hand", **payload: Any) -> str:
    return store.publish(queue=queue, kind=ADD, task_id=task_id, payload={"args": [], "kwargs": {}, **payload},
                         priority=0, run_after=None, is_retry=False)  # fmt: skip


def test_control_documents_whose_id_names_no_queue_are_no_queues(store: JobStore, db: Database) -> None:
    # A document _id and a number as a control's name: every worker's claim read them into a set of paused names
    # (unhashable) and the queue listings sorted them with the names (unsortable).
    db.bb_queues.insert_many(
        [
            {"_id": {"queue": "celery"}, "paused": True},
            {"_id": 1, "paused": True, "concurrency": 2},
            {"_id": 2.5, "fair": True, "rateStarts": 1, "ratePeriod": 1.0},
        ]
    )
    operations = Operations(store)
    operations.pause("real", by="tester")
    operations.set_limits("limited", concurrency=3, by="tester")
    known = KnownControls(QueueControls(db), max_age=0.0)
    assert "real" in known and "celery" not in known and "limited" not in known
    assert known.limits("limited") == QueueLimits(concurrency=3) and not known.limits("celery")
    assert list(operations.queues()) == ["limited", "real"]
    assert list(operations.paused()) == ["real"]
    assert db.bb_queues.count_documents({}) == 5  # nothing written to the hand-written ones


def test_every_action_on_many_jobs_takes_a_job_whose_actions_are_no_array_and_keeps_them(
    store: JobStore, db: Database, clock: FakeClock
) -> None:
    # MongoDB refuses a $push to anything but an array, and an update_many stops at the first such job: the cancel of
    # a filter or of a canvas changed the jobs before it and answered an error; a revoke left the job queued.
    ids = {name: publish(store, f"t-{name}") for name in ("plain", "empty", "text", "number")}
    db.jobs.update_many({}, {"$set": {"rootId": "root"}})  # one canvas
    db.jobs.update_one({"_id": ids["empty"]}, {"$set": {"actions": []}})
    db.jobs.update_one({"_id": ids["text"]}, {"$set": {"actions": "written by hand"}})
    db.jobs.update_one({"_id": ids["number"]}, {"$set": {"actions": 7}})
    operations = Operations(store)

    def actions(name: str) -> Any:
        return db.jobs.find_one({"_id": ids[name]}).get("actions")

    def recorded(name: str) -> list[str]:
        return [entry["action"] for entry in actions(name)]

    def statuses() -> set[str]:
        return {doc["status"] for doc in db.jobs.find({"_id": {"$in": list(ids.values())}})}

    assert operations.act_on_filter("cancel", JobFilter.parse({"queue": "hand"}, clock.now), by="ops") == 4
    assert statuses() == {"failed"} and recorded("plain") == recorded("empty") == ["cancel"]
    assert actions("text") == "written by hand" and actions("number") == 7
    retried = operations.retry(list(ids.values()), by="ops")
    assert sorted(retried.job_ids) == sorted(ids.values()) and not retried.held and statuses() == {"queued"}
    assert recorded("plain") == ["cancel", "retry"] and actions("text") == "written by hand"
    assert revoke_queued(store, [f"t-{name}" for name in ids], by="ops") == 4
    assert statuses() == {"failed"} and recorded("empty") == ["cancel", "retry", "revoke"] and actions("number") == 7
    operations.retry(list(ids.values()), by="ops")
    later = clock.now + timedelta(hours=1)
    db.jobs.update_many({"_id": {"$in": list(ids.values())}}, {"$set": {"runAfter": later}})
    assert operations.act_on_filter("run-now", JobFilter.parse({"queue": "hand"}, clock.now), by="ops") == 4
    assert db.jobs.count_documents({"runAfter": later}) == 0 and actions("text") == "written by hand"
    cancel = cancel_canvas(operations, "t-plain", by="ops")
    assert cancel is not None and len(cancel.cancelled) == 4 and not cancel.refused
    assert statuses() == {"failed"} and actions("number") == 7 and recorded("plain")[-1] == "cancel"


def test_a_canvas_step_whose_id_is_a_document_at_the_end_of_its_stored_chain(
    store: JobStore, db: Database, clock: FakeClock
) -> None:
    # Its chain names a step not published: the read of its whole chain keyed the steps by _id (unhashable).
    publish(store, "root")
    db.jobs.update_one({"taskId": "root"}, {"$set": {"rootId": "root"}})
    chain = [{"task": ADD, "options": {"task_id": "n"}}]
    step = {"_id": {"a": "document"}, "taskId": "t-doc", "kind": ADD, "queue": "hand", "status": "succeeded",
            "attempts": 1, "priority": 0, "createdAt": clock.now, "updatedAt": clock.now, "runAfter": clock.now,
            "rootId": "root", "parentId": "root",
            "payload": {"args": [], "kwargs": {}, "options": {"chain": chain}}}  # fmt: skip
    db.jobs.insert_one(step)
    canvas = canvas_of(Operations(store), "root")
    assert canvas is not None
    steps = {s["id"]: s for s in canvas["steps"]}
    assert steps["t-doc"]["status"] == "succeeded" and steps["n"]["status"] == "pending"
    assert any("t-doc" in line for line in tree_lines(canvas))


def test_a_history_entry_whose_duration_was_written_by_hand_shows_the_one_its_times_give(
    store: JobStore, db: Database, clock: FakeClock
) -> None:
    # `duration` is worked out from the entry's times: a text one was formatted as seconds (`bb-broker show`, the
    # job's page) and raised.
    job_id = publish(store, "t-history")
    started = clock.now
    entries = [{"n": 1, "startedAt": started, "finishedAt": started + timedelta(seconds=2), "duration": "x"},
               {"n": 2, "duration": [1]}]  # fmt: skip
    db.jobs.update_one({"_id": job_id}, {"$set": {"history": entries}})
    doc = db.jobs.find_one({"_id": job_id})
    assert [row.get("duration") for row in attempts_of(doc)] == [2.0, None]
    shown = dict(describe_job(doc))
    assert "(2.000 s)" in shown["attempt 1"] and "s)" not in shown["attempt 2"]


@pytest.fixture
def failed(app: Celery, db: Database) -> tuple[Operations, str]:
    """Operations on a store of one attempt, and a failed job of `add(1, "x")` as Celery's producer stores it."""
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    job_id = app.send_task(ADD, args=(1, "x")).id
    # Waited for: due by the publisher's reading of the server's clock, a moment later by the store's (a loaded
    # machine's round trips).
    claimed = wait_for(lambda: store.claim("celery", "worker-1"), timeout=30, message="the job claimed")
    assert claimed.task_id == job_id
    store.fail(claimed.id, claimed.attempts, "TypeError: unsupported operand")
    return Operations(store), claimed.id


def test_retry_with_changed_arguments_refuses_a_link_it_could_not_record_before_it_sends(
    app: Celery, db: Database, failed: tuple[Operations, str]
) -> None:
    # The new job went out first, then the $push of its link to a replacedBy that is no array was refused: the
    # operator, answered with an error, tried again and sent a second new job.
    operations, job_id = failed
    db.jobs.update_one({"_id": job_id}, {"$set": {"replacedBy": "written by hand"}})
    refused = pytest.raises(RerunRefused, plan, operations, job_id, [1, 2], None)
    assert refused.value.reason == "conflict" and "'s replacedBy is string, not an array" in str(refused.value)
    assert db.jobs.count_documents({}) == 1


@pytest.mark.parametrize("compression", [["zlib"], {"zlib": 1}, 7])
def test_retry_with_changed_arguments_refuses_a_compression_header_that_names_none(
    app: Celery, db: Database, failed: tuple[Operations, str], compression: Any
) -> None:
    operations, job_id = failed
    db.jobs.update_one({"_id": job_id}, {"$set": {"payload.headers.compression": compression}})
    refused = pytest.raises(RerunRefused, plan, operations, job_id, [1, 2], None)
    assert refused.value.reason == "conflict" and "body is not Celery's [args, kwargs, embed]" in str(refused.value)


@pytest.mark.parametrize(
    ("name", "value"), [("delivery_mode", "fast"), ("delivery_mode", [2]), ("priority", "high"), ("reply_to", 5)]
)
def test_retry_with_changed_arguments_drops_a_property_no_message_can_have_and_says_so(
    app: Celery, db: Database, failed: tuple[Operations, str], name: str, value: Any
) -> None:
    # Copied as they were, kombu's publish raised on them (a KeyError, a TypeError) in the send.
    operations, job_id = failed
    db.jobs.update_one({"_id": job_id}, {"$set": {f"payload.properties.{name}": value}})
    rerun = plan(operations, job_id, [1, 2], None)
    assert any(note.startswith(f"its {name} ") and "the new job has none" in note for note in rerun.notes)
    assert name not in rerun.preview()["message"]["properties"]
    with app.connection_for_write() as connection:
        new = send(operations, rerun, connection, by="ops")
    assert new["replaces"] == job_id and new["status"] == "queued" and new["payload"]["args"] == [1, 2]


def test_a_canvas_cancel_says_which_queued_step_it_could_not_find_by_its_id(
    store: JobStore, db: Database, clock: FakeClock
) -> None:
    # A queued step whose _id is a document is shown under its text; the cancel by that text found nothing, and the
    # answer counted the step as finished before.
    publish(store, "root")
    db.jobs.update_one({"taskId": "root"}, {"$set": {"rootId": "root"}})
    step = {"_id": {"a": "document"}, "taskId": "t-doc", "kind": ADD, "queue": "hand", "status": "queued",
            "attempts": 0, "priority": 0, "createdAt": clock.now, "updatedAt": clock.now, "runAfter": clock.now,
            "rootId": "root", "parentId": "root", "payload": {"args": [], "kwargs": {}}}  # fmt: skip
    db.jobs.insert_one(step)
    cancel = cancel_canvas(Operations(store), "root", by="ops")
    assert cancel is not None and [s["id"] for s in cancel.cancelled] == ["root"] and not cancel.finished
    (refused,) = cancel.refused
    assert refused["id"] == "t-doc" and "no job has this id as a string" in refused["why"]
    assert db.jobs.find_one({"taskId": "t-doc"})["status"] == "queued"
