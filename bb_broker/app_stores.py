"""A Celery app's job stores: the store behind its bbmongo:// broker, one per app and process (and options), which the
worker, the result backend and the Flower plugin all use; and what an app's own result backend is told of its tasks
revoked while queued (store_revoked_results) or failed at their claim (tell_of_undeliverable_job).

A task revoked while still queued, told to the app's own result backend when that is not bbmongo://.

A worker that receives a revoked task stores REVOKED in its app's result backend (celery.worker.request's
`_announce_revoked`: `backend.mark_as_revoked(task_id, reason, request=...)`, which also counts a chord part). bb_broker
fails such a job at the revoke itself (bb_broker.jobs.revokes.revoke_queued): no worker ever receives it, so on a
result backend of the app's own (Redis, a database) its result stayed PENDING and `get()` waited for ever. Here the
revoker's process stores it as that worker would have. bbmongo:// needs nothing stored (its results are the job
documents), but a chord's header part is counted in its chord counter there too, as the worker would have counted it:
the chord's body fails with Celery's ChordError instead of waiting for ever. An operator's cancel of a queued job
(`bb-broker cancel`, the Jobs tab) is made where no Celery app may be: it counts no chord part.
"""

from __future__ import annotations

import logging
import os
import queue
import reprlib
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from bb_broker import connection
from bb_broker.connection import parse_broker_url, scrub
from bb_broker.forks import reset_in_child
from bb_broker.jobs import lifecycle
from bb_broker.jobs.document import stored_not_utf8
from bb_broker.jobs.payloads import MalformedTaskMessage, PayloadError, body_parts, deliverable_message
from bb_broker.jobs.revokes import revoked_before_running
from bb_broker.options import BrokerOptions, open_store
from bb_broker.threads import start_supervised
from bb_broker.upstream import celery as upstream_celery

if TYPE_CHECKING:
    from bb_broker.jobs.settles import SettleRelay
    from bb_broker.jobs.store import JobStore

logger = logging.getLogger(__name__)

#: The key (in upstream_celery.app_state) of an app's job stores, one per (process, broker URL, options, client
#: options).
APP_STORES = "bb_broker_stores"
#: The key of the relay a worker's pool processes settle through (settles.SettleRelay), in the worker's app.
APP_SETTLE_RELAY = "bb_broker_settle_relay"
#: The key of (process id, the job store its tasks settle on): task_store's. Set to None by keep_task_store at
#: worker_init: from then on the app's conf no longer changes, and the store may be kept.
APP_TASK_STORE = "bb_broker_task_store"
_stores_lock = threading.Lock()


@reset_in_child
def _forget_parent_stores_lock() -> None:
    # A lock a parent's thread held at the fork would never be released in the child, whose first task would wait
    # for it forever; the stores themselves are kept by process (their key holds the pid).
    global _stores_lock
    _stores_lock = threading.Lock()


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
        stores: dict[tuple[int, str, str, str], JobStore] = upstream_celery.app_state(app).setdefault(APP_STORES, {})
        store = stores.get(key)
        if store is None:
            target = connection.parse_broker_url(url)
            store = stores[key] = open_store(target, BrokerOptions.parse(options), **client_options)
            store.settle_relay = upstream_celery.app_state(app).get(APP_SETTLE_RELAY)
    return store


def keep_settle_relay(app: Any, relay: SettleRelay) -> None:
    """The relay the pool processes of the worker running `app` settle through: every store made from now on (the
    pool processes' own, after the fork) sends its settles to it."""
    upstream_celery.app_state(app)[APP_SETTLE_RELAY] = relay


def keep_task_store(app: Any) -> None:
    """From now on the app's conf no longer changes (a worker's init): task_store may keep the store it finds."""
    upstream_celery.app_state(app)[APP_TASK_STORE] = None


def task_store(app: Any) -> JobStore | None:
    """store_for(app), kept on the app by process once keep_task_store was called."""
    # store_for reads the app's conf, about a tenth of a pool process's CPU per task (py-spy --gil, a drain). In a
    # worker, whatever its pool, the conf no longer changes: the store is kept on the app, by process.
    state = upstream_celery.app_state(app)
    kept = state.get(APP_TASK_STORE)
    if kept is not None and kept[0] == os.getpid():
        return kept[1]
    store = store_for(app)
    if APP_TASK_STORE in state:
        state[APP_TASK_STORE] = (os.getpid(), store)
    return store


#: The reason a worker stores for a revoked task (celery.worker.request: `revoked()`).
REASON = "revoked"


def store_revoked_results(store: JobStore, task_ids: Iterable[str]) -> None:
    """Store REVOKED in the result backend of each Celery app of this process whose broker is `store`'s and whose
    backend is its own (not bbmongo://, nor none), for each of `task_ids` whose job `store` holds failed as revoked
    before it ran (see the module). A chord's header part is counted in every backend, bbmongo:// too (its result is
    the job document, but its chord counter is the backend's): the chord's body fails then, as Celery fails it."""
    if "celery" not in sys.modules:
        return  # a Kombu client: no Celery app, no result backend
    every = _apps_with_a_backend(store)
    if not every:
        return
    own = _apps_with_their_own_backend(store)
    from celery.app.task import Context

    for doc in revoked_before_running(store, task_ids):
        request = _request_of(store, doc)
        name = request.get("task") if request is not None else None
        in_a_chord = request is not None and bool(request.get("chord"))
        for app in every if in_a_chord else own:
            task = app.tasks.get(name) if name is not None else None
            backend = task.backend if task is not None else app.backend
            # As the worker's Request decides: a task that ignores its result stores its errors only when told to.
            # bbmongo:// stores nothing: the job document, failed as revoked, is its result.
            store_errors = app in own and (task is None or not task.ignore_result or task.store_errors_even_if_ignored)
            # A refused message: a request of the task id alone (without one, Celery takes the children of the task
            # running in this process, a revoker's own, for the revoked task's).
            context = Context(request if request is not None else {"id": doc["taskId"]})
            try:
                backend.mark_as_revoked(doc["taskId"], REASON, request=context, store_result=store_errors)
            except Exception as exc:  # the backend is the user's: its outage must not fail the revoke itself
                logger.warning("task %s was revoked, but its result backend could not be told: %s", doc["taskId"], exc)


def _request_of(store: JobStore, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The request a worker would have run a revoked job's message with, its message read as a claim reads it (a
    claim hands a worker nothing else); None, said in one line naming the job and the field, for a message a hand edit
    or a corruption made unreadable: none of it reaches the result backend, which is told REVOKED without it."""
    try:
        if altered := stored_not_utf8(store.coll, doc, ["payload"]):
            # Read with U+FFFD in place of its bytes: stored so in the result backend, the text would be altered.
            raise PayloadError(f"{', '.join(altered)} holds text that is not UTF-8")
        message = deliverable_message(doc.get("payload"))
    except (PayloadError, MalformedTaskMessage) as exc:
        logger.error(
            "task %s was revoked; the message of its job %s is refused, and its result backend is told REVOKED "
            "without it: %s",
            doc["taskId"],
            reprlib.repr(doc.get("_id")),
            exc,
        )
        return None
    headers, body = message["headers"], message["body"]
    parts = body_parts(message, body.encode() if isinstance(body, str) else body)
    return {**headers, "args": parts.get("args"), "kwargs": parts.get("kwargs"), **(parts.get("options") or {})}


def _apps_with_their_own_backend(store: JobStore) -> list[Any]:
    """The Celery apps of this process on `store`'s broker whose result backend is their own."""
    # bbmongo:// (its results are the job documents, bb_broker.results) needs nothing.
    return [app for app in _apps_with_a_backend(store) if not type(app.backend).__module__.startswith("bb_broker.")]


def _apps_with_a_backend(store: JobStore) -> list[Any]:
    """The Celery apps of this process on `store`'s broker that have a result backend."""
    from celery.backends.base import DisabledBackend

    found = []
    for app in upstream_celery.apps():
        url = broker_url(app)
        try:
            on_store = (
                url is not None
                and parse_broker_url(url).database == store.coll.database.name
                and BrokerOptions.parse(app.conf.broker_transport_options or {}).jobs_collection == store.coll.name
            )
        except ValueError:  # another app of the process, whose URL or options name no store (BrokerURLError, ...)
            continue
        if on_store and not isinstance(app.backend, DisabledBackend):
            found.append(app)
    return found


def store_never_run(backend: Any, task_id: str, error: BaseException) -> None:
    """Store FAILURE with `error` for `task_id` in a result backend, for a task the broker will never run (a
    callback dropped as malformed, the body of a chord whose header's job failed before it ran): its waiters
    (`AsyncResult(task_id).get()`) would wait for ever. A backend's outage, or one that cannot store a result for a
    task it did not see (rpc://), is logged, never raised: the task that carried it goes on."""
    from celery.backends.base import DisabledBackend

    if isinstance(backend, DisabledBackend):
        return
    try:
        backend.mark_as_failure(task_id, error, call_errbacks=False)
    except Exception as exc:  # the backend is the user's
        logger.warning("task %s will never run, but its result backend could not be told: %s", task_id, exc)


#: At most this many tellings of result backends wait for their thread (tell_of_undeliverable_job): beyond, one is
#: dropped, said in one line (each holds up to a lastError's text).
QUEUED_TELLINGS = 1000


class _Tellings:
    """The tellings of result backends of the jobs a claim refused, made in their order by one thread of their own,
    `bb-undeliverable-telling`, started at the first: the worker's event loop must not wait on a backend that does
    not answer (Redis's socket timeout and retries hold a caller for minutes). The thread owns the backends it reads
    (Celery builds one per thread: built once there, not once per telling)."""

    def __init__(self) -> None:
        self._waiting: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=QUEUED_TELLINGS)
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def add(self, tell: Callable[[], None], task_id: str | None) -> None:
        try:
            self._waiting.put_nowait(tell)
        except queue.Full:
            logger.warning(
                "job of task %s cannot be delivered, and its result backend is not told: %d tellings wait already",
                task_id,
                QUEUED_TELLINGS,
            )
            return
        with self._starting:
            if self._thread is None:
                self._thread = start_supervised("bb-undeliverable-telling", self._tell_each)

    def _tell_each(self) -> None:
        while True:
            self._waiting.get()()


_tellings = _Tellings()


@reset_in_child
def _forget_parent_tellings() -> None:
    # The parent's thread does not run in the child, and its queue's lock may have been held at the fork.
    global _tellings
    _tellings = _Tellings()


def tell_of_undeliverable_job(store: JobStore, task_id: str | None, reason: str, chord_body: str | None) -> None:
    """Tell the result backends of this process's apps on `store`'s broker of a job `store` failed at its claim
    because its stored message cannot be delivered (a hand edit, a corruption, another program's write): no worker
    ever receives its task, and their waiters would wait for ever. FAILURE with `reason` for `task_id` (None: no task
    id a result can be stored under, task_id_of) in each backend of the app's own (bbmongo:// needs nothing: its
    results are the job documents); Celery's ChordError for `chord_body`, the body of a chord whose header held the
    job (its part is never counted), in every backend. Told by the telling thread (_Tellings), `reason` scrubbed of
    the broker's credentials and cut to the length a job's lastError has."""
    if "celery" not in sys.modules:
        return  # a Kombu client: no Celery app, no result backend
    text = scrub(reason, store.secrets)[: lifecycle.MAX_ERROR_LENGTH]
    own = _apps_with_their_own_backend(store) if task_id is not None else []
    every = _apps_with_a_backend(store) if chord_body is not None else []
    if not own and not every:
        return

    def tell() -> None:
        # Never raises: the thread goes on to the next telling.
        from celery.exceptions import ChordError

        try:
            for app in own:
                store_never_run(app.backend, str(task_id), PayloadError(text))
            for app in every:
                error = ChordError(f"a task of the chord's header failed before it ran: {text}")
                store_never_run(app.backend, str(chord_body), error)
        except Exception as exc:  # an app's backend that cannot even be built: the user's to fix, said once
            logger.warning("job of task %s cannot be delivered, and its result backend is not told: %s", task_id, exc)

    _tellings.add(tell, task_id)
