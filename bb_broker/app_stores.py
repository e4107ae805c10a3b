"""A Celery app's job stores: the store behind its bbmongo:// broker, one per app and process (and options), which the
worker, the result backend and the Flower plugin all use."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from bb_broker import connection
from bb_broker.forks import reset_in_child
from bb_broker.options import BrokerOptions, open_store
from bb_broker.upstream import celery as upstream_celery

if TYPE_CHECKING:
    from bb_broker.jobs.settles import SettleRelay
    from bb_broker.jobs.store import JobStore

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
