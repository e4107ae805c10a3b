"""The settle protocol: which outcome of a task settles its job, and how, whoever hears of it first.

Celery tells of one attempt's outcome twice: to the result backend (mark_as_done, mark_as_failure, its RETRY state,
mark_as_revoked), which has the result, and then to the task's signals (task_success, task_failure, task_retry,
task_revoked; worker/receivers.py), which every worker has, whatever its result backend. Both call the verb of the
outcome here (`succeeded`, `ignored`, `failed`, `retried`, `revoked`): the first call for an attempt writes its settle,
a later one changes nothing. A failed attempt the broker runs again (`broker_retry`) is settled by the retry itself,
before Celery's RETRY reaches either. The attempt's state (when it started, whether it is settled) lives on its
request, which Celery hands to both and which lives exactly as long as the attempt.

Where a settle goes: in a worker's tracer, with the other settles this process makes meanwhile (jobs/settles.py);
one larger than settles.GROUP_COMMIT_MAX_BYTES, or made outside a worker (a script calling the backend), at once.
A result or failure that cannot be kept in its job document fails the job for good, saying so (the size fallback:
the backend's `unwritable`).
"""

from __future__ import annotations

import socket
import traceback as tracebacks
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, Protocol

from billiard.exceptions import WorkerLostError
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject, Retry
from kombu.exceptions import EncodeError

from bb_broker import app_stores, connection
from bb_broker.jobs import settles
from bb_broker.jobs.document import DOES_NOT_FIT, ResultTooLarge, SettleUnwritable, attempt_entry, history_entry_of
from bb_broker.jobs.lifecycle import Policy, describe_error, retry_countdown
from bb_broker.jobs.payloads import ATTEMPTS_HEADER, BROKER_RETRIES_HEADER, DELIVERY_HEADERS, JOB_ID_HEADER
from bb_broker.jobs.settles import Settle
from bb_broker.jobs.store import JOB_SETTLE, JobStore
from bb_broker.upstream import celery as upstream_celery

#: What a job's failure names when its result, or its failure, cannot be kept in its document (Settle.subject).
RESULT = "the task's result"
FAILURE = "the task's failure"

#: The result fields of an outcome, as the result backend stores them, and about how many bytes they are (the encoded
#: result and the traceback): a large settle is written alone.
ResultFields = tuple[dict[str, Any], int]


class Unwritable(Protocol):
    """The result backend's settle that fails a job for good because its result or failure (`subject`) cannot be kept
    in its document, for `cause` (JobResultBackend.failed_unstored)."""

    def __call__(
        self,
        store: JobStore,
        job: tuple[str, int],
        attempt: dict[str, Any] | None,
        request: Any,
        subject: str,
        cause: str,
    ) -> Settle: ...


#: The attribute of a task's request (Celery's `task.request`, a Context) that holds its _AttemptState.
_ATTEMPT_STATE = "bb_attempt_state"


@dataclass
class _AttemptState:
    """What this module knows of one attempt this process runs, kept on the attempt's request (the tracer's Context;
    for a revoke, the worker Request's Context): nothing to bound or to clear."""

    #: When the task started, on the server's clock: its history entry's `startedAt` (taken once, by _entry).
    started_at: datetime | None = None
    #: The attempt's settle was written (or, for a broker retry, its failure recorded): a later verb writes nothing.
    settled: bool = False
    #: The result fields a revoke stores, told by the backend before task_revoked tells why.
    revoke_result: dict[str, Any] | None = None
    #: The job store of the task's app, looked up once per attempt by store_of (each lookup reads the app's conf).
    store: JobStore | None = None
    store_looked_up: bool = False


def _attempt(request: Any) -> _AttemptState:
    state = getattr(request, _ATTEMPT_STATE, None)
    if state is None:
        state = _AttemptState()
        setattr(request, _ATTEMPT_STATE, state)
    return state


def store_of(task: Any) -> JobStore | None:
    """app_stores.task_store(task.app), looked up once for the attempt the task's request runs: a task's signals each
    need it."""
    state = _attempt(task.request)
    if not state.store_looked_up:
        state.store, state.store_looked_up = app_stores.task_store(task.app), True
    return state.store


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


# --- what a failure means -------------------------------------------------------------------------------------------


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
    store = app_stores.store_for(task.app)
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


def ends_the_job(store: JobStore, request: Any, exception: BaseException) -> bool:
    """Whether this failure of the attempt `request` runs is the job's last: it fails for good."""
    job = job_of(request)
    return not is_retryable(request, exception) or job is None or store.policy.is_final_attempt(job[1])


def runs_again(app: Any, request: Any, exc: BaseException) -> bool:
    """True when the broker runs the job of this failed request again: the failure is not the task's last."""
    store, job = app_stores.store_for(app), job_of(request) if request is not None else None
    if store is None or job is None or getattr(request, "is_eager", False):
        return False
    return retry_countdown(store.policy, job[1], retryable=is_retryable(request, exc)) is not None


# --- broker retries -------------------------------------------------------------------------------------------------


def retry_failed_attempts(app: Any) -> None:
    """Make a failed attempt the broker runs again a Celery retry, in every task of a bbmongo:// worker's app.

    As Celery's `autoretry_for` does it (celery/app/autoretry.py): Celery then stores RETRY, not FAILURE, runs no
    errback, chain failure or chord error, and Flower shows RETRY; the last attempt's failure propagates as ever."""
    if app_stores.store_for(app) is None:
        return
    upstream_celery.wrap_task_runs(app, broker_retry)


def broker_retry(task: Any, exc: Exception) -> Retry | Ignore | None:
    """The Retry that runs this failed attempt again (published already), None when the failure is final, or Ignore
    when the attempt lost its job to another. The attempt is settled by it: its failure is recorded here, and
    Celery's RETRY that follows (the backend's, task_retry) records no attempt."""
    request = task.request
    store, job = app_stores.store_for(task.app), job_of(request)
    if store is None or job is None or request.is_eager:
        return None
    countdown = retry_countdown(store.policy, job[1], retryable=is_retryable(request, exc))
    if countdown is None:
        return None
    error = describe_error(exc)
    trace = "".join(tracebacks.format_exception(exc))
    if not store.record_failed_attempt(*job, error, attempt=_entry(store, request, job[1], "failed", error, trace)):
        # The attempt is no longer the job's (the stale sweep gave it to another worker): its retry's publish would
        # send the job that attempt holds back to the queue. It ends here, with nothing recorded, as Ignore does.
        return Ignore()
    _attempt(request).settled = True
    headers = {k: v for k, v in (request.headers or {}).items() if k not in DELIVERY_HEADERS}
    headers[BROKER_RETRIES_HEADER] = broker_retries(request) + 1
    # The attempt the retry comes from: its publish is fenced on it (store.publish's `retry_of`), since the job may be
    # taken over between the write above and the publish.
    headers.update({JOB_ID_HEADER: job[0], ATTEMPTS_HEADER: job[1]})
    try:
        # max_retries: never Celery's limit (the task's, 3 by default) but the broker's, checked above.
        return task.retry(exc=exc, countdown=countdown, max_retries=request.retries + 1, headers=headers, throw=False)
    finally:
        upstream_celery.forget_retry_override(task)


# --- the verbs: one per outcome -------------------------------------------------------------------------------------


def started(store: JobStore, request: Any) -> None:
    """The attempt `request` runs starts in this process: its history entry's `startedAt`."""
    _attempt(request).started_at = store.now()


def succeeded(
    store: JobStore | None,
    request: Any,
    *,
    result: ResultFields | None = None,
    unwritable: Unwritable | None = None,
) -> None:
    """Settle the attempt `request` runs `succeeded`, with the backend's `result` fields. Raises SettleUnwritable
    (written at once) when the result cannot be kept in the job's document: the attempt is not settled then, and
    Celery records that as the task's failure."""
    _succeeded(store, request, "succeeded", result, unwritable)


def ignored(store: JobStore | None, request: Any) -> None:
    """Settle the attempt of a task that raised Ignore (Task.replace does: its replacement is a new message with the
    same task id): its job is done, not lost; left running, the stale sweep would run it again."""
    _succeeded(store, request, "ignored", None, None)


def _succeeded(
    store: JobStore | None,
    request: Any,
    outcome: str,
    result: ResultFields | None,
    unwritable: Unwritable | None,
) -> None:
    job = job_of(request)
    if store is None or job is None or _attempt(request).settled:
        return
    attempt = _entry(store, request, job[1], outcome)
    if result is None:
        _write(store, request, store.success(*job, attempt=attempt))
    else:
        fields, size = result
        lost = partial(unwritable, store, job, attempt, request, RESULT) if unwritable is not None else None
        _write(
            store,
            request,
            store.success(*job, attempt=attempt, result=fields, if_unwritable=lost, subject=RESULT),
            size,
        )
    _attempt(request).settled = True


def failed(
    store: JobStore,
    request: Any,
    exception: BaseException,
    traceback: str | None = None,
    *,
    task_id: str | None = None,
    result: Callable[[], ResultFields] | None = None,
    unwritable: Unwritable | None = None,
) -> bool:
    """Settle the attempt `request` runs as failed by `exception`: back to the queue, or failed for good. Returns
    whether the failure ends the job (errbacks, chain and chord part are the last failure's).

    `result` builds the backend's result fields; a failure that cannot be kept in the job's document (ResultTooLarge
    from `result`, or a settle that cannot land) fails the job for good on that, by `unwritable`. Without a request
    (None: the main process reporting a hard time limit has only the task id) the job of `task_id` this worker runs
    fails."""
    job = job_of(request) if request is not None else None
    # Without the request, the exception alone still says whether the job may run again: a rejected task must not.
    retryable = is_retryable(request if job is not None else None, exception)
    error = describe_error(exception)
    # A pool process ended by its worker's cold shutdown was cut short, not failed: its attempt is "lost", as the
    # release of a stopping worker's jobs records it. Celery 5.4 reports it (WorkerLostError) on its way down.
    outcome = "lost" if isinstance(exception, WorkerLostError) and connection.shutting_down() else "failed"
    if job is None:
        if task_id:
            worker = getattr(request, "hostname", None) or socket.gethostname()
            owner = connection.lease_owner()
            store.fail_running_task(task_id, owner, error, retryable=retryable, worker=worker, outcome=outcome)
        return not retryable
    ends = not retryable or store.policy.is_final_attempt(job[1])
    state = _attempt(request)
    if state.settled:
        return ends
    ran_here = state.started_at is not None
    entry: dict[str, Any] | None = _entry(store, request, job[1], outcome, error, traceback)
    if not ran_here and store.attempt_recorded(*job):
        # Another process ran the attempt (a pool process this worker lost): its broker retry recorded the failure,
        # then the process died before the retry's publish. The attempt has its entry.
        entry = None
    size = len((entry or {}).get("traceback") or "")
    if result is None:
        _write(store, request, store.failure(*job, error, retryable=retryable, attempt=entry), size)
    else:
        lost = partial(unwritable, store, job, entry, request, FAILURE) if unwritable is not None else None
        try:
            fields, result_size = result()
            settle = store.failure(
                *job, error, retryable=retryable, attempt=entry, result=fields, if_unwritable=lost, subject=FAILURE
            )
            _write(store, request, settle, result_size + size)
        except (ResultTooLarge, SettleUnwritable) as unstored:
            if lost is None:
                raise
            # The exception or its traceback is what cannot be kept: the job fails on that, for good.
            ends = True
            cause = unstored.cause if isinstance(unstored, SettleUnwritable) else f"{DOES_NOT_FIT}: {unstored}"
            store.settle(lost(cause))
    state.settled = True
    return ends


def requeued(store: JobStore | None, request: Any, reason: str) -> None:
    """Settle the attempt of a task that raised Reject(requeue=True) after its message was acknowledged (no
    acks_late: Celery acks a message as its task starts, and its rejection then reaches no one): back to the queue
    due at once, the attempt counted, as an acks_late task's rejection is (JobQoS.reject); failed on its last."""
    job = job_of(request)
    if store is None or job is None or _attempt(request).settled:
        return
    entry = _entry(store, request, job[1], "failed", reason)
    _write(store, request, store.failure(*job, reason, backoff=False, attempt=entry))
    _attempt(request).settled = True


def retried(
    store: JobStore | None,
    request: Any,
    error: str | None,
    traceback: str | None = None,
    *,
    result: dict[str, Any] | None = None,
) -> None:
    """The task's own Celery retry of the attempt `request` runs (its publish put the job back in the queue already):
    the attempt joins the history, with `error`, and the backend's RETRY `result` fields are stored on the job. No
    `error`: Celery cancelled the task as its worker stops, and the release of the worker's jobs records the attempt.
    After a broker retry (broker_retry recorded the attempt) only the fields are stored."""
    job = job_of(request)
    if store is None or job is None:
        return
    state, entry = _attempt(request), None
    if error is not None and not state.settled:
        entry = _entry(store, request, job[1], "retry", error, traceback)
        state.settled = True
    # Fenced on the attempt: a worker whose job was taken over changes nothing.
    if result is not None and store.annotate(*job, result, attempt=entry):
        return
    if entry is not None:
        store.record_retry(*job, entry)  # the retry's publish let a worker claim the job again first


def revoked(
    store: JobStore | None,
    request: Any,
    *,
    why: str | None = None,
    result: dict[str, Any] | None = None,
) -> None:
    """Fail the job of the revoked attempt `request` ran (or was to run) for good. Celery tells a revoke to the
    backend first, with the `result` fields to store, then to task_revoked, which knows `why` (revoke_reason): the
    call with `why` writes, with the result a call before it gave."""
    job = job_of(request)
    if store is None or job is None:
        return
    state = _attempt(request)
    if why is None:
        state.revoke_result = result
        return
    if state.settled:
        return
    entry = _entry(store, request, job[1], "revoked", why)
    store.fail(*job, why, retryable=False, attempt=entry, result=state.revoke_result, revoked=True)
    state.settled = True


def revoke_reason(terminated: bool, expired: bool, signum: Any) -> str:
    if expired:
        return "revoked: the task expired before it ran"
    if terminated:
        return f"revoked: terminated by signal {signum}"
    return "revoked before it ran"


# --- writing --------------------------------------------------------------------------------------------------------


def _entry(
    store: JobStore,
    request: Any,
    attempts: int,
    outcome: str,
    error: str | None = None,
    traceback: str | None = None,
) -> dict[str, Any]:
    """The history entry of the attempt `request` is running, finished now with `outcome`."""
    state = _attempt(request)
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


def _write(store: JobStore, request: Any, settle: Settle, size: int = 0) -> None:
    """Write the settle of an attempt `request` ran: in a worker's tracer, with the other settles this process makes
    meanwhile (settles.py; `size`, the bytes of its result and tracebacks, sends a large one alone); called directly
    (a script, a test calling the backend), at once."""
    if getattr(request, "called_directly", True) or size > settles.GROUP_COMMIT_MAX_BYTES:
        store.settle(settle)
    else:
        store.settle_soon(settle)


#: The result fields a relayed settle's replacement keeps from it (the main process has no request to build them).
_RESULT_CONTEXT = ("children", "groupId", "parentId")


def relayed_unwritable(app: Any, store: JobStore, settle: Settle, with_result: bool, cause: str) -> Settle:
    """What fails a job whose relayed settle can never be written (`cause`): the result backend's failure when the
    settle carried a result (get() raises its ResultNotStored, as from a pool process's own write), else the
    store's."""
    failed_unstored: Unwritable | None = getattr(app.backend, "failed_unstored", None) if with_result else None
    job = (settle.job_id, settle.fence["attempts"])
    if failed_unstored is None or settle.subject is None:
        return store.failure(*job, f"{settle.subject or JOB_SETTLE} {cause}", retryable=False)
    entry = history_entry_of(settle.update)
    replacement: Settle = failed_unstored(store, job, entry, None, settle.subject, cause)
    relayed = settle.update.get("$set", {})
    replacement.update["$set"].update({field: relayed[field] for field in _RESULT_CONTEXT if field in relayed})
    return replacement
