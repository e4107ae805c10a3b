"""What a job document (or a `bb_results` document) reads as in Celery: its state and meta, with no server."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from celery import states
from celery.exceptions import TaskRevokedError
from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import loads

from bb_broker.jobs.document import READY_IN_ATTEMPT
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, SUCCEEDED
from bb_broker.jobs.payloads import PayloadError, to_message

#: The fields a result read needs from a job document.
RESULT_FIELDS = {
    "status": 1,
    "lastError": 1,
    "state": 1,
    "result": 1,
    "resultFormat": 1,
    "traceback": 1,
    "dateDone": 1,
    "children": 1,
    "groupId": 1,
    "parentId": 1,
    "finishedAt": 1,
    "forgotten": 1,
    "attempts": 1,
    READY_IN_ATTEMPT: 1,
}
#: The fields `result_extended` reads too: the task's name, message, queue and the worker that ran it.
EXTENDED_FIELDS = {"kind": 1, "payload": 1, "queue": 1, "history": {"$slice": -1}}
#: Fields forget() removes from a job.
FORGOTTEN = {
    field: "" for field in RESULT_FIELDS if field not in ("status", "lastError", "finishedAt", "forgotten", "attempts")
}

#: Decodes a stored result: (the `result` field, its `resultFormat`) -> the value (codec.loaded, bound to a backend).
Loader = Callable[[Any, str | None], Any]


class JobFailed(Exception):
    """The task's job failed without a result from Celery (its worker was lost, its task unknown, an operator)."""


class UnreadableResult(Exception):
    """What a task's stored state or result reads as when it cannot be read (its job, or its `bb_results` document,
    written by hand or by another client): that task's read fails with it, the others of the same read go on."""


def unreadable(task_id: str, where: str, exc: BaseException) -> dict[str, Any]:
    """The meta of a task whose stored outcome (in `where`) cannot be read for `exc`: FAILURE, saying so."""
    cause = f"{type(exc).__name__}: {exc}"[:500]
    error = UnreadableResult(f"task {task_id}: the result stored in {where} cannot be read ({cause})")
    return finished_without_result(task_id, states.FAILURE, error)


def pending(task_id: str) -> dict[str, Any]:
    return {"status": states.PENDING, "result": None, "task_id": task_id}


def finished_without_result(task_id: str, state: str, exc: BaseException) -> dict[str, Any]:
    """The meta of a task whose outcome is an exception the broker knows, not one Celery stored."""
    return {"task_id": task_id, "status": state, "result": exc, "traceback": None, "children": []}


def meta_of_job(doc: dict[str, Any], load: Loader) -> dict[str, Any]:
    """A job document's meta: its stored result when its status agrees, else what its status says."""
    status, state = doc.get("status"), _state_of(doc)
    task_id = doc["taskId"]
    finished = doc.get("finishedAt")
    if status == FAILED and state is None and finished is not None and doc.get("forgotten") == finished:
        return pending(task_id)  # forget() forgot this failure
    if status == FAILED and (state not in (states.FAILURE, states.REVOKED) or "resultFormat" not in doc):
        # No outcome Celery stored (or one whose result a hand edit took away): what the job's failure says.
        last_error = str(doc.get("lastError") or "failed")
        if last_error.startswith("revoked") or state == states.REVOKED:
            return finished_without_result(task_id, states.REVOKED, TaskRevokedError(last_error))
        return finished_without_result(task_id, states.FAILURE, JobFailed(last_error))
    if status == SUCCEEDED and (state is None or state in states.UNREADY_STATES):
        # ignore_result, or forgotten. A state a task set before it raised Ignore (a custom one, or FAILURE as
        # Celery's docs show) stays what it reads, as in Celery's other backends.
        return pending(task_id)
    if status in (QUEUED, RUNNING) and (state is None or state in states.READY_STATES):
        ready_in = doc.get(READY_IN_ATTEMPT)
        if status == RUNNING and state is not None and ready_in is not None and ready_in == doc.get("attempts"):
            return meta_of_result(doc, task_id, load)  # stored by the attempt that runs, just before its settle
        return pending(task_id)  # an outcome from an earlier run
    return meta_of_result(doc, task_id, load)


def meta_of_task_document(doc: dict[str, Any], load: Loader) -> tuple[str, dict[str, Any]]:
    """The task id and meta of a `task:<id>` document in bb_results (a task that never had a job)."""
    task_id = doc["_id"].partition(":")[2]
    if doc.get("state") == states.REVOKED and "resultFormat" not in doc:
        # A revoked task an operator retried under a new id (operations.py): its old id stays REVOKED (a canvas
        # step's follows the new id first: JobResultBackend._found_metas).
        return task_id, finished_without_result(task_id, states.REVOKED, TaskRevokedError(doc.get("lastError")))
    return task_id, meta_of_result(doc, task_id, load)


def _state_of(doc: dict[str, Any]) -> str | None:
    """A document's stored Celery state; a TypeError when it holds one that is not a string (a hand edit)."""
    state = doc.get("state")
    if state is not None and not isinstance(state, str):
        raise TypeError(f"its state is {type(state).__name__} {str(state)[:60]!r}, not a string")
    return state


def meta_of_result(doc: dict[str, Any], task_id: str, load: Loader) -> dict[str, Any]:
    """The meta of a document's result fields, the result decoded (an exception still as it was encoded). Fields
    of another type than Celery stores (a hand edit) are left out: a `children` that is not a list of results, a
    `dateDone` that is not a date, a `traceback` that is not text."""
    children = doc.get("children")
    if not (isinstance(children, list) and all(isinstance(child, list) for child in children)):
        children = []
    meta = {
        "task_id": task_id,
        "status": _state_of(doc) or states.PENDING,
        "result": load(doc.get("result"), doc.get("resultFormat")) if "resultFormat" in doc else None,
        "traceback": doc.get("traceback") if isinstance(doc.get("traceback"), str) else None,
        "children": children,
        "date_done": doc.get("dateDone") if isinstance(doc.get("dateDone"), datetime) else None,
    }
    if doc.get("groupId"):
        meta["group_id"] = doc["groupId"]
    if doc.get("parentId"):
        meta["parent_id"] = doc["parentId"]
    return meta


def extended(doc: dict[str, Any], accept: Any) -> dict[str, Any]:
    """`result_extended`'s fields, as Celery's backends store them from the request: read off the job."""
    try:
        message = to_message(doc.get("payload"))
        body = loads(message["body"], message["content-type"], message["content-encoding"], accept=accept)
        args, kwargs = (body[0], body[1]) if isinstance(body, list | tuple) else (None, None)
    except (PayloadError, ContentDisallowed, DecodeError, TypeError, ValueError, IndexError):
        message, args, kwargs = {"headers": {}}, None, None  # a message the client cannot read: no arguments
    history = doc.get("history")
    if not isinstance(history, list):
        history = []
    finished = doc.get("status") in (SUCCEEDED, FAILED) and history and isinstance(history[-1], dict)
    return {
        "name": doc.get("kind"),
        "args": args,
        "kwargs": kwargs,
        "worker": history[-1].get("worker") if finished else None,
        "retries": message["headers"].get("retries"),
        "queue": doc.get("queue"),
    }
