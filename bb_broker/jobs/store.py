"""The hot path's queries on `jobs`: publish, claim, settle, leases, sweeps, counts (indexes and retention: admin.py).

The job document's record of its attempts and its Celery result (designed once, for the Jobs view and for the
`bbmongo://` result backend in results.py), written inside writes that exist anyway, never in a round trip of its own:

- `startedAt`: set by the claim (the claim is when an attempt starts holding the job).
- `history`: the last HISTORY_LIMIT attempts, oldest first, each `{n, worker, startedAt, finishedAt, outcome, error,
  traceback}`; `outcome` is `succeeded`, `failed` (the broker's retries included), `retry` (the task's own Celery
  retry), `ignored` (the task raised Celery's `Ignore`, as `Task.replace` does: the job ends `succeeded`), `revoked`
  or `lost` (the worker vanished: the stale sweep or its shutdown settled it). Pushed with
  `$push`/`$slice` by the settling write (a failed attempt the broker retries: just before its retry's publish).
- The result, set by the settling write when the backend is `bbmongo://` (see results.py): `state` (Celery's state),
  `result` (the value as BSON when it came as JSON, else the encoded bytes; `resultFormat` says which), `traceback`,
  `dateDone`, `children`, `groupId`, `parentId`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import ObjectId
from kombu.exceptions import EncodeError
from pymongo import ReturnDocument
from pymongo.collection import Collection as MongoCollection
from pymongo.database import Database
from pymongo.errors import ConnectionFailure, DocumentTooLarge, DuplicateKeyError, OperationFailure
from ulid import ULID

from bb_broker.connection import scrub
from bb_broker.jobs import admin, lifecycle
from bb_broker.jobs.admin import CLAIM_ORDER, INDEXES
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED, Outcome, Policy
from bb_broker.jobs.outages import is_transient, through_outages
from bb_broker.jobs.unique import DuplicateJob
from bb_broker.ops import metrics

#: Celery's state for a task that failed and will run again (celery.states.RETRY), without importing Celery here.
RETRY_STATE = "RETRY"

logger = logging.getLogger(__name__)

#: How statuses() names the documents that have no status.
UNKNOWN_STATUS = "(none)"

#: What a worker needs of a job it claims, and what the claim checks (see malformed): its `queue`, and of its
#: `history` only its type; the history itself and the result fields stay on the server.
CLAIMED_FIELDS = {
    "_id": 1, "attempts": 1, "taskId": 1, "payload": 1, "runAfter": 1, "queue": 1,
    "historyType": {"$type": "$history"},
}  # fmt: skip

#: One claim at a time per process: then a job's owner and attempts say whose claim it is (see claim_many).
_claiming = threading.Lock()

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024

#: Attempts kept in a job's `history`, the newest last.
HISTORY_LIMIT = 10
#: A traceback in `history` is cut to its last this many characters (where the exception is).
MAX_HISTORY_TRACEBACK = 4000
#: Server error codes for an update whose document would exceed the limit (BSONObjectTooLarge and kin).
DOCUMENT_TOO_LARGE = {10334, 17419, 17420}

#: Server error codes for an update that cannot apply to one document (BadValue, TypeMismatch).
UNAPPLICABLE_UPDATE = {2, 14}

#: The result backend's collection (same database) of what has no job: see results/backend.py.
RESULTS_COLLECTION = "bb_results"


def claim_query(queue: str, owner: str, now: datetime) -> tuple[dict[str, Any], dict[str, Any]]:
    """The claim: the filter of `queue`'s due jobs (taken in CLAIM_ORDER) and the update that makes one `owner`'s."""
    due = {"status": QUEUED, "queue": queue, "runAfter": {"$lte": now}}
    take = {
        "$set": {"status": RUNNING, "updatedAt": now, "startedAt": now, "leaseOwner": owner},
        "$inc": {"attempts": 1},
    }
    return due, take


class JobTooLarge(ValueError):
    """The task message does not fit in one MongoDB document."""


class SettleTooLarge(ValueError):
    """A settling write (with a task's result) would make the job document larger than MongoDB's limit."""


class ResultTooLarge(EncodeError):
    """A task's result does not fit in its job document: the job fails with this as its error, never retried.

    An EncodeError, so that Celery's tracer records it as the task's failure, as it does a result it cannot encode.
    """


def attempt_entry(
    n: int,
    *,
    worker: str | None,
    started_at: datetime | None,
    finished_at: datetime,
    outcome: str,
    error: str | None = None,
    traceback: str | None = None,
) -> dict[str, Any]:
    """One element of a job's `history`; the traceback is bounded to its end."""
    entry: dict[str, Any] = {"n": n, "worker": worker, "startedAt": started_at, "finishedAt": finished_at}
    entry["outcome"] = outcome
    if error:
        entry["error"] = error[: lifecycle.MAX_ERROR_LENGTH]
    if traceback:
        entry["traceback"] = traceback[-MAX_HISTORY_TRACEBACK:]
    return entry


def _pushed(entry: dict[str, Any] | None) -> dict[str, Any]:
    return {} if entry is None else {"$push": {"history": {"$each": [entry], "$slice": -HISTORY_LIMIT}}}


@dataclass(frozen=True)
class Claimed:
    """A job a worker now holds: `attempts` is its fencing token for every later write."""

    id: str
    attempts: int
    task_id: str | None
    payload: Any
    #: When the job was due, on the server's clock (None in a hand-edited document without it).
    run_after: datetime | None = None


def _claimed(doc: dict[str, Any], attempts: int) -> Claimed:
    run_after = doc.get("runAfter")
    if not isinstance(run_after, datetime):
        run_after = None
    elif run_after.tzinfo is None:
        run_after = run_after.replace(tzinfo=UTC)
    return Claimed(doc["_id"], attempts, doc.get("taskId"), doc.get("payload"), run_after)


def malformed(doc: dict[str, Any]) -> str | None:
    """What makes a claimed job document one no worker can work through to its end, naming the field; None when it
    can. A job's id travels to the worker as a string and every later write finds the job by it; its attempts are
    its fencing token (a whole number in a header); its queue is what claims, counts and wake-ups go by; its history
    (read as its type, `historyType`) takes a $push at each settle."""
    job_id = doc.get("_id")
    if not isinstance(job_id, str):
        return f"_id must be a string, not {bson_kind(job_id)} {job_id!r}"[: lifecycle.MAX_ERROR_LENGTH]
    attempts = doc.get("attempts")
    if not isinstance(attempts, int) or isinstance(attempts, bool):
        return f"attempts must be a whole number, not {bson_kind(attempts)} {attempts!r}"
    if not isinstance(doc.get("queue"), str):
        return f"queue must be a string, not {bson_kind(doc.get('queue'))}"
    if doc.get("historyType", "missing") not in ("missing", "array"):
        return f"history must be an array, not {doc['historyType']}"
    return None


def bson_kind(value: Any) -> str:
    """The name MongoDB gives a value's type ($type), for errors a person reads."""
    kinds: tuple[tuple[type, str], ...] = (
        (bool, "bool"),  # before int: a bool is an int too
        (int, "int"),
        (float, "double"),
        (str, "string"),
        (dict, "object"),
        (list, "array"),
        (datetime, "date"),
        (bytes, "binData"),
        (ObjectId, "objectId"),
        (type(None), "null"),
    )
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def new_job_id() -> str:
    """A job's id: a ULID, so that ids sort by creation time (the operator's lists page by it)."""
    return str(ULID())


class JobStore:
    """A `jobs` collection as the hot path uses it; every write on a held job is fenced on its attempt."""

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
        #: Seconds succeeded jobs are kept where the server has no TTL index (set by ensure_indexes), else None.
        self.retention_sweep: int | None = None

    @property
    def key(self) -> Hashable:
        """What names this store's collection in a process's registries (its lease keeper, its releases to make):
        pymongo compares collections by their client's seed list (replica set name and SRV host included), database
        and name, without a server call and for any topology (`client.address` refuses a URL of several mongos
        routers, the sharded deployment docs/scale.md recommends)."""
        return self.coll

    def ensure_indexes(self, *, retention: float | None = None) -> None:
        """Create the indexes and set the retention of succeeded jobs (see admin.ensure_indexes)."""
        self.retention_sweep = admin.ensure_indexes(self.coll, retention=retention)

    def expire_succeeded(self) -> int:
        """Where the server has no TTL index: delete the succeeded jobs past retention (a worker's periodic sweep)."""
        return admin.expire_succeeded(self.coll, self.retention_sweep, self.now())

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
        job_id: str | None = None,
        retry_of: tuple[str, int] | None = None,
        unique_key: str | None = None,
    ) -> str:
        """Insert a queued job; a Celery retry reschedules the job that is running instead.

        `job_id`, when given, makes the insert safe to repeat: a second publish of the same message under the same
        id (a producer retrying a write whose answer it never got) finds the first and writes nothing.
        `retry_of`, the (job id, attempt) a retry comes from, fences the reschedule on that attempt: the retry of an
        attempt whose job was taken over (the stale sweep gave it to another worker) writes nothing.
        `unique_key` (see bb_broker.jobs.unique): when another job holds it, DuplicateJob, and nothing written."""
        now = self.now()
        due = run_after or now
        if is_retry:
            held = {"taskId": task_id} if retry_of is None else {"_id": retry_of[0], "attempts": retry_of[1]}
            updated = self._write(
                self.coll.find_one_and_update,
                {**held, "status": RUNNING},
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
            if retry_of is not None and self.coll.find_one({"_id": retry_of[0]}, {"_id": 1}) is not None:
                logger.warning("job %s: a retry from attempt %d, no longer the job's, was dropped", *retry_of)
                return retry_of[0]
        job: dict[str, Any] = {
            "_id": job_id or new_job_id(),
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
            **({} if unique_key is None else {"uniqueKey": unique_key}),
        }
        try:
            self._write(self.coll.insert_one, job)
        except DuplicateKeyError:
            # Read after the refusal, never before: a read first would cost every publish a round trip, and would
            # still race. A holder under our own id is this publish's earlier try, which the lines below find.
            if unique_key is not None:
                holder = self.coll.find_one({"uniqueKey": unique_key}, {"taskId": 1})
                if holder is not None and holder["_id"] != job["_id"]:
                    raise DuplicateJob(unique_key, holder.get("taskId"), holder["_id"]) from None
            first = self.coll.find_one({"_id": job["_id"]}, {"taskId": 1, "queue": 1})
            if first is not None and (first.get("taskId"), first.get("queue")) == (task_id, queue):
                return job["_id"]  # the earlier try landed
            job["_id"] = new_job_id()  # the id came with another task (a reused properties dict): a job of its own
            self._write(self.coll.insert_one, job)
        metrics.record("enqueued")
        return job["_id"]

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
        due, take = claim_query(queue, owner, self.now())
        try:
            with _claiming:
                doc = self._hinted(
                    lambda: self.coll.find_one_and_update(
                        due,
                        take,
                        CLAIMED_FIELDS,
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
        if self._failed_malformed(doc, doc["attempts"]):
            return None
        return _claimed(doc, doc["attempts"])

    def claim_many(self, queue: str, owner: str, limit: int) -> list[Claimed]:
        """Move up to `limit` due jobs of `queue` to running: one round trip for one job, two for a batch.

        The head of the queue is read, then taken with one write fenced on each job's status and attempts: a job
        another worker took in between is not taken again, and the write is safe to repeat. Only when it was not
        all ours, or its outcome is unknown, does a third read say which jobs are.
        """
        if limit <= 1:
            job = self.claim(queue, owner)
            return [] if job is None else [job]
        due, taken = claim_query(queue, owner, self.now())
        head = self._hinted(
            lambda: list(self.coll.find(due, CLAIMED_FIELDS, sort=CLAIM_ORDER, hint="bb_claim", limit=limit))
        )
        if not all(type(doc.get("attempts")) is int for doc in head):
            return self.claim_many(queue, owner, 1)  # a hand-edited document: the single claim deals with it
        if not head:
            return []
        ids = {"$in": [doc["_id"] for doc in head]}  # found through the _id index; the fence checks each one
        mine = {"_id": ids, "status": RUNNING, "leaseOwner": owner, **_fence(head, shift=1)}

        def take() -> int:
            return self.coll.update_many(
                {"_id": ids, "status": QUEUED, **_fence(head)}, taken, hint="_id_"
            ).modified_count

        with _claiming:
            try:
                complete = take() == len(head)
            except (ConnectionFailure, OperationFailure) as exc:
                if not is_transient(exc):
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
        return [
            _claimed(doc, doc["attempts"] + 1) for doc in head if not self._failed_malformed(doc, doc["attempts"] + 1)
        ]

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

    def _failed_malformed(self, doc: dict[str, Any], attempts: Any) -> bool:
        """Whether the claimed `doc` (now at `attempts`) is malformed: then it ends failed here, once, naming the
        field, and is never delivered (a job delivered under another id would run, stay running, and run again)."""
        reason = malformed({**doc, "attempts": attempts})
        if reason is None:
            return False
        logger.error("job %r is malformed and cannot be run: %s", doc.get("_id"), reason)
        now = self.now()
        result = self._through_outages(
            lambda: self.coll.update_one(
                {"_id": doc["_id"], "status": RUNNING, "attempts": attempts},
                {
                    "$set": {
                        "status": FAILED,
                        "lastError": f"malformed job document: {reason}"[: lifecycle.MAX_ERROR_LENGTH],
                        "updatedAt": now,
                        "finishedAt": now,
                    },
                    "$unset": {"leaseOwner": ""},
                },
            )
        )
        metrics.record("failed", result.modified_count)
        return True

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

    def succeed(
        self,
        job_id: str,
        attempts: int,
        *,
        attempt: dict[str, Any] | None = None,
        result: dict[str, Any] | None = None,
    ) -> bool:
        """Settle a held job `succeeded`, with its history entry and (from the result backend) its result fields."""
        now = self.now()
        changes = {**(result or {}), "status": SUCCEEDED, "lastError": "", "updatedAt": now, "finishedAt": now}
        done = self._settle(job_id, attempts, {"$set": changes, "$unset": {"leaseOwner": ""}, **_pushed(attempt)})
        if done:
            metrics.record("succeeded")
        return done

    def fail(
        self,
        job_id: str,
        attempts: int,
        error: str,
        *,
        retryable: bool = True,
        backoff: bool = True,
        attempt: dict[str, Any] | None = None,
        result: dict[str, Any] | None = None,
    ) -> Outcome | None:
        """Record a failed attempt: back to the queue (with backoff unless told otherwise), or failed for good.

        `result` (from the result backend) is stored as it is when the job fails for good; when the job goes back to
        the queue its `state` becomes RETRY, so a caller waiting on the result waits for the next attempt.
        """
        now = self.now()
        outcome = lifecycle.after_failure(
            self.policy, attempts, self._scrub(error), now, retryable=retryable, backoff=backoff
        )
        changes: dict[str, Any] = {"status": outcome.status, "lastError": outcome.last_error, "updatedAt": now}
        if result is not None:
            changes = {**result, **changes}
            if outcome.status == QUEUED:
                changes["state"] = RETRY_STATE
        if outcome.status == QUEUED:
            changes["runAfter"] = outcome.run_after
        else:
            changes["finishedAt"] = now
        attempt = self._scrubbed(attempt)
        done = self._settle(job_id, attempts, {"$set": changes, "$unset": {"leaseOwner": ""}, **_pushed(attempt)})
        if done:
            metrics.record("retried" if outcome.status == QUEUED else "failed")
        return outcome if done else None

    def record_failed_attempt(self, job_id: str, attempts: int, error: str, *, attempt: dict[str, Any]) -> bool:
        """Record the failure of the attempt a Celery retry is about to run again, while this worker still holds it.

        The retry's publish then puts the job back in the queue (see publish): written first, the failure is never
        late for an attempt another worker already claimed."""
        changes = {"lastError": self._scrub(error)[: lifecycle.MAX_ERROR_LENGTH], "updatedAt": self.now()}
        return self._settle(job_id, attempts, {"$set": changes, **_pushed(self._scrubbed(attempt))})

    def attempt_recorded(self, job_id: str, attempts: int) -> bool:
        """Whether the held attempt has its history entry already (its broker retry recorded the failure)."""
        doc = self.coll.find_one(
            {"_id": job_id, "status": RUNNING, "attempts": attempts},
            {"attempts": 1, "startedAt": 1, "history": {"$slice": -1}},
        )
        return doc is not None and _has_entry_of_current_attempt(doc)

    def _scrubbed(self, attempt: dict[str, Any] | None) -> dict[str, Any] | None:
        if attempt is None:
            return None
        return {k: self._scrub(v) if k in ("error", "traceback") else v for k, v in attempt.items()}

    def annotate(
        self, job_id: str, attempts: int, fields: dict[str, Any], *, attempt: dict[str, Any] | None = None
    ) -> bool:
        """Set result fields (a STARTED or custom state, a Celery retry) on the job's current attempt, any status."""
        current = {"_id": job_id, "attempts": attempts}
        # MongoDB refuses an empty $set
        update = {**({"$set": fields} if fields else {}), **_pushed(self._scrubbed(attempt))}
        if not update:
            return False
        return self._through_outages(lambda: self.coll.update_one(current, update)).modified_count == 1

    def record_retry(self, job_id: str, attempts: int, attempt: dict[str, Any]) -> bool:
        """Add the entry of an attempt that a task's own retry ended (Celery's `self.retry()`).

        The retry's publish put the job back in the queue before Celery tells of the retry, so another worker may
        have claimed it since: the entry goes in whatever attempt the job is at now, in the order the attempts
        finished. Not when the stale sweep took the attempt over: the sweep's entry for it came after it started.
        """
        started = attempt.get("startedAt")
        if started is None:  # the attempt's start went unseen: only while the job is still at it
            return self.annotate(job_id, attempts, {}, attempt=attempt)
        taken_over = {"$elemMatch": {"n": attempts, "finishedAt": {"$gte": started}}}
        selector = {"_id": job_id, "attempts": {"$gte": attempts}, "history": {"$not": taken_over}}
        entry = {"$each": [self._scrubbed(attempt)], "$sort": {"finishedAt": 1}, "$slice": -HISTORY_LIMIT}
        update = {"$push": {"history": entry}}
        return self._through_outages(lambda: self.coll.update_one(selector, update)).modified_count == 1

    def fail_running_task(
        self, task_id: str, owner: str, error: str, *, retryable: bool = True, worker: str | None = None
    ) -> Outcome | None:
        """Fail the running job of a Celery task id that `owner` holds (when only the task id is known)."""
        running = {"taskId": task_id, "status": RUNNING, "leaseOwner": owner}
        doc = self.coll.find_one(running, {"attempts": 1, "startedAt": 1, "history": {"$slice": -1}})
        if doc is None:
            return None
        attempt = None
        # A pool process killed between its broker retry's recorded failure and the retry's publish (a hard time
        # limit) left the attempt in the history already: one entry per attempt.
        if not _has_entry_of_current_attempt(doc):
            attempt = attempt_entry(
                doc["attempts"],
                worker=worker,
                started_at=doc.get("startedAt"),
                finished_at=self.now(),
                outcome="failed",
                error=error,
            )
        return self.fail(doc["_id"], doc["attempts"], error, retryable=retryable, attempt=attempt)

    def release(self, job_id: str, attempts: int, *, owner: str | None = None) -> bool:
        """Give back a job that never started (prefetched, then the worker stopped): no attempt used.

        The job reads as before the claim: its `startedAt` is again its previous attempt's (from that attempt's
        history entry), or none when it had no attempt (or no entry of it). `owner`: fenced on the lease too (a
        release made late, once the server answers again)."""
        held: dict[str, Any] = {"_id": job_id, "status": RUNNING, "attempts": attempts}
        if owner is not None:
            held["leaseOwner"] = owner
        doc = self._through_outages(lambda: self.coll.find_one(held, {"history": {"$slice": -1}}))
        if doc is None:
            return False
        last = (doc.get("history") or [None])[-1]
        previous_start = last.get("startedAt") if isinstance(last, dict) and last.get("n") == attempts - 1 else None
        changes: dict[str, Any] = {"status": QUEUED, "updatedAt": self.now()}
        unset = {"leaseOwner": ""}
        if isinstance(previous_start, datetime):
            changes["startedAt"] = previous_start
        else:
            unset["startedAt"] = ""
        update = {"$set": changes, "$inc": {"attempts": -1}, "$unset": unset}
        return self._settle(job_id, attempts, update, fence=held)

    def _settle(
        self, job_id: str, attempts: int, update: dict[str, Any], *, fence: dict[str, Any] | None = None
    ) -> bool:
        # Fenced on the attempt: a late write from a worker that lost its lease changes nothing.
        fenced = fence or {"_id": job_id, "status": RUNNING, "attempts": attempts}
        try:
            return self._through_outages(lambda: self.coll.update_one(fenced, update)).modified_count == 1
        except DocumentTooLarge as exc:
            raise SettleTooLarge(f"the job document would exceed {MAX_DOCUMENT_BYTES} bytes: {exc}") from None
        except OperationFailure as exc:
            if exc.code not in DOCUMENT_TOO_LARGE:
                raise
            raise SettleTooLarge(f"the job document would exceed MongoDB's {MAX_DOCUMENT_BYTES} bytes") from None

    def _through_outages(self, write: Callable[[], Any]) -> Any:
        return through_outages(write, patience=self.settle_patience)

    def _scrub(self, text: Any) -> Any:
        return scrub(text, self._secrets) if isinstance(text, str) else text

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
                {"$set": {"status": FAILED, "lastError": reason, "updatedAt": now, "finishedAt": now}},
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
            history = {"$concatArrays": [_HISTORY_ARRAY, [lost]]}
            # A broker retry records its attempt's failure, then publishes the retry: a worker lost between the two
            # left the attempt in the history already. Its entry and error stay; the job goes where the retry would.
            recorded = _attempt_recorded()
            changes: dict[str, Any] = {
                "status": status,
                "lastError": {"$cond": [recorded, "$lastError", {"$literal": last_error}]},
                "updatedAt": now,
            }
            changes["runAfter" if status == QUEUED else "finishedAt"] = now
            # A history written by hand that is not an array is kept as it is: no sweep fails on it (for every job).
            kept = {"$or": [recorded, {"$and": [{"$ne": [{"$type": "$history"}, "missing"]}, _HISTORY_NOT_ARRAY]}]}
            changes["history"] = {"$cond": [kept, "$history", {"$slice": [history, -HISTORY_LIMIT]}]}
            return [{"$set": changes}, {"$unset": ["leaseOwner"]}]

        retry = self._hinted(
            lambda: self.coll.update_many(
                {"status": RUNNING, **selector, "attempts": {"$lt": self.policy.max_attempts}},
                settled_lost(QUEUED, reason),
                hint=hint,
            )
        )
        give_up = self._hinted(
            lambda: self.coll.update_many(
                {"status": RUNNING, **selector, "attempts": {"$gte": self.policy.max_attempts}},
                settled_lost(FAILED, f"{reason}, and no attempt is left"),
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


#: Aggregation expressions: a job's `history` as an array (none when it is missing, or is not one); whether it is not.
_HISTORY_NOT_ARRAY = {"$not": [{"$isArray": "$history"}]}
_HISTORY_ARRAY = {"$cond": [_HISTORY_NOT_ARRAY, [], "$history"]}


def _attempt_recorded() -> dict[str, Any]:
    """An aggregation expression: the job's current attempt has its entry in the history already (the last one, with
    the attempt's number, finished since the attempt's claim: not an entry from before `bb-broker retry`)."""
    last = {"$arrayElemAt": [_HISTORY_ARRAY, -1]}
    current = {"$and": [{"$eq": ["$$last.n", "$attempts"]}, {"$gte": ["$$last.finishedAt", "$startedAt"]}]}
    return {"$let": {"vars": {"last": last}, "in": current}}


def _has_entry_of_current_attempt(doc: dict[str, Any]) -> bool:
    """What _attempt_recorded says, of a job read with its `attempts`, `startedAt` and last history entry."""
    last = (doc.get("history") or [None])[-1]
    if not isinstance(last, dict) or last.get("n") != doc.get("attempts"):
        return False
    finished, started = last.get("finishedAt"), doc.get("startedAt")
    return started is None or (finished is not None and finished >= started)


def _fence(docs: list[dict[str, Any]], *, shift: int = 0) -> dict[str, Any]:
    """The filter that holds each doc to its own attempts (plus `shift`): `{attempts: n}` when they all share one
    value, as the head of a queue nearly always does, else one `$in` of ids per value under an `$or`. A server may
    answer an `$or` by scanning the collection (the Rust stand-in does), where the plain form is a lookup by id."""
    by_attempts: dict[int, list[Any]] = {}
    for doc in docs:
        by_attempts.setdefault(doc["attempts"] + shift, []).append(doc["_id"])
    if len(by_attempts) == 1:
        return {"attempts": next(iter(by_attempts))}
    return {"$or": [{"_id": {"$in": ids}, "attempts": n} for n, ids in by_attempts.items()]}
