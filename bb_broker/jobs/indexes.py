"""The indexes of `jobs` and of the rate counters: those the hot path needs (made again by `hinted` when a hinted
query finds them gone), and the TTL index that says how long succeeded jobs are kept."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from pymongo import ASCENDING, DESCENDING, IndexModel
from pymongo.collection import Collection as MongoCollection
from pymongo.errors import OperationFailure

from bb_broker.jobs.canvas import CANVAS_INDEXES
from bb_broker.jobs.lifecycle import SUCCEEDED
from bb_broker.jobs.serial import SERIAL_INDEX
from bb_broker.jobs.unique import UNIQUE_INDEXES
from bb_broker.server import (
    Capabilities,
    is_index_conflict,
    is_missing_hinted_index,
    is_not_implemented,
    unique_refusals,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The hint of a query to one of our indexes by its name, for a command (find, update, aggregate...): what the
#: deployment's Capabilities.hint says, so that a server that refuses a hint gets none.
Hint = Callable[[str, str], dict[str, Any]]

#: Claim order: higher priority first, then the earliest due, then the oldest (what the bb_claim index serves).
CLAIM_ORDER = [("priority", DESCENDING), ("runAfter", ASCENDING), ("_id", ASCENDING)]

INDEXES = [
    IndexModel([("status", ASCENDING), ("queue", ASCENDING), *CLAIM_ORDER], name="bb_claim"),
    IndexModel([("status", ASCENDING), ("updatedAt", ASCENDING)], name="bb_status_updated"),
    IndexModel([("taskId", ASCENDING)], name="bb_task_id"),
    # The operator's lists (bb_broker.ops.queries), newest first by job id, filtered by status, queue or kind.
    IndexModel([("status", ASCENDING), ("_id", ASCENDING)], name="bb_list_status"),
    IndexModel([("queue", ASCENDING), ("status", ASCENDING), ("_id", ASCENDING)], name="bb_list_queue"),
    IndexModel([("kind", ASCENDING), ("status", ASCENDING), ("_id", ASCENDING)], name="bb_list_kind"),
    # The jobs of one periodic entry (bb_broker.beat): partial, so the jobs no entry sent cost it nothing.
    IndexModel(
        [("schedule", ASCENDING), ("status", ASCENDING), ("_id", ASCENDING)],
        name="bb_list_schedule",
        partialFilterExpression={"schedule": {"$exists": True}},
    ),
    *UNIQUE_INDEXES,  # one per unique mode (bb_broker.jobs.unique)
    # A queue's concurrency limit: the running jobs of a limited queue each hold one of its slots (`limitSlot`, set by
    # the claim, unset by whatever ends the attempt); a second claim of a slot is refused (see JobStore.claim).
    IndexModel(
        [("queue", ASCENDING), ("limitSlot", ASCENDING)],
        name="bb_limit_slot",
        unique=True,
        partialFilterExpression={"limitSlot": {"$exists": True}},
    ),
    SERIAL_INDEX,
    *CANVAS_INDEXES,  # the steps of one canvas (bb_broker.jobs.canvas)
]

#: The TTL index that removes a rate counter once its next start has come (`expireAt`, see
#: rates.RateCounters.take_start): a rate per key makes a counter for each key it meets.
RATE_EXPIRY = IndexModel([("expireAt", ASCENDING)], name="bb_rate_expiry", expireAfterSeconds=0)

#: Seconds a succeeded job is kept (7 days); 0 keeps succeeded jobs for good.
DEFAULT_RETENTION = 7 * 24 * 3600.0
#: The TTL index that expires succeeded jobs; failed ones are outside its partial filter and stay.
RETENTION_INDEX = "bb_retention"
RETENTION_FILTER = {"status": SUCCEEDED}


class IndexedStore(Protocol):
    """What hint_if_indexed reads of a store (a JobStore): its collection and what its server offers."""

    @property
    def coll(self) -> MongoCollection: ...

    @property
    def server(self) -> Capabilities: ...


def hint_if_indexed(store: IndexedStore, index: str, command: str = "find") -> dict[str, Any]:
    """The hint of `index` for `command`, for a read an operator makes (their queries, the charts' summaries)."""
    # An operator may look at a database no worker has indexed yet, where a hint would be an error. The _id index
    # is always there (a missing collection ignores the hint), and hinted: a planner may otherwise scan and sort
    # the whole collection for a newest-first read with nothing else in its filter (the Python stand-in does).
    # No hint at all where the server refuses one on `command` (server.py).
    hint = store.server.hint(index, command)
    if not hint or index == "_id_":
        return hint
    return hint if any(ix["name"] == index for ix in store.coll.list_indexes()) else {}


class ServerLacksFeature(RuntimeError):
    """The server cannot do something the broker cannot safely do without."""


_said_no_ttl = threading.Event()


def say_no_ttl_once(exc: OperationFailure) -> None:
    """One log line per process for a server without TTL indexes, however many collections find out."""
    if not _said_no_ttl.is_set():
        _said_no_ttl.set()
        logger.warning(
            "this server cannot make TTL indexes (code %s): succeeded jobs and plumbing messages are deleted by a "
            "periodic sweep of the workers instead",
            exc.code,
        )


def ensure_plain_indexes(coll: MongoCollection, indexes: list[IndexModel]) -> None:
    """Create indexes the broker needs; a server that cannot, and does not have them already, is refused."""
    try:
        coll.create_indexes(indexes)
    except OperationFailure as exc:
        if not is_not_implemented(exc):
            raise
        present = {ix["name"] for ix in coll.list_indexes()}
        missing = sorted(ix.document["name"] for ix in indexes if ix.document["name"] not in present)
        if missing:
            raise ServerLacksFeature(
                f"the server cannot create the indexes {', '.join(missing)} on {coll.full_name} (createIndexes "
                f"answered code {exc.code}); claims without them are not safe: create them by hand or use a server "
                "that supports createIndexes"
            ) from None


def ensure_indexes(coll: MongoCollection, *, retention: float | None = None) -> int | None:
    """Create the indexes; `retention` (seconds, 0 = keep) sets when succeeded jobs expire. The seconds a periodic
    sweep must keep succeeded jobs where the server has no TTL index (see expire_succeeded), else None.

    Without `retention` an existing expiry is left as it is, so a producer that does not configure it
    never undoes what the workers set; a new collection gets DEFAULT_RETENTION.
    """
    ensure_plain_indexes(coll, INDEXES)
    try:
        _ensure_retention(coll, retention)
    except OperationFailure as exc:
        if not is_not_implemented(exc):
            raise
        say_no_ttl_once(exc)
        seconds = DEFAULT_RETENTION if retention is None else retention
        return math.ceil(seconds) or None
    return None


def hinted(coll: MongoCollection, query: Callable[[], T]) -> T:
    """Run a query on `coll` hinted to our index; if someone dropped the indexes (or the collection), make them again.
    A unique index's refusal comes out as DuplicateKeyError, however this server reports it."""
    try:
        with unique_refusals(coll.database):
            return query()
    except OperationFailure as exc:
        if not is_missing_hinted_index(exc):
            raise
    logger.warning("the indexes of %s are gone; creating them again", coll.full_name)
    coll.create_indexes(INDEXES)
    return query()


def first_due(coll: MongoCollection, due: dict[str, Any], fields: dict[str, Any], hint: Hint) -> dict[str, Any] | None:
    """The job a claim of `due` would take first (CLAIM_ORDER, through bb_claim), its `fields` only; None if none."""
    return hinted(coll, lambda: coll.find_one(due, fields, sort=CLAIM_ORDER, **hint("bb_claim", "find")))


def ensure_rate_expiry(counters: MongoCollection) -> None:
    """The TTL index on the rate counters; a server without TTL indexes keeps them (one small document per key)."""
    try:
        counters.create_indexes([RATE_EXPIRY])
    except OperationFailure as exc:
        if not is_not_implemented(exc):
            raise
        say_no_ttl_once(exc)


def expire_succeeded(coll: MongoCollection, retention_sweep: int | None, now: datetime) -> int:
    """Where the server has no TTL index: delete the succeeded jobs past retention (a worker's periodic sweep)."""
    if not retention_sweep:
        return 0
    cutoff = now - timedelta(seconds=retention_sweep)
    return coll.delete_many({"status": SUCCEEDED, "finishedAt": {"$lt": cutoff}}).deleted_count


def _ensure_retention(coll: MongoCollection, retention: float | None) -> None:
    current = next((ix for ix in coll.list_indexes() if ix["name"] == RETENTION_INDEX), None)
    if retention is None:
        if current is not None:
            return
        retention = DEFAULT_RETENTION
    if retention < 0 or math.isnan(retention):
        raise ValueError(f"retention must be 0 (keep) or a number of seconds, got {retention!r}")
    seconds = math.ceil(retention)  # a TTL index counts whole seconds
    if seconds == 0:
        if current is not None:
            coll.drop_index(RETENTION_INDEX)
        return
    if current is not None:
        ours = dict(current["key"]) == {"finishedAt": 1}
        ours = ours and dict(current.get("partialFilterExpression") or {}) == RETENTION_FILTER
        if ours and current.get("expireAfterSeconds") == seconds:
            return
        if ours:
            _set_retention(coll, seconds)
            return
        coll.drop_index(RETENTION_INDEX)  # not the shape we need: rebuild it
    try:
        coll.create_index(
            [("finishedAt", ASCENDING)],
            name=RETENTION_INDEX,
            expireAfterSeconds=seconds,
            partialFilterExpression=RETENTION_FILTER,
        )
    except OperationFailure as exc:
        if not is_index_conflict(exc):
            raise
        _set_retention(coll, seconds)  # another process created it a moment ago with another retention


def _set_retention(coll: MongoCollection, seconds: int) -> None:
    try:
        coll.database.command("collMod", coll.name, index={"name": RETENTION_INDEX, "expireAfterSeconds": seconds})
    except OperationFailure as exc:
        if not is_not_implemented(exc):
            raise
        # No collMod: the same change as a new index (a server without TTL indexes says so in create_index).
        coll.drop_index(RETENTION_INDEX)
        coll.create_index(
            [("finishedAt", ASCENDING)],
            name=RETENTION_INDEX,
            expireAfterSeconds=seconds,
            partialFilterExpression=RETENTION_FILTER,
        )
