"""Bad and hostile input through a real worker: each gets a clear error and loses nothing else."""

from __future__ import annotations

import pytest

import bb_broker
from tests.support.workers import failing_write, job, send, settled, wait_for


@pytest.mark.change_streams
def test_a_serializer_the_worker_refuses_fails_the_job_and_nothing_else(app, db, worker_factory) -> None:
    worker_factory()
    with db.jobs.watch([{"$match": {"operationType": "update"}}]) as changes:
        refused = app.send_task("tests.support.e2e_app.add", args=(1, 2), serializer="pickle").id
        fields = failing_write(changes)
    assert "ContentDisallowed" in fields["lastError"]  # in the write that failed it: no reader saw a placeholder
    failed = wait_for(settled(db, refused, "failed"), message="pickled task refused")
    assert failed["attempts"] == 1 and failed["lastError"] == fields["lastError"]
    assert (
        failed["payload"]["headers"]["task"] == "tests.support.e2e_app.add"
        and failed["payload"]["bodyFormat"] == "base64"
    )
    fine = send(app, "add", 1, 2)
    wait_for(settled(db, fine, "succeeded"), message="the worker keeps running")


def test_a_payload_corrupted_in_the_collection_fails_that_job_only(app, db, worker_factory) -> None:
    corrupted, fine = send(app, "add", 1, 2), send(app, "add", 3, 4)
    db.jobs.update_one({"taskId": corrupted}, {"$set": {"payload": {"args": "not a list"}}})
    worker_factory()
    failed = wait_for(settled(db, corrupted, "failed"), message="corrupted job failed")
    assert "stored message is unreadable" in failed["lastError"]
    # Its attempt never started, and its history says so, as for every message a claim refuses.
    (entry,) = failed["history"]
    assert entry["outcome"] == "failed" and entry["startedAt"] is None and entry["error"] == failed["lastError"]
    wait_for(settled(db, fine, "succeeded"), message="the other job ran")


def test_an_argument_over_16mb_raises_at_the_producer_with_nothing_written(app, db) -> None:
    with pytest.raises(bb_broker.JobTooLarge, match="16777216 bytes"):
        app.send_task("tests.support.e2e_app.add", args=("x" * (17 * 1024 * 1024), 1))
    assert db.jobs.count_documents({}) == 0


def test_operator_shaped_names_are_only_values(app, db, worker_factory) -> None:
    queue = "$where.q"
    worker_factory(extra_args=("-Q", queue))
    task_id = app.send_task("$gt.task", args=({"$ne": 1},), kwargs={"$where": "1"}, queue=queue).id
    failed = wait_for(settled(db, task_id, "failed"), message="unknown operator-named task failed")
    assert failed["queue"] == queue and failed["kind"] == "$gt.task" and "'$gt.task'" in failed["lastError"]
    assert db.jobs.count_documents({}) == 1


def test_remote_control_and_events_work_and_never_become_jobs(app, db, worker_factory) -> None:
    worker = worker_factory(extra_args=("-E",))
    replies = wait_for(lambda: app.control.inspect(timeout=2).ping(), message="ping answered")
    assert list(replies) == [f"{worker.name}@{list(replies)[0].split('@')[1]}"]
    registered = app.control.inspect(timeout=2).registered()
    assert "tests.support.e2e_app.add" in next(iter(registered.values()))
    task_id = send(app, "add", 5, 5)
    wait_for(settled(db, task_id, "succeeded"), message="add succeeded")
    assert db.jobs.count_documents({}) == 1
    assert [d["taskId"] for d in db.jobs.find()] == [task_id]
    assert bb_broker.statuses(db)["succeeded"] == 1
    assert job(db, task_id)["kind"] == "tests.support.e2e_app.add"
