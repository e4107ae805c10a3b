"""Celery's internals bb_broker patches or reads: the worker's task run and request class, the result backend's
failure, chain and errback helpers, canvas and registry names (bb_broker/upstream/__init__.py has the rules).

Celery is imported inside the functions: this module is imported while `celery` itself is.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import wraps
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery.canvas import _chain

#: The releases every function here was checked against (their sources read, the contract tests run on the newest).
CHECKED_AGAINST = "celery 5.4.0, 5.5.3, 5.6.3, 5.7.0"

#: Marks a wrapper this module installed, so that installing twice wraps once.
_INSTALLED = "bb_broker_patch"

# --- Celery: patches ------------------------------------------------------------------------------------------------


def install_failure_as_retry(
    runs_again: Callable[[Any, Any, BaseException], bool],
    before_errbacks: Callable[[Any, Any], None] = lambda backend, request: None,
) -> None:
    """Make every result backend's `BaseBackend.mark_as_failure` store RETRY instead of FAILURE when
    `runs_again(app, request, exc)` says the broker runs the job again (idempotent); at a failure that ends the job,
    `before_errbacks(backend, request)` comes before the errbacks run (it may take some off `request.errbacks`).

    A failure Celery reports from outside the task (a pool process that died, a hard time limit) reaches the result
    backend's mark_as_failure, which also runs the task's errbacks, fails its chain and counts its chord part: those
    belong to the job's last failure. No public hook comes before them: `task_failure` and `Task.on_failure` run after
    the backend stored FAILURE and called the errbacks, and the backend is the user's (Redis, a database), not a class
    of ours to subclass. bbmongo:// (results.backend) overrides mark_as_failure itself; this covers every other
    backend. Relies on: `BaseBackend.mark_as_failure(self, task_id, exc, traceback, request, store_result,
    call_errbacks, state)` and `mark_as_retry(task_id, exc, traceback, request=)`. Checked against celery 5.4.0,
    5.5.3, 5.6.3, 5.7.0."""
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
        if call_errbacks and request is not None:
            before_errbacks(self, request)
        return mark_as_failure(self, task_id, exc, traceback, request, store_result, call_errbacks, state)

    setattr(mark_as_failure_unless_retried, _INSTALLED, True)
    BaseBackend.mark_as_failure = mark_as_failure_unless_retried  # type: ignore[method-assign]  # the patch itself


def hook_requests(task: Any, explain: Callable[[Any, BaseException], None], cancelled: Callable[[Any], None]) -> None:
    """Subclass `task`'s request class (idempotent) so that the transport hears of two things only the worker's main
    process knows of a message: `explain(message, WorkerLostError)` gives the message of a request whose pool process
    died its reason, before Celery rejects it; `cancelled(message)` says a started request's run is being cut short
    by Celery's cold shutdown, before it ends the run. (A lost connection's cancel, with
    worker_cancel_long_running_tasks_on_connection_loss, comes after Celery closed the connection, whose close gave
    the unacked messages back already: such a job goes back as never started.)

    With `acks_late` and `reject_on_worker_lost` Celery rejects the lost one's message with requeue and reports no
    failure: the rejection is all the job hears (the transport takes the reason through its explain_rejection). A
    cancelled acks_late one's message comes back unacked (Celery 5.7 sends no task_retry for it): its job must not be
    given back as never started. The public hook: Celery's documented custom request class (`Task.Request`, "Requests
    and custom requests" in its task guide), subclassed from the task's own so that a request class the app chose keeps
    working; Celery builds each task's request class from it when the consumer starts, after worker_init. Relies on:
    `Request.on_failure(self, exc_info, ...)`, the exception at `exc_info.exception` (billiard's ExceptionWithTraceback
    around it at `.exc`), the message at `self.message`; `Request.cancel(self, pool, ...)`, which ends the run of a
    request whose `time_start` is set. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    from billiard.exceptions import WorkerLostError
    from kombu.utils.imports import symbol_by_name

    base = symbol_by_name(task.Request)
    if getattr(base, _INSTALLED, False):
        return

    # The task's Request class is named by a string (Task.Request) and found at run time: a type mypy cannot know.
    class HookedRequest(base):  # type: ignore[misc, valid-type]
        def on_failure(self, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
            message = getattr(self, "message", None)
            if isinstance(exc, WorkerLostError):
                explain(message, exc)
            return super().on_failure(exc_info, *args, **kwargs)

        def cancel(self, pool: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "time_start", None):
                cancelled(getattr(self, "message", None))
            return super().cancel(pool, *args, **kwargs)

    setattr(HookedRequest, _INSTALLED, True)
    task.Request = HookedRequest


def wrap_task_run(task: Any, retry_for: Callable[[Any, Exception], BaseException | None]) -> None:
    """Wrap `task.run` so that an exception the task raises becomes what `retry_for(task, exc)` returns (a Retry the
    broker published, an Ignore), or propagates when it returns None; Ignore, Reject and Retry the task raised itself
    pass through (idempotent).

    No public hook turns a task's exception into a retry before Celery's tracer stores FAILURE and runs the errbacks:
    `task_failure` comes after. Celery's own `autoretry_for` wraps `task.run` the same way (celery/app/autoretry.py),
    and the tracer calls `task.run` as it is when the pool process builds its tracer: so this runs at worker_init and
    as the tasks' modules are imported (import_modules), before either. Relies on: `task.run` being the attribute the
    tracer calls (celery.app.trace.build_tracer's `fun = task if task_has_custom(task, '__call__') else task.run`).
    Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
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
    limit for one retry only. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    task.__dict__.pop("override_max_retries", None)


# --- Celery: private names read --------------------------------------------------------------------------------------


def chain_class() -> type[_chain]:
    """The class of every chain signature, `celery.canvas._chain`.

    The public `celery.chain` is a subclass whose `__new__` builds chains; a chain that comes back from a message
    (maybe_signature of its dict, as a chord's callback does) is a `_chain`, not a `chain`, so only `_chain` tells
    every chain apart. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    from celery import canvas

    return canvas._chain


def registered_task(name: str) -> Any:
    """The task registered as `name` in a Celery app of this process (the current app first), or None.

    A `before_task_publish` receiver is told the task's name only, not its app or task: its unique options are the
    task's attributes. No public name lists a process's apps (`celery._state._get_active_apps`), and each app's
    registry is read as `app._tasks`, since `app.tasks` would finalize an app mid-publish. A task being published
    is in its app's registry already (a task proxy registers itself as it is evaluated). Checked against celery
    5.4.0, 5.5.3, 5.6.3, 5.7.0."""
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
    Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    from celery.utils import functional

    return isinstance(value, functional._regen)  # type: ignore[attr-defined]  # private: celery-types omits it


def result_meta(backend: Any, result: Any, state: str, traceback: str | None, request: Any) -> dict[str, Any]:
    """Celery's result meta for a result (`date_done`, `children`, `group_id`, `parent_id`...), as every backend
    stores it, undated-format (`format_date=False`): `BaseBackend._get_result_meta`, which store_result calls.
    No public method returns it without storing. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
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


def pool_ends_running_tasks(pool: Any) -> bool:
    """Whether the started worker pool `pool` can end a task while it runs (`revoke(terminate=True)`): Celery's
    `BasePool.terminate_job` raises NotImplementedError, and a pool that can end one overrides it (prefork with its
    billiard pool's, as it starts). Prefork and eventlet can; the threads and solo pools never could; gevent's can from
    5.5.0 only (5.4 logs "does not implement kill_job" and lets the task run to its end, on every broker). Checked
    against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0 (celery/concurrency/)."""
    from celery.concurrency.base import BasePool

    terminate = getattr(pool, "terminate_job", None)
    return terminate is not None and getattr(terminate, "__func__", terminate) is not BasePool.terminate_job


def pool_remembers_busy_processes_through_a_reconnect(pool: Any) -> bool:
    """Whether the started worker pool `pool` still knows, after a lost broker connection, which of its processes run
    a task. Not the prefork pool before Celery 5.7.0: on a reconnect `AsynPool.flush` ends with
    `self._busy_workers.clear()`, so the next task received is written to a process still running a long one and
    waits for it to end, on every broker (Celery's d4eb32a78 keeps the processes of accepted jobs, in 5.7.0). The
    other pools keep no such record. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0
    (celery/concurrency/asynpool.py)."""
    import celery
    from celery.concurrency.prefork import TaskPool as PreforkPool

    return not isinstance(pool, PreforkPool) or celery.VERSION >= (5, 7)


def ignores_results_of_tasks_sent_by_name() -> bool:
    """Whether a task declared with `ignore_result=True` and sent by name (`app.send_task`, which cannot read the
    task's attributes as `apply_async` does) stores no result. Not on Celery 5.6: its send_task writes
    `ignore_result: False` into the message when the caller passes none, and its tracer lets the message's value
    override the task's (`celery.app.trace.get_actual_ignore_result`), so the worker stores the result on every
    result backend, Redis's too. 5.4 and 5.5 read the task's attribute alone; 5.7's send_task leaves the message's
    value None, so the task's own counts. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0 (celery/app/base.py,
    celery/app/trace.py)."""
    import celery

    return celery.VERSION[:2] != (5, 6)


def compressed_result_mark() -> bytes | None:
    """The marker Celery puts before a result it compressed (`result_compression`, celery.backends.base
    `COMPRESSED_PAYLOAD_MAGIC`, then the method and a NUL), or None on a Celery without result compression (before
    5.7.0: no result it stores is compressed). Checked against celery 5.4.0, 5.5.3, 5.6.3 (absent), 5.7.0."""
    from celery.backends import base

    return getattr(base, "COMPRESSED_PAYLOAD_MAGIC", None)


def call_errbacks(backend: Any, request: Any, exc: BaseException, traceback: str | None) -> None:
    """Run a failed task's errbacks, as Celery's own mark_as_failure does (`BaseBackend._call_task_errbacks`): no
    public method runs them. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    backend._call_task_errbacks(request, exc, traceback)


def refuse_when_eager(backend: Any) -> None:
    """Raise as Celery's backends do when results are read under `task_always_eager` without
    `task_store_eager_result` (`BaseBackend._ensure_not_eager`, which get_many calls first). Checked against celery
    5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    backend._ensure_not_eager()


def result_cache(backend: Any) -> Any:
    """The backend's cache of ready results by task id (`BaseBackend._cache`, an LRU that get_many fills and reads).
    Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    return backend._cache


def install_url_censor(censor: Callable[[str], str]) -> None:
    """Make Celery's censored configuration pass every URL it shows through `censor` as well (idempotent): what
    `celery inspect conf` answers, Flower's worker Config tab shows, and `celery report` prints.

    Celery masks a URL's password only (`maybe_sanitize_url` for a backend's URL, Kombu's `as_uri` for the broker's,
    nothing for a URL under any other setting): a credential among a URL's options (pymongo's
    `tlsCertificateKeyFilePassword`, `proxyPassword`, an AWS session token in `authMechanismProperties`) is shown as
    written (Celery 5.7's own `sanitize_url` keeps a backend URL's options; 5.4 to 5.6, through Kombu's, drop them).
    No public hook: the censoring is one module function, and neither a setting nor a signal reaches it. Relies on:
    `celery.app.utils.filter_hidden_settings(conf)`, the module global `Settings.table(censored=True)` calls at each
    call, returning a mapping of the settings (nested mappings as mappings). Checked against celery 5.4.0, 5.5.3,
    5.6.3, 5.7.0."""
    from celery.app import utils

    if getattr(utils.filter_hidden_settings, _INSTALLED, False):
        return
    filter_hidden_settings = utils.filter_hidden_settings

    @wraps(filter_hidden_settings)
    def filter_hidden_settings_and_url_credentials(conf: Any) -> Any:
        return _urls_censored(filter_hidden_settings(conf), censor)

    setattr(filter_hidden_settings_and_url_credentials, _INSTALLED, True)
    utils.filter_hidden_settings = filter_hidden_settings_and_url_credentials


def _urls_censored(value: Any, censor: Callable[[str], str]) -> Any:
    if isinstance(value, Mapping):
        return {key: _urls_censored(item, censor) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_urls_censored(item, censor) for item in value)
    if isinstance(value, str) and _URL.match(value):
        return censor(value)
    return value


#: A value that is a URL: a scheme, then `://`.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


# --- Celery: the app's state, beat's schedules -----------------------------------------------------------------------


def app_state(app: Any) -> dict[str, Any]:
    """The dict where bb_broker keeps its state on a Celery app (its job stores, the settle relay, the task store),
    under keys of its own (`bb_broker_*`): the app's instance `__dict__`.

    A Celery app offers no place for a plugin's state, and the state belongs to the app (two apps in one process use
    two brokers). Relies on: the app class having a `__dict__` (no `__slots__`), and an app pickled to a pool process
    or a thread being rebuilt from its constructor's arguments and conf (`Celery.__reduce__` and
    `__reduce_keys__`), never from that dict: the stores' live clients and the relay's sockets never travel. Checked
    against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    state: dict[str, Any] = app.__dict__
    return state


def apps() -> list[Any]:
    """Every Celery app alive in this process (whether or not it is the current one).

    No public API lists them: `celery.current_app` is one app, and a process may publish through others (an app made
    with set_as_current=False, a library's own). Relies on: `celery._state._apps`, the WeakSet every Celery app adds
    itself to as it is made (`_register_app`). Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    from celery import _state

    return list(_state._apps)  # type: ignore[attr-defined]  # celery-types does not declare it


def solar_next_event(solar: Any, start: datetime) -> datetime | None:
    """The first time of a `celery.schedules.solar`'s event at or after `start` (aware), in UTC, as Celery's own
    remaining_estimate finds it; None when its search finds none (a polar night: Celery searches a year ahead).

    No public method answers "when is the event after this moment": remaining_estimate and is_due measure from now.
    Relies on: the solar's `ephem` module, its observer `cal` (whose `date` is where the search starts) and
    `_next_event(start)`, which returns `start` itself when the event never comes. Checked against celery 5.7.0; 5.4.0
    to 5.6.3 have no `_next_event` (their remaining_estimate asks the observer once, and after a CircumpolarError
    checks again the next day): there the same search is made with what their remaining_estimate uses, the solar's
    `cal`, `method` and `use_center` (_solar_search)."""
    ephem = solar.ephem
    begin = ephem.Date(start.astimezone(UTC).replace(tzinfo=None))
    solar.cal.date = begin
    next_event = getattr(solar, "_next_event", None)
    found = next_event(begin) if next_event is not None else _solar_search(solar, begin)
    if found == begin:
        return None
    slot: datetime = found.datetime().replace(tzinfo=UTC)
    return slot


#: How many days Celery 5.7's solar._next_event searches ahead (its `max_search_days`).
_SOLAR_SEARCH_DAYS = 366


def _solar_search(solar: Any, start: Any) -> Any:
    # Celery 5.7.0's solar._next_event, for 5.4 to 5.6: a day without the event (CircumpolarError) moves the search
    # to the next anti-transit; `start` itself when no event comes within the days searched.
    sun = solar.ephem.Sun()
    kwargs = {"use_center": True} if solar.use_center else {}
    for _ in range(_SOLAR_SEARCH_DAYS):
        try:
            return getattr(solar.cal, solar.method)(sun, start=start, **kwargs)
        except solar.ephem.CircumpolarError:
            start = solar.cal.next_antitransit(sun, start=start)
    return start


def crontab_fields(crontab: Any) -> tuple[Any, Any, Any, Any, Any]:
    """A `celery.schedules.crontab`'s five fields as they were given (minute, hour, day of month, month of year, day
    of week): strings, numbers or sets, before Celery expands them.

    The public `minute`, `hour`... are the expanded sets (every minute of `*/15` listed), which say the schedule
    but not as it was written. Relies on: `_orig_minute`, `_orig_hour`, `_orig_day_of_month`, `_orig_month_of_year`,
    `_orig_day_of_week` (what crontab's own repr and pickling read). Checked against celery 5.4.0, 5.5.3, 5.6.3,
    5.7.0."""
    return (
        crontab._orig_minute,
        crontab._orig_hour,
        crontab._orig_day_of_month,
        crontab._orig_month_of_year,
        crontab._orig_day_of_week,
    )


# --- the task runs of an app ------------------------------------------------------------------------------------------


def wrap_task_runs(app: Any, retry_for: Callable[[Any, Exception], BaseException | None]) -> None:
    """`wrap_task_run` for every task of the app (idempotent)."""
    for task in list(app.tasks.values()):
        wrap_task_run(task, retry_for)


# --- a task's publish, recorded and replayed (bb_broker.bulk) ---------------------------------------------------------


@dataclass
class SendTaskCall:
    """What one `app.send_task` (and so one `apply_async`) handed Celery's two public message steps: the arguments of
    `app.amqp.create_task_message` (the builder of the task message: headers, properties, body, sent event) and the
    keywords of `app.amqp.send_task_message` (queue, exchange, serializer, the properties apply_async adds; it runs
    `before_task_publish`, publishes, runs `after_task_publish` and sends the task-sent event). `create` and `send`
    are those two, to call again for another task of the same call shape."""

    create: Callable[..., Any]
    send: Callable[..., Any]
    created: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


#: The positions of the arguments `create_task_message` (as_task_v1/as_task_v2) takes that a bulk call gives per task:
#: (task_id, name, args, kwargs, countdown, eta, ...) as `Celery.send_task` passes them.
CREATE_TASK_ID, CREATE_ARGS, CREATE_KWARGS, CREATE_ETA = 0, 2, 3, 5


#: The SendTaskCall each thread records into (recording_send_task), if any.
_recording = threading.local()
#: Installs the recording wrappers on an app's AMQP once, whichever thread comes first.
_installing = threading.Lock()


@contextmanager
def recording_send_task(app: Any) -> Iterator[SendTaskCall]:
    """Record, for the calling thread, what `app.send_task` hands `app.amqp.create_task_message` and
    `app.amqp.send_task_message` while the block runs (every other thread's calls, and this one's after the block,
    pass through unrecorded; two threads recording at once each record their own).

    No public hook sees the message's parts before the producer serializes them: these two are public attributes of
    the app's AMQP (cached properties, looked up at each send_task), wrapped on that instance the first time (the
    wrappers stay: a thread-local look-up per publish). Relies on: `Celery.send_task` computing the exec options, the
    routing, the expiry, the parent's ids, then calling `amqp.create_task_message(task_id, name, args, kwargs,
    countdown, eta, group_id, group_index, expires, retries, chord, callbacks, errbacks, reply_to, time_limit,
    soft_time_limit, create_sent_event, root_id, parent_id, shadow, chain, **options)` once and
    `amqp.send_task_message(producer, name, message, **options)` once. Checked against celery 5.4.0, 5.5.3, 5.6.3,
    5.7.0."""
    amqp = app.amqp
    with _installing:
        if not getattr(amqp.create_task_message, _INSTALLED, False):
            _install_recorders(amqp)
    create, send = amqp.create_task_message, amqp.send_task_message
    call = SendTaskCall(create=create.__wrapped__, send=send.__wrapped__)
    outer, _recording.call = getattr(_recording, "call", None), call
    try:
        yield call
    finally:
        _recording.call = outer


def _install_recorders(amqp: Any) -> None:
    create, send = amqp.create_task_message, amqp.send_task_message

    @wraps(create)
    def create_recorded(*args: Any, **kwargs: Any) -> Any:
        call = getattr(_recording, "call", None)
        if call is not None:
            call.created.append((args, kwargs))
        return create(*args, **kwargs)

    @wraps(send)
    def send_recorded(producer: Any, name: str, message: Any, **options: Any) -> Any:
        call = getattr(_recording, "call", None)
        if call is not None:
            call.sent.append((name, dict(options)))
        return send(producer, name, message, **options)

    setattr(create_recorded, _INSTALLED, True)
    amqp.create_task_message, amqp.send_task_message = create_recorded, send_recorded


def argument_check(task: Any) -> Callable[..., Any] | None:
    """What `Task.apply_async` calls with a task's args and kwargs before it sends (the task's signature, raising
    TypeError for arguments it cannot take), or None when the task has `typing=False`: `task.__header__`, the
    function header Celery's task decorator builds. Checked against celery 5.4.0, 5.5.3, 5.6.3, 5.7.0."""
    if not task.typing:
        return None
    return getattr(task, "__header__", None)


def converts_arguments(task: Any) -> bool:
    """Whether `Task.apply_async` converts a task's arguments before it sends them (pydantic models dumped: the
    task's `pydantic=True`, Celery 5.5 and later, `Task._dump_pydantic_arguments`), so that its message cannot be
    built from its arguments as they are. Checked against celery 5.4.0 (absent), 5.5.3, 5.6.3, 5.7.0."""
    return getattr(task, "_dump_pydantic_arguments", None) is not None
