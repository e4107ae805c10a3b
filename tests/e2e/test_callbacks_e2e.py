"""Callbacks, errbacks and chain steps the broker refuses: never a reason to run a task's body again.

Celery's worker publishes them after the task's body ran. Refused then, the failure was the task's, and the broker ran
the body again: three times for a callback with priority 300, six for a chain step whose options is 5 (issue 44)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from celery import Celery, chord
from celery.exceptions import ChordError
from celery.result import AsyncResult
from pymongo.database import Database

import bb_broker
from tests.support.workers import job, settled, wait_for

ADD = "tests.support.e2e_app.add"


def _runs(db: Database, task_id: str) -> int:
    """How many times the body of `add` ran for this task id (tests/support/e2e_app.py records each run)."""
    return db.runs.count_documents({"taskId": task_id})


def _ended(db: Database, task_id: str) -> Any:
    """A wait_for condition: the task's job is succeeded or failed (then the document)."""
    return lambda: (doc := job(db, task_id)).get("status") in (bb_broker.SUCCEEDED, bb_broker.FAILED) and doc


def test_a_canvas_the_broker_would_refuse_later_is_refused_at_the_call_and_nothing_is_published(
    app: Celery, db: Database, worker_factory
) -> None:
    worker = worker_factory()
    refused: dict[str, Any] = {
        "link priority 300": {"link": app.signature(ADD, (3, 4), immutable=True).set(priority=300)},
        "errback time limit text": {"link_error": app.signature(ADD, (3, 4), immutable=True).set(time_limit="x")},
        "chain step options 5": {"chain": [{"task": ADD, "args": [3], "kwargs": {}, "options": 5}]},
        "link of a link countdown past year 9999": {
            "link": app.signature(ADD, (3, 4), immutable=True).set(
                link=app.signature(ADD, (5, 6), immutable=True).set(countdown=1e12)
            )
        },
    }
    for name, options in refused.items():
        with pytest.raises(bb_broker.MalformedTaskMessage) as raised:
            app.signature(ADD, (1, 2)).apply_async(**options)
        assert "the embed's" in str(raised.value), (name, str(raised.value))
    assert db.jobs.count_documents({}) == 0, "a refused call published something"
    # The canvases Celery makes of valid options pass, and run: a chain with a link, each step with its options.
    valid = (
        app.signature(ADD, (1, 2)).set(priority=5, time_limit=30, soft_time_limit=20)
        | app.signature(ADD, (10,)).set(countdown=0.1, expires=600)
    ).apply_async(link=app.signature(ADD, (100, 200), immutable=True).set(priority=9))
    wait_for(settled(db, valid.id, bb_broker.SUCCEEDED), timeout=120, message="the valid chain's last step")
    wait_for(lambda: db.runs.count_documents({}) == 3, message="the chain's two steps and its link ran")
    assert worker.process.poll() is None


def _edited(db: Database, task_id: str, change: dict[str, Any]) -> None:
    assert db.jobs.update_one({"taskId": task_id}, change).modified_count == 1


def test_a_stored_callback_the_broker_refuses_fails_alone_and_the_body_runs_once(
    app: Celery, db: Database, worker_factory
) -> None:
    # Valid at their publish, made bad in the stored job (as a hand-written message, or another client, would be):
    # the body runs once and its job succeeds; the refused callback or chain step is not published, and is reported.
    link = app.signature(ADD, (3, 4), immutable=True)
    with_link = app.signature(ADD, (1, 2)).apply_async(link=link).id
    _edited(db, with_link, {"$set": {"payload.options.callbacks.0.options.priority": 300}})
    with_chain = (app.signature(ADD, (5, 6)) | app.signature(ADD, (7,))).apply_async()
    first_step = with_chain.parent.id
    _edited(db, first_step, {"$set": {"payload.options.chain.0.options": 5}})
    both = app.signature(ADD, (8, 9)).apply_async(link=[link, app.signature(ADD, (30, 40), immutable=True)]).id
    _edited(db, both, {"$set": {"payload.options.callbacks.0.options.time_limit": "x"}})
    worker = worker_factory()
    for task_id in (with_link, first_step, both):
        ended = wait_for(_ended(db, task_id), timeout=120, message=f"{task_id} ended")
        assert ended["status"] == bb_broker.SUCCEEDED, (ended["status"], ended.get("lastError"))
        assert ended["attempts"] == 1 and _runs(db, task_id) == 1, (ended["attempts"], _runs(db, task_id))
    # The valid callback beside the refused one ran (a job of its own); nothing else was published.
    wait_for(lambda: db.runs.count_documents({"name": ADD}) == 4, message="the valid callback ran")
    assert db.jobs.count_documents({}) == 4, [doc["kind"] for doc in db.jobs.find()]
    log = worker.log()
    assert log.count("is not published, the broker refuses it") == 3, log[-3000:]
    assert "property 'priority' must be an integer from 0 to 255" in log
    assert worker.process.poll() is None


def test_a_callback_refused_only_when_the_worker_publishes_it_ends_its_task_once(
    app: Celery, db: Database, worker_factory
) -> None:
    # A callback whose unique option names an argument its task does not have: only the worker, which has the task
    # registered, finds the key cannot be made. The task that ran fails once, as Celery fails a task whose callback
    # cannot be encoded (PublishRefused is an EncodeError); its body is not run again, and its job is not left running.
    link = app.signature(ADD, (3, 4), immutable=True).set(unique_on=["no_such_argument"])
    task_id = app.signature(ADD, (1, 2)).apply_async(link=link).id
    worker_factory()
    ended = wait_for(_ended(db, task_id), timeout=120, message="the task ended")
    assert ended["status"] == bb_broker.FAILED and "no_such_argument" in ended["lastError"], ended.get("lastError")
    assert ended["attempts"] == 1 and _runs(db, task_id) == 1, (ended["attempts"], _runs(db, task_id))
    assert [entry["outcome"] for entry in ended["history"]] == ["failed"]


def test_a_chord_body_celery_cannot_rebuild_fails_its_header_jobs_once_and_its_waiter_gets_the_error(
    results_app: Celery, db: Database, worker_factory, broker_url: str
) -> None:
    # A chord body made bad in its header's stored jobs (as a hand-written message would carry it): its `options` 5,
    # or a canvas type Celery does not have. Each header's last part ran three times ("AttributeError: 'int' object
    # has no attribute 'get'", "KeyError: 'bogus'" from Celery's rebuild of the body after the part's own body ran,
    # a retryable error) and ended failed, and `AsyncResult(body id).get()` waited for ever.
    edits = {"options": 5, "subtask_type": "bogus"}
    chords = {}
    for field, value in edits.items():
        header = [results_app.signature(ADD, (1, 2)), results_app.signature(ADD, (3, 4))]
        result = chord(header)(results_app.signature("tests.support.e2e_app.tsum"))
        chords[field] = (result, [part.id for part in result.parent.results])
        for part in chords[field][1]:
            _edited(db, part, {"$set": {f"payload.options.chord.{field}": value}})
    worker = worker_factory(env={"BB_RESULT_BACKEND": broker_url})
    for field, (result, parts) in chords.items():
        for part in parts:
            failed = wait_for(settled(db, part, bb_broker.FAILED), timeout=120, message=f"header part {part} failed")
            assert failed["attempts"] == 1 and _runs(db, part) == 0, (failed["attempts"], _runs(db, part))
            assert failed["lastError"].startswith(f"malformed message: the embed's 'chord''s '{field}' must be ")
        with pytest.raises(Exception, match="malformed message"):
            result.get(timeout=60)  # the chord's own result: its header's failure
    # A waiter holding the body's id alone is told, where the stored body still names its id (`options` 5 does not).
    with pytest.raises(ChordError, match="a task of the chord's header failed before it ran: malformed message"):
        AsyncResult(chords["subtask_type"][0].id, app=results_app).get(timeout=60)
    assert db.runs.count_documents({}) == 0
    assert results_app.signature(ADD, (5, 6)).apply_async().get(timeout=60) == 11
    assert worker.process.poll() is None


def test_a_dropped_callback_or_chain_step_fails_its_waiter_and_the_body_runs_once(
    results_app: Celery, db: Database, worker_factory, broker_url: str
) -> None:
    # Each dropped signature named its task id: its waiter used to wait for ever, as nothing would ever run it.
    link = results_app.signature(ADD, (3, 4), immutable=True)
    link_result = link.freeze()
    with_link = results_app.signature(ADD, (1, 2)).apply_async(link=link).id
    _edited(db, with_link, {"$set": {"payload.options.callbacks.0.options.priority": 300}})
    chained = (results_app.signature(ADD, (5, 6)) | results_app.signature(ADD, (7,))).apply_async()
    first_step = chained.parent.id
    _edited(db, first_step, {"$set": {"payload.options.chain.0.options.priority": 300}})
    worker = worker_factory(env={"BB_RESULT_BACKEND": broker_url})
    for task_id in (with_link, first_step):
        ended = wait_for(_ended(db, task_id), timeout=120, message=f"{task_id} ended")
        assert ended["status"] == bb_broker.SUCCEEDED and _runs(db, task_id) == 1
    for waited in (AsyncResult(link_result.id, app=results_app), AsyncResult(chained.id, app=results_app)):
        with pytest.raises(bb_broker.PublishRefused, match="not published, the broker refuses it .* 'priority'"):
            waited.get(timeout=60)
    assert db.runs.count_documents({}) == 2 and worker.process.poll() is None


def test_a_stored_errback_the_broker_refuses_is_dropped_and_the_failure_is_recorded_once(
    app: Celery, db: Database, worker_factory
) -> None:
    # As a stored callback above, an errback made bad in the stored job: Celery's worker publishes errbacks after the
    # last attempt's body failed, too late to refuse anything but the errback. The valid errback beside it runs once.
    fails, note_error = "tests.support.e2e_app.always_fails", "tests.support.e2e_app.note_error"
    errbacks = [app.signature(note_error), app.signature(note_error)]
    task_id = app.send_task(fails, link_error=errbacks).id
    _edited(db, task_id, {"$set": {"payload.options.errbacks.0.options.priority": 300}})
    worker = worker_factory()
    ended = wait_for(_ended(db, task_id), timeout=120, message="the failing task ended")
    assert (ended["status"], ended["attempts"], ended["lastError"]) == (
        bb_broker.FAILED,
        3,
        "ValueError: always fails",
    ), ended
    assert [(entry["n"], entry["outcome"]) for entry in ended["history"]] == [(n, "failed") for n in (1, 2, 3)]
    [errback_job] = wait_for(lambda: list(db.jobs.find({"kind": note_error})), message="the valid errback's job")
    wait_for(settled(db, errback_job["taskId"], bb_broker.SUCCEEDED), timeout=120, message="the valid errback ran")
    assert [run["failed"] for run in db.runs.find({"name": note_error})] == [task_id]
    assert db.runs.count_documents({"name": fails}) == 3 and db.jobs.count_documents({}) == 2
    log = worker.log()
    assert "errbacks 'tests.support.e2e_app.note_error' is not published, the broker refuses it" in log, log[-3000:]
    assert "property 'priority' must be an integer from 0 to 255" in log
    assert log.count("Traceback") == 1, log[-3000:]  # the last attempt's own ValueError, as Celery logs it
    assert "Unrecoverable error" not in log and worker.process.poll() is None


@pytest.mark.parametrize("results", ["none", "bbmongo"])
def test_a_stored_errback_the_broker_refuses_is_dropped_where_the_main_process_reports_the_failure(
    app: Celery, db: Database, worker_factory, broker_url: str, results: str
) -> None:
    # A hard time limit, a pool process that died: the worker's main process reports the failure and runs the errbacks
    # from the message as it received it, where no task_prerun took the refused one off. Refused there, the failure
    # went unrecorded (the job stayed running until the stale sweep ran it again); and a hard time limit ran each
    # errback twice (Celery's main process reports it twice).
    fails = {"tests.support.e2e_app.overrun": (), "tests.support.e2e_app.exits_until": (99,)}
    note_error = "tests.support.e2e_app.note_error"
    task_ids = []
    for name, args in fails.items():
        task_ids.append(app.send_task(name, args, link_error=[app.signature(note_error), app.signature(note_error)]).id)
        _edited(db, task_ids[-1], {"$set": {"payload.options.errbacks.0.options.priority": 300}})
    env = {"BB_RESULT_BACKEND": broker_url} if results == "bbmongo" else {}
    worker = worker_factory(options={"max_attempts": 1}, env=env)
    for task_id, error in zip(task_ids, ("TimeLimitExceeded", "WorkerLostError"), strict=True):
        ended = wait_for(_ended(db, task_id), timeout=120, message=f"{task_id} ended")
        assert ended["status"] == bb_broker.FAILED and ended["lastError"].startswith(error), ended.get("lastError")
        assert ended["attempts"] == 1 and _runs(db, task_id) == 1, (ended["attempts"], _runs(db, task_id))
    wait_for(lambda: db.runs.count_documents({"name": note_error}) == 2, timeout=120, message="the valid errbacks")
    wait_for(lambda: db.jobs.count_documents({"kind": note_error, "status": {"$ne": bb_broker.SUCCEEDED}}) == 0)
    assert sorted(run["failed"] for run in db.runs.find({"name": note_error})) == sorted(task_ids)  # each once
    assert db.jobs.count_documents({"kind": note_error}) == 2
    log = worker.log()
    dropped = "errbacks 'tests.support.e2e_app.note_error' is not published, the broker refuses it"
    assert all(f"[{task_id}]: {dropped}" in log for task_id in task_ids), log[-3000:]
    assert "Unrecoverable error" not in log and worker.process.poll() is None


def test_a_tasks_own_retry_the_broker_refuses_fails_it_once_and_the_worker_stays_up(
    app: Celery, db: Database, worker_factory
) -> None:
    # A retry whose message the publish check refuses (its ETA within two days of year 9999's end): Celery raises
    # Reject(the refusal) in the pool process, which sends it to the main process. Rebuilt there with its message
    # alone, MalformedTaskMessage raised TypeError and the worker exited ("Unrecoverable error").
    countdown = (datetime.max.replace(tzinfo=UTC) - datetime.now(UTC)).total_seconds() - 3600
    task_id = app.send_task("tests.support.e2e_app.retry_self", (countdown,)).id
    worker = worker_factory()
    ended = wait_for(_ended(db, task_id), timeout=120, message="the task ended")
    assert ended["status"] == bb_broker.FAILED and "malformed message" in ended["lastError"], ended.get("lastError")
    assert ended["attempts"] == 1 and _runs(db, task_id) == 1, (ended["attempts"], _runs(db, task_id))
    assert app.signature(ADD, (1, 2)).apply_async().id and db.jobs.count_documents({}) == 2
    wait_for(lambda: _runs(db, db.jobs.find_one({"kind": ADD})["taskId"]) == 1, message="the next task ran")
    log = worker.log()
    assert "Unrecoverable error" not in log and worker.process.poll() is None, log[-3000:]
