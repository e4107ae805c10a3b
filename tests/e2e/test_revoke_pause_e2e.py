"""Durable revoke and queue pauses with real workers: what the collection says holds whatever the workers do."""

from __future__ import annotations

import time

from pymongo.database import Database

from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.workers import job, send, settled, wait_for


def test_a_revoked_queued_job_never_runs_even_after_every_worker_restarts(app, db: Database, worker_factory) -> None:
    first = worker_factory()
    # Due in 10 s: the revoke lands first even on a loaded machine (the worker would run a job due at once).
    sent = time.monotonic()
    doomed = send(app, "add", 1, 1, countdown=10)
    app.control.revoke(doomed)
    # At once, in the revoker's process: no worker needs to be up, or to stay up, for it to hold.
    revoked = job(db, doomed)
    assert revoked["status"] == "failed" and revoked["lastError"] == "revoked before it ran" and revoked["revokedAt"]

    first.kill()
    worker_factory()  # a new worker, which never heard of the revoke
    marker = send(app, "add", 2, 2, countdown=max(1.0, 11 - (time.monotonic() - sent)))  # due after the revoked one
    wait_for(settled(db, marker, "succeeded"), message="a job due after the revoked one ran")
    assert job(db, doomed)["status"] == "failed" and db.runs.count_documents({"taskId": doomed}) == 0


def test_retrying_a_revoked_job_runs_it_on_the_worker_that_saw_the_revoke(app, db: Database, worker_factory) -> None:
    worker_factory()
    doomed = send(app, "add", 3, 4, countdown=600)
    app.control.revoke(doomed)
    assert job(db, doomed)["status"] == "failed"
    # The worker got the broadcast too (it keeps the id in memory): wait until it answers with it.
    wait_for(lambda: doomed in str(app.control.inspect(timeout=5).revoked() or {}), message="revoke reached the worker")

    operations = Operations(JobStore(db))
    retried = operations.retry([doomed], by="tester")
    assert retried.unmatched == []
    job_id = retried.job_ids[0]
    done = wait_for(
        lambda: (doc := db.jobs.find_one({"_id": job_id}))["status"] in ("succeeded", "failed") and doc,
        message="the retried job settled",
    )
    assert done["status"] == "succeeded", done["lastError"]  # not discarded as revoked
    new_task_id = done["taskId"]
    assert new_task_id != doomed and db.runs.find_one({"taskId": new_task_id})["name"] == "tests.support.e2e_app.add"
    assert [a["action"] for a in done["actions"]] == ["revoke", "retry"]


def test_a_paused_queue_waits_for_every_worker_and_resumes(app, db: Database, worker_factory) -> None:
    operations = Operations(JobStore(db))
    assert operations.pause("celery", by="tester")
    worker_factory(extra_args=("-Q", "celery,other"))  # started after the pause: it respects it
    held = send(app, "add", 1, 2)
    ran = send(app, "add", 3, 4, queue="other")
    wait_for(settled(db, ran, "succeeded"), message="the other queue's job ran")
    later = send(app, "add", 5, 6, queue="other")  # sent after the held one: proof the worker kept claiming
    wait_for(settled(db, later, "succeeded"), message="a later job of the other queue ran")
    assert job(db, held)["status"] == "queued" and job(db, held)["attempts"] == 0

    assert operations.resume("celery", by="tester")
    wait_for(settled(db, held, "succeeded"), message="the held job ran after the resume")
