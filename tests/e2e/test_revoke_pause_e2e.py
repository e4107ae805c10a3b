"""Durable revoke and queue pauses with real workers: what the collection says holds whatever the workers do."""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery
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


def test_a_revoke_holds_beside_other_apps_whose_broker_url_or_options_name_no_store(
    broker_url: str, db: Database, tmp_path: Path
) -> None:
    # The revoker tells each app of its process on the same store whose result backend is its own: an app whose
    # URL names no database (or whose options cannot be read) raised there, and the revoke failed for every app.
    no_database = Celery("no_database", broker="bbmongo://bb:hunter2@localhost", set_as_current=False)
    odd_options = Celery("odd_options", broker=broker_url, set_as_current=False)
    odd_options.conf.broker_transport_options = {"max_attempts": "many"}
    (tmp_path / "results").mkdir()
    revoker = Celery("revoker", broker=broker_url, backend=f"file://{tmp_path / 'results'}", set_as_current=False)
    try:
        parked = revoker.send_task("tests.support.e2e_app.add", args=(1, 2), queue="parked").id
        revoker.control.revoke(parked)
        assert job(db, parked)["status"] == "failed"
        assert revoker.backend.get_task_meta(parked)["status"] == "REVOKED"
    finally:
        for app in (no_database, odd_options, revoker):
            app.close()


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
