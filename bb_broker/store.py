"""Every MongoDB query on the `jobs` collection: publish, claim, settle, leases, sweeps, counts and operations."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo import ASCENDING, DESCENDING, IndexModel, ReturnDocument
from pymongo.collection import Collection as MongoCollection
from pymongo.database import Database
from pymongo.errors import ConnectionFailure, DocumentTooLarge, OperationFailure
from ulid import ULID

from . import lifecycle, metrics
from .lifecycle import FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED, Outcome, Policy

logger = logging.getLogger(__name__)

#: Claim order: higher priority first, then the earliest due, then the oldest.
CLAIM_ORDER = [("priority", DESCENDING), ("runAfter", ASCENDING), ("_id", ASCENDING)]

INDEXES = [
    IndexModel([("status", ASCENDING), ("queue", ASCENDING), *CLAIM_ORDER], name="bb_claim"),
    IndexModel([("status", ASCENDING), ("updatedAt", ASCENDING)], name="bb_status_updated"),
    IndexModel([("taskId", ASCENDING)], name="bb_task_id"),
]

#: One claim at a time per process: then a job's owner and attempts say whose claim it is (see claim_many).
_claiming = threading.Lock()

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024

#: Server error codes for an update that cannot apply to one document (BadValue, TypeMismatch).
UNAPPLICABLE_UPDATE = {2, 14}

#: Seconds a succeeded job is kept (7 days); 0 keeps succeeded jobs for good.
DEFAULT_RETENTION = 7 * 24 * 3600.0
#: The TTL index that expires succeeded jobs; failed ones are outside its partial filter and stay.
RETENTION_INDEX = "bb_retention"
RETENTION_FILTER = {"status": SUCCEEDED}
#: Server error codes for an index that exists under the same name with other options.
INDEX_CONFLICT = {85, 86}

#: What `bb-broker status` can break the counts down by.
BREAKDOWNS = ("queue", "kind")
#: The fields an operator reads about a failed job.
FAILED_FIELDS = {"_id": 1, "kind": 1, "queue": 1, "taskId": 1, "attempts": 1, "lastError": 1, "updatedAt": 1}


class JobTooLarge(ValueError):
    """The task message does not fit in one MongoDB document."""


@dataclass(frozen=True)
class Claimed:
    """A job a worker now holds: `attempts` is its fencing token for every later write."""

    id: str
    attempts: int
    task_id: str | None
    payload: Any


class JobStore:
    #: Seconds a settling write keeps trying through an outage before it gives up to the stale sweep.
    settle_patience = 60.0

    def __init__(
        self,
        db: Database,
        policy: Policy | None = None,
        *,
        clock: Callable[[], datetime] | None = None,
        collection: str = "jobs",
        secrets: Iterable[str] = (),
    ) -> None:
        self.coll: MongoCollection = db[collection]
        self.policy = policy or Policy()
        self.now = clock or (lambda: datetime.now(UTC))
        self._secrets = tuple(secrets)

    def ensure_indexes(self, *, retention: float | None = None) -> None:
        """Create the indexes; `retention` (seconds, 0 = keep) sets when succeeded jobs expire.

        Without `retention` an existing expiry is left as it is, so a producer that does not configure it
        never undoes what the workers set; a new collection gets DEFAULT_RETENTION.
        """
        self.coll.create_indexes(INDEXES)
        self._ensure_retention(retention)

    def _ensure_retention(self, retention: float | None) -> None:
        current = next((ix for ix in self.coll.list_indexes() if ix["name"] == RETENTION_INDEX), None)
        if retention is None:
            if current is not None:
                return
            retention = DEFAULT_RETENTION
        if retention < 0 or math.isnan(retention):
            raise ValueError(f"retention must be 0 (keep) or a number of seconds, got {retention!r}")
        seconds = math.ceil(retention)  # a TTL index counts whole seconds
        if seconds == 0:
            if current is not None:
                self.coll.drop_index(RETENTION_INDEX)
            return
        if current is not None:
            ours = dict(current["key"]) == {"finishedAt": 1}
            ours = ours and dict(current.get("partialFilterExpression") or {}) == RETENTION_FILTER
            if ours and current.get("expireAfterSeconds") == seconds:
                return
            if ours:
                self._set_retention(seconds)
                return
            self.coll.drop_index(RETENTION_INDEX)  # not the shape we need: rebuild it
        try:
            self.coll.create_index(
                [("finishedAt", ASCENDING)],
                name=RETENTION_INDEX,
                expireAfterSeconds=seconds,
                partialFilterExpression=RETENTION_FILTER,
            )
        except OperationFailure as exc:
            if exc.code not in INDEX_CONFLICT:
                raise
            self._set_retention(seconds)  # another process created it a moment ago with another retention

    def _set_retention(self, seconds: int) -> None:
        self.coll.database.command(
            "collMod", self.coll.name, index={"name": RETENTION_INDEX, "expireAfterSeconds": seconds}
        )

    # --- producing -------------------------------------------------------

    def publish(
        self,
        *,
        queue: str,
        kind: str,
        task_id: str,
        payload: dict[str, Any],
        priority: int,
        run_after: datetime | None,
        is_retry: bool,
    ) -> str:
        """Insert a queued job; a Celery retry reschedules the job that is running instead."""
        now = self.now()
        due = run_after or now
        if is_retry:
            updated = self._write(
                self.coll.find_one_and_update,
                {"taskId": task_id, "status": RUNNING},
                {
                    "$set": {
                        "status": QUEUED,
                        "payload": payload,
                        "queue": queue,
                        "priority": priority,
                        "runAfter": due,
                        "updatedAt": now,
                    },
                    "$unset": {"leaseOwner": ""},
                },
                projection={"_id": 1},
            )
            if updated is not None:
                metrics.record("retried")
                return updated["_id"]
        job_id = str(ULID())
        self._write(
            self.coll.insert_one,
            {
                "_id": job_id,
                "kind": kind,
                "taskId": task_id,
                "queue": queue,
                "priority": priority,
                "payload": payload,
                "status": QUEUED,
                "attempts": 0,
                "runAfter": due,
                "createdAt": now,
                "updatedAt": now,
            },
        )
        metrics.record("enqueued")
        return job_id

    def _write(self, operation: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return operation(*args, **kwargs)
        except DocumentTooLarge as exc:
            raise JobTooLarge(
                f"task message does not fit in a MongoDB document (limit {MAX_DOCUMENT_BYTES} bytes): {exc}"
            ) from None

    # --- working -----------------------------------------------------------

    def claim(self, queue: str, owner: str) -> Claimed | None:
        """Atomically move the next due job of `queue` to running, held by `owner`."""
        now = self.now()
        due = {"status": QUEUED, "queue": queue, "runAfter": {"$lte": now}}
        try:
            with _claiming:
                doc = self._hinted(
                    lambda: self.coll.find_one_and_update(
                        due,
                        {"$set": {"status": RUNNING, "updatedAt": now, "leaseOwner": owner}, "$inc": {"attempts": 1}},
                        sort=CLAIM_ORDER,
                        hint="bb_claim",
                        return_document=ReturnDocument.AFTER,
                    )
                )
        except OperationFailure as exc:
            if exc.code not in UNAPPLICABLE_UPDATE:
                raise
            # A hand-edited document the update cannot apply to must not block the queue behind it.
            self._fail_unclaimable(due, lifecycle.describe_error(exc))
            return None
        if doc is None:
            return None
        return Claimed(doc["_id"], doc["attempts"], doc.get("taskId"), doc.get("payload"))

    def claim_many(self, queue: str, owner: str, limit: int) -> list[Claimed]:
        """Move up to `limit` due jobs of `queue` to running: one round trip for one job, two for a batch.

        The head of the queue is read, then taken with one write fenced on each job's status and attempts: a job
        another worker took in between is not taken again, and the write is safe to repeat. Only when it was not
        all ours, or its outcome is unknown, does a third read say which jobs are.
        """
        if limit <= 1:
            job = self.claim(queue, owner)
            return [] if job is None else [job]
        now = self.now()
        due = {"status": QUEUED, "queue": queue, "runAfter": {"$lte": now}}
        head = self._hinted(lambda: list(self.coll.find(due, sort=CLAIM_ORDER, hint="bb_claim", limit=limit)))
        if not all(type(doc.get("attempts")) is int for doc in head):
            return self.claim_many(queue, owner, 1)  # a hand-edited document: the single claim deals with it
        if not head:
            return []
        taken = {"$set": {"status": RUNNING, "updatedAt": now, "leaseOwner": owner}, "$inc": {"attempts": 1}}
        ids = {"$in": [doc["_id"] for doc in head]}  # found through the _id index; the $or fences each one
        fenced = [{"_id": doc["_id"], "attempts": doc["attempts"]} for doc in head]
        ours = [{"_id": doc["_id"], "attempts": doc["attempts"] + 1} for doc in head]
        mine = {"_id": ids, "status": RUNNING, "leaseOwner": owner, "$or": ours}

        def take() -> int:
            return self.coll.update_many(
                {"_id": ids, "status": QUEUED, "$or": fenced}, taken, hint="_id_"
            ).modified_count

        with _claiming:
            try:
                complete = take() == len(head)
            except (ConnectionFailure, OperationFailure) as exc:
                if not _transient(exc):
                    raise
                # pymongo does not retry a multi-document write, and this one may have landed, in part or late:
                # repeat it (the fence makes that safe), then read what is ours.
                self._through_outages(take)
                complete = False
            if not complete:
                won = {
                    doc["_id"]
                    for doc in self._through_outages(lambda: list(self.coll.find(mine, {"_id": 1}, hint="_id_")))
                }
                head = [doc for doc in head if doc["_id"] in won]
        return [Claimed(doc["_id"], doc["attempts"] + 1, doc.get("taskId"), doc.get("payload")) for doc in head]

    def _hinted(self, query: Callable[[], Any]) -> Any:
        """Run a query hinted to our index; if someone dropped the indexes (or the collection), make them again."""
        try:
            return query()
        except OperationFailure as exc:
            if exc.code != 2 or "hint" not in str((exc.details or {}).get("errmsg", "")):
                raise
        logger.warning("the indexes of %s are gone; creating them again", self.coll.full_name)
        self.coll.create_indexes(INDEXES)
        return query()

    def _fail_unclaimable(self, due: dict[str, Any], reason: str) -> None:
        head = self._hinted(lambda: self.coll.find_one(due, {"_id": 1}, sort=CLAIM_ORDER, hint="bb_claim"))
        if head is not None:
            logger.error("job %s is malformed and cannot be claimed: %s", head["_id"], reason)
            result = self.coll.update_one(
                {"_id": head["_id"], "status": QUEUED},
                {
                    "$set": {
                        "status": FAILED,
                        "lastError": f"malformed job document: {reason}"[: lifecycle.MAX_ERROR_LENGTH],
                        "updatedAt": self.now(),
                        "finishedAt": self.now(),
                    }
                },
            )
            metrics.record("failed", result.modified_count)

    def heartbeat(self, job_ids: Iterable[str], owner: str) -> int:
        """Refresh the lease of the live jobs this owner still holds."""
        ids = list(job_ids)
        if not ids:
            return 0
        result = self.coll.update_many(
            {"_id": {"$in": ids}, "status": RUNNING, "leaseOwner": owner},
            {"$set": {"updatedAt": self.now()}},
        )
        return result.modified_count

    def succeed(self, job_id: str, attempts: int) -> bool:
        now = self.now()
        done = self._settle(
            job_id,
            attempts,
            {
                "$set": {"status": SUCCEEDED, "lastError": "", "updatedAt": now, "finishedAt": now},
                "$unset": {"leaseOwner": ""},
            },
        )
        if done:
            metrics.record("succeeded")
        return done

    def fail(
        self, job_id: str, attempts: int, error: str, *, retryable: bool = True, backoff: bool = True
    ) -> Outcome | None:
        """Record a failed attempt: back to the queue (with backoff unless told otherwise), or failed for good."""
        now = self.now()
        outcome = lifecycle.after_failure(
            self.policy, attempts, self._scrub(error), now, retryable=retryable, backoff=backoff
        )
        changes: dict[str, Any] = {"status": outcome.status, "lastError": outcome.last_error, "updatedAt": now}
        if outcome.status == QUEUED:
            changes["runAfter"] = outcome.run_after
        else:
            changes["finishedAt"] = now
        done = self._settle(job_id, attempts, {"$set": changes, "$unset": {"leaseOwner": ""}})
        if done:
            metrics.record("retried" if outcome.status == QUEUED else "failed")
        return outcome if done else None

    def fail_running_task(self, task_id: str, owner: str, error: str, *, retryable: bool = True) -> Outcome | None:
        """Fail the running job of a Celery task id that `owner` holds (when only the task id is known)."""
        doc = self.coll.find_one({"taskId": task_id, "status": RUNNING, "leaseOwner": owner}, {"attempts": 1})
        if doc is None:
            return None
        return self.fail(doc["_id"], doc["attempts"], error, retryable=retryable)

    def release(self, job_id: str, attempts: int) -> bool:
        """Give back a job that never started (prefetched, then the worker stopped): no attempt used."""
        return self._settle(
            job_id,
            attempts,
            {
                "$set": {"status": QUEUED, "updatedAt": self.now()},
                "$inc": {"attempts": -1},
                "$unset": {"leaseOwner": ""},
            },
        )

    def _settle(self, job_id: str, attempts: int, update: dict[str, Any]) -> bool:
        # Fenced on the attempt: a late write from a worker that lost its lease changes nothing.
        fenced = {"_id": job_id, "status": RUNNING, "attempts": attempts}
        return self._through_outages(lambda: self.coll.update_one(fenced, update)).modified_count == 1

    def _through_outages(self, write: Callable[[], Any]) -> Any:
        """Retry a write on a held job through a failover or a restart: losing a settle would run the task again."""
        deadline = time.monotonic() + self.settle_patience
        delay = 0.1
        while True:
            try:
                return write()
            except (ConnectionFailure, OperationFailure) as exc:
                if not _transient(exc) or time.monotonic() > deadline:
                    raise
                logger.warning("a write on a held job failed (%s), retrying in %.1fs", type(exc).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "**")
        return text

    # --- recovering lost work ---------------------------------------------

    def requeue_stale(self) -> tuple[int, int]:
        """Running jobs whose lease ran out: back to the queue, or failed when no attempt is left."""
        cutoff = self.now() - timedelta(seconds=self.policy.stale_after)
        reason = f"worker lost: no heartbeat for {self.policy.stale_after:g} s"
        return self._recover({"updatedAt": {"$lt": cutoff}}, reason, hint="bb_status_updated")

    def release_owner(self, owner: str, reason: str) -> tuple[int, int]:
        """At a worker's shutdown, whatever it still holds was cut short."""
        # Among the running jobs (few: workers x prefetch) by the status index; one index less on every claim.
        return self._recover({"leaseOwner": owner}, reason, hint="bb_status_updated")

    def _recover(self, selector: dict[str, Any], reason: str, *, hint: str) -> tuple[int, int]:
        now = self.now()
        retry = self._hinted(
            lambda: self.coll.update_many(
                {"status": RUNNING, **selector, "attempts": {"$lt": self.policy.max_attempts}},
                {
                    "$set": {"status": QUEUED, "lastError": reason, "runAfter": now, "updatedAt": now},
                    "$unset": {"leaseOwner": ""},
                },
                hint=hint,
            )
        )
        give_up = self._hinted(
            lambda: self.coll.update_many(
                {"status": RUNNING, **selector, "attempts": {"$gte": self.policy.max_attempts}},
                {
                    "$set": {
                        "status": FAILED,
                        "lastError": f"{reason}, and no attempt is left",
                        "updatedAt": now,
                        "finishedAt": now,
                    },
                    "$unset": {"leaseOwner": ""},
                },
                hint=hint,
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
        """Counts per status, all four keys, from one aggregation."""
        counts = dict.fromkeys(STATUSES, 0)
        for row in self.coll.aggregate(
            [
                {"$match": {"status": {"$in": list(STATUSES)}}},
                {"$group": {"_id": "$status", "n": {"$sum": 1}}},
            ],
        ):
            counts[row["_id"]] = row["n"]
        return counts

    def queued_count(self, queue: str) -> int:
        return self.coll.count_documents({"status": QUEUED, "queue": queue})

    def purge_queued(self, queue: str) -> int:
        return self.coll.delete_many({"status": QUEUED, "queue": queue}).deleted_count

    # --- flower ------------------------------------------------------------

    def queue_depths(self, queues: Iterable[str]) -> dict[str, dict[str, int]]:
        """Queued, running and failed jobs of each named queue (zeros for an empty one), from one aggregation."""
        names = list(queues)
        shown = (QUEUED, RUNNING, FAILED)
        depths = {name: dict.fromkeys(shown, 0) for name in names}
        for row in self.coll.aggregate(
            [
                {"$match": {"status": {"$in": list(shown)}, "queue": {"$in": names}}},
                {"$group": {"_id": {"queue": "$queue", "status": "$status"}, "n": {"$sum": 1}}},
            ],
            **self._hint_if_indexed("bb_claim"),
        ):
            depths[row["_id"]["queue"]][row["_id"]["status"]] = row["n"]
        return depths

    # --- operations ---------------------------------------------------------

    def breakdown(self, by: str) -> dict[str, dict[str, int]]:
        """Counts per status for each queue (or each kind), all four keys per row, sorted by name."""
        if by not in BREAKDOWNS:
            raise ValueError(f"cannot break the counts down by {by!r}: one of {', '.join(BREAKDOWNS)}")
        rows: dict[str, dict[str, int]] = {}
        for row in self.coll.aggregate(
            [
                {"$match": {"status": {"$in": list(STATUSES)}}},
                {"$group": {"_id": {"name": f"${by}", "status": "$status"}, "n": {"$sum": 1}}},
            ],
            **self._hint_if_indexed("bb_status_updated"),
        ):
            name = row["_id"].get("name")
            counts = rows.setdefault("" if name is None else str(name), dict.fromkeys(STATUSES, 0))
            counts[row["_id"]["status"]] = row["n"]
        return dict(sorted(rows.items()))

    def failed_jobs(
        self,
        *,
        kind: str | None = None,
        older_than: timedelta | None = None,
        newer_than: timedelta | None = None,
        limit: int = 0,
    ) -> list[dict[str, Any]]:
        """Failed jobs, the most recently failed first (a failed job's updatedAt is when it failed); 0 = no limit."""
        query: dict[str, Any] = {"status": FAILED, **self._age(older_than, newer_than)}
        if kind is not None:
            query["kind"] = str(kind)
        cursor = self.coll.find(
            query,
            FAILED_FIELDS,
            sort=[("updatedAt", DESCENDING)],
            limit=max(limit, 0),
            **self._hint_if_indexed("bb_status_updated"),
        )
        return list(cursor)

    def retry_failed(self, *, ids: Iterable[str] | None = None, kind: str | None = None) -> int:
        """Failed jobs back to queued, due now, with all their attempts again; no selector means every one."""
        query: dict[str, Any] = {"status": FAILED}
        if ids is not None:
            query["_id"] = {"$in": [str(job_id) for job_id in ids]}
        if kind is not None:
            query["kind"] = str(kind)
        now = self.now()
        # lastError stays: it says why the job needed a retry until its next attempt settles.
        update = {
            "$set": {"status": QUEUED, "attempts": 0, "runAfter": now, "updatedAt": now},
            "$unset": {"finishedAt": ""},
        }
        hint = {"hint": "_id_"} if ids is not None else self._hint_if_indexed("bb_status_updated")
        return self.coll.update_many(query, update, **hint).modified_count

    def purge(self, statuses: Collection[str], *, older_than: timedelta | None = None) -> int:
        """Delete the jobs in these statuses last changed (for a finished job: finished) over `older_than` ago."""
        if not statuses or not set(statuses) <= set(STATUSES):
            raise ValueError(f"purge needs statuses among {', '.join(STATUSES)}, got {sorted(statuses)!r}")
        query = {"status": {"$in": sorted(statuses)}, **self._age(older_than, None)}
        return self.coll.delete_many(query, **self._hint_if_indexed("bb_status_updated")).deleted_count

    def _hint_if_indexed(self, index: str) -> dict[str, str]:
        # An operator may look at a database no worker has indexed yet, where a hint would be an error.
        return {"hint": index} if any(ix["name"] == index for ix in self.coll.list_indexes()) else {}

    def _age(self, older_than: timedelta | None, newer_than: timedelta | None) -> dict[str, Any]:
        # Ages are measured on self.now (the server's clock in a worker or the CLI), like due times and leases.
        now = self.now()
        window: dict[str, datetime] = {}
        if older_than is not None:
            window["$lt"] = now - older_than
        if newer_than is not None:
            window["$gte"] = now - newer_than
        return {"updatedAt": window} if window else {}


def _transient(exc: ConnectionFailure | OperationFailure) -> bool:
    """A failover, a restart or a dropped connection: the same write may be tried again."""
    return isinstance(exc, ConnectionFailure) or exc.has_error_label("RetryableWriteError")
