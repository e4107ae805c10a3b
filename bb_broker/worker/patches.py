"""Every contact with Celery's, Kombu's and billiard's internals: each patch, and each private name read, is here.

Each function says what it changes or reads, why no public hook does it, and the releases it was checked against;
tests/unit/test_upstream_contracts.py asserts the shape each one relies on and fails, naming the upstream change and
the function here, when a release moves it. The rest of bb_broker calls these functions and touches no private name
of those packages itself. What a patch does for the broker (the decision, the reason it records) is passed in by its
caller (bb_broker.worker.hooks): this module knows the upstream shapes, not the broker's rules.

Not here: the methods bb_broker.transport (channel.py, qos.py, transport.py) overrides on Kombu's virtual Channel,
QoS and Transport (`_get`, `_put`, `_size`, `_purge`, `_delete`, `_new_queue`, `_has_queue`, `_queue_bind`,
`_lookup`, `_put_fanout`, `_deliver`): underscored, but the interface Kombu's virtual transports are written against
(its docstrings tell subclasses to implement them). Their signatures are asserted by the contract tests all the same.
Nor are Celery's BaseBackend methods results.backend implements (`_store_result`, `_get_task_meta_for`, `_forget`,
the group ones), for the same reason, nor the public registries bb_broker/__init__.py adds its names to (Kombu's
TRANSPORT_ALIASES, Celery's BACKEND_ALIASES).

Celery, Kombu and billiard are imported inside the functions: this module is imported while `celery` and
`kombu.transport` themselves are (bb_broker registers its transport and hooks from their post-import hooks).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery.canvas import _chain

#: The releases every function here was checked against (their sources read, the contract tests run on the newest).
CHECKED_AGAINST = "celery 5.5.3, 5.6.3, 5.7.0; kombu 5.5.4, 5.6.2, 5.7.0; billiard 4.2.4, 4.3.2"

#: Marks a wrapper this module installed, so that installing twice wraps once.
_INSTALLED = "bb_broker_patch"

# --- Celery: patches ------------------------------------------------------------------------------------------------


def install_failure_as_retry(runs_again: Callable[[Any, Any, BaseException], bool]) -> None:
    """Make every result backend's `BaseBackend.mark_as_failure` store RETRY instead of FAILURE when
    `runs_again(app, request, exc)` says the broker runs the job again (idempotent).

    A failure Celery reports from outside the task (a pool process that died, a hard time limit) reaches the result
    backend's mark_as_failure, which also runs the task's errbacks, fails its chain and counts its chord part: those
    belong to the job's last failure. No public hook comes before them: `task_failure` and `Task.on_failure` run after
    the backend stored FAILURE and called the errbacks, and the backend is the user's (Redis, a database), not a class
    of ours to subclass. bbmongo:// (results.backend) overrides mark_as_failure itself; this covers every other
    backend. Relies on: `BaseBackend.mark_as_failure(self, task_id, exc, traceback, request, store_result,
    call_errbacks, state)` and `mark_as_retry(task_id, exc, traceback, request=)`. Checked against celery 5.5.3,
    5.6.3, 5.7.0."""
    from celery import states
    from celery.backends.base import Backend, BaseBackend

    if getattr(BaseBackend.mark_as_failure, _INSTALLED, False):
        return
    mark_as_failure = BaseBackend.mark_as_failure

    @wraps(mark_as_failure)
    def mark_as_failure_unless_retried(
        self: Backend,
        task_id: str,
        exc: Exception,
        traceback: str | None = None,
        request: Any = None,
        store_result: bool = True,
        call_errbacks: bool = True,
        state: str = states.FAILURE,
    ) -> None:
        # Backend.__init__ sets `app`; celery-types does not declare it.
        if state == states.FAILURE and runs_again(self.app, request, exc):  # type: ignore[attr-defined]
            if store_result:
                self.mark_as_retry(task_id, exc, traceback, request=request)
            return None
        return mark_as_failure(self, task_id, exc, traceback, request, store_result, call_errbacks, state)

    setattr(mark_as_failure_unless_retried, _INSTALLED, True)
    BaseBackend.mark_as_failure = mark_as_failure_unless_retried  # type: ignore[method-assign]  # the patch itself


def explain_worker_lost(task: Any, explain: Callable[[Any, BaseException], None]) -> None:
    """Let `explain(message, WorkerLostError)` give the message of `task`'s request whose pool process died its
    reason, before Celery rejects it (idempotent).

    With `acks_late` and `reject_on_worker_lost` Celery rejects such a message with requeue and reports no failure: the
    rejection is all the job hears (the transport takes the reason through its explain_rejection). The public hook:
    Celery's documented custom request class (`Task.Request`, "Requests and custom requests" in its task guide),
    subclassed from the task's own so that a request class the app chose keeps working; Celery builds each task's
    request class from it when the consumer starts, after worker_init. Relies on: `Request.on_failure(self, exc_info,
    ...)`, the exception at `exc_info.exception` (billiard's ExceptionWithTraceback around it at `.exc`), the message at
    `self.message`. Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    from billiard.exceptions import WorkerLostError
    from kombu.utils.imports import symbol_by_name

    base = symbol_by_name(task.Request)
    if getattr(base, _INSTALLED, False):
        return

    # The task's Request class is named by a string (Task.Request) and found at run time: a type mypy cannot know.
    class ExplainedRequest(base):  # type: ignore[misc, valid-type]
        def on_failure(self, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
            message = getattr(self, "message", None)
            if isinstance(exc, WorkerLostError):
                explain(message, exc)
            return super().on_failure(exc_info, *args, **kwargs)

    setattr(ExplainedRequest, _INSTALLED, True)
    task.Request = ExplainedRequest


def wrap_task_run(task: Any, retry_for: Callable[[Any, Exception], BaseException | None]) -> None:
    """Wrap `task.run` so that an exception the task raises becomes what `retry_for(task, exc)` returns (a Retry the
    broker published, an Ignore), or propagates when it returns None; Ignore, Reject and Retry the task raised itself
    pass through (idempotent).

    No public hook turns a task's exception into a retry before Celery's tracer stores FAILURE and runs the errbacks:
    `task_failure` comes after. Celery's own `autoretry_for` wraps `task.run` the same way (celery/app/autoretry.py),
    and the tracer calls `task.run` as it is when the pool process builds its tracer: so this runs at worker_init and
    as the tasks' modules are imported (import_modules), before either. Relies on: `task.run` being the attribute the
    tracer calls (celery.app.trace.build_tracer's `fun = task if task_has_custom(task, '__call__') else task.run`).
    Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    from celery.exceptions import Ignore, Reject, Retry

    run = task.run
    if getattr(run, _INSTALLED, False):
        return

    @wraps(run)
    def run_with_broker_retries(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except (Ignore, Reject, Retry):
            raise  # the task's own decisions
        except Exception as exc:
            retry = retry_for(task, exc)
            if retry is None:
                raise
            raise retry from exc  # the RETRY state's traceback shows the failure

    setattr(run_with_broker_retries, _INSTALLED, True)
    task.run = run_with_broker_retries


def forget_retry_override(task: Any) -> None:
    """Remove what `Task.retry(max_retries=...)` leaves on the task for autoretry to read (`override_max_retries`).

    Celery's `autoretry_for` deletes it after its own retry (celery/app/autoretry.py); a retry made any other way
    leaves it, and the task's next `self.retry()` would take that limit for its own. There is no public way to pass a
    limit for one retry only. Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    task.__dict__.pop("override_max_retries", None)


# --- Celery: private names read --------------------------------------------------------------------------------------


def chain_class() -> type[_chain]:
    """The class of every chain signature, `celery.canvas._chain`.

    The public `celery.chain` is a subclass whose `__new__` builds chains; a chain that comes back from a message
    (maybe_signature of its dict, as a chord's callback does) is a `_chain`, not a `chain`, so only `_chain` tells
    every chain apart. Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    from celery import canvas

    return canvas._chain


def registered_task(name: str) -> Any:
    """The task registered as `name` in a Celery app of this process (the current app first), or None.

    A `before_task_publish` receiver is told the task's name only, not its app or task: its unique options are the
    task's attributes. No public name lists a process's apps (`celery._state._get_active_apps`), and each app's
    registry is read as `app._tasks`, since `app.tasks` would finalize an app mid-publish. A task being published
    is in its app's registry already (a task proxy registers itself as it is evaluated). Checked against celery
    5.5.3, 5.6.3, 5.7.0."""
    from celery import _state

    current = _state.get_current_app()
    others = [app for app in list(_state._get_active_apps()) if app is not current]  # type: ignore[attr-defined]  # private: celery-types omits it
    for app in [current, *others]:
        task = app._tasks.get(name)
        if task is not None:
            return task
    return None


def is_lazy_result_list(value: Any) -> bool:
    """True for the lazily evaluated list Celery passes as a chord header's results when the header is a generator
    (`celery.utils.functional._regen`): it cannot be walked for nested groups before the header is sent.
    No public name: Celery tells it apart with the same isinstance (celery/backends/base.py, canvas.py).
    Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    from celery.utils import functional

    return isinstance(value, functional._regen)  # type: ignore[attr-defined]  # private: celery-types omits it


def result_meta(backend: Any, result: Any, state: str, traceback: str | None, request: Any) -> dict[str, Any]:
    """Celery's result meta for a result (`date_done`, `children`, `group_id`, `parent_id`...), as every backend
    stores it, undated-format (`format_date=False`): `BaseBackend._get_result_meta`, which store_result calls.
    No public method returns it without storing. Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    return backend._get_result_meta(result=result, state=state, traceback=traceback, request=request, format_date=False)


def fail_chain(
    backend: Any, chain: Any, exc: BaseException, traceback: str | None, store_result: bool, state: str
) -> None:
    """Fail the tasks chained after a failed one, as Celery's own mark_as_failure does on the installed release: for a
    backend that overrides mark_as_failure and stores the failure itself. No public method fails a chain without
    storing the failed task's own result again. Celery 5.7.0 does it in `BaseBackend._fail_chain` (which also
    descends into a chord step's body); 5.4.0, 5.5.3 and 5.6.3 have no such method and do it inline in
    mark_as_failure, which _fail_chain_before_celery_5_7 does the same way, so a chain fails as it does on Celery's
    own backends of that release (Redis's among them)."""
    own = getattr(backend, "_fail_chain", None)
    if own is None:
        _fail_chain_before_celery_5_7(backend, chain, exc, traceback, store_result, state)
    else:
        own(chain, exc, traceback, store_result=store_result, state=state)


def _fail_chain_before_celery_5_7(
    backend: Any, chain: Any, exc: BaseException, traceback: str | None, store_result: bool, state: str
) -> None:
    # Celery 5.4.0's to 5.6.3's mark_as_failure: each chained task's request rebuilt from its signature; its failure
    # stored when it has an id, its chord part counted when it is part of a chord.
    from celery import states
    from celery.app.task import Context

    try:
        elements = iter(chain)
    except TypeError:
        elements = iter(())
    for element in elements:
        options = element.get("options") or {}  # Context(element).options, which celery-types does not declare
        context = Context(element)
        context.update(options)
        context.id = options.get("task_id")
        context.group = options.get("group_id")
        if store_result and state in states.PROPAGATE_STATES and context.id is not None:
            backend.store_result(context.id, exc, state, traceback=traceback, request=context)
        if "chord" in options:
            backend.on_chord_part_return(context, state, exc)


def fails_rejected_tasks() -> bool:
    """Whether Celery itself reports a task that raised `Reject(requeue=False)` as failed: from 5.7.0 the worker's
    `Request.on_failure` calls the result backend's mark_as_failure and sends `task_failure` (its issue 4222); 5.4.0
    to 5.6.3 only reject the message (already acked unless acks_late) and leave the result PENDING, on every result
    backend, Redis's too: the pool process's `task_postrun` (state REJECTED, the Reject as retval) is all that
    tells of it. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0 (celery/worker/request.py)."""
    import celery

    return celery.VERSION >= (5, 7)


def compressed_result_mark() -> bytes | None:
    """The marker Celery puts before a result it compressed (`result_compression`, celery.backends.base
    `COMPRESSED_PAYLOAD_MAGIC`, then the method and a NUL), or None on a Celery without result compression (before
    5.7.0: no result it stores is compressed). Checked against celery 5.4.0, 5.5.3, 5.6.3 (absent), 5.7.0."""
    from celery.backends import base

    return getattr(base, "COMPRESSED_PAYLOAD_MAGIC", None)


def call_errbacks(backend: Any, request: Any, exc: BaseException, traceback: str | None) -> None:
    """Run a failed task's errbacks, as Celery's own mark_as_failure does (`BaseBackend._call_task_errbacks`): no
    public method runs them. Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    backend._call_task_errbacks(request, exc, traceback)


def refuse_when_eager(backend: Any) -> None:
    """Raise as Celery's backends do when results are read under `task_always_eager` without
    `task_store_eager_result` (`BaseBackend._ensure_not_eager`, which get_many calls first). Checked against celery
    5.5.3, 5.6.3, 5.7.0."""
    backend._ensure_not_eager()


def result_cache(backend: Any) -> Any:
    """The backend's cache of ready results by task id (`BaseBackend._cache`, an LRU that get_many fills and reads).
    Checked against celery 5.5.3, 5.6.3, 5.7.0."""
    return backend._cache


# --- Kombu: private names read ---------------------------------------------------------------------------------------


def serializer_content_types(name: str) -> tuple[str, str]:
    """The (content type, content encoding) `kombu.serialization.loads` needs for the serializer registered as
    `name`. Kombu's registry keeps them only in its private `_encoders` table (Celery's BaseBackend reads it the same
    way); the public `name_to_type` has the content type but not the encoding. Checked against kombu 5.5.4, 5.6.2,
    5.7.0."""
    from kombu.serialization import registry  # type: ignore[attr-defined]  # celery-types' kombu stubs omit it

    content_type, content_encoding, _ = registry._encoders[name]
    return content_type, content_encoding


def delivered_messages(qos: Any) -> dict[str, Any]:
    """A virtual QoS's messages delivered and not yet acked or rejected, by delivery tag: `QoS._delivered` without
    the tags in `QoS._dirty`, which no public method lists. An ack (from any thread) only adds its tag to `_dirty`;
    Kombu drops it from `_delivered` at the next delivery, which a worker given nothing more never gets: counted as
    delivered, its job's lease was renewed for as long. Checked against kombu 5.5.4, 5.6.2, 5.7.0."""
    settled = set(qos._dirty)  # one C-level copy: acks from other threads add to it meanwhile
    return {tag: message for tag, message in list(qos._delivered.items()) if tag not in settled}


def ack_without_restore(qos: Any, delivery_tag: str) -> None:
    """Settle a delivered message on a virtual QoS as acked, without the channel's basic_ack (`QoS._quick_ack`, what
    the virtual QoS's own ack and reject end with). Checked against kombu 5.5.4, 5.6.2, 5.7.0."""
    qos._quick_ack(delivery_tag)


def has_consumers(channel: Any) -> bool:
    """Whether a virtual channel has consumers (`Channel._consumers`, the tags basic_consume adds). Checked against
    kombu 5.5.4, 5.6.2, 5.7.0."""
    return bool(channel._consumers)


def consumed_queues(channel: Any) -> list[str]:
    """The queues a virtual channel consumes (`Channel._active_queues`). Checked against kombu 5.5.4, 5.6.2, 5.7.0."""
    return channel._active_queues


def queue_of_consumer(channel: Any, consumer_tag: str) -> str | None:
    """The queue a consumer tag of a virtual channel consumes (`Channel._tag_to_queue`). Checked against kombu
    5.5.4, 5.6.2, 5.7.0."""
    return channel._tag_to_queue.get(consumer_tag)


def next_delivery_tag(channel: Any) -> str:
    """A new delivery tag from a virtual channel (`Channel._next_delivery_tag`, what basic_get and the cycle give each
    message). Checked against kombu 5.5.4, 5.6.2, 5.7.0."""
    return channel._next_delivery_tag()


def exchange_table(state: Any, exchange: str) -> list[Any]:
    """This connection's bindings of an exchange, as Kombu's virtual BrokerState keeps them: the `table` of
    `state.exchanges[exchange]` (rows of (routing key, pattern, queue)); empty for an exchange it does not know.
    Kombu routes by `Channel.get_table`, which reads the same. Checked against kombu 5.5.4, 5.6.2, 5.7.0."""
    return state.exchanges.get(exchange, {}).get("table", [])


def drop_bindings(state: Any, keep: Callable[[tuple[Any, ...]], bool], exchange: str | None = None) -> None:
    """Remove from this connection's exchange tables (one exchange's, or every one's) each row `keep` refuses.

    Kombu's queue_unbind edits the list `get_table` returns in place, which here is a copy (the stored bindings
    every connection routes by are added to it), and its queue_delete leaves the tables as they are: so the rows go
    from the tables themselves. Checked against kombu 5.5.4, 5.6.2, 5.7.0."""
    declared = state.exchanges.values() if exchange is None else [state.exchanges.get(exchange)]
    for meta in declared:
        if meta is not None:
            meta["table"] = [row for row in meta.get("table", []) if keep(tuple(row))]


# --- billiard: patches -----------------------------------------------------------------------------------------------

#: The signal billiard's pool ends its processes with (pool shrink, pool terminate).
_TERMINATE = {signal.SIGTERM}
#: Seconds a waiting process keeps the signal pending before it looks again: the most a shrink waits for it.
_WAIT_SLICE = 0.5


def _get_payload_guarded(self: Any) -> bytes:
    # Without an event loop every idle pool process reads the one shared job queue under its read lock, and
    # `pool_shrink` SIGTERMs idle processes together. billiard's handler raises SystemExit, which a process inside
    # `with lock:` survives cleanly; but a process whose lock wait succeeds just as its own signal arrives raises
    # inside `__enter__`, before the `with` protects anything, and dies holding the lock: every other process then
    # waits on it forever, tasks are received and never start, and the worker cannot stop. So the signal is held
    # back while the lock is taken, and let in only where a `finally` releases the lock.
    while True:
        masked = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINATE)
        try:
            if self._rlock.acquire(timeout=_WAIT_SLICE):
                try:
                    signal.pthread_sigmask(signal.SIG_SETMASK, masked)  # a pending SIGTERM is raised here
                    return self._reader.recv_bytes()
                finally:
                    self._rlock.release()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, masked)  # not holding the lock: a pending SIGTERM may act


def install_pool_queue_guard() -> None:
    """Replace billiard's `SimpleQueue.get_payload` (`with self._rlock: return self._reader.recv_bytes()`) by one
    that holds SIGTERM back while it takes the read lock (idempotent): a pool process terminated by `pool_shrink`
    while it waits for a task then never leaves the pool's job queue locked. The pool processes forked after this
    inherit it.

    No public hook: billiard's pool builds its queues itself (Pool._setup_queues) and takes no queue class or reader
    from Celery or the app. Relies on: SimpleQueue's `_rlock` (a lock with `acquire(timeout=)`) and `_reader` (a
    Connection with `recv_bytes()`), and the pool reading through `get_payload` (billiard/pool.py's
    `conn.get_payload`). Checked against billiard 4.2.4, 4.3.2."""
    from billiard.queues import SimpleQueue

    if SimpleQueue.get_payload is not _get_payload_guarded:
        SimpleQueue.get_payload = _get_payload_guarded  # type: ignore[method-assign]  # the patch itself


# --- the entry point -------------------------------------------------------------------------------------------------


def install(
    app: Any,
    *,
    runs_again: Callable[[Any, Any, BaseException], bool],
    retry_for: Callable[[Any, Exception], BaseException | None],
    explain_lost: Callable[[Any, BaseException], None],
) -> None:
    """Every patch a bbmongo:// worker needs, before its pool forks and its consumer builds the tasks' requests and
    tracers (its worker_init); calling it again changes nothing. `wrap_task_runs` alone runs again as the tasks'
    modules are imported (a pool process started afresh builds its tracers without worker_init)."""
    install_pool_queue_guard()
    wrap_task_runs(app, retry_for)
    for task in list(app.tasks.values()):
        explain_worker_lost(task, explain_lost)
    install_failure_as_retry(runs_again)


def wrap_task_runs(app: Any, retry_for: Callable[[Any, Exception], BaseException | None]) -> None:
    """`wrap_task_run` for every task of the app (idempotent)."""
    for task in list(app.tasks.values()):
        wrap_task_run(task, retry_for)
