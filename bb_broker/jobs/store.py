"""The hot path's queries on `jobs`: publish, claim, heartbeat and settle, each write on a held job fenced on it.

The job document itself is in document.py, the sweeps and counts JobStore inherits in sweeps.py, the indexes and
retention in admin.py.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Hashable, Iterable
from datetime import UTC, datetime
from typing import Any

from pymongo import ReturnDocument
from pymongo.collection import Collection as MongoCollection
from pymongo.database import Database
from pymongo.errors import (
    ConnectionFailure,
    DocumentTooLarge,
    DuplicateKeyError,
    OperationFailure,
)

from bb_broker import metrics
from bb_broker.connection import scrub
from bb_broker.forks import reset_in_child
from bb_broker.jobs import admin, lifecycle
from bb_broker.jobs.admin import CLAIM_ORDER, INDEXES
from bb_broker.jobs.batched import queued_job
from bb_broker.jobs.document import (
    CLAIMED_FIELDS,
    DOES_NOT_FIT,
    HISTORY_LIMIT,
    HOLDS_RELEASED,
    MAX_DOCUMENT_BYTES,
    RETRY_STATE,
    UNCOUNTABLE_ATTEMPTS,
    Claimed,
    JobTooLarge,
    SettleUnwritable,
    attempt_entry,
    attempts_fence,
    bad_serial_key,
    claim_query,
    claimed,
    due_query,
    has_entry_of_current_attempt,
    in_slot,
    in_slots,
    malformed,
    new_job_id,
    pushed,
    storable_text,
    unwritable_cause,
)
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, SUCCEEDED, Outcome, Policy
from bb_broker.jobs.outages import Refusals, is_transient, through_outages, through_refusals
from bb_broker.jobs.queues import (
    MAX_SLOT_LOOKS,
    SLOT_WAITERS_FIELD,
    LimitReached,
    QueueLimits,
    Rate,
    RateStart,
    moment_us,
)
from bb_broker.jobs.rate_keys import RateHolds, counted_key
from bb_broker.jobs.serial import SERIAL_INDEX_NAME, WAITERS_FIELD, busy_key, is_serial_key
from bb_broker.jobs.settles import GroupCommit, Settle, SettleRelay, SettleWriter
from bb_broker.jobs.sweeps import Sweeps
from bb_broker.jobs.unique import RELEASED_AT_END, RELEASED_BY_CANCEL, DuplicateJob, Hold, shown
from bb_broker.server import (
    Capabilities,
    before_server_time,
    capabilities,
    is_missing_hinted_index,
    is_unapplicable_update,
    unique_refusals,
)

logger = logging.getLogger(__name__)

#: The counters of the rate-limited queues' starts, one document per queue and rate (see JobStore._take_start).
RATES_COLLECTION = "bb_rates"
#: How far a rate counter's next start may be ahead of a claimer's clock beyond one spacing before it is taken for a
#: hand edit (or a clock far ahead) and replaced: the workers read the server's time (ServerClock) within milliseconds.
MAX_RATE_CLOCK_SKEW_US = 60_000_000
#: The tries one claim makes at a counter that changes under it before it waits a spacing.
MAX_RATE_TRIES = 3

#: The most busy serial keys one claim skips before it gives up for now (each skip costs a round trip or two).
MAX_KEY_SKIPS = 16

#: The most hand-edited jobs one claim fails on its way before it gives up for now (each costs a round trip or two).
MAX_MALFORMED_SKIPS = 16

#: The error of a job whose settle would make its document exceed MongoDB's limit (each settle's own replacement).
#: What the store's own failure of a settle that can never be written names (Settle.subject), and that failure for
#: a settle too large.
JOB_SETTLE = "the job's settle"
TOO_LARGE_TO_SETTLE = f"{JOB_SETTLE} {DOES_NOT_FIT}"

#: One claim at a time per process: then a job's owner and attempts say whose claim it is (see claim_many).
_claiming = threading.Lock()


@reset_in_child
def _forget_parent_claim() -> None:
    # A parent's claim in flight at the fork is not the child's: its lock would never be released there.
    global _claiming
    _claiming = threading.Lock()


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
        """Create the indexes and set the retention of succeeded jobs (see admin.ensure_indexes)."""
        self.retention_sweep = admin.ensure_indexes(self.coll, retention=retention)
        admin.ensure_rate_expiry(self.coll.database[RATES_COLLECTION])

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
        unique: Hold | None = None,
        schedule: str | None = None,
        serial_key: str | None = None,
        rate_key: str | None = None,
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
        `rate_key` (see bb_broker.jobs.rate_keys): whose starts a queue's rate per key counts it among."""
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
        until: datetime | None = None,
    ) -> Claimed | None:
        """Atomically move the next due job of `queue` to running, held by `owner`, within the queue's `limits`
        (LimitReached when they let no job start now).

        A job whose serial key another running job holds is skipped (see serial.py): its key is added to `busy_keys`,
        which the caller keeps and passes again (the jobs of those keys are not tried) until one of them is freed.
        Likewise, under a rate per key, a job whose key's next start is ahead is skipped: its key is added to
        `rate_holds` (see rate_keys.py), which the caller keeps for the queue's rate and passes again.

        With `until`, the claim's write takes nothing once the server's clock has passed it (server.before_server_time:
        the deadline of what the caller knows of the queue's controls, see CONTROL_SETTLE): None, as for no job."""
        fence = {} if until is None else before_server_time(until)
        busy = set() if busy_keys is None else busy_keys
        rate = None if limits is None else limits.rate
        holds = None
        if rate is not None and rate.per_key:
            holds = rate_holds if rate_holds is not None and rate_holds.rate == rate else RateHolds(rate)
        learnt = False  # a held rate key found by this claim: the claims after it leave it out
        for _ in range(MAX_KEY_SKIPS):
            now = self.now()
            due, take = claim_query(queue, owner, now)
            if busy:
                due["serialKey"] = {"$nin": sorted(busy)}
            start = None
            if rate is not None:
                take["$set"]["claimLimits"] = {"rate": str(rate)}
                if holds is None:
                    start = self._take_start(queue, rate, now)
                else:
                    head = self._rate_head(due, holds, now)
                    if head is None:
                        self._raise_if_held(queue, holds, now)
                        return None
                    due["_id"] = head["_id"]  # the job whose key's start is taken, and no other
                    rate_key = counted_key(head.get("rateKey"))
                    try:
                        start = self._take_start(queue, rate, now, rate_key)
                    except LimitReached as exc:
                        holds.until[rate_key] = moment_us(now) + round((exc.retry_in or 0.0) * 1_000_000)
                        learnt = True
                        continue
            try:
                if limits is not None and limits.concurrency is not None:
                    job = self._claim_in_a_slot(queue, due, take, limits.concurrency, fence)
                else:
                    job = self._claim_one(due, take, fence)
            except DuplicateKeyError as exc:
                self._give_start_back(start)
                self._skip_busy_key(exc, due, busy)
                continue
            except BaseException:
                self._give_start_back(start)
                raise
            if job is None:
                self._give_start_back(start)  # nothing started: the start is not spent
                if holds is not None:
                    continue  # its key's head was taken meanwhile: the next job, whoever's key it is
            elif holds is not None and start is not None:
                holds.until[counted_key(start.key["key"])] = start.next  # the next claim goes on to the other keys
            return job
        if holds is not None:
            self._raise_if_held(queue, holds, self.now(), learnt=learnt)
        return None

    def _skip_busy_key(self, exc: DuplicateKeyError, due: dict[str, Any], busy: set[str]) -> None:
        """A claim refused by the serial key index: the key goes into `busy` while its running job is flagged (see
        serial.py); any other refusal is raised."""
        ours, key = busy_key(exc)
        if ours is False:
            raise exc
        # Unnamed (ours is None): the serial key's is the one unique index a claim outside a slot can meet.
        if not is_serial_key(key):  # a server that does not name the key: the head of the queue is the refused job
            key = self._head_key(due)
        if not is_serial_key(key):
            # A hand-edited key (null, a number, too long) no claim can leave out by name: left queued, its job would
            # be refused at the head of every claim and hold back the queue behind it. It fails, as its claim would.
            self._fail_unclaimable(due, bad_serial_key(key), {"serialKey": {"$exists": True, "$eq": key}})
        elif self._wait_for_key(key):
            busy.add(key)
        metrics.record_held_back("serial key")

    def _rate_head(self, due: dict[str, Any], holds: RateHolds, now: datetime) -> dict[str, Any] | None:
        """The next due job (its _id and rateKey) whose rate key is not held, under a rate per key."""
        held = holds.due(moment_us(now))
        if held is not None:
            due = {**due, "rateKey": held}
        return self._hinted(lambda: self.coll.find_one(due, {"rateKey": 1}, sort=CLAIM_ORDER, **self._hint("bb_claim")))

    def _raise_if_held(self, queue: str, holds: RateHolds, now: datetime, *, learnt: bool = False) -> None:
        """No job whose rate key is free was found: LimitReached until the first held key's next start, if a key is
        held; at once when this claim `learnt` held keys (more than one claim skips), so that the next claim leaves
        them out and finds the keys behind them."""
        retry_in = 0.0 if learnt else holds.retry_in(moment_us(now))
        if retry_in is not None:
            raise LimitReached(queue, f"rate limit {holds.rate}", retry_in=max(retry_in, 0.0))

    def _take_start(self, queue: str, rate: Rate, now: datetime, rate_key: str | None = None) -> RateStart:
        """Take one start of `queue` at `now` within its `rate` (see RateStart); LimitReached, with the seconds until
        the next start, when the last one was less than the rate's spacing ago.

        One counter document per queue and rate in RATES_COLLECTION holds `next`, the earliest moment (in
        microseconds) the next start may be. The start is taken by moving `next` one spacing past now, only where it
        is not ahead of now: when it is, the filter matches nothing and the upsert's insert collides with the counter's
        _id, so of two workers at once only one moves it. Under a rate per key, `rate_key`'s own counter.

        A rate key's counter expires once its next start has come (`expireAt`, the TTL index admin.RATE_EXPIRY): one
        that is gone lets a start through as it would have, and the counters of keys no longer seen do not pile up."""
        counters = self.coll.database[RATES_COLLECTION]
        start = RateStart.at(queue, rate, now, rate_key)
        for _ in range(MAX_RATE_TRIES):
            try:
                # A key's counter expires (one per key the rate meets); a queue's is the queue's for good.
                expiry = {"expireAt": start.expires_at} if rate.per_key else {}
                taken = self._write(
                    counters.update_one,
                    {"_id": start.key, "next": {"$lte": start.taken_at}},
                    {"$set": {"next": start.next, **expiry}},
                    upsert=True,
                )
            except DuplicateKeyError:
                retry_in = self._rate_wait(counters, start, rate)
                if retry_in is None:
                    continue  # the counter changed under us, or was replaced: take it again
                metrics.record_held_back("rate")
                raise LimitReached(queue, f"rate limit {rate}", retry_in=retry_in) from None
            if taken.upserted_id is not None and not rate.per_key:
                # A new rate for the queue: its earlier rates' counters are of no use. (A rate per key makes a
                # counter for each new key: the old ones expire.)
                counters.delete_many({"_id.queue": queue, "_id": {"$ne": start.key}})
            return start
        metrics.record_held_back("rate")
        # A counter that changed under every try (many claimers at once): soon again, not a whole spacing later.
        raise LimitReached(queue, f"rate limit {rate}", retry_in=min(rate.spacing_us / 1_000_000, 1.0))

    def _rate_wait(self, counters: MongoCollection, start: RateStart, rate: Rate) -> float | None:
        """The seconds until the refused `start`'s counter lets the next one through; None to take it again: the
        counter let it through meanwhile, or held a `next` no claim writes (not a whole number, or further ahead than
        one spacing and MAX_RATE_CLOCK_SKEW_US: edited by hand, or written by a clock far ahead), which is logged and
        replaced, so that a bad counter never stops a queue."""
        counter = counters.find_one({"_id": start.key})
        if counter is None:
            return None
        next_at = counter.get("next")
        if isinstance(next_at, int) and not isinstance(next_at, bool):
            if next_at <= start.taken_at:
                return None
            if next_at - start.taken_at <= rate.spacing_us + MAX_RATE_CLOCK_SKEW_US:
                return (next_at - start.taken_at) / 1_000_000
        logger.warning("queue %s: its rate counter's next start %r is not one a claim writes: replaced", start.queue,
                       shown(next_at))  # fmt: skip
        counters.update_one({"_id": start.key, "next": next_at}, {"$set": {"next": start.taken_at}})
        return None

    def _give_start_back(self, start: RateStart | None) -> None:
        """Undo a start no job took, unless another claim has taken the next one since."""
        if start is not None:
            self.coll.database[RATES_COLLECTION].update_one(
                {"_id": start.key, "next": start.next}, {"$set": {"next": start.taken_at}}
            )

    def _head_key(self, due: dict[str, Any]) -> Any:
        head = self._hinted(
            lambda: self.coll.find_one(due, {"serialKey": 1}, sort=CLAIM_ORDER, **self._hint("bb_claim"))
        )
        return None if head is None else head.get("serialKey")

    def _wait_for_key(self, key: str) -> bool:
        """Flag the running job of `key` so that its end wakes the claimers; False when it ended meanwhile (then the
        key is free: claim again)."""
        flagged = self.coll.update_one(
            {"serialKey": key, "status": RUNNING},
            {"$set": {WAITERS_FIELD: True}},
            **self._hint(SERIAL_INDEX_NAME, "update"),
        )
        return flagged.matched_count == 1

    def _claim_one(self, due: dict[str, Any], take: dict[str, Any], fence: dict[str, Any]) -> Claimed | None:
        # A hand-edited job failed on the way is not the end of the queue: the job behind it is claimed in its place
        # (given up as empty, the queue would wait for its next wake-up with jobs in it).
        for _ in range(MAX_MALFORMED_SKIPS):
            try:
                with _claiming:
                    doc = self._hinted(
                        lambda: self.coll.find_one_and_update(
                            {**due, **fence},
                            take,
                            CLAIMED_FIELDS,
                            sort=CLAIM_ORDER,
                            # A claim of one job by its _id (a rate per key's) must not walk the queue when it is gone.
                            **self._hint("_id_" if "_id" in due else "bb_claim", "findAndModify"),
                            return_document=ReturnDocument.AFTER,
                        )
                    )
            except (ConnectionFailure, OperationFailure) as exc:
                if is_transient(exc):
                    doc = self._landed_unseen(take)
                    if doc is None:
                        raise  # nothing claimed: the outage goes on to the caller
                    return None if self._failed_malformed(doc, doc["attempts"]) else claimed(doc, doc["attempts"])
                if not is_unapplicable_update(exc):
                    raise
                # A hand-edited document the update cannot apply to must not block the queue behind it.
                if not self._fail_unclaimable(due, lifecycle.describe_error(exc)):
                    return None
                continue
            if doc is None:
                return None
            if not self._failed_malformed(doc, doc["attempts"]):
                return claimed(doc, doc["attempts"])
        return None

    def _landed_unseen(self, take: dict[str, Any]) -> dict[str, Any] | None:
        """The job a claim of one job took if its write landed and its answer was lost (a failover interrupted it,
        pymongo's one retry met no primary either), read once the server answers: else it stayed `running` in this
        worker's name, held by nobody, until the stale sweep took it back with an attempt spent. The claim's own
        owner and moment (`take`) name it: no other write of this process sets both at once."""
        mine = {"status": RUNNING, **{name: take["$set"][name] for name in ("leaseOwner", "updatedAt", "startedAt")}}
        return self._through_outages(lambda: self.coll.find_one(mine, CLAIMED_FIELDS))

    def _claim_in_a_slot(
        self, queue: str, due: dict[str, Any], take: dict[str, Any], limit: int, fence: dict[str, Any]
    ) -> Claimed | None:
        """The claim of a queue limited to `limit` jobs running at once: the job takes one of the queue's slots
        0..limit-1 in the claim's own write, and the unique index bb_limit_slot refuses a slot another running job
        holds. A first guess costs nothing more than the claim; only a refused one reads the slots taken (one read
        through that index), then tries the free ones, and with none free flags their holders (_wait_for_slot). Every
        write that ends the attempt unsets the slot, the stale sweep's too, so a dead worker's slot comes back with its
        job. Slots at `limit` and above (a limit lowered) are never taken again: their jobs drain."""
        for _ in range(MAX_SLOT_LOOKS):
            taken: set[int] = set()
            looked = False
            while free := [slot for slot in range(limit) if slot not in taken]:
                slot = random.choice(free)  # workers guessing at once spread over the slots
                try:
                    return self._claim_one(due, in_slot(take, slot, limit), fence)
                except DuplicateKeyError as exc:
                    if self._refused_by_serial_key(exc, due):
                        raise  # the job's serial key, not its slot: the caller skips the key
                    if looked:
                        taken.add(slot)  # taken since the read
                    else:
                        taken, looked = self._slots_taken(queue), True
            if self._wait_for_slot(queue, limit):
                break
        metrics.record_held_back("concurrency")
        raise LimitReached(queue, f"concurrency limit {limit}")

    def _refused_by_serial_key(self, exc: DuplicateKeyError, due: dict[str, Any]) -> bool:
        """Whether a slot claim's refusal was the serial key's index, not the slot's: as the server says, or, where it
        names no index, by a read: the head's key is held by a running job."""
        ours = busy_key(exc)[0]
        if ours is not None:
            return ours
        key = self._head_key(due)
        holder = {"serialKey": key, "status": RUNNING}
        return (
            is_serial_key(key) and self.coll.find_one(holder, {"_id": 1}, **self._hint(SERIAL_INDEX_NAME)) is not None
        )

    def _wait_for_slot(self, queue: str, limit: int) -> bool:
        """Flag the jobs holding `queue`'s slots below `limit` (SLOT_WAITERS_FIELD, each once), so that the first of
        them to end wakes the claimers held back; False when fewer hold them than the limit once they are flagged: a
        slot was freed before its holder was flagged, and nothing would report it, so the claim looks again."""
        holders = {"queue": queue, "limitSlot": {"$exists": True, "$lt": limit}}
        self._hinted(
            lambda: self.coll.update_many(
                {**holders, SLOT_WAITERS_FIELD: {"$exists": False}},
                {"$set": {SLOT_WAITERS_FIELD: True}},
                **self._hint("bb_limit_slot", "update"),
            )
        )
        return (
            self._hinted(lambda: self.coll.count_documents(holders, **self._hint("bb_limit_slot", "aggregate")))
            >= limit
        )

    def _slots_taken(self, queue: str) -> set[int]:
        """The concurrency slots of `queue` its running jobs hold (read through bb_limit_slot)."""
        holders = self._hinted(
            lambda: list(
                self.coll.find(
                    {"queue": queue, "limitSlot": {"$exists": True}},
                    {"_id": 0, "limitSlot": 1},
                    **self._hint("bb_limit_slot"),
                )
            )
        )
        return {doc["limitSlot"] for doc in holders if type(doc.get("limitSlot")) is int}

    def any_due(self, queues: Iterable[str]) -> bool:
        """Whether a job of any of `queues` is due: a safety poll's one read for them all (the claim's index, and
        the first due job found ends it)."""
        due = due_query({"$in": list(queues)}, self.now())
        return self._hinted(lambda: self.coll.find_one(due, {"_id": 1}, **self._hint("bb_claim"))) is not None

    def claim_many(
        self,
        queue: str,
        owner: str,
        limit: int,
        limits: QueueLimits | None = None,
        busy_keys: set[str] | None = None,
        rate_holds: RateHolds | None = None,
        until: datetime | None = None,
    ) -> list[Claimed]:
        """Move up to `limit` due jobs of `queue` to running: one round trip for one job, two for a batch, also in a
        queue with a concurrency limit (each job in a slot of its own: _take_in_slots). A queue with a rate, or with
        serial keys at its head, claims one job per round trip (each takes its own start or key). LimitReached once
        the limits are met, with the jobs taken before; `busy_keys` as for claim.

        The head of the queue is read, then taken with one write fenced on each job's status and attempts: a job
        another worker took in between is not taken again, and the write is safe to repeat. Only when it was not
        all ours, or its outcome is unknown, does a third read say which jobs are. `until` fences every claim's write
        as claim's does.
        """
        slots = None if limits is None else limits.concurrency
        batch = min(limit, slots or limit)  # a limit below what is asked: no more can start at once
        if (
            busy_keys
            or (limits is not None and limits.rate is not None)
            or batch <= 1
            or (slots and not self.server.update_pipelines)
        ):
            # A rate takes a start per job, and a busy key asks for the jobs around it: one job per round trip; so do
            # a concurrency limit's slots where the server has no update pipelines to spread a batch over them.
            return self._claim_each(queue, owner, limit, limits, busy_keys, rate_holds, until)
        due, taken = claim_query(queue, owner, self.now())
        head = self._hinted(
            lambda: list(self.coll.find(due, CLAIMED_FIELDS, sort=CLAIM_ORDER, limit=batch, **self._hint("bb_claim")))
        )
        if not all(type(doc.get("attempts")) is int and type(doc.get("_id")) is str for doc in head):
            # A hand-edited document (an _id that may not even hash, a document say): the claims of one job deal
            # with it, within the queue's limits, and take the jobs behind it.
            return self._claim_each(queue, owner, limit, limits, busy_keys, until=until)
        if any("serialKey" in doc for doc in head):
            # Two jobs of a key in one updateMany would stop it at the second: jobs with keys are claimed one by one.
            return self._claim_each(queue, owner, limit, limits, busy_keys, until=until)
        if not head:
            return []
        ids = {"$in": [doc["_id"] for doc in head]}  # found through the _id index; the fence checks each one
        mine = {"_id": ids, "status": RUNNING, "leaseOwner": owner, **attempts_fence(head, shift=1)}
        fence = {} if until is None else before_server_time(until)
        take = self._take_in_slots(head, taken, slots, fence) if slots else self._take_all(head, ids, taken, fence)
        asked = len(head)
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
                    for doc in self._through_outages(
                        lambda: list(self.coll.find(mine, {"_id": 1}, **self._hint("_id_")))
                    )
                }
                head = [doc for doc in head if doc["_id"] in won]
        jobs = [
            claimed(doc, doc["attempts"] + 1) for doc in head if not self._failed_malformed(doc, doc["attempts"] + 1)
        ]
        if len(jobs) < len(head) and not slots:
            # Hand-edited jobs failed on the way are not the end of the queue: the claims of one job take their place.
            jobs += self._claim_each(queue, owner, len(head) - len(jobs), limits, busy_keys, until=until)
        elif slots and len(jobs) < limit and (len(head) < asked or batch < limit or len(jobs) < len(head)):
            # A guessed slot was taken, or the limit is below what was asked: the claims of one job go on, and read
            # the free slots, or flag their holders and say the limit is reached, as a claim of one job does.
            try:
                jobs += self._claim_each(queue, owner, limit - len(jobs), limits, busy_keys, until=until)
            except LimitReached as exc:
                raise LimitReached(exc.queue, exc.limit, jobs + exc.claimed, retry_in=exc.retry_in) from None
        return jobs

    def _take_all(
        self, head: list[dict[str, Any]], ids: dict[str, Any], taken: dict[str, Any], fence: dict[str, Any]
    ) -> Callable[[], int]:
        """The write that takes every job of `head` still queued at its attempts: one updateMany, how many it took."""
        return lambda: (
            self.coll.update_many(
                {"_id": ids, "status": QUEUED, **attempts_fence(head), **fence}, taken, **self._hint("_id_", "update")
            ).modified_count
        )

    def _take_in_slots(
        self, head: list[dict[str, Any]], taken: dict[str, Any], limit: int, fence: dict[str, Any]
    ) -> Callable[[], int]:
        """The write that takes the jobs of `head` in a queue limited to `limit` running at once, each in a slot of its
        own, guessed at random as a single claim's first guess is (_claim_in_a_slot): one updateMany, as in a queue
        without a limit, how many it took. bb_limit_slot refuses a slot another running job holds, and that stops the
        updateMany there (the jobs it took before stay taken): 0, and the caller reads which jobs are its own."""
        slots = dict(zip((doc["_id"] for doc in head), random.sample(range(limit), len(head)), strict=True))
        fenced = {"_id": {"$in": list(slots)}, "status": QUEUED, **attempts_fence(head), **fence}
        pipeline = in_slots(taken, slots, limit)

        def take() -> int:
            try:
                return self._write(
                    self.coll.update_many, fenced, pipeline, **self._hint("_id_", "update")
                ).modified_count
            except DuplicateKeyError as exc:
                pattern = (exc.details or {}).get("keyPattern")
                if pattern is not None and "limitSlot" not in pattern:
                    raise  # not a slot: no claim's write should meet another unique index
                return 0

        return take

    def _claim_each(
        self,
        queue: str,
        owner: str,
        wanted: int,
        limits: QueueLimits | None,
        busy_keys: set[str] | None,
        rate_holds: RateHolds | None = None,
        until: datetime | None = None,
    ) -> list[Claimed]:
        jobs: list[Claimed] = []
        busy = set() if busy_keys is None else busy_keys
        while len(jobs) < wanted:
            try:
                job = self.claim(queue, owner, limits, busy, rate_holds, until)
            except LimitReached as exc:
                raise LimitReached(exc.queue, exc.limit, jobs, retry_in=exc.retry_in) from None
            if job is None:
                break
            jobs.append(job)
        return jobs

    def _hinted(self, query: Callable[[], Any]) -> Any:
        """Run a query hinted to our index; if someone dropped the indexes (or the collection), make them again. A
        unique index's refusal comes out as DuplicateKeyError, however this server reports it."""
        try:
            with unique_refusals(self.coll.database):
                return query()
        except OperationFailure as exc:
            if not is_missing_hinted_index(exc):
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
                    "$unset": {**HOLDS_RELEASED, **RELEASED_AT_END},
                },
            )
        )
        metrics.record("failed", result.modified_count)
        return True

    def _fail_unclaimable(self, due: dict[str, Any], reason: str, unclaimable: dict[str, Any] | None = None) -> bool:
        """Fail the job at the head of `due` that no claim can take, as the filter `unclaimable` says (by default:
        its attempts the claim could not count on, not a number or one past counting): whether there was one. Only
        such a job: another claim may have failed the job this one met, and a sound job be at the head now."""
        head = self._hinted(lambda: self.coll.find_one(due, {"_id": 1}, sort=CLAIM_ORDER, **self._hint("bb_claim")))
        if head is None:
            return False
        if unclaimable is None:
            unclaimable = {"attempts": {"$not": {"$gte": 0, "$lt": UNCOUNTABLE_ATTEMPTS}}}
        result = self.coll.update_one(
            {"_id": head["_id"], "status": QUEUED, **unclaimable},
            {
                "$set": {
                    "status": FAILED,
                    "lastError": f"malformed job document: {reason}"[: lifecycle.MAX_ERROR_LENGTH],
                    "updatedAt": self.now(),
                    "finishedAt": self.now(),
                },
                "$unset": RELEASED_AT_END,
            },
        )
        if result.modified_count:
            logger.error("job %s is malformed and cannot be claimed: %s", head["_id"], reason)
            metrics.record("failed", result.modified_count)
        return result.modified_count == 1

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
            True,
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
        if not has_entry_of_current_attempt(doc):
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
        unset = dict(HOLDS_RELEASED)
        if isinstance(previous_start, datetime):
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
