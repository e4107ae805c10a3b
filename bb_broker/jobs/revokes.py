"""Celery's revoke broadcast: the task ids it names, and the queued jobs of those tasks failed at once, so that no
worker runs them later (a worker's own list of revoked ids lives in its memory)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from bb_broker.clock import reading
from bb_broker.jobs.document import action_record, of_task, update_recorded
from bb_broker.jobs.indexes import hint_if_indexed
from bb_broker.jobs.lifecycle import FAILED, QUEUED
from bb_broker.jobs.store import JobStore
from bb_broker.jobs.unique import RELEASED_BY_CANCEL

logger = logging.getLogger(__name__)

#: The lastError of a job revoked while it was still queued (as a worker's own revoke says it).
REVOKED = "revoked before it ran"


def revoked_task_ids(message: dict[str, Any], body: Any) -> list[str]:
    """The task ids of a Celery `revoke` control broadcast (any other message: none). Only JSON is read."""
    from kombu.exceptions import ContentDisallowed, DecodeError
    from kombu.serialization import loads

    if message.get("content-type") != "application/json" or body is None:
        return []
    try:
        decoded = loads(
            body, "application/json", message.get("content-encoding") or "utf-8", accept={"application/json"}
        )
    except (ContentDisallowed, DecodeError, ValueError, TypeError):
        return []
    if not isinstance(decoded, dict) or decoded.get("method") != "revoke":
        return []
    arguments = decoded.get("arguments")
    task_ids = arguments.get("task_id") if isinstance(arguments, dict) else None
    if isinstance(task_ids, str):
        return [task_ids]
    if isinstance(task_ids, list):
        return [str(task_id) for task_id in task_ids if isinstance(task_id, str)]
    return []


def revoke_queued(store: JobStore, task_ids: Iterable[str], *, by: str) -> int:
    """The jobs of revoked Celery tasks that are still queued end failed at once, so no worker runs them later
    (a worker's own list of revoked ids lives in its memory). Running jobs are left to the workers."""
    ids = [str(task_id) for task_id in task_ids]
    if not ids:
        return 0
    now = reading(store.now)
    revoked = update_recorded(
        store.coll,
        {"taskId": of_task(ids), "status": QUEUED},
        {
            "$set": {"status": FAILED, "lastError": REVOKED, "updatedAt": now, "finishedAt": now, "revokedAt": now},
            "$unset": RELEASED_BY_CANCEL,
            "$push": action_record("revoke", by, now),
        },
        **hint_if_indexed(store, "bb_task_id"),
    )
    if revoked:
        logger.info("revoked %d queued job(s) of task(s) %s (%s)", revoked, ", ".join(ids), by)
    return revoked


def revoked_before_running(store: JobStore, task_ids: Iterable[str]) -> list[dict[str, Any]]:
    """The jobs (task id and payload) of `task_ids` that a revoke failed while they were still queued."""
    ids = [str(task_id) for task_id in task_ids]
    if not ids:
        return []
    found = store.coll.find(
        {"taskId": of_task(ids), "status": FAILED, "lastError": REVOKED},
        {"taskId": 1, "payload": 1},
        **hint_if_indexed(store, "bb_task_id"),
    )
    return list(found)
