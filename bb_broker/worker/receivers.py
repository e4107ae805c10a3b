"""Celery's task signals, each handing its outcome to the settle protocol (worker/settle.py)."""

from __future__ import annotations

import logging
from typing import Any

from celery import signals, states
from celery.exceptions import Reject

from bb_broker import app_stores
from bb_broker.jobs.lifecycle import describe_error
from bb_broker.jobs.payloads import MalformedTaskMessage, check_signature, signature_task_id
from bb_broker.jobs.refusals import PublishRefused
from bb_broker.transport.qos import REQUEUED, explain_rejection
from bb_broker.upstream import celery as upstream_celery
from bb_broker.worker import settle

logger = logging.getLogger(__name__)


@signals.task_prerun.connect
def _on_prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    store = settle.store_of(sender) if sender is not None else None
    if store is not None and task_id and settle.job_of(sender.request) is not None:
        settle.started(store, sender.request)
        _drop_refused_signatures(sender.request, sender.backend, sender.name, _AFTER_THE_BODY)


#: The attributes of a task's request holding the signatures its tracer publishes once its body ran (callbacks, the
#: next chain step) or failed for good (errbacks), and that a broker retry's message carries: read from the request
#: Celery's tracer runs, the one given here.
_AFTER_THE_BODY = ("callbacks", "errbacks", "chain")


#: Set on a request whose errbacks its result backend ran (prepare_errbacks).
_ERRBACKS_RAN = "bb_errbacks_ran"


def prepare_errbacks(backend: Any, request: Any) -> None:
    """Make a failed task's errbacks what its result backend may run, before it runs them at the failure that ends
    the job (upstream_celery.install_failure_as_retry; bbmongo's own mark_as_failure): each the broker would refuse
    taken off, and none a second time for the same request.

    The task_prerun took the refused ones off the pool process's request; a failure the worker's main process reports
    (a hard time limit, a pool process that died) runs the errbacks of its own request, as the message carried them:
    refused there, the failure itself went unrecorded, and the job ran again once the stale sweep took it back. And
    Celery's main process reports a hard time limit twice (Request.on_timeout, then on_failure as the pool process is
    killed), each time running the request's errbacks: every errback ran twice."""
    if getattr(request, _ERRBACKS_RAN, False):
        request.errbacks = None
        return
    setattr(request, _ERRBACKS_RAN, True)
    name = getattr(request, "task", None)
    _drop_refused_signatures(request, backend, name if isinstance(name, str) else "(a task)", ("errbacks",))


def _drop_refused_signatures(request: Any, backend: Any, task_name: str, names: tuple[str, ...]) -> None:
    """Take off the task's request every signature of `names` whose publish the broker would refuse (check_signature,
    the check of a publish's whole canvas), each reported in one line, before Celery's tracer publishes them.

    A message that carries one never passed this broker's publish (written by hand, or by another client): refused
    when Celery's tracer publishes it after the body, it would fail the task that ran, and the broker would run the
    body again. The task runs and settles as it would without it. A refused chain step takes the steps after it
    along: it is the one that would publish them. Each dropped signature that names its task id gets a failure in
    the result backend, so that its waiters (`AsyncResult(id).get()`) get the reason rather than wait for ever."""
    for name in names:
        signatures = getattr(request, name, None)
        if not isinstance(signatures, list) or not signatures:
            continue
        refused: dict[int, str] = {}
        for index, signature in enumerate(signatures):
            if (error := _refusal(task_name, request.id, name, index, signature)) is not None:
                refused[index] = error
        if not refused:
            continue
        dropped = dict.fromkeys(range(len(signatures)), next(iter(refused.values()))) if name == "chain" else {}
        dropped.update(refused)
        kept = [signature for index, signature in enumerate(signatures) if index not in dropped]
        setattr(request, name, kept or None)
        for index, error in dropped.items():
            if (task_id := signature_task_id(signatures[index])) is not None:
                refusal = PublishRefused(f"not published, the broker refuses it ({name} of task {request.id}): {error}")
                app_stores.store_never_run(backend, task_id, refusal)


def _refusal(task_name: str, task_id: Any, name: str, index: int, signature: Any) -> str | None:
    """Why the broker would refuse to publish the signature (reported in one line), None when it would not."""
    try:
        check_signature(signature, f"its {name!r}[{index}]")
    except MalformedTaskMessage as exc:
        shown = signature.get("task") if isinstance(signature, dict) else None
        logger.error(
            "task %s[%s]: %s %r is not published, the broker refuses it (the task runs without it): %s",
            task_name,
            task_id,
            name,
            shown,
            exc,
        )
        return str(exc)
    return None


@signals.task_success.connect
def _on_success(sender: Any = None, **_: Any) -> None:
    settle.succeeded(settle.store_of(sender), sender.request)


@signals.task_failure.connect
def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    einfo: Any = None,
    **_: Any,
) -> None:
    store = app_stores.store_for(sender.app)
    if store is None or exception is None:
        return
    # A hard time limit is reported by the main process, whose task has no request of that task id.
    request = sender.request
    held = request if getattr(request, "id", None) == task_id else None
    settle.failed(store, held, exception, getattr(einfo, "traceback", None), task_id=task_id)


@signals.task_postrun.connect
def _on_postrun(sender: Any = None, state: str | None = None, retval: Any = None, **_: Any) -> None:
    if sender is None:
        return
    # A task that raised Ignore gets no success or failure signal.
    if state == states.IGNORED:
        settle.ignored(settle.store_of(sender), sender.request)
    elif state == states.REJECTED and isinstance(retval, Reject):
        store = app_stores.store_for(sender.app)
        if store is None:
            return
        if retval.requeue:  # type: ignore[attr-defined]  # celery-types omits it
            # With acks_late the rejection reaches the message (JobQoS.reject settles it). Without, the message was
            # acked as the task started and Celery's rejection does nothing: the job would stay running until its
            # lease ran out.
            if not getattr(sender, "acks_late", False):
                settle.requeued(store, sender.request, REQUEUED)
        elif not upstream_celery.fails_rejected_tasks():
            # Before Celery 5.7 a task that rejects its message without requeue gets no failure signal, and its
            # message, acked when it was received (unless acks_late), cannot be rejected any more: its job fails for
            # good here, as 5.7's task_failure fails it (_on_failure).
            settle.failed(store, sender.request, retval)


@signals.task_retry.connect
def _on_retry(sender: Any = None, request: Any = None, reason: Any = None, einfo: Any = None, **_: Any) -> None:
    # No reason: Celery cancelled the task as its worker stops.
    if reason is None:
        error = None
    else:
        error = describe_error(reason.exc) if getattr(reason, "exc", None) is not None else str(reason)
    settle.retried(app_stores.store_for(sender.app), request, error, getattr(einfo, "traceback", None))


@signals.task_revoked.connect
def _on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    signum: Any = None,
    **_: Any,
) -> None:
    why = settle.revoke_reason(terminated, expired, signum)
    settle.revoked(app_stores.store_for(sender.app), request, why=why)


@signals.task_unknown.connect
def _on_unknown(sender: Any = None, message: Any = None, name: str | None = None, **_: Any) -> None:
    _explain_rejection(message, f"unknown task {name!r}: no worker has it registered")


@signals.task_rejected.connect
def _on_rejected(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    reason = describe_error(exc) if exc is not None else "not a task message this worker understands"
    _explain_rejection(message, f"invalid task message: {reason}")


def explain_lost(message: Any, exc: BaseException) -> None:
    """Give the message of a request whose pool process died its reason (upstream_celery.hook_requests)."""
    explain_rejection(message, describe_error(exc))


def _explain_rejection(message: Any, reason: str) -> None:
    # Celery sends this just after rejecting the message, inside its delivery: the transport fails the job with
    # this reason when the delivery returns, in the one write that fails it.
    explain_rejection(message, reason)
