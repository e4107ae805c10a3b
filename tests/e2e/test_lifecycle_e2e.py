"""Every lifecycle path with a real `celery worker` subprocess, observed in the `jobs` documents."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import celery
import pytest

import bb_broker
from tests.support.workers import Worker, failing_write, job, send, settled, wait_for

T = "tests.support.e2e_app."

#: prefork and threads run Celery's event loop (asynloop) on bbmongo://, gevent its blocking loop (synloop).
POOLS = ["prefork", "threads", "gevent"]
#: For what only a pool of processes does (a task that kills its process, a hard time limit).
PREFORK_ONLY = pytest.mark.parametrize("worker_factory", ["prefork"], indirect=True)
#: Celery's thread pool cannot end a running task (no kill_job): no terminating revoke, no cold shutdown.
CAN_TERMINATE = pytest.mark.parametrize("worker_factory", ["prefork", "gevent"], indirect=True)


@pytest.fixture(params=POOLS)
def worker_factory(request: pytest.FixtureRequest, worker_factory: Callable[..., Worker]) -> Callable[..., Worker]:
    """The lifecycle suite, once per pool (and so on both of Celery's loops)."""

    def make(**kwargs) -> Worker:
        return worker_factory(**{"pool": request.param, **kwargs})

    return make


def outcomes(db, task_id: str) -> list[str]:
    """The outcome of each attempt in the job's history."""
    return [attempt["outcome"] for attempt in job(db, task_id).get("history", [])]


def test_success_failure_backoff_and_final_attempt(app, db, worker_factory) -> None:
    worker_factory()
    ok = send(app, "add", 2, 3)
    flaky = send(app, "fail_until", 2)
    doomed = send(app, "always_fails")

    assert wait_for(settled(db, ok, "succeeded"), message="add succeeded")["attempts"] == 1
    done = wait_for(settled(db, flaky, "succeeded"), message="flaky succeeded")
    assert done["attempts"] == 2 and done["lastError"] == ""
    failed = wait_for(settled(db, doomed, "failed"), message="always_fails failed")
    assert failed["attempts"] == 3 and failed["lastError"] == "ValueError: always fails"
    assert [r["final"] for r in db.runs.find({"taskId": doomed}).sort("attempt")] == [False, False, True]
    # the broker's backoff: base 0.25 s here, 2^attempts: 0.5 s, then 1 s between attempts. The task notes its
    # start on its own clock while the due time is on the server's, which each process measures to within a few
    # milliseconds (bb_broker/clock.py): a loaded machine has seen 7 ms, so the gaps are read to within 50 ms.
    starts = [r["at"] for r in db.runs.find({"taskId": doomed}).sort("attempt")]
    assert starts[1] - starts[0] >= 0.5 - 0.05 and starts[2] - starts[1] >= 1.0 - 0.05
    assert bb_broker.statuses(db) == {"queued": 0, "running": 0, "succeeded": 2, "failed": 1}
    # Each attempt in the job's history, written by the settling writes themselves.
    assert outcomes(db, ok) == ["succeeded"] and outcomes(db, flaky) == ["failed", "succeeded"]
    history = job(db, doomed)["history"]
    assert [(a["n"], a["outcome"], a["error"]) for a in history] == [
        (n, "failed", "ValueError: always fails") for n in (1, 2, 3)
    ]
    assert all("always fails" in a["traceback"] and a["startedAt"] <= a["finishedAt"] for a in history)
    assert db.jobs.count_documents({}) == 3  # events and remote control never become jobs


def test_a_failed_attempt_the_broker_runs_again_is_a_celery_retry(app, db, worker_factory) -> None:
    """Celery sees RETRY for each failed attempt but the last: no errback, no on_failure (Flower: task-retried)."""
    worker_factory()
    errback = app.signature(T + "note_error")
    flaky = send(app, "noted_fail_until", 3, link_error=errback)
    doomed = send(app, "noted_fail_until", 99, link_error=errback)

    done = wait_for(settled(db, flaky, "succeeded"), message="flaky succeeded at its third attempt")
    assert done["attempts"] == 3 and done["lastError"] == ""
    assert [(a["n"], a["outcome"], a.get("error")) for a in done["history"]] == [
        (1, "failed", "RuntimeError: failing attempt 1"),
        (2, "failed", "RuntimeError: failing attempt 2"),
        (3, "succeeded", None),
    ]
    assert all(f"failing attempt {a['n']}" in a["traceback"] for a in done["history"][:2])
    failed = wait_for(settled(db, doomed, "failed"), message="doomed failed after its attempts")
    assert failed["attempts"] == 3 and failed["lastError"] == "RuntimeError: failing attempt 3"
    assert [a["outcome"] for a in failed["history"]] == ["failed", "failed", "failed"]
    wait_for(lambda: db.runs.count_documents({"name": T + "note_error"}) == 1, message="the errback of doomed")

    def hooks(task_id: str) -> list[str]:
        return [r["name"] for r in db.runs.find({"taskId": task_id, "name": {"$in": ["on_retry", "on_failure"]}})]

    assert sorted(hooks(flaky)) == ["on_retry", "on_retry"]
    assert sorted(hooks(doomed)) == ["on_failure", "on_retry", "on_retry"]
    assert [r["failed"] for r in db.runs.find({"name": T + "note_error"})] == [doomed]  # never for flaky
    # Celery counts the broker's retries in request.retries; the task's own retry policy does not.
    runs = list(db.runs.find({"taskId": doomed, "name": T + "noted_fail_until"}).sort("attempt"))
    assert [(r["attempt"], r["retries"], r["final"]) for r in runs] == [(1, 0, False), (2, 1, False), (3, 2, True)]
    assert db.jobs.count_documents({"taskId": {"$in": [flaky, doomed]}}) == 2


def test_a_replaced_task_ends_its_job_and_runs_once(app, db, worker_factory) -> None:
    # Task.replace raises Ignore: Celery sends no success or failure signal, yet the job is done. Left running,
    # the stale sweep, or the worker's release at exit, would run the replaced task again.
    worker = worker_factory()
    task_id = send(app, "replaced_by_add", 2, 3)
    both = {"taskId": task_id, "status": "succeeded"}
    wait_for(lambda: db.jobs.count_documents(both) == 2, message="the replaced job and its replacement succeeded")
    replaced, replacement = db.jobs.find({"taskId": task_id}).sort("_id", 1)
    assert [a["outcome"] for a in replaced["history"]] == ["ignored"]
    assert [a["outcome"] for a in replacement["history"]] == ["succeeded"]
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert db.jobs.count_documents(both) == 2
    assert [r["name"] for r in db.runs.find({"taskId": task_id}).sort("at")] == [T + "replaced_by_add", T + "add"]


def test_eta_waits_in_mongodb_not_in_a_worker(app, db, worker_factory) -> None:
    worker_factory()
    eta = datetime.now(UTC) + timedelta(seconds=10)  # not due yet when the document is read, however slow the publish
    task_id = send(app, "add", 1, 1, eta=eta)
    doc = wait_for(lambda: job(db, task_id), message="the job document")
    # Due at the ETA Celery stamped, on the server's clock (this machine's: they agree within 0.5 s), however long the
    # first publish took on a loaded machine; it waits queued in the collection, not in the worker's memory.
    assert doc["status"] == "queued" and abs(doc["runAfter"] - eta) < timedelta(seconds=0.5)
    done = wait_for(settled(db, task_id, "succeeded"), message="eta task succeeded")
    run = db.runs.find_one({"taskId": task_id})
    assert run["at"] >= doc["runAfter"].timestamp() - 0.5  # not run early (clocks agree within 0.5 s)
    assert done["attempts"] == 1


def test_self_retry_keeps_one_document_with_its_eta(app, db, worker_factory) -> None:
    worker_factory()
    task_id = send(app, "retry_self", 1)
    failed = wait_for(settled(db, task_id, "failed"), message="retry_self gave up")
    runs = list(db.runs.find({"taskId": task_id}).sort("at"))
    assert [r["retries"] for r in runs] == [0, 1, 2]  # max_retries=2, Celery's own policy
    assert all(b["at"] - a["at"] >= 0.9 for a, b in zip(runs, runs[1:], strict=False))  # countdown=1 honoured
    assert db.jobs.count_documents({"taskId": task_id}) == 1
    assert failed["attempts"] == 3 and "not yet" in failed["lastError"]
    assert outcomes(db, task_id) == ["retry", "retry", "failed"]


def test_autoretry_is_honoured_and_its_final_attempt_known(app, db, worker_factory) -> None:
    worker_factory()
    task_id = send(app, "autoretry")
    failed = wait_for(settled(db, task_id, "failed"), message="autoretry gave up")
    runs = list(db.runs.find({"taskId": task_id}).sort("at"))
    assert [(r["retries"], r["final"]) for r in runs] == [(0, False), (1, True)]
    assert failed["attempts"] == 2 and failed["lastError"].startswith("KeyError")


@pytest.mark.change_streams
def test_unknown_task_fails_at_once_naming_it(app, db, worker_factory) -> None:
    worker_factory()
    with db.jobs.watch([{"$match": {"operationType": "update"}}]) as changes:
        task_id = app.send_task("nobody.has.this", args=(1,)).id
        fields = failing_write(changes)
    assert "nobody.has.this" in fields["lastError"]  # in the write that failed it: no reader saw a placeholder
    failed = wait_for(settled(db, task_id, "failed"), message="unknown task failed")
    assert failed["attempts"] == 1 and failed["lastError"] == fields["lastError"]
    assert outcomes(db, task_id) == ["failed"]  # its attempt is recorded by that same write


def test_a_task_running_longer_than_its_lease_keeps_its_job_and_runs_once(app, db, worker_factory) -> None:
    # The worker's lease keeper renews the job while it runs, on every pool. On gevent and eventlet a request's
    # worker_pid is a greenlet's id, which the keeper once took for a process id: os.kill raised OverflowError, the
    # keeper's thread ended, and the stale sweep gave the job to a second run.
    stale_after = 5.0  # a stall of most of it on a loaded machine does not let it lapse
    worker_factory(options={"stale_after": stale_after})
    # Every worker of a fleet sweeps: a second one, on a queue of its own, takes back a job whose lease lapsed.
    worker_factory(options={"stale_after": stale_after}, pool="prefork", extra_args=("-Q", "elsewhere"))
    task_id = send(app, "sleep", 3 * stale_after)
    done = wait_for(settled(db, task_id, "succeeded"), timeout=90, message="the long task succeeded")
    assert done["attempts"] == 1 and outcomes(db, task_id) == ["succeeded"], done
    assert db.runs.count_documents({"taskId": task_id, "phase": "start"}) == 1


def test_revoke_ends_failed(app, db, worker_factory, request: pytest.FixtureRequest) -> None:
    pool = request.node.callspec.params["worker_factory"]
    # Celery's threads pool never ends a running task, gevent's only from 5.5.0: a terminating revoke lets it finish.
    ends_running = pool == "prefork" or (pool == "gevent" and celery.VERSION >= (5, 5))
    worker = worker_factory()
    waiting = send(app, "add", 1, 2, countdown=600)  # never due in the test: only the revoke settles it
    app.control.revoke(waiting)
    running = send(app, "sleep", 30 if ends_running else 3)
    wait_for(lambda: db.runs.find_one({"taskId": running}), message="sleep started")
    app.control.revoke(running, terminate=True)
    revoked = wait_for(settled(db, waiting, "failed"), message="revoked before it ran")
    assert "revoked" in revoked["lastError"]
    assert db.runs.count_documents({"taskId": waiting}) == 0
    # The queued one never had an attempt: the revoke itself is what the job records.
    assert outcomes(db, waiting) == [] and [a["action"] for a in job(db, waiting)["actions"]] == ["revoke"]
    line = rf"Celery {re.escape(celery.__version__)}'s \w+ pool cannot end a running task"
    said = re.search(line, worker.log()) is not None
    assert said != ends_running, worker.log()  # the worker said so as it started, and only where it is so
    if not ends_running:
        wait_for(settled(db, running, "succeeded"), message="the revoked task ran to its end")
        assert outcomes(db, running) == ["succeeded"]
        return
    terminated = wait_for(settled(db, running, "failed"), message="revoked while running")
    assert "revoked" in terminated["lastError"] and "terminated" in terminated["lastError"]
    assert outcomes(db, running) == ["revoked"]


@PREFORK_ONLY
def test_time_limit_counts_as_a_failure(app, db, worker_factory) -> None:
    # a retry that lands while billiard still replaces the killed pool process can be lost in the pool
    worker_factory(options={"max_attempts": 2, "backoff_base": 1.5})
    task_id = send(app, "overrun")
    failed = wait_for(settled(db, task_id, "failed"), timeout=90, message="overrun failed")
    assert failed["attempts"] == 2 and "TimeLimitExceeded" in failed["lastError"]
    assert db.runs.count_documents({"taskId": task_id}) == 2
    assert outcomes(db, task_id) == ["failed", "failed"]
    assert all("TimeLimitExceeded" in a["error"] for a in job(db, task_id)["history"])


def test_warm_shutdown_finishes_and_records_running_tasks(app, db, worker_factory) -> None:
    worker = worker_factory()
    task_id = send(app, "sleep", 2)
    wait_for(lambda: db.runs.find_one({"taskId": task_id}), message="sleep started")
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert job(db, task_id)["status"] == "succeeded"
    assert db.runs.count_documents({"taskId": task_id, "phase": "end"}) == 1


@pytest.mark.parametrize("worker_factory", ["solo"], indirect=True)
def test_a_warm_shutdown_of_a_solo_worker_starts_no_job_after_the_running_one(app, db, worker_factory) -> None:
    # The solo pool runs a task inside its delivery: one turn of the event loop delivered the next job and ran it
    # too, after the stop was asked for (and Celery's remote control waited through every task of the turn).
    worker = worker_factory()
    first, second = send(app, "sleep", 3), send(app, "sleep", 3)
    wait_for(lambda: db.runs.find_one({"taskId": first}), message="the first task started")
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert job(db, first)["status"] == "succeeded"
    assert db.runs.find_one({"taskId": second}) is None and job(db, second)["status"] == "queued"


@CAN_TERMINATE
def test_cold_shutdown_settles_the_jobs_it_cut_short(app, db, worker_factory) -> None:
    worker = worker_factory()
    task_id = send(app, "sleep", 60)
    wait_for(lambda: db.runs.find_one({"taskId": task_id}), message="sleep started")
    worker.signal(signal.SIGQUIT)
    worker.wait(60)
    doc = job(db, task_id)
    assert doc["status"] == "queued" and doc["lastError"], doc
    [cut_short] = doc["history"]
    assert cut_short["outcome"] == "lost" and cut_short["n"] == 1 and cut_short["error"] == doc["lastError"]


@CAN_TERMINATE
@pytest.mark.parametrize("max_attempts", [3, 1])
def test_cold_shutdown_settles_the_acks_late_jobs_it_cut_short_as_run(
    app, db, worker_factory, tmp_path, max_attempts: int
) -> None:
    # Celery cancels an acks_late task as it stops cold, then its message comes back unacked: the job was given
    # back as never started (its attempt taken back, no history), and a task the worker kept being stopped on never
    # failed.
    worker = worker_factory(options={"max_attempts": max_attempts})
    task_id = send(app, "hold_until_acked_late", str(tmp_path / "never"))
    wait_for(lambda: db.runs.find_one({"taskId": task_id}), message="the task started")

    def started_in_the_main_process() -> bool:
        # Celery cancels a request whose start its main process heard of (time_start): under load that can come
        # after the task's own first line ran.
        active = app.control.inspect(timeout=2).active() or {}
        return any(task["id"] == task_id and task.get("time_start") for tasks in active.values() for task in tasks)

    wait_for(started_in_the_main_process, message="the worker's main process has the task started")
    worker.signal(signal.SIGQUIT)
    worker.wait(60)
    doc = job(db, task_id)
    assert doc["status"] == ("queued" if max_attempts > 1 else "failed") and doc["attempts"] == 1, doc
    [cut_short] = doc["history"]
    assert cut_short["outcome"] == "lost" and cut_short["n"] == 1 and cut_short["startedAt"] is not None


@PREFORK_ONLY
def test_a_task_that_kills_its_pool_process_fails_after_its_attempts(app, db, worker_factory) -> None:
    worker_factory()
    exits, segfaults = send(app, "exit_process"), send(app, "segfault")
    fine = send(app, "add", 4, 4)
    for doomed in (exits, segfaults):
        failed = wait_for(settled(db, doomed, "failed"), timeout=120, message="the process killer failed")
        assert failed["attempts"] == 3 and "WorkerLostError" in failed["lastError"]
    assert "SIGSEGV" in job(db, segfaults)["lastError"]
    assert outcomes(db, exits) == ["failed"] * 3 and outcomes(db, segfaults) == ["failed"] * 3
    assert job(db, fine)["status"] == "succeeded"


def test_worker_killed_mid_task_its_job_is_requeued_and_run_again(app, db, worker_factory) -> None:
    victim = worker_factory(options={"stale_after": 3})
    task_id = send(app, "sleep", 5)  # long enough to be still running when the kill comes, however loaded the machine
    wait_for(lambda: db.runs.find_one({"taskId": task_id}), message="sleep started")
    victim.kill()
    assert job(db, task_id)["status"] == "running"
    worker_factory(options={"stale_after": 3})
    done = wait_for(settled(db, task_id, "succeeded"), timeout=60, message="re-run after the crash")
    assert done["attempts"] == 2 and db.runs.count_documents({"taskId": task_id, "phase": "start"}) == 2
    lost, rerun = done["history"]
    assert (lost["n"], lost["outcome"], rerun["n"], rerun["outcome"]) == (1, "lost", 2, "succeeded")
    assert "no heartbeat" in lost["error"] and lost["worker"].count(":") == 2  # the lease owner host:pid:ulid


def test_a_live_job_is_never_requeued_however_long_it_runs(app, db, worker_factory) -> None:
    worker_factory(options={"stale_after": 1.5})
    task_id = send(app, "sleep", 6)  # four times stale_after
    wait_for(settled(db, task_id, "succeeded"), timeout=60, message="long task succeeded")
    assert db.runs.count_documents({"taskId": task_id, "phase": "start"}) == 1
    assert job(db, task_id)["attempts"] == 1


def test_a_task_that_rejects_its_message_without_requeue_never_runs_again(app, db, worker_factory) -> None:
    # Without a result backend too: Celery reports that failure in the worker's main process without the task's
    # request, and the job was put back in the queue (retried with backoff) before Celery's reject could fail it.
    worker_factory()
    task_id = send(app, "reject_for_good")
    failed = wait_for(settled(db, task_id, "failed"), message="the rejected task failed")
    assert failed["attempts"] == 1 and "bad input" in failed["lastError"], failed
    assert outcomes(db, task_id) == ["failed"]
    assert db.runs.count_documents({"taskId": task_id}) == 1


@PREFORK_ONLY
def test_a_lost_pool_process_says_so_when_celery_rejects_its_message(app, db, worker_factory) -> None:
    # acks_late with reject_on_worker_lost: Celery rejects the message of a task whose pool process died, with
    # requeue, and reports no failure, so the rejection is all the job hears of it.
    worker_factory()
    recovers, doomed = send(app, "lost_and_requeued", 2), send(app, "lost_and_requeued", 99)

    done = wait_for(settled(db, recovers, "succeeded"), timeout=120, message="the requeued task ran again")
    [lost, ran] = done["history"]
    assert lost["outcome"] == "failed" and lost["error"].startswith("WorkerLostError: "), lost
    assert ran["outcome"] == "succeeded" and done["attempts"] == 2
    failed = wait_for(settled(db, doomed, "failed"), timeout=120, message="the requeued task used its attempts")
    assert failed["attempts"] == 3 and failed["lastError"].startswith("WorkerLostError: "), failed
    assert all(a["error"].startswith("WorkerLostError: ") for a in failed["history"])


@PREFORK_ONLY
def test_a_lost_or_overrun_attempt_the_broker_runs_again_runs_no_errback(app, db, worker_factory) -> None:
    # The worker's main process reports these failures to Celery's result backend (here none: Celery's disabled
    # one), whose mark_as_failure runs the errbacks: only the job's last failure may.
    worker_factory(options={"max_attempts": 2, "backoff_base": 1.5})
    errback = app.signature(T + "note_error")
    recovers = send(app, "exits_until", 2, link_error=errback)
    overruns = send(app, "overrun", link_error=errback)

    wait_for(settled(db, recovers, "succeeded"), timeout=90, message="the task whose first process died")
    wait_for(settled(db, overruns, "failed"), timeout=90, message="the task that overran twice")
    wait_for(lambda: db.runs.find_one({"name": T + "note_error"}), message="the overrun task's errback")
    errbacks = list(db.runs.find({"name": T + "note_error"}))
    assert {e["failed"] for e in errbacks} == {overruns}  # never for the task that succeeded in the end
    last_start = max(r["at"] for r in db.runs.find({"taskId": overruns}))
    assert all(e["at"] > last_start for e in errbacks)  # none for the first attempt, which the broker ran again
