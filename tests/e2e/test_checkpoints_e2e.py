"""Jobs that resume: a task's checkpoint on its job document, kept through every way a job goes back to the queue,
fenced on the attempt, refused clearly when it cannot be one. Real workers, the real stand-in server."""

from __future__ import annotations

import json
import os
import signal

import pytest
from click.testing import CliRunner

from bb_broker.cli import main
from tests.support.workers import job, producer, settled, wait_for

APP = "tests.support.resume_app"
#: Where its tasks live, for a producer's send_task (the module needs a worker's environment to import).
PREFIX = APP + "."


def _items_done(db, task_id: str) -> list[tuple[int, int]]:
    """(attempt, item) of each item the task did, in the order done."""
    runs = db.runs.find({"taskId": task_id, "item": {"$exists": True}}, sort=[("at", 1)])
    return [(run["attempt"], run["item"]) for run in runs]


@pytest.mark.parametrize("killed", ["the whole worker", "its pool process"])
def test_a_task_sigkilled_midway_resumes_from_its_last_checkpoint(killed, broker_url, db, worker_factory) -> None:
    # Attempt 1 does items 1..4, a checkpoint after each, and is SIGKILLed while it holds after item 4. The next
    # attempt (after the stale sweep, or after the worker saw its pool process die) starts at item 5: every item is
    # done once.
    options = {"stale_after": 4.0}
    first = worker_factory(app=APP, options=options, concurrency=1)
    task_id = producer(broker_url).send_task(PREFIX + "items", args=(10, 4, "hold")).id
    holding = wait_for(lambda: db.runs.find_one({"taskId": task_id, "phase": "holding"}), message="attempt 1 holds")
    assert json.loads(job(db, task_id)["checkpoint"]) == {"done": 4, "total": 10}
    if killed == "the whole worker":
        first.kill()
        worker_factory(app=APP, options=options, concurrency=1)
    else:
        os.kill(holding["pid"], signal.SIGKILL)
    done = wait_for(settled(db, task_id, "succeeded"), timeout=120, message="the job succeeded")
    assert done["attempts"] == 2
    assert _items_done(db, task_id) == [(1, i) for i in range(1, 5)] + [(2, i) for i in range(5, 11)]
    second = db.runs.find_one({"taskId": task_id, "phase": "start", "attempt": 2})
    assert second["resumed"] == {"done": 4, "total": 10}
    assert json.loads(done["checkpoint"]) == {"done": 10, "total": 10}
    assert db.runs.find_one({"taskId": task_id, "phase": "start", "attempt": 1})["resumed"] is None  # a first run


@pytest.mark.parametrize("how", ["retry", "raise"], ids=["celery's own retry", "the broker's retry"])
def test_a_retried_task_resumes_from_its_last_checkpoint(how, broker_url, db, worker_factory) -> None:
    worker_factory(app=APP, concurrency=1)
    task_id = producer(broker_url).send_task(PREFIX + "items", args=(10, 6, how)).id
    done = wait_for(settled(db, task_id, "succeeded"), timeout=90, message="the job succeeded")
    assert done["attempts"] == 2
    assert _items_done(db, task_id) == [(1, i) for i in range(1, 7)] + [(2, i) for i in range(7, 11)]
    assert done["checkpointCounts"] == {"done": 10, "total": 10}


def test_a_job_given_back_at_a_warm_shutdown_resumes_from_its_checkpoint(
    broker_url, db, worker_factory, tmp_path
) -> None:
    # Attempt 1 checkpoints items 1..4 and retries itself in 3 s. Meanwhile the worker's one process runs a task that
    # holds it, and the worker claims the job ahead (prefetch) as it comes due. A warm shutdown gives the job back
    # unstarted; another worker runs attempt 2, which resumes at item 5.
    first = worker_factory(app=APP, concurrency=1, env={"BB_PREFETCH_MULTIPLIER": "4"})
    app = producer(broker_url)
    task_id = app.send_task(PREFIX + "items", args=(10, 4, "retry-later")).id
    wait_for(lambda: job(db, task_id).get("status") == "queued" and job(db, task_id).get("checkpoint"))
    gate = tmp_path / "gate"
    app.send_task("tests.support.e2e_app.hold_until", args=(str(gate),))
    wait_for(lambda: (doc := job(db, task_id))["status"] == "running" and doc["attempts"] == 2, message="prefetched")
    first.signal(signal.SIGTERM)
    gate.touch()
    assert first.wait(60) == 0
    given_back = job(db, task_id)
    assert (given_back["status"], given_back["attempts"]) == ("queued", 1)
    assert json.loads(given_back["checkpoint"]) == {"done": 4, "total": 10}
    worker_factory(app=APP, concurrency=1)
    done = wait_for(settled(db, task_id, "succeeded"), timeout=90, message="the job succeeded")
    assert done["attempts"] == 2
    assert _items_done(db, task_id) == [(1, i) for i in range(1, 5)] + [(2, i) for i in range(5, 11)]


def test_a_stale_attempts_checkpoint_changes_nothing(broker_url, db, worker_factory) -> None:
    # Attempt 1's worker stops (SIGSTOP: no heartbeats) while its pool process runs on; the sweep gives the job to a
    # second worker (attempt 2), which saves its checkpoint. Attempt 1's save afterwards lands nowhere, and says so.
    options = {"stale_after": 4.0}
    first = worker_factory(app=APP, options=options, concurrency=1)
    task_id = producer(broker_url).send_task(PREFIX + "save_after_gate", args=("k",)).id
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 1}), message="attempt 1 runs")
    first.signal(signal.SIGSTOP)
    worker_factory(app=APP, options=options, concurrency=1)
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 2}), timeout=60, message="attempt 2 runs")
    db.fixes.insert_one({"_id": "k:2"})
    second = wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 2, "phase": "saved"}))
    assert (second["saved"], second["reads"]) == (True, {"attempt": 2})
    saved_at = job(db, task_id)["checkpointAt"]
    db.fixes.insert_one({"_id": "k:1"})
    first_save = wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 1, "phase": "saved"}))
    # Nothing landed: what it reads back is the job's checkpoint, attempt 2's.
    assert (first_save["saved"], first_save["reads"]) == (False, {"attempt": 2})
    doc = job(db, task_id)
    assert (json.loads(doc["checkpoint"]), doc["checkpointAt"]) == ({"attempt": 2}, saved_at)
    db.fixes.insert_many([{"_id": "k:2:end"}, {"_id": "k:1:end"}])
    assert wait_for(settled(db, task_id, "succeeded"), message="attempt 2 succeeded")["attempts"] == 2
    assert json.loads(job(db, task_id)["checkpoint"]) == {"attempt": 2}


def test_an_operators_retry_resumes_from_the_checkpoint_and_a_fresh_one_starts_over(
    broker_url, db, worker_factory
) -> None:
    worker_factory(app=APP, options={"max_attempts": 1}, concurrency=1)
    app = producer(broker_url)
    kept, fresh = (app.send_task(PREFIX + "items", args=(6, 3, "until-fixed")).id for _ in range(2))
    for task_id in (kept, fresh):
        failed = wait_for(settled(db, task_id, "failed"), message="the job failed for good")
        assert failed["checkpointCounts"] == {"done": 3, "total": 6}
    db.fixes.insert_one({"_id": "fixed"})
    for task_id, options in ((kept, []), (fresh, ["--fresh"])):
        result = CliRunner().invoke(main, ["retry", "--broker", broker_url, task_id, *options])
        assert result.exit_code == 0 and result.stdout == "retried 1 failed job\n", result.output
        wait_for(settled(db, task_id, "succeeded"), message="the retried job succeeded")
    assert _items_done(db, kept) == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6)]  # item 3 saved before it failed
    assert _items_done(db, fresh) == [(1, 1), (1, 2), (1, 3)] + [(1, i) for i in range(1, 7)]
    records = {task_id: job(db, task_id)["actions"][-1] for task_id in (kept, fresh)}
    assert "checkpoint" not in records[kept] and records[fresh]["checkpoint"] == "cleared"


BAD = {
    "object": "CheckpointError: a checkpoint holds JSON types only (dict, list, str, int, float, bool, None); "
    "the value['cursor'] is a object",
    "nan": "CheckpointError: a checkpoint holds JSON numbers only; the value['done'] is nan",
    "int key": "CheckpointError: a checkpoint's object keys are strings; the value has the key 1",
    "oversize": "CheckpointError: a checkpoint is at most 16384 bytes as JSON; this one is 17419: keep a cursor "
    "(an offset, the last id done), not the work itself",
    "deep": "CheckpointError: a checkpoint nests at most 32 levels deep;",
}


def test_a_checkpoint_that_cannot_be_one_fails_its_task_clearly_and_the_worker_runs_on(
    broker_url, db, worker_factory
) -> None:
    worker = worker_factory(app=APP, options={"max_attempts": 1}, concurrency=1)
    app = producer(broker_url)
    ids = {kind: app.send_task(PREFIX + "bad_checkpoint", args=(kind,)).id for kind in BAD}
    for kind, task_id in ids.items():
        failed = wait_for(settled(db, task_id, "failed"), message=f"the {kind} task failed")
        assert failed["lastError"].startswith(BAD[kind]), failed["lastError"]
        assert db.runs.find_one({"taskId": task_id})["error"].startswith(BAD[kind])
        assert "checkpoint" not in failed
    after = app.send_task(PREFIX + "items", args=(3, 0, "hold")).id
    assert wait_for(settled(db, after, "succeeded"), message="the worker runs on")
    assert worker.process.poll() is None
