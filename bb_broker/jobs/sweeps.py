"""The sweeps and counts on `jobs`: lost running jobs recovered, unclaimable queued jobs failed, statuses counted.

A mixin JobStore inherits, not functions: every caller (the worker's sweep thread, the CLI, Flower, the tests) keeps
calling `store.requeue_stale()` and `store.statuses()` on the one store it holds, and store.py reads as the hot path
alone. The mixin uses only what JobStore sets up (its collection, policy, clock and hints), declared below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from pymongo import UpdateOne
from pymongo.collection import Collection as MongoCollection
from pymongo.errors import BulkWriteError

from bb_broker import metrics
from bb_broker.connection import as_read, exact_reads
from bb_broker.jobs.document import (
    HISTORY_ARRAY,
    HISTORY_LIMIT,
    HISTORY_NOT_ARRAY,
    RUNNING_ONLY_FIELDS,
    attempt_recorded_expression,
    has_entry_of_current_attempt,
)
from bb_broker.jobs.indexes import hinted
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, STATUSES, Policy
from bb_broker.jobs.unique import RELEASED_AT_END
from bb_broker.server import Capabilities, unapplicable_write_error

logger = logging.getLogger(__name__)

#: How statuses() names the documents that have no status.
UNKNOWN_STATUS = "(none)"


class Sweeps:
    """The sweeps and counts of a JobStore (see the module's docstring)."""

    coll: MongoCollection
    policy: Policy
    now: Callable[[], datetime]
    _hint: Callable[[str, str], dict[str, Any]]
    if TYPE_CHECKING:

        @property
        def server(self) -> Capabilities: ...

    # --- recovering lost work ---------------------------------------------

    def requeue_stale(self) -> tuple[int, int]:
        """Running jobs whose lease ran out: back to the queue, or failed when no attempt is left."""
        cutoff = self.now() - timedelta(seconds=self.policy.stale_after)
        reason = f"worker lost: no heartbeat for {self.policy.stale_after:g} s"
        return self._recover({"updatedAt": {"$lt": cutoff}}, reason, hint="bb_status_updated")

    def fail_unclaimable_queued(self) -> int:
        """Fail the queued jobs no claim can find, naming the field (a queue that is not a string, a runAfter that is
        not a date: written by hand), so that none waits for ever as queued. Run with each stale sweep."""
        now = self.now()
        unclaimable = (
            ("queue", {"$or": [{"queue": {"$not": {"$type": "string"}}}, {"queue": {"$type": "array"}}]}, "a string"),
            ("runAfter", {"runAfter": {"$not": {"$type": "date"}}}, "a date"),
        )
        failed = 0
        for field, selector, kind in unclaimable:
            reason = f"malformed job document: {field} must be {kind}"
            failed += self.coll.update_many(
                {"status": QUEUED, **selector},
                {
                    "$set": {"status": FAILED, "lastError": reason, "updatedAt": now, "finishedAt": now},
                    "$unset": RELEASED_AT_END,
                },
            ).modified_count
        metrics.record("failed", failed)
        if failed:
            logger.error("failed %d queued jobs no claim could find (a queue or a runAfter written by hand)", failed)
        return failed

    def release_owner(self, owner: str, reason: str) -> tuple[int, int]:
        """At a worker's shutdown, whatever it still holds was cut short."""
        # Among the running jobs (few: workers x prefetch) by the status index; one index less on every claim.
        return self._recover({"leaseOwner": owner}, reason, hint="bb_status_updated")

    def recover_cut_short(self, job_id: str, attempts: int, owner: str, reason: str) -> bool:
        """One job whose run this worker cut short, as a stopping worker's are (release_owner): requeued where an
        attempt is left, else failed, with its `lost` entry; fenced on its attempt and owner."""
        # `$and`: the sweep's own filter sets `attempts` (those that end in each status).
        selector = {"_id": job_id, "leaseOwner": owner, "$and": [{"attempts": attempts}]}
        return any(self._recover(selector, reason, hint="_id_"))

    def _recover(self, selector: dict[str, Any], reason: str, *, hint: str) -> tuple[int, int]:
        """Settle the running jobs `selector` finds as lost: requeued where an attempt is left, else failed. Two
        pipeline updates where the server takes them; else a read and fenced per-job writes (see _recover_by_read)."""
        now = self.now()
        outcomes = ((QUEUED, reason), (FAILED, f"{reason}, and no attempt is left"))
        if self.server.update_pipelines:
            retried, failed = (self._recover_by_pipeline(selector, *outcome, now, hint) for outcome in outcomes)
        else:
            retried, failed = self._recover_by_read(selector, dict(outcomes), now, hint)
        metrics.record("retried", retried)
        metrics.record("failed", failed)
        if retried or failed:
            logger.warning("recovered lost jobs: %d re-queued, %d failed (%s)", retried, failed, reason)
        return retried, failed

    def _recover_by_pipeline(
        self, selector: dict[str, Any], status: str, last_error: str, now: datetime, hint: str
    ) -> int:
        """One pipeline update settles every job of `selector` that ends in `status` (one round trip), so that each
        job's history entry takes its own attempt number, owner and start."""
        lost = {
            "n": "$attempts",
            "worker": "$leaseOwner",
            "startedAt": "$startedAt",
            "finishedAt": now,
            "outcome": "lost",
            "error": {"$literal": last_error},
        }
        history = {"$concatArrays": [HISTORY_ARRAY, [lost]]}
        # A broker retry records its attempt's failure, then publishes the retry: a worker lost between the two left
        # the attempt in the history already. Its entry and error stay; the job goes where the retry would.
        recorded = attempt_recorded_expression()
        changes: dict[str, Any] = {
            "status": status,
            "lastError": {"$cond": [recorded, "$lastError", {"$literal": last_error}]},
            "updatedAt": now,
        }
        changes["runAfter" if status == QUEUED else "finishedAt"] = now
        # A history written by hand that is not an array is kept as it is: no sweep fails on it (for every job).
        kept = {"$or": [recorded, {"$and": [{"$ne": [{"$type": "$history"}, "missing"]}, HISTORY_NOT_ARRAY]}]}
        changes["history"] = {"$cond": [kept, "$history", {"$slice": [history, -HISTORY_LIMIT]}]}
        pipeline: list[dict[str, Any]] = [{"$set": changes}, {"$unset": list(_released(status))}]
        result = hinted(
            self.coll,
            lambda: self.coll.update_many(
                {"status": RUNNING, **selector, "attempts": _attempts_ending_in(status, self.policy.max_attempts)},
                pipeline,
                **self._hint(hint, "update"),
            ),
        )
        return int(result.modified_count)

    def _recover_by_read(
        self, selector: dict[str, Any], errors: dict[str, str], now: datetime, hint: str
    ) -> tuple[int, int]:
        """Where the server refuses update pipelines (Amazon DocumentDB): the lost jobs read, then one update per job
        computed here, fenced on what was read (its status, attempt and updatedAt, as well as `selector`), sent in one
        unordered bulk write per outcome. A job whose lease was renewed, or that another sweeper settled, between
        the read and the write matches no fence and is left alone: each lost job is settled once, as by the pipeline.
        Read with EXACT_DECODING and written with as_read: what the job holds (its owner, its start, the updatedAt the
        fence matches) is copied as its bytes are, text that is not UTF-8 and dates outside years 1 to 9999 included.
        """
        fields = ("attempts", "leaseOwner", "startedAt", "updatedAt")
        projection = {**dict.fromkeys(fields, 1), "history": {"$slice": -1}}
        exact = exact_reads(self.coll)
        found = hinted(
            self.coll, lambda: list(exact.find({"status": RUNNING, **selector}, projection, **self._hint(hint, "find")))
        )
        writes: dict[str, list[UpdateOne]] = {QUEUED: [], FAILED: []}
        for doc in found:
            if not isinstance(doc.get("attempts"), int | float):
                continue  # written by hand: neither pipeline's filter matches it either
            status = QUEUED if doc["attempts"] < self.policy.max_attempts else FAILED
            # The read's updatedAt, equal, in place of the selector's `$lt` (it met it): a heartbeat since moves it.
            fence = {**selector, "_id": doc["_id"], "status": RUNNING, "attempts": doc["attempts"]}
            fence["updatedAt"] = doc.get("updatedAt")
            writes[status].append(UpdateOne(as_read(fence), _lost_update(doc, status, errors[status], now)))
        return self._write_lost(writes[QUEUED]), self._write_lost(writes[FAILED])

    def _write_lost(self, writes: list[UpdateOne]) -> int:
        if not writes:
            return 0
        try:
            return int(self.coll.bulk_write(writes, ordered=False).modified_count)
        except BulkWriteError as exc:
            # A history edited by hand into another type since the read: that job's write cannot apply; the next
            # sweep reads it again (and keeps its history). Any other refusal is the caller's to handle.
            if not all(unapplicable_write_error(error) for error in exc.details.get("writeErrors", [])):
                raise
            return int(exc.details.get("nModified", 0))

    # --- reading and operating --------------------------------------------

    def statuses(self) -> dict[str, int]:
        """Counts per status from one aggregation: the four statuses always, then any other status a document has
        (written by hand or by another program) under its own name, `(none)` for none: they add up to the
        collection's size."""
        known = list(STATUSES)
        group = {"$group": {"_id": "$status", "n": {"$sum": 1}}}
        counts = dict.fromkeys(STATUSES, 0)
        for row in self.coll.aggregate([{"$match": {"status": {"$in": known}}}, group]):
            counts[row["_id"]] = row["n"]
        others: dict[str, int] = {}
        # The collection's size from its metadata: the read of the other statuses only when there may be some.
        if self.coll.estimated_document_count() > sum(counts.values()):
            for row in self.coll.aggregate([{"$match": {"status": {"$nin": known}}}, group]):
                name = UNKNOWN_STATUS if row["_id"] is None else str(row["_id"])
                others[name] = others.get(name, 0) + row["n"]
        return {**counts, **dict(sorted(others.items()))}

    def queued_count(self, queue: str) -> int:
        return self.coll.count_documents({"status": QUEUED, "queue": queue})

    def purge_queued(self, queue: str) -> int:
        return self.coll.delete_many({"status": QUEUED, "queue": queue}).deleted_count


def _attempts_ending_in(status: str, max_attempts: int) -> dict[str, int]:
    """The attempts of a lost job the sweep settles as `status`: requeued while an attempt is left, else failed."""
    return {"$lt": max_attempts} if status == QUEUED else {"$gte": max_attempts}


def _released(status: str) -> dict[str, str]:
    """What a lost job gives back: its lease and slot; failed for good, its unique key too (requeued, it keeps it)."""
    return dict.fromkeys(RUNNING_ONLY_FIELDS, "") | ({} if status == QUEUED else RELEASED_AT_END)


def _lost_update(doc: dict[str, Any], status: str, last_error: str, now: datetime) -> dict[str, Any]:
    """The pipeline's change to one lost job, computed from `doc` as read (its last history entry only): the same
    fields, entry and error, as operators every server takes."""
    changes: dict[str, Any] = {"status": status, "updatedAt": now}
    changes["runAfter" if status == QUEUED else "finishedAt"] = now
    update: dict[str, Any] = {"$set": changes, "$unset": _released(status)}
    history = doc.get("history", [])
    if not isinstance(history, list):
        return update | {"$set": {**changes, "lastError": last_error}}  # written by hand: kept as it is
    if has_entry_of_current_attempt(doc):
        return update  # the attempt's failure is recorded already: its entry and its error stay
    # As the pipeline's `$leaseOwner` and `$startedAt`: a field the job does not have is left out of the entry.
    entry = {"n": doc["attempts"]}
    kept = {"worker": "leaseOwner", "startedAt": "startedAt"}
    entry |= {name: doc[field] for name, field in kept.items() if field in doc}
    entry |= {"finishedAt": now, "outcome": "lost", "error": last_error}
    changes["lastError"] = last_error
    update["$push"] = {"history": {"$each": [as_read(entry)], "$slice": -HISTORY_LIMIT}}
    return update
