"""The sweeps and counts on `jobs`: lost running jobs recovered, unclaimable queued jobs failed, statuses counted.

A mixin JobStore inherits, not functions: every caller (the worker's sweep thread, the CLI, Flower, the tests) keeps
calling `store.requeue_stale()` and `store.statuses()` on the one store it holds, and store.py reads as the hot path
alone. The mixin uses only what JobStore sets up (its collection, policy, clock and hinted query), declared below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from pymongo.collection import Collection as MongoCollection

from bb_broker import metrics
from bb_broker.jobs.document import (
    HISTORY_ARRAY,
    HISTORY_LIMIT,
    HISTORY_NOT_ARRAY,
    RUNNING_ONLY_FIELDS,
    attempt_recorded_expression,
)
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, STATUSES, Policy
from bb_broker.jobs.unique import RELEASED_AT_END

logger = logging.getLogger(__name__)

#: How statuses() names the documents that have no status.
UNKNOWN_STATUS = "(none)"


class Sweeps:
    """The sweeps and counts of a JobStore (see the module's docstring)."""

    coll: MongoCollection
    policy: Policy
    now: Callable[[], datetime]
    _hinted: Callable[[Callable[[], Any]], Any]
    _hint: Callable[[str, str], dict[str, Any]]

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

    def _recover(self, selector: dict[str, Any], reason: str, *, hint: str) -> tuple[int, int]:
        now = self.now()

        def settled_lost(status: str, last_error: str) -> list[dict[str, Any]]:
            # A pipeline update, so that each job's history entry takes its own attempt number, owner and start.
            lost = {
                "n": "$attempts",
                "worker": "$leaseOwner",
                "startedAt": "$startedAt",
                "finishedAt": now,
                "outcome": "lost",
                "error": {"$literal": last_error},
            }
            history = {"$concatArrays": [HISTORY_ARRAY, [lost]]}
            # A broker retry records its attempt's failure, then publishes the retry: a worker lost between the two
            # left the attempt in the history already. Its entry and error stay; the job goes where the retry would.
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
            # Requeued, the job keeps its unique key; failed for good, it gives it back.
            released = [*RUNNING_ONLY_FIELDS] if status == QUEUED else [*RUNNING_ONLY_FIELDS, *RELEASED_AT_END]
            return [{"$set": changes}, {"$unset": released}]

        retry = self._hinted(
            lambda: self.coll.update_many(
                {"status": RUNNING, **selector, "attempts": {"$lt": self.policy.max_attempts}},
                settled_lost(QUEUED, reason),
                **self._hint(hint, "update"),
            )
        )
        give_up = self._hinted(
            lambda: self.coll.update_many(
                {"status": RUNNING, **selector, "attempts": {"$gte": self.policy.max_attempts}},
                settled_lost(FAILED, f"{reason}, and no attempt is left"),
                **self._hint(hint, "update"),
            )
        )
        metrics.record("retried", retry.modified_count)
        metrics.record("failed", give_up.modified_count)
        if retry.modified_count or give_up.modified_count:
            logger.warning(
                "recovered lost jobs: %d re-queued, %d failed (%s)",
                retry.modified_count,
                give_up.modified_count,
                reason,
            )
        return retry.modified_count, give_up.modified_count

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
