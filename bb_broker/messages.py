"""Kombu's plumbing traffic (events, remote control, replies) and exchange bindings, kept apart from `jobs`."""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from kombu.utils.json import dumps, loads
from pymongo import ASCENDING, DESCENDING, IndexModel
from pymongo.collection import Collection
from pymongo.database import Database


class BindingsWatch:
    """What a live change stream says about a bindings collection, shared by every channel of the process.

    A worker publishes its events (a heartbeat every 2 s) on a connection that consumes nothing, so the
    news comes from the consuming connection's watcher, through this registry.
    """

    _watched: dict[tuple[int, str], BindingsWatch] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.live_since: float | None = None  # monotonic; None while no change stream covers the collection
        self.changed_at = 0.0

    @classmethod
    def of(cls, bindings: Collection) -> BindingsWatch:
        key = (id(bindings.database.client), bindings.full_name)
        with cls._lock:
            return cls._watched.setdefault(key, cls())

    def went_live(self) -> None:
        self.live_since = time.monotonic()

    def went_dark(self) -> None:
        self.live_since = None

    def changed(self) -> None:
        self.changed_at = time.monotonic()

    def vouches_for(self, read_at: float) -> bool:
        """True when the stream was live when the table was read and has reported no change since."""
        live = self.live_since
        return live is not None and read_at > live and read_at > self.changed_at


def _forget_parent_watches() -> None:
    # The parent's watcher does not follow a fork; a child's clients are new and start unwatched.
    BindingsWatch._watched = {}
    BindingsWatch._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_watches)


class MessageStore:
    """Transient messages: deleted when fetched, expired by a TTL index when nobody fetches them."""

    def __init__(self, db: Database, *, ttl: float = 300.0, prefix: str = "bb_") -> None:
        self.messages = db[f"{prefix}messages"]
        self.bindings = db[f"{prefix}bindings"]
        self.ttl = ttl
        self._table_cache: dict[str, tuple[float, list[tuple[str, str, str]]]] = {}
        self._watch = BindingsWatch.of(self.bindings)

    def ensure_indexes(self) -> None:
        self.messages.create_indexes(
            [
                IndexModel([("queue", ASCENDING), ("priority", DESCENDING), ("_id", ASCENDING)], name="bb_fetch"),
                IndexModel([("expiresAt", ASCENDING)], name="bb_expiry", expireAfterSeconds=0),
            ]
        )
        self.bindings.create_indexes(
            [
                IndexModel(
                    [("exchange", ASCENDING), ("routing_key", ASCENDING), ("queue", ASCENDING)],
                    name="bb_binding",
                    unique=True,
                ),
                IndexModel([("queue", ASCENDING)], name="bb_binding_queue"),
            ]
        )

    def put(self, queue: str, message: dict[str, Any], priority: int, *, ttl: float | None = None) -> None:
        """Store a message for `queue`; `ttl` (seconds, the message's own expiration) shortens the store's."""
        expires = datetime.now(UTC) + timedelta(seconds=self.ttl if ttl is None else min(ttl, self.ttl))
        self.messages.insert_one(
            {"queue": queue, "priority": priority, "payload": dumps(message), "expiresAt": expires}
        )

    def get(self, queue: str) -> dict[str, Any] | None:
        # The TTL monitor deletes expired messages only every minute or so: one past its time is never delivered.
        live = {"queue": queue, "expiresAt": {"$gt": datetime.now(UTC)}}
        doc = self.messages.find_one_and_delete(live, sort=[("priority", DESCENDING), ("_id", ASCENDING)])
        return None if doc is None else loads(doc["payload"])

    def size(self, queue: str) -> int:
        return self.messages.count_documents({"queue": queue, "expiresAt": {"$gt": datetime.now(UTC)}})

    def purge(self, queue: str) -> int:
        return self.messages.delete_many({"queue": queue}).deleted_count

    def bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        key = {"exchange": exchange, "routing_key": routing_key, "queue": queue}
        self.bindings.update_one(key, {"$set": {**key, "pattern": pattern}}, upsert=True)
        self._table_cache.pop(exchange, None)

    def table(self, exchange: str, max_age: float = 0.0) -> list[tuple[str, str, str]]:
        """The bindings of an exchange, as kombu's (routing_key, pattern, queue) rows.

        A table that may be `max_age` seconds old may also be kept for as long as a live change stream on
        the bindings reports no change; `max_age` 0 always reads.
        """
        cached = self._table_cache.get(exchange)
        fresh = cached is not None and (time.monotonic() - cached[0] < max_age or self._watch.vouches_for(cached[0]))
        if cached is not None and max_age > 0 and fresh:
            return cached[1]
        rows = [
            (b["routing_key"], b.get("pattern") or "", b["queue"]) for b in self.bindings.find({"exchange": exchange})
        ]
        self._table_cache[exchange] = (time.monotonic(), rows)
        return rows

    def delete_queue(self, queue: str) -> None:
        self.bindings.delete_many({"queue": queue})
        self.messages.delete_many({"queue": queue})
        self._table_cache.clear()
