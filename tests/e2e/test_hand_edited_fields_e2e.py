"""Job documents edited by hand in the fields the claim, the serial index and the backoff go by, through a real
worker: each bad one fails its own job once, at its claim, never run, and the queue behind it keeps moving."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pymongo.database import Database

import bb_broker
from tests.support.workers import job, send, settled, wait_for


def hand_edited(app: Celery, db: Database, task: str, *args: Any, **fields: Any) -> str:
    """A job of `task` published far in the future (so that no claim takes it first), then edited by hand to hold
    `fields` and be due now: its task id."""
    task_id = send(app, task, *args, countdown=3600)
    due = datetime.now(UTC) - timedelta(minutes=1)  # ahead of the jobs published after it
    assert db.jobs.update_one({"taskId": task_id}, {"$set": {**fields, "runAfter": due}}).modified_count == 1
    return task_id


def test_attempts_below_zero_or_past_counting_fail_their_job_once_and_it_never_runs(
    app: Celery, db: Database, worker_factory
) -> None:
    # attempts -1000000 passed the claim's check, and a backoff of 5 s * 2**-999999 is nothing: the failing task ran
    # again at once, hundreds of times, a traceback each, for a million attempts. One past counting ran once.
    bad = {
        -1_000_000: hand_edited(app, db, "always_fails", attempts=-1_000_000),
        -1: hand_edited(app, db, "always_fails", attempts=-1),
        2**40: hand_edited(app, db, "always_fails", attempts=2**40),
    }
    sentinel = send(app, "add", 20, 22)  # behind them all
    worker = worker_factory()
    wait_for(settled(db, sentinel, "succeeded"), timeout=120, message="the job behind the hand-edited ones")
    for attempts, task_id in bad.items():
        failed = wait_for(settled(db, task_id, "failed"), timeout=120, message=f"attempts {attempts} failed")
        assert "malformed job document: attempts must be a whole number from 0 to" in failed["lastError"], failed
        assert f"not {attempts}" in failed["lastError"], failed["lastError"]
        assert failed["attempts"] == attempts + 1 and "history" not in failed, failed  # claimed once, never run
        assert db.runs.count_documents({"taskId": task_id}) == 0, attempts
    assert worker.process.poll() is None
    assert "Traceback" not in worker.log()


def test_serial_keys_that_are_no_strings_fail_their_own_jobs_and_hold_back_no_job_behind_them(
    app: Celery, db: Database, worker_factory, tmp_path: Path
) -> None:
    # A running job whose key is null in the serial index refused the claim of the next null-key job at the head of
    # the queue; the claim skipped only string keys, tried the same head again and gave up: a job without a key
    # behind it waited, a pool process idle, until the running one ended (here, for good: no safety poll).
    worker = worker_factory(concurrency=2, options={"safety_poll_interval": 600.0})
    gate = tmp_path / "gate"
    holder = send(app, "hold_until", str(gate), serial_key="account")
    wait_for(lambda: db.runs.find_one({"taskId": holder}), message="the key's holder under way")
    assert db.jobs.update_one({"taskId": holder}, {"$set": {"serialKey": None}}).modified_count == 1
    bad = {
        "null behind a running null": hand_edited(app, db, "add", 1, 1, serialKey=None),
        "a number": hand_edited(app, db, "add", 1, 2, serialKey=5),
        "the same number": hand_edited(app, db, "add", 1, 3, serialKey=5),
        "too long": hand_edited(app, db, "add", 1, 4, serialKey="k" * 513),
        "empty": hand_edited(app, db, "add", 1, 5, serialKey=""),
    }
    keyless = send(app, "add", 2, 3)
    wait_for(settled(db, keyless, "succeeded"), timeout=60, message="the job without a key behind the bad keys")
    for name, task_id in bad.items():
        failed = wait_for(settled(db, task_id, "failed"), timeout=60, message=f"the key {name} failed")
        assert "malformed job document: serialKey must be a string of 1 to 512 characters" in failed["lastError"]
        assert db.runs.count_documents({"taskId": task_id}) == 0, name  # never run
    assert job(db, holder)["status"] == "running"  # the hand edit of a running job's key is left to it
    gate.touch()
    wait_for(settled(db, holder, "succeeded"), message="the holder, its gate open")
    assert worker.process.poll() is None
    assert "Traceback" not in worker.log()


def test_a_task_name_longer_than_a_kind_holds_is_refused_at_the_producer(app: Celery, db: Database) -> None:
    # The job's `kind` is kept twice in the charts' summaries: an 8.6 MB name was published, and stopped the charts.
    with pytest.raises(bb_broker.MalformedTaskMessage, match="header 'task' must be a task name of at most 1024"):
        app.send_task("t" * 1025, args=(1, 2))
    assert db.jobs.count_documents({}) == 0
    assert job(db, send(app, "add", 1, 2))["kind"] == "tests.support.e2e_app.add"


def test_queue_controls_written_by_hand_under_names_that_are_no_strings_stop_no_worker(
    app: Celery, db: Database, worker_factory
) -> None:
    # Each claim reads the paused and limited queues into a set by name: a document _id there was unhashable, and
    # every claim of every queue failed with it.
    db.bb_queues.insert_many(
        [{"_id": {"queue": "celery"}, "paused": True}, {"_id": 1, "concurrency": 1}, {"_id": 2.5, "fair": True}]
    )
    worker = worker_factory()
    task_id = send(app, "add", 2, 3)
    wait_for(settled(db, task_id, "succeeded"), timeout=60, message="a task beside the hand-written controls")
    assert worker.process.poll() is None
    assert "Traceback" not in worker.log()
