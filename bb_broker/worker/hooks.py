"""Celery's side of the lifecycle: each job is settled in the process where its task's outcome is known."""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from celery import signals, states
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject, Retry
from celery.worker import state as worker_state
from kombu.exceptions import EncodeError

from bb_broker import connection
from bb_broker.forks import reset_in_child
from bb_broker.jobs import rate_keys, serial, settles, unique
from bb_broker.jobs.document import attempt_entry, history_entry_of
from bb_broker.jobs.leases import add_process_source, add_started_source
from bb_broker.jobs.lifecycle import Policy, describe_error, retry_countdown
from bb_broker.jobs.payloads import (
    ATTEMPTS_HEADER,
    BROKER_RETRIES_HEADER,
    DELIVERY_HEADERS,
    JOB_ID_HEADER,
    MalformedTaskMessage,
    check_signature,
)
from bb_broker.jobs.settles import Settle
from bb_broker.jobs.store import JOB_SETTLE, JobStore
from bb_broker.ops import metrics_endpoint
from bb_broker.options import BrokerOptions, OptionError, open_store
from bb_broker.transport.qos import explain_rejection
from bb_broker.worker import patches

logger = logging.getLogger(__name__)

#: Celery's setting (5.1 and later; True by default from 6.0) that cancels the running acks_late tasks on a reconnect.
CANCEL_ON_CONNECTION_LOSS = "worker_cancel_long_running_tasks_on_connection_loss"

#: The attribute of a Celery app holding its job stores, one per (process, broker URL, options, client options).
APP_STORES = "bb_broker_stores"
#: The attribute of a worker's Celery app holding the relay its pool processes settle through (settles.SettleRelay).
APP_SETTLE_RELAY = "bb_broker_settle_relay"
#: The attribute of a worker's Celery app holding (process id, the job store its tasks settle on): store_of's. Set
#: to None at worker_init: from then on the app's conf no longer changes, and the store may be kept.
APP_TASK_STORE = "bb_broker_task_store"
_stores_lock = threading.Lock()


@reset_in_child
def _forget_parent_stores_lock() -> None:
    # A lock a parent's thread held at the fork would never be released in the child, whose first task would wait
    # for it forever; the stores themselves are kept by process (their key holds the pid).
    global _stores_lock
    _stores_lock = threading.Lock()


#: The attribute of a task's request (Celery's `task.request`, a Context) that holds its AttemptState.
ATTEMPT_STATE = "bb_attempt_state"


@dataclass
class AttemptState:
    """What the result backend and the signal receivers tell each other of one attempt this process runs.

    It is kept on the attempt's request, which Celery hands to both (the tracer's Context; for a revoke, the
    worker Request's Context) and which lives exactly as long as the attempt: nothing to bound or to clear."""

    #: When the task started, on the server's clock: its history entry's `startedAt` (taken once, by attempt_for).
    started_at: datetime | None = None
    #: The result backend made the settling write (with the result): the signal adds nothing.
    settled_by_backend: bool = False
    #: Result fields the backend prepared for the settling write a signal makes (a revoke: the signal knows why).
    pending_result: dict[str, Any] | None = None
    #: The broker retried the attempt, its failure already recorded: Celery's retry that follows records nothing.
    retried_by_broker: bool = False
    #: The job store of the task's app, looked up once per attempt by store_of (each lookup reads the app's conf).
    store: JobStore | None = None
    store_looked_up: bool = False


def attempt_state(request: Any) -> AttemptState:
    """The AttemptState of the attempt `request` runs, made on first use."""
    state = getattr(request, ATTEMPT_STATE, None)
    if state is None:
        state = AttemptState()
        setattr(request, ATTEMPT_STATE, state)
    return state


def broker_url(app: Any) -> str | None:
    """The app's broker URL when it is bbmongo://, else None."""
    url = app.conf.broker_url or ""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    url = str(url).split(";", 1)[0]
    return url if url.lower().startswith(("bbmongo://", "bbmongo+srv://")) else None


def store_for(app: Any, **client_options: Any) -> JobStore | None:
    """The job store behind an app's broker (on a client with `client_options`, e.g. shorter timeouts), or None when
    the app does not use bbmongo://."""
    url = broker_url(app)
    if url is None:
        return None
    options = app.conf.broker_transport_options or {}
    key = (os.getpid(), url, repr(sorted(options.items())), repr(sorted(client_options.items())))
    with _stores_lock:
        stores: dict[tuple[int, str, str, str], JobStore] = app.__dict__.setdefault(APP_STORES, {})
        store = stores.get(key)
        if store is None:
            target = connection.parse_broker_url(url)
            store = stores[key] = open_store(target, BrokerOptions.parse(options), **client_options)
            store.settle_relay = app.__dict__.get(APP_SETTLE_RELAY)
    return store


def store_of(task: Any) -> JobStore | None:
    """store_for(task.app), looked up once for the attempt the task's request runs: a task's signals each need it."""
    state = attempt_state(task.request)
    if not state.store_looked_up:
        state.store, state.store_looked_up = _task_store(task.app), True
    return state.store


def _task_store(app: Any) -> JobStore | None:
    # store_for reads the app's conf, about a tenth of a pool process's CPU per task (py-spy --gil, a drain). In a
    # worker, whatever its pool, the conf no longer changes: the store is kept on the app, by process.
    kept = app.__dict__.get(APP_TASK_STORE)
    if kept is not None and kept[0] == os.getpid():
        return kept[1]
    store = store_for(app)
    if APP_TASK_STORE in app.__dict__:
        app.__dict__[APP_TASK_STORE] = (os.getpid(), store)
    return store


def job_of(request: Any) -> tuple[str, int] | None:
    """The (job id, attempt) a task request was delivered as, or None when it did not come through bbmongo://."""
    job_id = getattr(request, JOB_ID_HEADER, None)
    attempts = getattr(request, ATTEMPTS_HEADER, None)
    if job_id is None:
        headers = getattr(request, "headers", None) or {}
        job_id, attempts = headers.get(JOB_ID_HEADER), headers.get(ATTEMPTS_HEADER)
    if job_id is None or attempts is None:
        return None
    return str(job_id), int(attempts)


def broker_retries(request: Any) -> int:
    """How many of the request's Celery retries were the broker running a failed attempt again."""
    count = getattr(request, BROKER_RETRIES_HEADER, None)
    if count is None:
        count = (getattr(request, "headers", None) or {}).get(BROKER_RETRIES_HEADER)
    return int(count or 0)


def own_retries(request: Any) -> int:
    """The task's own Celery retries (`self.retry`, `autoretry_for`) behind this request, the broker's left out."""
    return max(0, int(getattr(request, "retries", 0) or 0) - broker_retries(request))


def is_final_attempt(task: Any) -> bool:
    """True when an exception raised now ends the job `failed`: the place for compensation logic."""
    request = task.request
    job = job_of(request)
    if job is None:
        raise RuntimeError("is_final_attempt() answers only inside a task delivered through bbmongo://")
    retries = own_retries(request)
    if retries:
        # The task drives its own Celery retries; its max_retries has the last word.
        return task.max_retries is not None and retries >= task.max_retries
    store = store_for(task.app)
    policy = store.policy if store is not None else Policy()
    return policy.is_final_attempt(job[1])


def is_retryable(request: Any, exception: BaseException) -> bool:
    # A failure after the task's own Celery retries means its retry policy gave up; a result that cannot be encoded
    # or stored (ResultTooLarge is one), or a callback or chain step the broker refuses to publish (PublishRefused is
    # an EncodeError), comes after the task's work is done, and running it again would do the work again to the same
    # end; a task that rejects its message without requeue asks never to run again.
    # Reject.__init__ sets `requeue`; celery-types does not declare it.
    rejected_for_good = isinstance(exception, Reject) and not exception.requeue  # type: ignore[attr-defined]
    if isinstance(exception, EncodeError) or rejected_for_good:
        return False
    return not (isinstance(exception, MaxRetriesExceededError) or own_retries(request))


def retry_failed_attempts(app: Any) -> None:
    """Make a failed attempt the broker runs again a Celery retry, in every task of a bbmongo:// worker's app.

    As Celery's `autoretry_for` does it (celery/app/autoretry.py): Celery then stores RETRY, not FAILURE, runs no
    errback, chain failure or chord error, and Flower shows RETRY; the last attempt's failure propagates as ever."""
    if store_for(app) is None:
        return
    patches.wrap_task_runs(app, _broker_retry)


def _broker_retry(task: Any, exc: Exception) -> Retry | Ignore | None:
    """The Retry that runs this failed attempt again (published already), None when the failure is final, or Ignore
    when the attempt lost its job to another."""
    request = task.request
    store, job = store_for(task.app), job_of(request)
    if store is None or job is None or request.is_eager:
        return None
    countdown = retry_countdown(store.policy, job[1], retryable=is_retryable(request, exc))
    if countdown is None:
        return None
    error = describe_error(exc)
    trace = "".join(traceback.format_exception(exc))
    if not store.record_failed_attempt(
        *job, error, attempt=attempt_for(store, request, job[1], "failed", error, trace)
    ):
        # The attempt is no longer the job's (the stale sweep gave it to another worker): its retry's publish would
        # send the job that attempt holds back to the queue. It ends here, with nothing recorded, as Ignore does.
        return Ignore()
    attempt_state(request).retried_by_broker = True
    headers = {k: v for k, v in (request.headers or {}).items() if k not in DELIVERY_HEADERS}
    headers[BROKER_RETRIES_HEADER] = broker_retries(request) + 1
    # The attempt the retry comes from: its publish is fenced on it (store.publish's `retry_of`), since the job may be
    # taken over between the write above and the publish.
    headers.update({JOB_ID_HEADER: job[0], ATTEMPTS_HEADER: job[1]})
    try:
        # max_retries: never Celery's limit (the task's, 3 by default) but the broker's, checked above.
        return task.retry(exc=exc, countdown=countdown, max_retries=request.retries + 1, headers=headers, throw=False)
    finally:
        patches.forget_retry_override(task)


def retried_by_broker(request: Any) -> bool:
    """True when this attempt's failure was recorded by the broker's retry (Celery's RETRY then adds no attempt)."""
    return attempt_state(request).retried_by_broker


def settled_by_backend(request: Any) -> None:
    """The result backend settled this attempt in its own write: the task's signal must not settle it again."""
    attempt_state(request).settled_by_backend = True


def pending_result(request: Any, fields: dict[str, Any]) -> None:
    """Result fields for the settling write the signal of this attempt makes."""
    attempt_state(request).pending_result = fields


def _settled_already(request: Any) -> bool:
    state = attempt_state(request)
    settled, state.settled_by_backend = state.settled_by_backend, False
    return settled


def attempt_for(
    store: JobStore,
    request: Any,
    attempts: int,
    outcome: str,
    error: str | None = None,
    traceback: str | None = None,
) -> dict[str, Any]:
    """The history entry of the attempt `request` is running, finished now with `outcome`."""
    state = attempt_state(request)
    started_at, state.started_at = state.started_at, None
    return attempt_entry(
        attempts,
        worker=getattr(request, "hostname", None) or socket.gethostname(),
        started_at=started_at,
        finished_at=store.now(),
        outcome=outcome,
        error=error,
        traceback=traceback,
    )


def settle_ran(store: JobStore, request: Any, settle: Settle, size: int = 0) -> None:
    """Write the settle of an attempt `request` ran: in a worker's tracer, with the other settles this process makes
    meanwhile (settles.py; `size`, the bytes of its result and tracebacks, sends a large one alone); called directly
    (a script, a test calling the backend), at once."""
    if getattr(request, "called_directly", True) or size > settles.GROUP_COMMIT_MAX_BYTES:
        store.settle(settle)
    else:
        store.settle_soon(settle)


@signals.task_prerun.connect
def _on_prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    store = store_of(sender) if sender is not None else None
    if store is not None and task_id and job_of(sender.request) is not None:
        attempt_state(sender.request).started_at = store.now()
        _drop_refused_signatures(sender)


#: The attributes of a task's request holding the signatures its tracer publishes once its body ran (callbacks, the
#: next chain step) or failed for good (errbacks): read from the request Celery's tracer runs, the one given here.
_LATER_SIGNATURES = ("callbacks", "errbacks", "chain")


def _drop_refused_signatures(task: Any) -> None:
    """Take off the task's request every callback, errback and chain step whose publish the broker would refuse
    (check_signature, the check of a publish's whole canvas), each reported in one line, before the body runs.

    A message that carries one never passed this broker's publish (written by hand, or by another client): refused
    when Celery's tracer publishes it after the body, it would fail the task that ran, and the broker would run the
    body again. The task runs and settles as it would without it. A refused chain step takes the steps after it
    along: it is the one that would publish them."""
    request = task.request
    for name in _LATER_SIGNATURES:
        signatures = getattr(request, name, None)
        if not isinstance(signatures, list) or not signatures:
            continue
        kept = [signature for index, signature in enumerate(signatures) if _publishable(task, name, index, signature)]
        if name == "chain" and len(kept) != len(signatures):
            kept = []
        if len(kept) != len(signatures):
            setattr(request, name, kept or None)


def _publishable(task: Any, name: str, index: int, signature: Any) -> bool:
    try:
        check_signature(signature, f"its {name!r}[{index}]")
    except MalformedTaskMessage as exc:
        shown = signature.get("task") if isinstance(signature, dict) else None
        logger.error(
            "task %s[%s]: %s %r is not published, the broker refuses it (the task runs without it): %s",
            task.name,
            task.request.id,
            name,
            shown,
            exc,
        )
        return False
    return True


@signals.task_success.connect
def _on_success(sender: Any = None, **_: Any) -> None:
    store, job = store_of(sender), job_of(sender.request)
    if store is not None and job is not None and not _settled_already(sender.request):
        attempt = attempt_for(store, sender.request, job[1], "succeeded")
        settle_ran(store, sender.request, store.success(*job, attempt=attempt))


@signals.task_failure.connect
def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    einfo: Any = None,
    **_: Any,
) -> None:
    store = store_for(sender.app)
    if store is None or exception is None:
        return
    request = sender.request
    job = job_of(request) if getattr(request, "id", None) == task_id else None
    if job is not None and _settled_already(request):
        return
    error = describe_error(exception)
    # Without the request (the main process reporting a hard time limit, or a Reject without requeue, for a pool
    # process) the exception alone still says whether the job may run again: a rejected task must not.
    retryable = is_retryable(request if job else None, exception)
    if job is not None:
        trace = getattr(einfo, "traceback", None)
        ran_here = attempt_state(request).started_at is not None
        entry: dict[str, Any] | None = attempt_for(store, request, job[1], "failed", error, trace)
        if not ran_here and store.attempt_recorded(*job):
            # Another process ran the attempt (a pool process this worker lost): its broker retry recorded the
            # failure, then the process died before the retry's publish. The attempt has its entry.
            entry = None
        size = 0 if entry is None else len(entry.get("traceback") or "")
        settle_ran(store, request, store.failure(*job, error, retryable=retryable, attempt=entry), size)
    elif task_id:
        # A hard time limit is reported by the main process, without the task's request.
        worker = getattr(request, "hostname", None) or socket.gethostname()
        store.fail_running_task(task_id, connection.lease_owner(), error, retryable=retryable, worker=worker)


@signals.task_postrun.connect
def _on_postrun(sender: Any = None, state: str | None = None, retval: Any = None, **_: Any) -> None:
    if sender is None:
        return
    if state == states.REJECTED and isinstance(retval, Reject) and not patches.fails_rejected_tasks():
        # Before Celery 5.7 a task that rejects its message without requeue gets no failure signal, and its
        # message, acked when it was received (unless acks_late), cannot be rejected any more: its job fails for
        # good here, as 5.7's task_failure fails it. A requeue is the message's (acks_late), on every release.
        if not retval.requeue:  # type: ignore[attr-defined]  # Reject.__init__ sets it; celery-types omits it
            _on_failure(sender=sender, task_id=sender.request.id, exception=retval)
        return
    # A task that raised Ignore (Task.replace does: its replacement is a new message with the same task id) gets
    # no success or failure signal. Its job is done, not lost: left running, the stale sweep would run it again.
    if state != states.IGNORED:
        return
    store, job = store_of(sender), job_of(sender.request)
    if store is not None and job is not None and not _settled_already(sender.request):
        attempt = attempt_for(store, sender.request, job[1], "ignored")
        settle_ran(store, sender.request, store.success(*job, attempt=attempt))


@signals.task_retry.connect
def _on_retry(sender: Any = None, request: Any = None, reason: Any = None, einfo: Any = None, **_: Any) -> None:
    # The task's own retry already put its job back in the queue (publish); the attempt joins the history.
    store, job = store_for(sender.app), job_of(request)
    if job is not None and retried_by_broker(request):
        return  # the broker's retry recorded the failed attempt before it published the task again
    if store is None or job is None or _settled_already(request) or reason is None:
        return  # no reason: Celery cancelled the task as its worker stops, and the release records the attempt
    error = describe_error(reason.exc) if getattr(reason, "exc", None) is not None else str(reason)
    trace = getattr(einfo, "traceback", None)
    store.record_retry(*job, attempt_for(store, request, job[1], "retry", error, trace))


def revoke_reason(terminated: bool, expired: bool, signum: Any) -> str:
    if expired:
        return "revoked: the task expired before it ran"
    if terminated:
        return f"revoked: terminated by signal {signum}"
    return "revoked before it ran"


@signals.task_revoked.connect
def _on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    signum: Any = None,
    **_: Any,
) -> None:
    store, job = store_for(sender.app), job_of(request)
    if store is None or job is None or _settled_already(request):
        return
    reason = revoke_reason(terminated, expired, signum)
    entry = attempt_for(store, request, job[1], "revoked", reason)
    store.fail(*job, reason, retryable=False, attempt=entry, result=attempt_state(request).pending_result, revoked=True)


@signals.before_task_publish.connect
def _flow_control_headers(
    sender: Any = None, body: Any = None, headers: Any = None, properties: Any = None, **_: Any
) -> None:
    """The unique, serial and rate key options of a publish (the call's, from apply_async's keywords, which Celery puts
    in the message's properties; the task's attributes under them) as the message's headers (bb_broker.jobs.unique,
    bb_broker.jobs.serial and bb_broker.jobs.rate_keys)."""
    if not isinstance(headers, dict) or not isinstance(properties, dict):
        return
    options = (*unique.OPTION_NAMES, *serial.OPTION_NAMES, *rate_keys.OPTION_NAMES)
    call = {name: properties.pop(name) for name in options if name in properties}
    task = patches.registered_task(sender) if isinstance(sender, str) else None
    if isinstance(body, (list, tuple)) and len(body) >= 2:  # Celery's protocol 2: (args, kwargs, embed)
        args, kwargs = body[0], body[1]
    else:  # protocol 1: a dict
        args, kwargs = (body.get("args"), body.get("kwargs")) if isinstance(body, dict) else ((), {})
    args, kwargs, run = args or (), kwargs or {}, getattr(task, "run", None)
    try:
        # A header already there is a retry's (its message carries the request's headers), a beat's slot, or set
        # by hand: kept as it is.
        if unique.UNIQUE_KEY_HEADER not in headers:
            headers.update(unique.UniqueOptions.read(task, call).headers(str(sender), args, kwargs, run))
        for header, option, longest in (
            (serial.SERIAL_KEY_HEADER, "serial", serial.MAX_SERIAL_KEY_LENGTH),
            (rate_keys.RATE_KEY_HEADER, "rate", rate_keys.MAX_RATE_KEY_LENGTH),
        ):
            if header not in headers:
                key = unique.option_key(option, task, call, str(sender), args, kwargs, run, max_length=longest)
                if key is not None:
                    headers[header] = key
    except unique.UniqueOptionError as exc:
        # Celery's signals swallow what a receiver raises: the transport raises it, writing nothing.
        headers[unique.UNIQUE_REFUSED_HEADER] = str(exc)


@signals.task_unknown.connect
def _on_unknown(sender: Any = None, message: Any = None, name: str | None = None, **_: Any) -> None:
    _explain_rejection(message, f"unknown task {name!r}: no worker has it registered")


@signals.task_rejected.connect
def _on_rejected(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    reason = describe_error(exc) if exc is not None else "not a task message this worker understands"
    _explain_rejection(message, f"invalid task message: {reason}")


def _explain_lost(message: Any, exc: BaseException) -> None:
    explain_rejection(message, describe_error(exc))


def _explain_rejection(message: Any, reason: str) -> None:
    # Celery sends this just after rejecting the message, inside its delivery: the transport fails the job with
    # this reason when the delivery returns, in the one write that fails it.
    explain_rejection(message, reason)


def runs_again(app: Any, request: Any, exc: BaseException) -> bool:
    """True when the broker runs the job of this failed request again: the failure is not the task's last."""
    store, job = store_for(app), job_of(request) if request is not None else None
    if store is None or job is None or getattr(request, "is_eager", False):
        return False
    return retry_countdown(store.policy, job[1], retryable=is_retryable(request, exc)) is not None


def _reserved_jobs() -> list[str]:
    # Every request the worker still holds, running or waiting in its pool: these leases stay fresh.
    return _jobs_of(worker_state.reserved_requests)


def _started_jobs() -> list[str]:
    # The requests its pool took. Celery keeps them through a reconnect (Consumer.on_close), and their runs go on,
    # except those it cancels then for the broker to deliver again (worker_cancel_long_running_tasks_on_connection_loss:
    # nothing settles a cancelled run, and its job goes back, as Celery means it to).
    return _jobs_of(request for request in list(worker_state.active_requests) if not _cancelled_on_reconnect(request))


def _cancelled_on_reconnect(request: Any) -> bool:
    """Celery's own test (Consumer.on_connection_error_after_connected) of a request it cancels on a reconnect."""
    task = getattr(request, "task", None)
    cancels = bool(getattr(getattr(task, "app", None), "conf", {}).get(CANCEL_ON_CONNECTION_LOSS))
    return cancels and bool(getattr(task, "acks_late", False)) and not getattr(request, "acknowledged", False)


def _jobs_of(requests: Iterable[Any]) -> list[str]:
    held = (getattr(request, "request_dict", None) or {} for request in list(requests))
    return [str(headers[JOB_ID_HEADER]) for headers in held if headers.get(JOB_ID_HEADER)]


class _ScrubSecrets(logging.Filter):
    """Masks the broker's credentials in every record, tracebacks included, whoever wrote them."""

    def __init__(self, secrets: tuple[str, ...]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = connection.scrub(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info:
            trace = logging.Formatter().formatException(record.exc_info)
            if connection.scrub(trace, self.secrets) != trace:
                record.exc_text, record.exc_info = connection.scrub(trace, self.secrets), None
        return True


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _scrub_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    from celery import current_app

    url = broker_url(current_app)
    secrets = connection.parse_broker_url(url).secrets if url else ()
    if logger is None or not secrets:
        return
    for handler in logger.handlers:
        if not any(isinstance(f, _ScrubSecrets) for f in handler.filters):
            handler.addFilter(_ScrubSecrets(secrets))


@signals.worker_shutting_down.connect
def _stopping(**_: Any) -> None:
    connection.begin_shutdown()


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _write_the_last_settles(**_: Any) -> None:
    # A pool process exits with os._exit (no atexit): the settles its writer still has go out first.
    settles.flush_all(connection.SHUTDOWN_PATIENCE)


@signals.import_modules.connect
def _tasks_imported(sender: Any = None, **_: Any) -> None:
    # A pool process started afresh (spawn, execv) imports the tasks and builds its tracers without worker_init.
    if sender is not None:
        try:
            retry_failed_attempts(sender)
        except (connection.BrokerURLError, OptionError) as exc:
            # The worker cannot start: one line, not the 50-line traceback Celery re-raises a receiver's error with.
            raise SystemExit(f"bb_broker: {exc}") from None


@signals.worker_process_init.connect
def _in_a_pool_process(**_: Any) -> None:
    connection.in_a_pool_process()  # its clients' monitors look at the server once a minute (connection.py says why)


@signals.worker_init.connect
def _become_worker(sender: Any = None, **_: Any) -> None:
    if broker_url(sender.app) is None:
        return
    # Before the pool forks and the consumer builds its tracers and request classes: `pool_shrink` must not wedge
    # a worker, a task's failed attempt the broker runs again is a Celery retry, and what the main process reports of
    # a task (its pool process died, a hard time limit) is right for the job (see patches.py).
    patches.install(sender.app, runs_again=runs_again, retry_for=_broker_retry, explain_lost=_explain_lost)
    # The requests this worker holds keep their leases, and what it still holds at exit is released. A consumer
    # closed by a lost connection gives back the jobs of the others, not of those whose runs go on (Channel._restore).
    add_process_source(_reserved_jobs)
    add_started_source(_started_jobs)
    sender.app.__dict__[APP_TASK_STORE] = None  # kept from the first task on (_task_store)
    # The pool processes it forks settle through this process: their settles go out together (settles.py).
    if _forks_its_pool(sender):
        app = sender.app
        try:
            linger = BrokerOptions.parse(app.conf.broker_transport_options).settle_linger
            relay = settles.SettleRelay(lambda: store_for(app), partial(_relayed_unwritable, app), linger=linger)
        except OptionError as exc:
            raise SystemExit(f"bb_broker: {exc}") from None  # one line, as for a broker URL it cannot use
        except OSError as exc:  # no SOCK_SEQPACKET socket pair here (macOS, the BSDs): each pool process writes
            logger.info("bb_broker: pool processes settle on their own (%s)", exc)
            return
        app.__dict__[APP_SETTLE_RELAY] = relay
        relay.start()


def _forks_its_pool(worker: Any) -> bool:
    """Whether the worker's pool is processes forked from this one (prefork): a threads, solo, gevent or eventlet
    pool settles in this process. `pool_cls` is the `-P` choice at worker_init, resolved by Celery's own public
    `get_implementation` (checked against celery 5.5.3, 5.6.3, 5.7.0)."""
    # Imported here: billiard's pool is of no use to the command line's start.
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool as PreforkPool

    try:
        pool = get_implementation(worker.pool_cls)
    except Exception:  # an unknown pool is Celery's to refuse, a moment later
        return False
    return isinstance(pool, type) and issubclass(pool, PreforkPool)


#: The result fields a relayed settle's replacement keeps from it (the main process has no request to build them).
_RESULT_CONTEXT = ("children", "groupId", "parentId")


def _relayed_unwritable(app: Any, store: JobStore, settle: Settle, with_result: bool, cause: str) -> Settle:
    """What fails a job whose relayed settle can never be written (`cause`): the result backend's failure when the
    settle carried a result (get() raises its ResultNotStored, as from a pool process's own write), else the
    store's."""
    failed_unstored = getattr(app.backend, "failed_unstored", None) if with_result else None
    job = (settle.job_id, settle.fence["attempts"])
    if failed_unstored is None or settle.subject is None:
        return store.failure(*job, f"{settle.subject or JOB_SETTLE} {cause}", retryable=False)
    entry = history_entry_of(settle.update)
    replacement: Settle = failed_unstored(store, job, entry, None, settle.subject, cause)
    relayed = settle.update.get("$set", {})
    replacement.update["$set"].update({field: relayed[field] for field in _RESULT_CONTEXT if field in relayed})
    return replacement


@signals.worker_ready.connect
def _summarize_charts_ahead(sender: Any = None, **_: Any) -> None:
    """The worker's main process takes its turns at keeping the Jobs tab's chart summaries written ahead of the
    charts (one process of the fleet at a time: bb_broker.ops.stats.SummarizingAhead), so that a chart finds them
    written whether or not a Flower that may write runs."""
    store = store_for(sender.app)
    if store is None:
        return
    # Imported here: the operator's queries are of no use to the pool processes and the command line's start.
    from bb_broker.ops.operations import Operations
    from bb_broker.ops.stats import SummarizingAhead

    SummarizingAhead.start(Operations(store), owner=f"{getattr(sender, 'hostname', None)}:{os.getpid()}")


@signals.worker_ready.connect
def _serve_metrics(sender: Any = None, **_: Any) -> None:
    """Opt-in with BB_METRICS_PORT: the worker's main process serves /metrics and /statuses."""
    port = os.environ.get("BB_METRICS_PORT", "").strip()
    if not port:
        return
    store = store_for(sender.app)
    if store is None:
        logger.warning("BB_METRICS_PORT is set but this worker's broker is not bbmongo://: no metrics endpoint")
        return
    host = os.environ.get("BB_METRICS_HOST", "127.0.0.1")
    try:
        server = metrics_endpoint.serve_in_background(store, host, int(port))
    except (OSError, ValueError) as exc:
        # A busy port must not stop the worker from working.
        logger.error("bb_broker metrics endpoint not started on %s:%s: %s", host, port, exc)
        return
    if not metrics_endpoint.multiprocess_dir() and type(getattr(sender, "pool", None)).__module__.endswith("prefork"):
        logger.warning("PROMETHEUS_MULTIPROC_DIR is not set: the counters of the pool processes are not served")
    logger.info("bb_broker metrics on http://%s:%d/metrics and /statuses", host, server.server_port)
