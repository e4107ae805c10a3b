"""Text BSON cannot hold, made by a task (a result, an error, a retry's error holding a lone surrogate), through a
real worker: the job is settled once and promptly, `get()` answers, and the worker goes on to its next job. And a
job whose run is over keeps no lease from the delivery Kombu acknowledged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from celery import Celery
from pymongo.database import Database

from tests.support.workers import job, producer, send, settled, wait_for

T = "tests.support.e2e_app."

#: What the e2e app's surrogate tasks make: a file name of bytes that are not UTF-8 (tests/support/e2e_app.py).
NOT_UTF8_NAME = os.fsdecode(b"caf\xe9.txt")
#: The same text as a document keeps it: the surrogate written out as its escape.
ESCAPED = "caf\\udce9.txt"

#: A lease long enough that a stranded job is still `running` when PROMPTLY runs out: what these tests wait for
#: must come from the settle, never from the stale sweep.
LONG_LEASE = {"stale_after": 120.0, "max_attempts": 2}
PROMPTLY = 40.0


@pytest.fixture
def start_worker(worker_factory, broker_url: str):
    def start(*, results: bool, **options):
        env = {"BB_RESULT_BACKEND": broker_url} if results else {}
        return worker_factory(env=env, options={**LONG_LEASE, **options})

    return start


def runs_of(db: Database, task_id: str) -> int:
    return db.runs.count_documents({"taskId": task_id})


def the_next_job_runs(app: Celery, db: Database) -> None:
    task_id = send(app, "add", 2, 3)
    wait_for(settled(db, task_id, "succeeded"), PROMPTLY, "the next job")


def test_a_result_holding_a_lone_surrogate_is_kept_and_returned(results_app: Celery, start_worker, db: Database):
    start_worker(results=True)
    result = results_app.send_task(T + "surrogate_result")
    assert result.get(timeout=PROMPTLY) == NOT_UTF8_NAME  # as Celery's JSON carries it, as any other backend
    doc = job(db, result.id)
    assert doc["status"] == "succeeded" and doc["attempts"] == 1 and doc["state"] == "SUCCESS"
    assert doc["resultFormat"] == "encoded:json"  # kept as Celery encoded it: BSON has no string for it
    assert runs_of(db, result.id) == 1
    the_next_job_runs(results_app, db)


@pytest.mark.parametrize("results", [True, False], ids=["result backend", "no result backend"])
def test_an_error_holding_a_lone_surrogate_fails_its_job_with_it(
    results: bool, broker_url: str, start_worker, db: Database
):
    start_worker(results=results)
    app = producer(broker_url)
    if results:
        app.conf.result_backend = broker_url
    task_id = send(app, "surrogate_error")
    doc = wait_for(settled(db, task_id, "failed"), PROMPTLY, "the job failed")
    # Retried as any ValueError is, then failed with it: the surrogate written out where a person reads it.
    assert doc["attempts"] == 2 and runs_of(db, task_id) == 2
    assert doc["lastError"] == f"ValueError: {ESCAPED}"
    assert [entry["error"] for entry in doc["history"]] == [f"ValueError: {ESCAPED}"] * 2
    assert ESCAPED in doc["history"][-1]["traceback"]
    if results:
        with pytest.raises(ValueError) as raised:
            app.AsyncResult(task_id).get(timeout=PROMPTLY)
        assert str(raised.value) == NOT_UTF8_NAME  # the task's own exception, as it raised it
        assert ESCAPED in doc["traceback"]
    the_next_job_runs(app, db)


def test_a_retry_holding_a_lone_surrogate_is_recorded_and_runs_again(results_app: Celery, start_worker, db: Database):
    start_worker(results=True)
    result = results_app.send_task(T + "surrogate_retry")
    assert result.get(timeout=PROMPTLY) == "ok"
    doc = job(db, result.id)
    assert doc["status"] == "succeeded" and runs_of(db, result.id) == 2
    assert [entry["outcome"] for entry in doc["history"]] == ["retry", "succeeded"]
    assert doc["history"][0]["error"] == f"ValueError: {ESCAPED}"
    the_next_job_runs(results_app, db)


def test_the_lease_of_an_acknowledged_delivery_is_not_renewed(
    worker_factory, broker_url: str, db: Database, tmp_path: Path
):
    # A 6 s lease: heartbeats every 1.2 s, a sweep every 3 s. One pool process, and nothing else to deliver: the
    # consumer's QoS keeps the acknowledged delivery until its next one, which never comes.
    worker_factory(concurrency=1, options={"stale_after": 6.0})
    app = producer(broker_url)
    gate = tmp_path / "gate"
    task_id = send(app, "hold_until", str(gate))
    doc = wait_for(lambda: runs_of(db, task_id) and settled(db, task_id, "running")(), 60, "the task running")
    # Its settle will change nothing (its attempt is no longer the job's, as after a settle that did not land): only
    # its lease says whether the job is alive. Celery acknowledged the message as the run started.
    db.jobs.update_one({"_id": doc["_id"]}, {"$inc": {"attempts": 1}})
    gate.touch()
    # The run over, nothing in the worker holds the job: its lease runs out and the stale sweep runs it again.
    wait_for(lambda: runs_of(db, task_id) == 2, 60, "the job taken back by the stale sweep and run again")
    doc = wait_for(settled(db, task_id, "succeeded"), 60, "the second run settled")
    assert [entry["outcome"] for entry in doc["history"]] == ["lost", "succeeded"]
