"""The hot path's queries on `jobs`: publish, claim, heartbeat and settle, each write on a held job fenced on it.

The job document itself is in document.py, the sweeps and counts JobStore inherits in sweeps.py, the claims it
delegates to in claiming.py (with the rate counters of rates.py and the concurrency slots of slots.py), the indexes
and retention in indexes.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterable
from datetime import UTC, datetime
from typing import Any

from bson import DatetimeMS
from pymongo.collection import Collection as MongoCollection
from pymongo.database import Database
from pymongo.errors import DocumentTooLarge, DuplicateKeyError

from bb_broker import metrics
from bb_broker.connection import exact_reads, scrub
from bb_broker.jobs import indexes, lifecycle
from bb_broker.jobs.batched import queued_job
from bb_broker.jobs.claiming import Claims
from bb_broker.jobs.document import (
    DOES_NOT_FIT,
    HISTORY_LIMIT,
    HOLDS_RELEASED,
    MAX_DOCUMENT_BYTES,
    RETRY_STATE,
    Claimed,
    JobTooLarge,
    SettleUnwritable,
    attempt_entry,
    has_entry_of_current_attempt,
    new_job_id,
    of_task,
    pushed,
    storable_text,
    unwritable_cause,
)
from bb_broker.jobs.fair_keys import FairRotation
from bb_broker.jobs.lifecycle import QUEUED, RUNNING, SUCCEEDED, Outcome, Policy
from bb_broker.jobs.outages import Refusals, through_outages, through_refusals
from bb_broker.jobs.queues import QueueLimits
from bb_broker.jobs.rate_keys import RateHolds
from bb_broker.jobs.rates import RateCounters
from bb_broker.jobs.settles import GroupCommit, Settle, SettleRelay, SettleWriter
from bb_broker.jobs.slots import ConcurrencySlots
from bb_broker.jobs.sweeps import Sweeps
from bb_broker.jobs.unique import RELEASED_AT_END, RELEASED_BY_CANCEL, DuplicateJob, Hold
from bb_broker.server import Capabilities, capabilities, unique_refusals

logger = logging.getLogger(__name__)

#: The error of a job whose settle would make its document exceed MongoDB's limit (each settle's own replacement).
#: What the store's own failure of a settle that can never be written names (Settle.subject), and that failure for
#: a settle too large.
JOB_SETTLE = "the job's settle"
TOO_LARGE_TO_SETTLE = f"{JOB_SETTLE} {DOES_NOT_FIT}"


class JobStore(Sweeps):
    """A `jobs` collection as the hot path uses it (its sweeps and counts: Sweeps); every write on a held job is
    fenced on its attempt."""

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
        #: The writer of this process's settle_soon, made at the first (one per process: see GroupCommit.pid).
        self._group_commit: GroupCommit | None = None
        self._group_commit_lock = threading.Lock()
        #: What the deployment offers, once asked (see `server`).
        self._server: Capabilities | None = None
        #: In a prefork worker's pool process, the main process's relay that writes this store's settles (set by
        #: app_stores.store_for, from the worker's start-up); None elsewhere.
        self.settle_relay: SettleRelay | None = None
        #: The server's answers the code does not recognise, met by this store's settles: said once, backed off.
        self._settle_refusals = Refusals("settle", self._secrets)
        #: The rate-limited queues' start counters, the limited queues' concurrency slots, and the claims that take
        #: them (claim, claim_many and any_due are the claims').
        self.rates = RateCounters(self.coll, self._hint)
        self.slots = ConcurrencySlots(self.coll, self._hint)
        self.fairness = FairRotation(self.coll, self._hint, lambda: self.now())
        self._claims = Claims(self)

    @property
    def secrets(self) -> tuple[str, ...]:
        """What a message of this store's must never show (the URL's credentials)."""
        return self._secrets

    @property
    def server(self) -> Capabilities:
        """What the deployment offers (server.py): probed once per process, kept here after the first ask (every claim
        asks it for its hints)."""
        if self._server is None:
            self._server = capabilities(self.coll.database)
        return self._server

    def _hint(self, index: str, command: str = "find") -> dict[str, Any]:
        return self.server.hint(index, command)

    @property
    def key(self) -> Hashable:
        """What names this store's collection in a process's registries (its lease keeper, its releases to make):
        pymongo compares collections by their client's seed list (replica set name and SRV host included), database
        and name, without a server call and for any topology (`client.address` refuses a URL of several mongos
        routers, the sharded deployment docs/scale.md recommends)."""
        return self.coll

    def ensure_indexes(self, *, retention: float | None = None) -> None:
        """Create the indexes and set the retention of succeeded jobs (see indexes.ensure_indexes)."""
        self.retention_sweep = indexes.ensure_indexes(self.coll, retention=retention)
        indexes.ensure_rate_expiry(self.rates.counters)

    def expire_succeeded(self) -> int:
        """Where the server has no TTL index: delete the succeeded jobs past retention (a worker's periodic sweep)."""
        return indexes.expire_succeeded(self.coll, self.retention_sweep, self.now())

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
        unique: Hold | None = None,
        schedule: str | None = None,
        serial_key: str | None = None,
        rate_key: str | None = None,
        fair_key: str | None = None,
        canvas: dict[str, Any] | None = None,
    ) -> str:
        """Insert a queued job; a Celery retry reschedules the job that is running instead.

        `job_id`, when given, makes the insert safe to repeat: a second publish of the same message under the same
        id (a producer retrying a write whose answer it never got) finds the first and writes nothing.
        `retry_of`, the (job id, attempt) a retry comes from, fences the reschedule on that attempt: the retry of an
        attempt whose job was taken over (the stale sweep gave it to another worker) writes nothing.
        `unique` (see bb_broker.jobs.unique): when another job holds its key, DuplicateJob, and nothing written. A
        retry's reschedule leaves the job's key as it is: the key stays taken through retries.
        `schedule`: the periodic entry that sent the job (payloads.SCHEDULE_HEADER), kept in its `schedule` field.
        `serial_key` (see bb_broker.jobs.serial): at most one job with it runs at a time.
        `rate_key` (see bb_broker.jobs.rate_keys): whose starts a queue's rate per key counts it among.
        `fair_key` (see bb_broker.jobs.fair_keys): whose turn a fair queue's rotation claims it in.
        `canvas`: the job's place in its canvas (bb_broker.jobs.canvas.canvas_fields), kept as they are."""
        now = self.now()
        due = run_after or now
        if is_retry:
            held = {"taskId": of_task(task_id)} if retry_of is None else {"_id": retry_of[0], "attempts": retry_of[1]}
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
                    "$unset": HOLDS_RELEASED,
                },
                projection={"_id": 1},
            )
            if updated is not None:
                metrics.record("retried")
                return updated["_id"]
            if retry_of is not None and self.coll.find_one({"_id": retry_of[0]}, {"_id": 1}) is not None:
                logger.warning("job %s: a retry from attempt %d, no longer the job's, was dropped", *retry_of)
                return retry_of[0]
        job = queued_job(
            job_id=job_id or new_job_id(),
            kind=kind,
            task_id=task_id,
            queue=queue,
            priority=priority,
            payload=payload,
            due=due,
            now=now,
            unique=unique,
            schedule=schedule,
            serial_key=serial_key,
            rate_key=rate_key,
            fair_key=fair_key,
            canvas=canvas,
        )
        try:
            self._write(self.coll.insert_one, job)
        except DuplicateKeyError:
            # Read after the refusal, never before: a read first would cost every publish a round trip, and would
            # still race. A holder under our own id is this publish's earlier try, which the lines below find.
            if unique is not None:
                holder = self.coll.find_one({unique.field: unique.key}, {"taskId": 1})
                if holder is not None and holder["_id"] != job["_id"]:
                    metrics.record("refused_duplicate")
                    raise DuplicateJob(unique.key, holder.get("taskId"), holder["_id"]) from None
            first = self.coll.find_one({"_id": job["_id"]}, {"taskId": 1, "queue": 1})
            if first is not None and (first.get("taskId"), first.get("queue")) == (task_id, queue):
                return job["_id"]  # the earlier try landed
            job["_id"] = new_job_id()  # the id came with another task (a reused properties dict): a job of its own
            self._write(self.coll.insert_one, job)
        metrics.record("enqueued")
        return job["_id"]

    def _write(self, operation: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            with unique_refusals(self.coll.database):
                return operation(*args, **kwargs)
        except DocumentTooLarge as exc:
            raise JobTooLarge(
                f"task message does not fit in a MongoDB document (limit {MAX_DOCUMENT_BYTES} bytes): {exc}"
            ) from None

    # --- working -----------------------------------------------------------

    def claim(
        self,
        queue: str,
        owner: str,
        limits: QueueLimits | None = None,
        busy_keys: set[str] | None = None,
        rate_holds: RateHolds | None = None,
    ) -> Claimed | None:
        """Claim the next due job of `queue` for `owner` (see claiming.Claims.claim)."""
        return self._claims.claim(queue, owner, limits, busy_keys, rate_holds)

    def claim_many(
        self,
        queue: str,
        owner: str,
        limit: int,
        limits: QueueLimits | None = None,
        busy_keys: set[str] | None = None,
        rate_holds: RateHolds | None = None,
    ) -> list[Claimed]:
        """Claim up to `limit` due jobs of `queue` for `owner` (see claiming.Claims.claim_many)."""
        return self._claims.claim_many(queue, owner, limit, limits, busy_keys, rate_holds)

    def any_due(self, queues: Iterable[str]) -> bool:
        """Whether a job of any of `queues` is due (see claiming.Claims.any_due)."""
        return self._claims.any_due(queues)

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
        return self.settle(self.success(job_id, attempts, attempt=attempt, result=result))

    def success(
        self,
        job_id: str,
        attempts: int,
        *,
        attempt: dict[str, Any] | None = None,
        result: dict[str, Any] | None = None,
        if_unwritable: Callable[[str], Settle] | None = None,
        subject: str | None = None,
    ) -> Settle:
        """The settle of succeed(), to write now (settle) or with others (settle_soon); `if_unwritable` the settle
        that replaces it when it can never be written, which names it `subject` (see Settle)."""
        now = self.now()
        changes = {**(result or {}), "status": SUCCEEDED, "lastError": "", "updatedAt": now, "finishedAt": now}
        released = {**HOLDS_RELEASED, **RELEASED_AT_END}  # the job's unique key, in the write that ends it
        update = {"$set": changes, "$unset": released, **pushed(attempt)}
        return self._held_settle(job_id, attempts, update, "succeeded", if_unwritable, subject)

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
        revoked: bool = False,
    ) -> Outcome | None:
        """Record a failed attempt: back to the queue (with backoff unless told otherwise), or failed for good.

        Failed for good, the job gives back its unique key (see bb_broker.jobs.unique); `revoked`, even a `period` one.

        `result` (from the result backend) is stored as it is when the job fails for good; when the job goes back to
        the queue its `state` becomes RETRY, so a caller waiting on the result waits for the next attempt.
        """
        outcome, settle = self._failure(
            job_id, attempts, error, retryable, backoff, attempt, result, revoked=revoked, if_unwritable=None
        )
        return outcome if self.settle(settle) else None

    def failure(
        self,
        job_id: str,
        attempts: int,
        error: str,
        *,
        retryable: bool = True,
        backoff: bool = True,
        attempt: dict[str, Any] | None = None,
        result: dict[str, Any] | None = None,
        if_unwritable: Callable[[str], Settle] | None = None,
        subject: str | None = None,
    ) -> Settle:
        """The settle of fail(), to write now (settle) or with others (settle_soon); `if_unwritable` as success's."""
        return self._failure(
            job_id,
            attempts,
            error,
            retryable,
            backoff,
            attempt,
            result,
            if_unwritable=if_unwritable,
            subject=subject,
        )[1]

    def _failure(
        self,
        job_id: str,
        attempts: int,
        error: str,
        retryable: bool,
        backoff: bool,
        attempt: dict[str, Any] | None,
        result: dict[str, Any] | None,
        *,
        revoked: bool = False,
        if_unwritable: Callable[[str], Settle] | None,
        subject: str | None = None,
    ) -> tuple[Outcome, Settle]:
        now = self.now()
        outcome = lifecycle.after_failure(
            self.policy, attempts, self._scrub(error), now, retryable=retryable, backoff=backoff
        )
        changes: dict[str, Any] = {"status": outcome.status, "lastError": outcome.last_error, "updatedAt": now}
        if result is not None:
            changes = {**result, **changes}
            if outcome.status == QUEUED:
                changes["state"] = RETRY_STATE
        released = dict(HOLDS_RELEASED)
        if outcome.status == QUEUED:
            changes["runAfter"] = outcome.run_after  # a retry: the job keeps its unique key
        else:
            changes["finishedAt"] = now
            released |= RELEASED_BY_CANCEL if revoked else RELEASED_AT_END
        update = {"$set": changes, "$unset": released, **pushed(self._scrubbed(attempt))}
        counted: metrics.Event = "retried" if outcome.status == QUEUED else "failed"
        return outcome, self._held_settle(job_id, attempts, update, counted, if_unwritable, subject)

    def _held_settle(
        self,
        job_id: str,
        attempts: int,
        update: dict[str, Any],
        outcome: metrics.Event,
        if_unwritable: Callable[[str], Settle] | None,
        subject: str | None = None,
    ) -> Settle:
        # Fenced on the attempt: a late write from a worker that lost its lease changes nothing.
        fence = {"_id": job_id, "status": RUNNING, "attempts": attempts}
        if if_unwritable is None:  # built only when needed: the job fails for good, holding nothing of the task's
            if_unwritable = lambda cause: self.failure(job_id, attempts, f"{JOB_SETTLE} {cause}", retryable=False)  # noqa: E731
        return Settle(job_id, fence, update, outcome, if_unwritable, subject)

    def settle(self, settle: Settle) -> bool:
        """Write a settle now; True when it landed (its attempt was still the job's)."""
        done = self._settle(settle.job_id, settle.fence["attempts"], settle.update, fence=settle.fence)
        if done:
            metrics.record(settle.outcome)
        return done

    def settle_soon(self, settle: Settle) -> None:
        """Write a settle with the others this process makes meanwhile, in one round trip; in a pool process, with
        those of the worker's other pool processes, by its main process (see jobs/settles.py)."""
        relay = self.settle_relay
        if relay is not None and relay.owner_pid != os.getpid():
            if not relay.send(settle):
                # Too large for a datagram, the socket's buffer full (the main process's writes held up by an
                # outage) or the main process gone: written here and now, before the task's result goes back. Until
                # then the main process holds the task's request, and so keeps the job's lease fresh.
                self.settle_writer().write([settle])
            return
        group = self._group_commit
        if group is None or group.pid != os.getpid():
            with self._group_commit_lock:
                group = self._group_commit
                if group is None or group.pid != os.getpid():  # a parent's writer does not follow a fork
                    group = self._group_commit = GroupCommit(self.settle_writer())
        group.submit(settle)

    def settle_writer(self) -> SettleWriter:
        """A writer of this store's settles (settles.py): through outages and answers the code does not recognise,
        for settle_patience; such an answer is said once per store, whichever of its writers met it."""
        return SettleWriter(self.coll, patience=self.settle_patience, refusals=self._settle_refusals)

    def flush_settles(self, timeout: float | None = None) -> bool:
        """Wait for the settles settle_soon gave this process's own writer; False when `timeout` ran out first. Those
        it sent to the main process's relay are the main process's to flush (settles.flush_all there)."""
        group = self._group_commit
        return group is None or group.flush(timeout)

    def record_failed_attempt(self, job_id: str, attempts: int, error: str, *, attempt: dict[str, Any]) -> bool:
        """Record the failure of the attempt a Celery retry is about to run again, while this worker still holds it.

        The retry's publish then puts the job back in the queue (see publish): written first, the failure is never
        late for an attempt another worker already claimed."""
        changes = {"lastError": self._scrub(error)[: lifecycle.MAX_ERROR_LENGTH], "updatedAt": self.now()}
        held = {"_id": job_id, "status": RUNNING, "attempts": attempts}
        # The job stays `running`, so the fence alone would let this write land twice: made again after its answer
        # was lost (pymongo's own retry's too), it would push a second entry. It pushes only where its entry is not.
        entry = {"n": attempt["n"], "finishedAt": attempt["finishedAt"]}
        update = {"$set": changes, **pushed(self._scrubbed(attempt))}
        if self._settle(job_id, attempts, update, fence={**held, "history": {"$not": {"$elemMatch": entry}}}):
            return True
        # Not written now: written already by a try whose answer was lost, or the attempt is no longer the job's.
        recorded = {**held, "history": {"$elemMatch": entry}}
        return self._through_outages(lambda: self.coll.find_one(recorded, {"_id": 1})) is not None

    def failed_with(self, job_id: str, attempts: int, error: str) -> bool:
        """Whether the job ended `failed` at `attempts` with `error` as fail() stores it: where fail() returned None
        because its write had landed before an answer was lost (the try after it found the fence gone), the job
        is still this caller's failure."""
        last_error = self._scrub(error)[: lifecycle.MAX_ERROR_LENGTH]
        failed = {"_id": job_id, "status": lifecycle.FAILED, "attempts": attempts, "lastError": last_error}
        return self._through_outages(lambda: self.coll.find_one(failed, {"_id": 1})) is not None

    def attempt_recorded(self, job_id: str, attempts: int) -> bool:
        """Whether the held attempt has its history entry already (its broker retry recorded the failure)."""
        doc = self.coll.find_one(
            {"_id": job_id, "status": RUNNING, "attempts": attempts},
            {"attempts": 1, "startedAt": 1, "history": {"$slice": -1}},
        )
        return doc is not None and has_entry_of_current_attempt(doc)

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
        update = {**({"$set": fields} if fields else {}), **pushed(self._scrubbed(attempt))}
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
        self,
        task_id: str,
        owner: str,
        error: str,
        *,
        retryable: bool = True,
        worker: str | None = None,
        outcome: str = "failed",
    ) -> Outcome | None:
        """Fail the running job of a Celery task id that `owner` holds (when only the task id is known); its attempt's
        history entry says `outcome`."""
        running = {"taskId": of_task(task_id), "status": RUNNING, "leaseOwner": owner}
        # Its start copied into the entry as it is (EXACT_DECODING): one before year 1 was written as 0001-01-01.
        exact = exact_reads(self.coll)
        doc = exact.find_one(running, {"attempts": 1, "startedAt": 1, "history": {"$slice": -1}})
        if doc is None:
            return None
        attempt = None
        # A pool process killed between its broker retry's recorded failure and the retry's publish (a hard time
        # limit) left the attempt in the history already: one entry per attempt.
        if not has_entry_of_current_attempt(doc):
            attempt = attempt_entry(
                doc["attempts"],
                worker=worker,
                started_at=doc.get("startedAt"),
                finished_at=self.now(),
                outcome=outcome,
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
        # The previous start written back as it is (EXACT_DECODING): one before year 1 was written as 0001-01-01.
        exact = exact_reads(self.coll)
        doc = self._through_outages(lambda: exact.find_one(held, {"history": {"$slice": -1}}))
        if doc is None:
            return False
        last = (doc.get("history") or [None])[-1]
        previous_start = last.get("startedAt") if isinstance(last, dict) and last.get("n") == attempts - 1 else None
        changes: dict[str, Any] = {"status": QUEUED, "updatedAt": self.now()}
        unset = dict(HOLDS_RELEASED)
        if isinstance(previous_start, datetime | DatetimeMS):
            changes["startedAt"] = previous_start
        else:
            unset["startedAt"] = ""
        update = {"$set": changes, "$inc": {"attempts": -1}, "$unset": unset}
        # An unknown answer is not outlasted here: a release is made on the consuming thread, and one not made
        # loses nothing (the stale sweep takes the job back).
        return self._settle(job_id, attempts, update, fence=held, outlast_refusals=False)

    def _settle(
        self,
        job_id: str,
        attempts: int,
        update: dict[str, Any],
        *,
        fence: dict[str, Any] | None = None,
        outlast_refusals: bool = True,
    ) -> bool:
        # Fenced on the attempt: a late write from a worker that lost its lease changes nothing.
        fenced = fence or {"_id": job_id, "status": RUNNING, "attempts": attempts}
        write = lambda: self.coll.update_one(fenced, update)  # noqa: E731
        try:
            if outlast_refusals:  # dropped, the settle would leave its task to run again (settles.py)
                done = through_refusals(
                    write, patience=self.settle_patience, refusals=self._settle_refusals, key=self.coll.full_name
                )
            else:
                done = self._through_outages(write)
            return done.modified_count == 1
        except Exception as exc:
            cause = unwritable_cause(exc)  # a retry would meet it again: the caller fails the job on it
            if cause is None:
                raise
            raise SettleUnwritable(cause) from None

    def _through_outages(self, write: Callable[[], Any]) -> Any:
        return through_outages(write, patience=self.settle_patience)

    def _scrub(self, text: Any) -> Any:
        """An error's or a traceback's text as a job document keeps it: the broker's secrets masked, a lone surrogate
        written out (storable_text), for BSON could not hold it and the settle carrying it would never land."""
        return storable_text(scrub(text, self._secrets)) if isinstance(text, str) else text
