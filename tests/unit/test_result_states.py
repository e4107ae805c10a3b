"""What a job document reads as in Celery (results/states.py): state and meta from the document alone, no server."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from typing import Any

import pytest
from celery import states
from celery.exceptions import TaskRevokedError
from kombu.serialization import dumps

from bb_broker.jobs.payloads import to_document
from bb_broker.results import codec
from bb_broker.results import states as job_states
from bb_broker.results.states import JobFailed

load = partial(codec.loaded, serializer="json", accept={"application/json"})
FINISHED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def job(status: str, **fields: Any) -> dict[str, Any]:
    return {"_id": "job-1", "taskId": "task-1", "status": status, **fields}


def result_fields(state: str, value: Any) -> dict[str, Any]:
    """The result fields the backend writes, the value stored as codec.stored keeps it."""
    stored, fmt = codec.stored(dumps(value, serializer="json")[2], "json", compressed=False)
    return {"state": state, "result": stored, "resultFormat": fmt, "dateDone": FINISHED, "children": []}


def test_a_succeeded_job_with_its_result_reads_success_and_the_value() -> None:
    meta = job_states.meta_of_job(job("succeeded", **result_fields(states.SUCCESS, {"sum": [1, 2]})), load)
    assert meta["status"] == states.SUCCESS and meta["result"] == {"sum": [1, 2]}
    assert meta["task_id"] == "task-1" and meta["date_done"] == FINISHED


def test_a_value_stored_as_encoded_bytes_reads_back_the_same() -> None:
    # A value JSON keeps but BSON cannot (a key with a dot) is kept as its encoded bytes.
    doc = job("succeeded", **result_fields(states.SUCCESS, {"a.b": 1}))
    assert doc["resultFormat"] == "encoded:json"
    assert job_states.meta_of_job(doc, load)["result"] == {"a.b": 1}


def test_a_job_failed_without_a_celery_result_reads_failure_with_its_last_error() -> None:
    meta = job_states.meta_of_job(job("failed", lastError="worker lost: no heartbeat for 300 s"), load)
    assert meta["status"] == states.FAILURE
    assert isinstance(meta["result"], JobFailed) and str(meta["result"]) == "worker lost: no heartbeat for 300 s"


def test_a_job_revoked_without_a_celery_result_reads_revoked() -> None:
    meta = job_states.meta_of_job(job("failed", lastError="revoked before it ran"), load)
    assert meta["status"] == states.REVOKED and isinstance(meta["result"], TaskRevokedError)


def test_a_failure_celery_stored_reads_as_stored_the_exception_still_encoded() -> None:
    exc = {"exc_type": "ValueError", "exc_message": ["bad"], "exc_module": "builtins"}
    meta = job_states.meta_of_job(
        job("failed", lastError="ValueError: bad", **result_fields(states.FAILURE, exc)), load
    )
    # The backend makes the exception of it (Celery's meta_from_decoded), as for any backend's stored failure.
    assert meta["status"] == states.FAILURE and meta["result"] == exc


@pytest.mark.parametrize("state", [None, states.STARTED, states.RETRY])
def test_a_succeeded_job_without_a_ready_state_reads_pending(state: str | None) -> None:
    # ignore_result (no state), or forgotten: as Celery's other backends read a result they do not have.
    fields = {} if state is None else {"state": state}
    assert job_states.meta_of_job(job("succeeded", **fields), load) == job_states.pending("task-1")


def test_a_queued_or_running_job_with_an_earlier_runs_outcome_reads_pending() -> None:
    # An operator's retry runs a failed job again: its old FAILURE is not the answer while it runs.
    for status in ("queued", "running"):
        doc = job(status, **result_fields(states.FAILURE, {"exc_type": "ValueError", "exc_message": []}))
        assert job_states.meta_of_job(doc, load)["status"] == states.PENDING


def test_a_running_job_reads_the_revoke_its_own_attempt_stored_before_the_settle() -> None:
    # A revoked chord part: REVOKED goes on the job before the part is counted, the settle comes after. Only the
    # attempt that stored it reads it; a later attempt of the job (its worker died before the settle) reads PENDING.
    revoked = result_fields(states.REVOKED, {"exc_type": "TaskRevokedError", "exc_message": ["revoked"]})
    doc = job("running", attempts=2, readyInAttempt=2, **revoked)
    assert job_states.meta_of_job(doc, load)["status"] == states.REVOKED
    for later in (job("running", attempts=3, readyInAttempt=2, **revoked), {**doc, "status": "queued"}):
        assert job_states.meta_of_job(later, load) == job_states.pending("task-1")


def test_a_running_job_reads_its_started_or_custom_state() -> None:
    doc = job("running", **result_fields("PROGRESS", {"done": 3}))
    meta = job_states.meta_of_job(doc, load)
    assert meta["status"] == "PROGRESS" and meta["result"] == {"done": 3}


def test_a_forgotten_failure_reads_pending_until_the_job_finishes_again() -> None:
    forgotten = job("failed", lastError="boom", finishedAt=FINISHED, forgotten=FINISHED)
    assert job_states.meta_of_job(forgotten, load)["status"] == states.PENDING
    failed_again = {**forgotten, "finishedAt": datetime(2026, 1, 3, tzinfo=UTC)}
    assert job_states.meta_of_job(failed_again, load)["status"] == states.FAILURE


def test_group_and_parent_ids_are_in_the_meta_only_when_the_job_has_them() -> None:
    plain = job_states.meta_of_job(job("succeeded", **result_fields(states.SUCCESS, 1)), load)
    assert "group_id" not in plain and "parent_id" not in plain
    doc = job("succeeded", groupId="g-1", parentId="p-1", **result_fields(states.SUCCESS, 1))
    meta = job_states.meta_of_job(doc, load)
    assert (meta["group_id"], meta["parent_id"]) == ("g-1", "p-1")


def test_a_task_document_of_a_revoked_task_retried_under_a_new_id_reads_revoked() -> None:
    doc = {"_id": "task:old-id", "state": states.REVOKED, "lastError": "revoked: retried as new-id"}
    task_id, meta = job_states.meta_of_task_document(doc, load)
    assert task_id == "old-id" and meta["status"] == states.REVOKED
    assert isinstance(meta["result"], TaskRevokedError) and "new-id" in str(meta["result"])


def test_a_task_document_with_a_result_reads_that_result() -> None:
    task_id, meta = job_states.meta_of_task_document({"_id": "task:t-2", **result_fields(states.SUCCESS, 5)}, load)
    assert (task_id, meta["status"], meta["result"]) == ("t-2", states.SUCCESS, 5)


def test_extended_fields_come_from_the_job_its_message_and_last_attempt() -> None:
    body = dumps([[1, 2], {"x": 3}, {}], serializer="json")[2].encode()
    message = {"content-type": "application/json", "content-encoding": "utf-8", "headers": {"retries": 1}}
    payload = to_document({**message, "body": body, "properties": {}}, body)  # as the transport stores it
    history = [{"n": 2, "worker": "celery@host", "outcome": "succeeded"}]
    doc = job("succeeded", kind="tasks.add", queue="celery", payload=payload, history=history)
    extended = job_states.extended(doc, accept={"application/json"})
    assert extended == {
        "name": "tasks.add",
        "args": [1, 2],
        "kwargs": {"x": 3},
        "worker": "celery@host",
        "retries": 1,
        "queue": "celery",
    }


def test_extended_fields_of_a_message_the_client_cannot_read_have_no_arguments() -> None:
    doc = job("running", kind="tasks.add", queue="celery", payload="not a message")
    extended = job_states.extended(doc, accept={"application/json"})
    assert (extended["args"], extended["kwargs"], extended["worker"], extended["retries"]) == (None, None, None, None)
