"""The bbmongo:// result backend against the real server and real workers: results live on the job documents."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import celery
import pytest
from celery import Celery, chain, chord, group
from celery.canvas import StampingVisitor
from celery.exceptions import ChordError, Reject, TaskRevokedError
from celery.result import AsyncResult, GroupResult
from click.testing import CliRunner, Result
from kombu.exceptions import EncodeError
from pymongo import monitoring
from pymongo.database import Database

import bb_broker
from bb_broker.cli import main
from bb_broker.results.backend import JobFailed, JobResultBackend
from bb_broker.upstream import celery as upstream_celery
from tests.support.workers import job, producer, wait_for

T = "tests.support.e2e_app."


class CommandCounter(monitoring.CommandListener):
    """Counts one command's calls by this process while `counting()`."""

    def __init__(self, name: str) -> None:
        self.name, self.count, self.on = name, 0, False

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self.on and event.command_name == self.name and event.command.get(self.name) == "jobs":
            self.count += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def bb(broker_url: str, *args: str) -> Result:
    """The `bb-broker` command, as an operator runs it."""
    return CliRunner().invoke(main, [*args, "--broker", broker_url], catch_exceptions=False)


def sig(app: Celery, name: str, *args, **options):
    return app.signature(T + name, args=args, **options)


def test_get_returns_the_result_kept_on_the_job(results_app, results_worker, db: Database):
    assert isinstance(results_app.backend, JobResultBackend)
    results_worker()
    result = results_app.send_task(T + "add", args=(2, 3))
    assert result.get(timeout=60) == 5
    assert result.state == "SUCCESS" and result.ready() and result.successful()
    doc = job(db, result.id)
    assert doc["status"] == "succeeded" and doc["state"] == "SUCCESS" and doc["result"] == 5
    assert doc["dateDone"] is not None
    [attempt] = doc["history"]
    assert attempt["n"] == 1 and attempt["outcome"] == "succeeded" and "@" in attempt["worker"]
    assert attempt["startedAt"] <= attempt["finishedAt"]
    assert "celery_taskmeta" not in db.list_collection_names()


def test_a_task_retried_twice_by_the_broker_gets_its_final_result(results_app, results_worker, db: Database):
    results_worker(options={"backoff_base": 2.0})  # 4 s, then 8 s: long enough to see the state in between
    result = results_app.send_task(T + "fail_until", args=(3,))
    wait_for(lambda: result.state == "RETRY", message="RETRY while the job waits for its next attempt")
    assert isinstance(result.info, RuntimeError) and not result.ready()
    assert result.get(timeout=90) == "ok"
    doc = job(db, result.id)
    assert [a["outcome"] for a in doc["history"]] == ["failed", "failed", "succeeded"]
    assert [a["n"] for a in doc["history"]] == [1, 2, 3]
    assert "RuntimeError: failing attempt 1" in doc["history"][0]["error"]
    assert "failing attempt 1" in doc["history"][0]["traceback"]


def test_another_result_backend_sees_retry_between_attempts_not_failure(broker_url: str, worker_factory):
    """Celery's own backends (rpc:// here, Redis alike) store RETRY for a failed attempt the broker runs again."""
    app = producer(broker_url)
    app.conf.result_backend = "rpc://"
    worker_factory(env={"BB_RESULT_BACKEND": "rpc://"}, options={"backoff_base": 2.0})  # 4 s, then 8 s
    try:
        flaky = app.send_task(T + "fail_until", args=(3,))
        wait_for(lambda: flaky.state == "RETRY", message="RETRY while the job waits for its next attempt")
        assert isinstance(flaky.info, RuntimeError) and not flaky.ready()
        assert flaky.get(timeout=90) == "ok" and flaky.state == "SUCCESS"
        doomed = app.send_task(T + "always_fails")
        with pytest.raises(ValueError, match="always fails"):
            doomed.get(timeout=90)
        assert doomed.state == "FAILURE"
    finally:
        app.close()


def test_a_final_failure_raises_with_its_traceback(results_app, results_worker, db: Database):
    results_worker()
    result = results_app.send_task(T + "always_fails")
    with pytest.raises(ValueError, match="always fails"):
        result.get(timeout=90)
    assert result.state == "FAILURE" and result.failed()
    assert "always fails" in result.traceback and "Traceback" in result.traceback
    doc = job(db, result.id)
    assert doc["status"] == "failed" and doc["state"] == "FAILURE"
    assert [a["outcome"] for a in doc["history"]] == ["failed", "failed", "failed"]


def test_unknown_ids_are_pending_and_forget_forgets(results_app, results_worker, db: Database):
    assert AsyncResult("no-such-task", app=results_app).state == "PENDING"
    results_worker()
    result = results_app.send_task(T + "add", args=(1, 1))
    assert result.get(timeout=60) == 2
    result.forget()
    assert AsyncResult(result.id, app=results_app).state == "PENDING"
    doc = job(db, result.id)
    assert doc["status"] == "succeeded" and "state" not in doc and "result" not in doc


def test_forget_forgets_a_failure_a_revoke_and_a_cancel_until_the_job_runs_again(
    broker_url: str, results_app, results_worker, db: Database
):
    """As with Celery's other backends, a forgotten result reads PENDING, whatever the task's outcome was; an
    operator's retry runs the job again and its new outcome reads as usual."""
    results_worker()
    failed = results_app.send_task(T + "always_fails")
    with pytest.raises(ValueError, match="always fails"):
        failed.get(timeout=90)
    revoked = results_app.send_task(T + "add", args=(1, 2), countdown=600)
    revoked.revoke()
    cancelled = results_app.send_task(T + "add", args=(2, 3), countdown=600)
    wait_for(lambda: job(db, cancelled.id).get("status") == "queued", message="the job to cancel")
    assert bb(broker_url, "cancel", cancelled.id).exit_code == 0
    assert AsyncResult(revoked.id, app=results_app).state == "REVOKED"
    assert AsyncResult(cancelled.id, app=results_app).state == "FAILURE"
    for result in (failed, revoked, cancelled):
        result.forget()
        assert AsyncResult(result.id, app=results_app).state == "PENDING", result.id
    assert bb(broker_url, "retry", failed.id, cancelled.id).exit_code == 0
    with pytest.raises(ValueError, match="always fails"):
        AsyncResult(failed.id, app=results_app).get(timeout=90)
    assert AsyncResult(cancelled.id, app=results_app).get(timeout=60) == 5


def test_result_extended_gives_the_tasks_name_arguments_worker_and_queue(results_app, results_worker):
    """With `result_extended`, as Celery's Redis and MongoDB backends: read off the job, which has them all."""
    results_app.conf.result_extended = True
    results_worker()
    result = results_app.send_task(T + "add", args=(2,), kwargs={"y": 3}, queue="celery")
    assert result.get(timeout=60) == 5
    read = AsyncResult(result.id, app=results_app)
    assert (read.name, read.args, read.kwargs, read.queue, read.retries) == (T + "add", [2], {"y": 3}, "celery", 0)
    assert read.worker.startswith("w0@"), read.worker
    retried = results_app.send_task(T + "fail_until", args=(2,))
    assert retried.get(timeout=90) == "ok"
    assert AsyncResult(retried.id, app=results_app).retries == 1
    huge = results_app.send_task(T + "add", args=(2**70, 1))  # a body BSON cannot hold: kept base64 on the job
    assert huge.get(timeout=60) == 2**70 + 1
    assert AsyncResult(huge.id, app=results_app).args == [2**70, 1]


def test_started_and_custom_states(results_app, results_worker, db: Database):
    results_worker()
    started = results_app.send_task(T + "started_then_sleep", args=(3,))
    wait_for(lambda: started.state == "STARTED", message="STARTED")
    assert started.get(timeout=60) == "slept"
    progress = results_app.send_task(T + "progress", args=(3, 1.0))
    meta = wait_for(lambda: progress.state == "PROGRESS" and progress.info, message="PROGRESS")
    assert meta["of"] == 3
    assert progress.get(timeout=60) == 3
    assert job(db, progress.id)["state"] == "SUCCESS"


def test_a_state_set_before_ignore_stays_and_a_replaced_task_gets_its_replacements_result(
    results_app, results_worker, db: Database
):
    results_worker()
    replaced = results_app.send_task(T + "replaced_by_add", args=(2, 3))
    assert replaced.get(timeout=60) == 5
    noted = results_app.send_task(T + "noted_then_ignored", args=("kept",))
    wait_for(lambda: job(db, noted.id).get("status") == "succeeded", message="the ignored task's job settled")
    assert [a["outcome"] for a in job(db, noted.id)["history"]] == ["ignored"]
    assert noted.state == "NOTED" and noted.info == {"note": "kept"}


def test_ignore_result_writes_nothing_extra(results_app, results_worker, db: Database):
    results_worker()
    result = results_app.send_task(T + "ignored")
    doc = wait_for(lambda: (d := job(db, result.id)).get("status") == "succeeded" and d, message="ignored task ran")
    if upstream_celery.ignores_results_of_tasks_sent_by_name():
        assert not {"state", "result", "traceback"} & set(doc)
        assert result.state == "PENDING"
    else:  # Celery 5.6: send_task's ignore_result=False overrides the task's, on every result backend
        assert result.get(timeout=60) == "not kept"


def test_a_result_over_the_document_limit_fails_the_job_clearly(results_app, results_worker, db: Database):
    results_worker()
    result = results_app.send_task(T + "big_result", args=(17 * 1024 * 1024,))
    with pytest.raises(bb_broker.ResultTooLarge, match="16 MB"):
        result.get(timeout=120)
    doc = job(db, result.id)
    assert doc["status"] == "failed" and doc["attempts"] == 1  # never retried
    assert "ResultTooLarge" in doc["lastError"] and "16 MB" in doc["lastError"]
    assert doc["state"] == "FAILURE" and len(str(doc["result"])) < 10_000  # nothing half-written


def test_a_result_that_fits_alone_but_not_beside_its_arguments(results_app, results_worker, db: Database):
    results_worker()
    nine_mb = "x" * (9 * 1024 * 1024)
    result = results_app.send_task(T + "add", args=(nine_mb, "!"))  # a 9 MB message, a 9 MB result
    with pytest.raises(bb_broker.ResultTooLarge, match="does not fit in its job document"):
        result.get(timeout=120)
    doc = job(db, result.id)
    assert doc["status"] == "failed" and doc["attempts"] == 1 and "ResultTooLarge" in doc["lastError"]
    assert len(str(doc["result"])) < 10_000


def test_a_small_result_settled_by_the_main_process_that_does_not_fit_beside_its_arguments(
    results_app, results_worker, db: Database, tmp_path: Path
):
    log = tmp_path / "settles.log"
    worker = results_worker(env={"BB_TEST_SETTLE_LOG": str(log)})
    # A result small enough to go to the worker's main process (settles.SettleRelay.max_bytes), arguments that
    # leave it no room: the main process writes the result backend's failure in its place.
    ballast = "b" * (16 * 1024 * 1024 - 24 * 1024)
    result = results_app.send_task(T + "big_result", args=(30 * 1024, ballast))
    with pytest.raises(bb_broker.ResultTooLarge, match="does not fit in its job document"):
        result.get(timeout=120)
    doc = job(db, result.id)
    assert doc["status"] == "failed" and doc["attempts"] == 1 and "ResultTooLarge" in doc["lastError"]
    assert doc["history"][-1]["outcome"] == "succeeded"  # the attempt's own entry, kept with the failure
    # Both writes, the refused settle and its replacement, came from the worker's main process.
    writes = [line.split() for line in log.read_text().splitlines() if doc["_id"] in line]
    assert len(writes) == 2 and {int(fields[2]) for fields in writes} == {worker.process.pid}, writes


def test_a_result_no_serializer_can_encode_fails_the_job_without_running_it_again(
    results_app, results_worker, db: Database
):
    # The task's work is done and would be done again, to the same end: like a result over the limit, never retried.
    results_worker()
    result = results_app.send_task(T + "unencodable_result")
    with pytest.raises(EncodeError):
        result.get(timeout=60)
    doc = job(db, result.id)
    assert doc["status"] == "failed" and doc["attempts"] == 1 and "EncodeError" in doc["lastError"]
    assert db.runs.count_documents({"name": T + "unencodable_result"}) == 1


def test_a_reject_without_requeue_fails_at_once(results_app, results_worker, db: Database):
    results_worker()
    result = results_app.send_task(T + "reject_for_good")
    # Celery 5.7 stores the Reject as the task's FAILURE (its issue 4222); before, Celery stores no result for it on
    # any backend (Redis's get() waits for ever), and get() raises the failure the job itself records.
    with pytest.raises(Reject if upstream_celery.fails_rejected_tasks() else JobFailed, match="bad input"):
        result.get(timeout=60)
    assert result.state == "FAILURE"
    doc = job(db, result.id)
    assert doc["status"] == "failed" and doc["attempts"] == 1 and "bad input" in doc["lastError"]
    assert db.runs.count_documents({"name": T + "reject_for_good"}) == 1  # never run again


def test_revoke_makes_get_raise(results_app, results_worker):
    results_worker()
    result = results_app.send_task(T + "add", args=(1, 2), countdown=600)  # never due in the test
    result.revoke()
    with pytest.raises(TaskRevokedError):
        result.get(timeout=60)
    assert result.state == "REVOKED"


def test_a_revoked_task_retried_by_an_operator_under_a_new_id_stays_revoked(broker_url: str, results_app, db: Database):
    """The retry gives the job a new task id (workers remember the revoked one): the old id still reads REVOKED, as
    Celery's states are final, and says which id the task runs as now, rather than PENDING with get() waiting for
    ever."""
    result = results_app.send_task(T + "add", args=(1, 2), countdown=600)
    wait_for(lambda: job(db, result.id).get("status") == "queued", message="the job")
    result.revoke()
    wait_for(lambda: job(db, result.id).get("status") == "failed", message="the revoke")
    assert bb(broker_url, "retry", result.id).exit_code == 0
    [retried] = db.jobs.find({"status": "queued"})
    assert retried["taskId"] != result.id
    again = AsyncResult(result.id, app=results_app)
    assert again.state == "REVOKED"
    with pytest.raises(TaskRevokedError, match=retried["taskId"]):
        again.get(timeout=10)


def test_groups_save_restore_and_join(results_app, results_worker):
    results_worker()
    result = group(sig(results_app, "add", i, i) for i in range(10)).apply_async()
    result.save()
    restored = GroupResult.restore(result.id, app=results_app)
    assert [r.id for r in restored.results] == [r.id for r in result.results]
    assert restored.join(timeout=60) == [2 * i for i in range(10)]
    assert result.join_native(timeout=60) == [2 * i for i in range(10)]
    result.delete()
    assert GroupResult.restore(result.id, app=results_app) is None


def test_chains_and_links(results_app, results_worker, db: Database):
    results_worker()
    assert (
        chain(sig(results_app, "add", 1, 2), sig(results_app, "add", 3), sig(results_app, "add", 4))().get(timeout=60)
        == 10
    )
    linked = results_app.send_task(T + "add", args=(1, 2), link=sig(results_app, "add", 10))
    assert linked.get(timeout=60) == 3
    [child] = wait_for(lambda: linked.children, message="the link's result")
    assert child.get(timeout=60) == 13


def test_an_errback_runs_once_after_the_last_attempt(results_app, results_worker, db: Database):
    results_worker()
    result = results_app.send_task(T + "always_fails", link_error=sig(results_app, "note_error"))
    with pytest.raises(ValueError):
        result.get(timeout=90)
    wait_for(lambda: db.runs.count_documents({"name": T + "note_error"}) == 1, message="the errback")
    assert db.runs.find_one({"name": T + "note_error"})["failed"] == result.id
    assert db.runs.count_documents({"name": T + "always_fails"}) == 3
    inline = results_app.send_task(T + "always_fails", link_error=sig(results_app, "note_failure"))
    with pytest.raises(ValueError):
        inline.get(timeout=90)
    wait_for(lambda: db.runs.count_documents({"name": "note_failure"}) == 1, message="the inline errback")
    assert db.runs.find_one({"name": "note_failure"})["failed"] == inline.id
    assert db.runs.count_documents({"name": T + "always_fails"}) == 6


def test_a_chord_of_a_hundred(results_app, results_worker, db: Database):
    results_worker(concurrency=2)
    result = chord(sig(results_app, "add", i, i) for i in range(100))(sig(results_app, "tsum"))
    assert result.get(timeout=240) == sum(2 * i for i in range(100))
    assert db.runs.count_documents({"name": T + "tsum"}) == 1
    assert db.runs.find_one({"name": T + "tsum"})["values"] == [2 * i for i in range(100)]
    assert "celery_taskmeta" not in db.list_collection_names()


def test_a_chord_whose_last_part_is_in_a_group_nested_in_its_header(results_app, results_worker):
    # The last part counted is a task of the nested group: the callback's values must not wait for that task's own
    # result, which it stores only after it is counted (Celery's test_nested_group_chain hung there).
    results_worker(concurrency=1)

    def add(x: int, y: int):
        return sig(results_app, "add", x, y).set(immutable=True)

    header = group(add(1, 100), chain(add(1, 200), group(add(1, 1000), add(1, 2000))))
    result = chord(header)(sig(results_app, "echo"))
    if celery.VERSION < (5, 7):
        # Celery 5.4-5.6 join the nested group from the part before it ran, with one pool process: with Redis as
        # broker and backend the chord never completes (get() times out); here the join's own timeout fails it.
        with pytest.raises(ChordError, match="Join error"):
            result.get(timeout=120)
        return
    assert result.get(timeout=120) == [101, [1001, 2001]]


def test_a_chord_whose_header_task_fails(results_app, results_worker, db: Database):
    results_worker()
    result = chord([sig(results_app, "add", 1, 1), sig(results_app, "always_fails")])(sig(results_app, "tsum"))
    # As with Redis, get() raises the header task's own error (it checks the chord's parents while it waits);
    # the callback's result is the ChordError.
    with pytest.raises(ValueError, match="always fails"):
        result.get(timeout=120)
    callback = wait_for(lambda: db.bb_results.find_one({"_id": f"task:{result.id}"}), message="the callback's result")
    assert callback["state"] == "FAILURE" and callback["result"]["exc_type"] == "ChordError"
    assert "always fails" in str(callback["result"]["exc_message"])
    with pytest.raises(ChordError, match="always fails"):
        result.get(timeout=10, follow_parents=False)
    assert db.runs.count_documents({"name": T + "tsum"}) == 0


class Monitored(StampingVisitor):
    """Stamps a canvas with a `monitoring_id` header, as Celery's own revoke-by-header tests do."""

    def on_signature(self, sig, **headers) -> dict:
        return {"monitoring_id": "m-1", "stamped_headers": ["monitoring_id"]}


def test_a_chord_whose_header_task_is_revoked_by_its_stamped_header(results_app, results_worker):
    """Celery's test_revoked_by_headers_complex_canvas: as with Redis, get() on the chord raises the revoked header
    task's TaskRevokedError (it checks the chord's parents while it waits), not the ChordError the revoke causes."""
    results_worker()
    assert results_app.control.revoke_by_stamped_headers({"monitoring_id": "m-1"}, reply=True, timeout=60, limit=1)
    stamped = sig(results_app, "sleep", 4)
    stamped.stamp(visitor=Monitored())
    result = chord([stamped])(sig(results_app, "tsum"))
    with pytest.raises(TaskRevokedError):
        result.get(timeout=120)
    assert result.parent.results[0].state == "REVOKED"
    with pytest.raises(ChordError, match="TaskRevokedError"):
        result.get(timeout=10, follow_parents=False)


def test_a_failed_chain_step_fails_the_rest_of_the_chain(results_app, results_worker, db: Database):
    results_worker()
    result = chain(
        sig(results_app, "add", 1, 2), sig(results_app, "always_fails", immutable=True), sig(results_app, "add", 4)
    )()
    with pytest.raises(ValueError, match="always fails"):
        result.get(timeout=90)
    # The last step never ran and has no job: its FAILURE lives in bb_results, not in a celery_taskmeta.
    assert job(db, result.id) == {}
    assert db.bb_results.find_one({"_id": f"task:{result.id}"})["state"] == "FAILURE"
    assert "celery_taskmeta" not in db.list_collection_names()


@pytest.mark.change_streams
def test_get_wakes_on_the_change_stream_and_polls_without_one(results_app, results_worker, db: Database):
    results_worker()
    finds = CommandCounter("find")
    monitoring.register(finds)  # applies to clients made from now: the backend's is made on its first use below
    backend = JobResultBackend(results_app, url=results_app.conf.result_backend)
    with finds.counting():
        result = results_app.send_task(T + "sleep", args=(4,))
        assert backend.wait_for(result.id, timeout=120, interval=0.05)["result"] == 4
    # Polling every 50 ms would have read the job some 80 times; woken by the stream it reads it a few times.
    assert finds.count <= 6, finds.count
    backend.result_consumer.change_streams = False  # as on a standalone server: plain polling at the interval asked
    result = results_app.send_task(T + "add", args=(2, 2))
    assert backend.wait_for(result.id, timeout=120, interval=0.2)["result"] == 4


def test_a_worker_killed_in_the_middle_of_a_chord(results_app, results_worker, db: Database):
    options = {"stale_after": 4.0}
    first = results_worker(concurrency=2, options=options)
    header = [sig(results_app, "sleep", 2) for _ in range(8)]
    result = chord(header)(sig(results_app, "tsum"))
    # Killed once two parts are done and two more are running.
    wait_for(lambda: db.runs.count_documents({"name": T + "sleep", "phase": "end"}) >= 2, message="two parts done")
    wait_for(lambda: db.runs.count_documents({"name": T + "sleep", "phase": "start"}) >= 4, message="two running")
    first.kill()
    results_worker(concurrency=2, options=options)
    assert result.get(timeout=240) == 16
    assert db.runs.count_documents({"name": T + "tsum"}) == 1  # the callback ran once
    counter = db.bb_results.find_one({"_id": f"chord:{result.parent.id}"})
    assert counter["count"] == 8 and len(counter["members"]) == 8  # every part counted, none twice
    # A part the killed worker finished and counted but had not settled is run again after the sweep: the callback
    # may have run before that rerun settles its job, so the eighth `succeeded` is waited for, not expected at once.
    sleeps = {"kind": T + "sleep", "status": "succeeded"}
    wait_for(lambda: db.jobs.count_documents(sleeps) == 8, message="every part's job settled")
    assert db.jobs.count_documents({"kind": "celery.chord_unlock"}) == 0


@pytest.mark.parametrize("crash_at", ["part-counted", "callback-claimed", "callback-sent"])
def test_a_worker_killed_at_each_step_of_a_chords_completion(crash_at, results_app, results_worker, db: Database):
    # The first worker SIGKILLs itself and its pool at `crash_at` (tests/support/e2e_app.py): the job of the part it
    # held stays running until the second worker's sweep re-queues it, and that part runs again.
    options = {"stale_after": 4.0}
    first = results_worker(concurrency=1, options=options, env={"BB_TEST_CRASH_AT": crash_at})
    result = chord(sig(results_app, "add", i, i) for i in range(3))(sig(results_app, "tsum"))
    wait_for(lambda: first.process.poll() is not None, message=f"the worker killed at {crash_at}")
    assert db.runs.find_one({"name": "crash"})["point"] == crash_at
    results_worker(concurrency=1, options=options)
    assert result.get(timeout=120) == 6
    header = {"kind": T + "add", "status": "succeeded"}
    wait_for(lambda: db.jobs.count_documents(header) == 3, message="every header job settled")
    # The part that was cut short ran again, and is counted once; the callback was sent and ran once.
    # (The killed worker may also have held the next header job, claimed but not started: it is re-queued too.)
    reruns = list(db.jobs.find({"kind": T + "add", "history.outcome": "lost"}))
    assert reruns and all([a["outcome"] for a in rerun["history"]] == ["lost", "succeeded"] for rerun in reruns)
    counter = db.bb_results.find_one({"_id": f"chord:{result.parent.id}"})
    assert counter["count"] == 3 and sorted(part["i"] for part in counter["parts"]) == [0, 1, 2]
    assert counter["sent"] and counter["callback"]["firstId"] == result.id
    assert db.jobs.count_documents({"kind": T + "tsum"}) == 1
    assert db.runs.find_one({"name": T + "tsum"})["values"] == [0, 2, 4]
    wait_for(lambda: db.jobs.count_documents({"kind": T + "tsum", "status": "succeeded"}) == 1, message="callback")
    assert db.runs.count_documents({"name": T + "tsum"}) == 1


def test_a_header_task_killed_on_its_last_attempt_fails_the_chords_get(results_app, results_worker, db: Database):
    # No attempt left: the sweep fails the job without a part, so the callback never runs; get() on the chord
    # does not hang, it raises the lost header task's failure (it checks the chord's parents while it waits).
    options = {"stale_after": 4.0, "max_attempts": 1}
    first = results_worker(concurrency=2, options=options)
    result = chord([sig(results_app, "add", 1, 1), sig(results_app, "sleep", 60)])(sig(results_app, "tsum"))
    wait_for(lambda: db.runs.count_documents({"name": T + "sleep", "phase": "start"}) == 1, message="sleep runs")
    first.kill()
    results_worker(concurrency=1, options=options)
    with pytest.raises(JobFailed, match="worker lost"):
        result.get(timeout=120)
    assert db.runs.count_documents({"name": T + "tsum"}) == 0


def test_urls_that_differ_only_in_options_share_the_jobs(broker_url: str, worker_factory, db: Database):
    # The worker's broker URL carries an option its result backend's does not, and the client's neither:
    # the result still goes on the job (one write) and the client reads it there.
    worker_factory(env={"BB_RESULT_BACKEND": broker_url, "BB_BROKER_URL": f"{broker_url}?appname=worker"})
    client = producer(f"{broker_url}?appname=client")
    client.conf.result_backend = broker_url
    try:
        result = client.send_task(T + "add", args=(20, 22))
        assert result.get(timeout=60) == 42
    finally:
        client.close()
    assert job(db, result.id)["state"] == "SUCCESS"
    assert "bb_results" not in db.list_collection_names() or db.bb_results.count_documents({}) == 0


def test_a_task_revoked_while_queued_reads_revoked_on_the_apps_own_result_backend(
    app: Celery, db: Database, tmp_path: Path
) -> None:
    """Celery's own test_revoked with Redis as the result backend, as on Celery 5.4 and 5.5: the task is revoked
    while queued, its job fails at the revoke and no worker ever receives it, so no worker stores REVOKED. The
    revoker's process does, in the app's own backend (a directory here, read by another app as by another process)."""
    app.conf.result_backend = f"file://{tmp_path}"
    result = app.send_task(T + "add", args=(1, 1))
    result.revoke()
    assert job(db, result.id)["lastError"] == "revoked before it ran"
    reader = producer(app.conf.broker_url)
    reader.conf.result_backend = f"file://{tmp_path}"
    try:
        revoked = AsyncResult(result.id, app=reader)
        with pytest.raises(TaskRevokedError):
            revoked.get(timeout=10)
        assert revoked.state == "REVOKED" and revoked.ready() and not revoked.failed()
    finally:
        reader.close()


def test_a_credential_among_the_backend_urls_options_is_masked_in_what_inspect_conf_answers(
    broker_url: str, worker_factory
) -> None:
    # Celery masks a URL's password in the settings it shows (`celery inspect conf`, Flower's worker Config tab),
    # not a credential among its options. The broker URL has none here, so the masking of plumbing messages by the
    # broker URL's secrets does not hide it either.
    backend_url = f"{broker_url}{'&' if '?' in broker_url else '?'}tlsCertificateKeyFilePassword=backend-s3cret"
    worker_factory(env={"BB_RESULT_BACKEND": backend_url})
    app = producer(broker_url)
    try:
        replies = wait_for(lambda: app.control.inspect(timeout=5).conf(), timeout=60, message="the worker's settings")
    finally:
        app.close()
    (settings,) = replies.values()
    assert "backend-s3cret" not in repr(settings)
    shown = settings["result_backend"]
    # Celery 5.4 to 5.6 drop a backend URL's options (Kombu's sanitize_url); 5.7 shows them, masked here.
    assert "tlsCertificateKeyFilePassword=**" in shown or "?" not in shown, shown


def test_a_chord_whose_header_task_is_revoked_while_queued_fails_its_body(results_app, results_worker, db: Database):
    # Its job fails at the revoke and no worker receives it, and no one counted its part: the body stayed PENDING, and
    # a get() on it (or on a step after it) waited for ever.
    header = [sig(results_app, "add", 1, 1), sig(results_app, "add", 2, 2)]
    result = chord(header)(sig(results_app, "tsum"))
    revoked = result.parent.results[1]
    revoked.revoke()
    assert job(db, revoked.id)["lastError"] == "revoked before it ran"
    results_worker()
    body = AsyncResult(result.id, app=results_app)
    with pytest.raises(ChordError, match="TaskRevokedError"):
        body.get(timeout=60)
    assert result.parent.results[0].get(timeout=10) == 2


class ChangeStreams(CommandCounter):
    """The change streams this process opens while `counting()` (an `aggregate` whose pipeline starts with
    `$changeStream`)."""

    def __init__(self) -> None:
        super().__init__("aggregate")

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pipeline = event.command.get("pipeline") if event.command_name == self.name else None
        if self.on and pipeline and "$changeStream" in pipeline[0]:
            self.count += 1


CHANGE_STREAMS = ChangeStreams()
monitoring.register(CHANGE_STREAMS)


def test_a_get_polls_when_the_transport_options_turn_change_streams_off(results_app, results_worker):
    # The option turned the consumers' change streams off, not a waiting get()'s (a deployment whose proxy or
    # permissions refuse them).
    results_worker(options={"use_change_streams": False})
    results_app.conf.broker_transport_options = {"use_change_streams": False}
    result = results_app.send_task(T + "sleep", args=(1,))
    with CHANGE_STREAMS.counting():
        assert result.get(timeout=60) == 1
    assert CHANGE_STREAMS.count == 0
