"""A task revoked while still queued, told to the app's own result backend when that is not bbmongo://.

A worker that receives a revoked task stores REVOKED in its app's result backend (celery.worker.request's
`_announce_revoked`: `backend.mark_as_revoked(task_id, reason, request=...)`, which also counts a chord part). bb_broker
fails such a job at the revoke itself (bb_broker.jobs.revokes.revoke_queued): no worker ever receives it, so on a
result backend of the app's own (Redis, a database) its result stayed PENDING and `get()` waited for ever. Here the
revoker's process stores it as that worker would have. bbmongo:// needs nothing: its results are the job documents.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from bb_broker import app_stores
from bb_broker.connection import parse_broker_url
from bb_broker.jobs.payloads import PayloadError, body_parts, to_message
from bb_broker.jobs.revokes import revoked_before_running
from bb_broker.jobs.store import JobStore
from bb_broker.options import BrokerOptions
from bb_broker.upstream import celery as upstream_celery

logger = logging.getLogger(__name__)

#: The reason a worker stores for a revoked task (celery.worker.request: `revoked()`).
REASON = "revoked"


def store_revoked_results(store: JobStore, task_ids: Iterable[str]) -> None:
    """Store REVOKED in the result backend of each Celery app of this process whose broker is `store`'s and whose
    backend is its own (not bbmongo://, nor none), for each of `task_ids` whose job `store` holds failed as revoked
    before it ran (see the module)."""
    if "celery" not in sys.modules:
        return  # a Kombu client: no Celery app, no result backend
    told = _apps_with_their_own_backend(store)
    if not told:
        return
    from celery.app.task import Context

    for doc in revoked_before_running(store, task_ids):
        try:
            message = to_message(doc.get("payload"))
        except PayloadError:
            continue  # a hand-written job: nothing a worker could have read either
        headers = message["headers"]
        body = message["body"]
        parts = body_parts(message, body.encode() if isinstance(body, str) else body)
        request = {**headers, "args": parts.get("args"), "kwargs": parts.get("kwargs"), **(parts.get("options") or {})}
        for app in told:
            task = app.tasks.get(headers.get("task"))
            backend = task.backend if task is not None else app.backend
            # As the worker's Request decides: a task that ignores its result stores its errors only when told to.
            store_errors = task is None or not task.ignore_result or task.store_errors_even_if_ignored
            try:
                backend.mark_as_revoked(doc["taskId"], REASON, request=Context(request), store_result=store_errors)
            except Exception as exc:  # the backend is the user's: its outage must not fail the revoke itself
                logger.warning("task %s was revoked, but its result backend could not be told: %s", doc["taskId"], exc)


def _apps_with_their_own_backend(store: JobStore) -> list[Any]:
    """The Celery apps of this process on `store`'s broker whose result backend is their own."""
    from celery.backends.base import DisabledBackend

    from bb_broker.results.backend import JobResultBackend

    found = []
    for app in upstream_celery.apps():
        url = app_stores.broker_url(app)
        if url is None or parse_broker_url(url).database != store.coll.database.name:
            continue
        if BrokerOptions.parse(app.conf.broker_transport_options or {}).jobs_collection != store.coll.name:
            continue
        if not isinstance(app.backend, (JobResultBackend, DisabledBackend)):
            found.append(app)
    return found
