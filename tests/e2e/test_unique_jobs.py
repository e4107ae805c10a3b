"""Unique jobs with real workers: when a key is held and when it is given back, through a run, a failure, the
broker's and the task's own retries and a SIGKILLed worker; publishers in processes of their own at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult
from pymongo.database import Database

from bb_broker import DuplicateJob
from tests.support import unique_app
from tests.support.workers import ROOT, job, settled, wait_for


@pytest.fixture
def tasks(results_app: Celery) -> dict[str, Any]:
    return unique_app.register(results_app)


def refused(publish: Callable[[], Any]) -> DuplicateJob:
    with pytest.raises(DuplicateJob) as duplicate:
        publish()
    assert type(duplicate.value) is DuplicateJob  # as the transport raised it: not retried, not wrapped by Kombu
    return duplicate.value


def status(db: Database, task_id: str) -> Callable[[], Any]:
    return lambda: job(db, task_id).get("status")


def test_a_key_is_held_while_the_job_runs_and_free_once_it_succeeded(tasks, results_worker, db, tmp_path) -> None:
    results_worker()
    gate = tmp_path / "gate"
    first = tasks["hold"].delay(str(gate))
    wait_for(lambda: status(db, first.id)() == "running", message="the unique job running")
    duplicate = refused(lambda: tasks["hold"].delay(str(gate)))
    assert duplicate.task_id == first.id
    gate.touch()
    # The caller refused waits on the job that holds the key, through the bbmongo:// result backend.
    assert AsyncResult(duplicate.task_id, app=first.app).get(timeout=60) == str(gate)
    assert "uniqueActive" not in job(db, first.id)
    again = tasks["hold"].delay(str(gate))
    assert again.get(timeout=60) == str(gate) and db.jobs.count_documents({}) == 2


def test_a_key_is_free_once_its_job_failed_for_good(tasks, results_worker, db) -> None:
    results_worker(options={"max_attempts": 1})
    first = tasks["fails"].delay("boom")
    wait_for(settled(db, first.id, "failed"), message="the unique job failed")
    assert "uniqueActive" not in job(db, first.id)
    second = tasks["fails"].delay("boom")
    assert second.id != first.id and job(db, second.id)["status"] in ("queued", "running", "failed")


def test_a_queued_only_key_is_free_as_soon_as_a_worker_holds_the_job(tasks, results_worker, db, tmp_path) -> None:
    results_worker()
    gate = tmp_path / "gate"
    first = tasks["hold_queued"].delay(str(gate))
    wait_for(lambda: status(db, first.id)() == "running", message="the first job running")
    # The claim gave the key back. The second job goes to a queue no worker reads, so that it stays queued.
    second = tasks["hold_queued"].apply_async((str(gate),), queue="unconsumed")
    assert job(db, second.id)["status"] == "queued" and "uniqueQueued" in job(db, second.id)
    assert refused(lambda: tasks["hold_queued"].delay(str(gate))).task_id == second.id
    gate.touch()
    assert first.get(timeout=60) == str(gate)


def test_the_brokers_retries_keep_the_key(tasks, results_worker, db, tmp_path) -> None:
    results_worker(options={"max_attempts": 20})
    gate = tmp_path / "gate"
    first = tasks["fails_until_file"].delay(str(gate))
    wait_for(lambda: len(job(db, first.id).get("history", [])) >= 1, message="a failed attempt, retried")
    assert refused(lambda: tasks["fails_until_file"].delay(str(gate))).task_id == first.id
    gate.touch()
    assert first.get(timeout=60) == str(gate)
    done = job(db, first.id)
    assert done["attempts"] >= 2 and "uniqueActive" not in done
    assert tasks["fails_until_file"].delay(str(gate)).get(timeout=60) == str(gate)


def test_the_tasks_own_retries_keep_the_key(tasks, results_worker, db, tmp_path) -> None:
    results_worker()
    gate = tmp_path / "gate"
    first = tasks["retries_self"].delay(str(gate))
    retried = lambda: any(entry["outcome"] == "retry" for entry in job(db, first.id).get("history", []))  # noqa: E731
    wait_for(retried, message="a retry of the task's own")
    assert refused(lambda: tasks["retries_self"].delay(str(gate))).task_id == first.id
    gate.touch()
    assert first.get(timeout=60) == str(gate)
    assert db.jobs.count_documents({}) == 1 and "uniqueActive" not in job(db, first.id)
    assert tasks["retries_self"].delay(str(gate)).get(timeout=60) == str(gate)


def test_a_sigkilled_workers_job_keeps_its_key_through_the_sweep(tasks, results_worker, db, tmp_path) -> None:
    victim = results_worker(options={"stale_after": 3})
    gate = tmp_path / "gate"
    first = tasks["hold"].delay(str(gate))
    wait_for(lambda: status(db, first.id)() == "running", message="the unique job running")
    victim.kill()
    assert refused(lambda: tasks["hold"].delay(str(gate))).task_id == first.id  # no lock to orphan: the job holds it
    results_worker(options={"stale_after": 3})
    lost = lambda: [entry["outcome"] for entry in job(db, first.id).get("history", [])] == ["lost"]  # noqa: E731
    wait_for(lost, message="the stale sweep requeued the job")
    assert refused(lambda: tasks["hold"].delay(str(gate))).task_id == first.id  # requeued, it keeps its key
    gate.touch()
    assert first.get(timeout=60) == str(gate)
    done = job(db, first.id)
    assert done["attempts"] == 2 and [entry["outcome"] for entry in done["history"]] == ["lost", "succeeded"]
    assert tasks["hold"].delay(str(gate)).get(timeout=60) == str(gate)  # settled, the key is free


PUBLISHER = """
import json, sys
from bb_broker import DuplicateJob
from tests.support import unique_app
from tests.support.workers import producer

app = producer(sys.argv[1])
add = unique_app.register(app)["add"]
print("ready", flush=True)
sys.stdin.readline()  # all the publishers start together
made, refused = [], []
for _ in range(int(sys.argv[2])):
    try:
        made.append(add.delay(40, 2).id)
    except DuplicateJob as exc:
        refused.append(exc.task_id)
print(json.dumps({"made": made, "refused": refused}))
"""


def test_publishers_in_eight_processes_at_once_make_one_job(broker_url: str, db: Database) -> None:
    publishers = [
        subprocess.Popen(
            [sys.executable, "-c", PUBLISHER, broker_url, "25"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    for publisher in publishers:
        assert publisher.stdout is not None and publisher.stdout.readline() == "ready\n"
    for publisher in publishers:
        assert publisher.stdin is not None
        publisher.stdin.write("go\n")
        publisher.stdin.flush()
    outcomes = [json.loads(publisher.communicate(timeout=120)[0]) for publisher in publishers]
    made = [task_id for outcome in outcomes for task_id in outcome["made"]]
    refusals = [task_id for outcome in outcomes for task_id in outcome["refused"]]
    assert len(made) == 1 and refusals == made * (8 * 25 - 1)
    assert db.jobs.count_documents({}) == 1
