"""Paused queues, kept in the `bb_queues` collection: an operator pauses a queue once, every worker's claims skip it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import DuplicateKeyError

#: The collection of queue controls: one document per queue that was ever paused, `_id` the queue's name.
QUEUES_COLLECTION = "bb_queues"


class QueueControls:
    """Pause and resume queues durably: the state outlives every process, and a worker started later reads it."""

    def __init__(self, db: Database, *, collection: str = QUEUES_COLLECTION) -> None:
        self.coll: Collection = db[collection]

    def pause(self, queue: str, *, by: str, now: datetime) -> bool:
        """Pause `queue`; False when it was paused already (the first pause keeps its author)."""
        try:
            # Upserted when the queue has no document yet; a paused one does not match and its _id collides.
            self.coll.update_one(
                {"_id": queue, "paused": {"$ne": True}},
                {"$set": {"paused": True, "pausedBy": by, "pausedAt": now}},
                upsert=True,
            )
        except DuplicateKeyError:
            return False
        return True

    def resume(self, queue: str, *, by: str, now: datetime) -> bool:
        """Resume `queue`; False when it was not paused."""
        result = self.coll.update_one(
            {"_id": queue, "paused": True},
            {"$set": {"paused": False, "resumedBy": by, "resumedAt": now}, "$unset": {"pausedBy": "", "pausedAt": ""}},
        )
        return result.modified_count == 1

    def paused(self) -> dict[str, dict[str, Any]]:
        """Every paused queue, with who paused it and when."""
        return {doc.pop("_id"): doc for doc in self.coll.find({"paused": True})}


#: Seconds a consumer trusts its read of the paused queues while a live change stream would report any change.
WATCHED_MAX_AGE = 60.0


class PausedQueues:
    """What a consumer knows of the paused queues, read again when `version()` changes (its change stream saw a
    queue paused or resumed, or came back after an outage) and otherwise after `max_age` seconds, or after
    WATCHED_MAX_AGE while `version()` is not None (a live change stream would have said)."""

    def __init__(
        self, controls: QueueControls, *, max_age: float, version: Callable[[], int | None] = lambda: None
    ) -> None:
        self.controls = controls
        self.max_age = max_age
        self._version = version
        self._lock = threading.Lock()
        self._names: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._read_version: int | None = -1

    def __contains__(self, queue: str) -> bool:
        now, version = time.monotonic(), self._version()
        max_age = self.max_age if version is None else max(self.max_age, WATCHED_MAX_AGE)
        with self._lock:
            if now - self._read_at >= max_age or version != self._read_version:
                # Read the version first: a change after it is seen at the next check.
                self._names = frozenset(self.controls.paused())
                self._read_at, self._read_version = now, version
            return queue in self._names
