"""The claims: a due job of a queue moved to running, held by its claimer, within the queue's limits (its rate:
rates.py, its concurrency: slots.py), past the busy serial keys and the hand-edited jobs at its head.

`Claims` works on what a `ClaimingStore` offers (JobStore does), never on store.py itself; JobStore's claim,
claim_many and any_due are its.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import cached_property, partial
from typing import Any, Protocol

from bson.errors import InvalidBSON
from pymongo import ReturnDocument
from pymongo.collection import Collection as MongoCollection
from pymongo.errors import ConnectionFailure, DuplicateKeyError, OperationFailure

from bb_broker import metrics
from bb_broker.connection import strict_text
from bb_broker.forks import reset_in_child
from bb_broker.jobs import lifecycle
from bb_broker.jobs.document import (
    CLAIMED_FIELDS,
    HOLDS_RELEASED,
    UNCOUNTABLE_ATTEMPTS,
    Claimed,
    attempts_fence,
    bad_serial_key,
    claim_query,
    claimed,
    due_query,
    malformed,
    not_utf8_fields,
)
from bb_broker.jobs.fair_keys import FairRotation
from bb_broker.jobs.indexes import CLAIM_ORDER, first_due, hinted
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING
from bb_broker.jobs.outages import is_transient, through_outages
from bb_broker.jobs.queues import LimitReached, QueueLimits, moment_us
from bb_broker.jobs.rate_keys import RateHolds, bad_rate_key, counted_key
from bb_broker.jobs.rates import RateCounters
from bb_broker.jobs.serial import SERIAL_INDEX_NAME, WAITERS_FIELD, busy_key, is_serial_key
from bb_broker.jobs.slots import ConcurrencySlots
from bb_broker.jobs.unique import RELEASED_AT_END
from bb_broker.server import Capabilities, is_unapplicable_update

logger = logging.getLogger(__name__)

#: The most busy serial keys one claim skips before it gives up for now (each skip costs a round trip or two).
MAX_KEY_SKIPS = 16

#: The most hand-edited jobs one claim fails on its way before it gives up for now (each costs a round trip or two).
MAX_MALFORMED_SKIPS = 16

#: One claim at a time per process: then a job's owner and attempts say whose claim it is (see claim_many).
_claiming = threading.Lock()


@reset_in_child
def _forget_parent_claim() -> None:
    # A parent's claim in flight at the fork is not the child's: its lock would never be released there.
    global _claiming
    _claiming = threading.Lock()


class ClaimingStore(Protocol):
    """What the claims need of the store that holds them (JobStore)."""

    coll: MongoCollection
    now: Callable[[], datetime]
    #: Seconds a write whose outcome is unknown keeps trying through an outage.
    settle_patience: float
    rates: RateCounters
    slots: ConcurrencySlots
    fairness: FairRotation

    @property
    def server(self) -> Capabilities: ...


class Claims:
    """The claims of one store's `jobs` collection (see the module's docstring)."""

    def __init__(self, store: ClaimingStore) -> None:
        self._store = store

    @cached_property
    def _strict(self) -> MongoCollection:
        """The jobs, their text read as it is or as InvalidBSON: a message read with U+FFFD in it (LENIENT_DECODING)
        would run altered (see _fail_unreadable)."""
        return strict_text(self._store.coll)

    def _hint(self, index: str, command: str = "find") -> dict[str, Any]:
        return self._store.server.hint(index, command)

    def claim(
        self,
        queue: str,
        owner: str,
        limits: QueueLimits | None = None,
        busy_keys: set[str] | None = None,
        rate_holds: RateHolds | None = None,
    ) -> Claimed | None:
        """Atomically move the next due job of `queue` to running, held by `owner`, within the queue's `limits`
        (LimitReached when they let no job start now).

        A job whose serial key another running job holds is skipped (see serial.py): its key is added to `busy_keys`,
        which the caller keeps and passes again (the jobs of those keys are not tried) until one of them is freed.
        Likewise, under a rate per key, a job whose key's next start is ahead is skipped: its key is added to
        `rate_holds` (see rate_keys.py), which the caller keeps for the queue's rate and passes again. A fair queue's
        job is the next in its rotation across the fair keys (see fair_keys.py)."""
        store, rates = self._store, self._store.rates
        busy = set() if busy_keys is None else busy_keys
        rate = None if limits is None else limits.rate
        holds = None
        if rate is not None and rate.per_key:
            holds = rate_holds if rate_holds is not None and rate_holds.rate == rate else RateHolds(rate)
        learnt = False  # a held rate key found by this claim: the claims after it leave it out
        for _ in range(MAX_KEY_SKIPS):
            now = store.now()
            due, take = claim_query(queue, owner, now)
            if busy:
                due["serialKey"] = {"$nin": sorted(busy)}
            start = None
            if rate is not None:
                take["$set"]["claimLimits"] = {"rate": str(rate)}
                if holds is None:
                    start = rates.take_start(queue, rate, now)
                else:
                    head = self._rate_head(due, holds, now)
                    if head is None:
                        rates.raise_if_held(queue, holds, now)
                        return None
                    due["_id"] = head["_id"]  # the job whose key's start is taken, and no other
                    rate_key = counted_key(head.get("rateKey"))
                    try:
                        start = rates.take_start(queue, rate, now, rate_key)
                    except LimitReached as exc:
                        holds.until[rate_key] = moment_us(now) + round((exc.retry_in or 0.0) * 1_000_000)
                        learnt = True
                        continue
            claim_in = self._claim_of(queue, due, fair=limits is not None and limits.fair)
            try:
                if limits is not None and limits.concurrency is not None:
                    job = store.slots.claim_in_a_slot(queue, due, take, limits.concurrency, claim_in)
                else:
                    job = claim_in(take)
            except DuplicateKeyError as exc:
                rates.give_back(start)
                self._skip_busy_key(exc, due, busy)
                continue
            except BaseException:
                rates.give_back(start)
                raise
            if job is None:
                rates.give_back(start)  # nothing started: the start is not spent
                if holds is not None:
                    continue  # its key's head was taken meanwhile: the next job, whoever's key it is
            elif holds is not None and start is not None:
                holds.until[counted_key(start.key["key"])] = start.next  # the next claim goes on to the other keys
            return job
        if holds is not None:
            rates.raise_if_held(queue, holds, store.now(), learnt=learnt)
        return None

    def _rate_head(self, due: dict[str, Any], holds: RateHolds, now: datetime) -> dict[str, Any] | None:
        """The next due job whose rate key is not held (RateCounters.head), past the jobs whose key no claim counts
        (bad_rate_key), failed on the way: a key longer than a publish writes would become its counter's _id and be
        sent in every later claim's filter while it is held, whatever its size."""
        for _ in range(MAX_MALFORMED_SKIPS):
            head = self._store.rates.head(due, holds, now)
            if head is None or (reason := bad_rate_key(head.get("rateKey"))) is None:
                return head
            self._fail_unclaimable({**due, "_id": head["_id"]}, reason, {"rateKey": {"$type": "string"}})
        return None

    def _skip_busy_key(self, exc: DuplicateKeyError, due: dict[str, Any], busy: set[str]) -> None:
        """A claim refused by the serial key index: the key goes into `busy` while its running job is flagged (see
        serial.py); any other refusal is raised."""
        ours, key = busy_key(exc)
        if ours is False:
            raise exc
        # Unnamed (ours is None): the serial key's is the one unique index a claim outside a slot can meet.
        if not is_serial_key(key):  # a server that does not name the key: the head of the queue is the refused job
            head = first_due(self._store.coll, due, {"serialKey": 1}, self._hint)
            key = None if head is None else head.get("serialKey")
        if not is_serial_key(key):
            # A hand-edited key (null, a number, too long) no claim can leave out by name: left queued, its job would
            # be refused at the head of every claim and hold back the queue behind it. It fails, as its claim would.
            self._fail_unclaimable(due, bad_serial_key(key), {"serialKey": {"$exists": True, "$eq": key}})
        elif self._wait_for_key(key):
            busy.add(key)
        metrics.record_held_back("serial key")

    def _wait_for_key(self, key: str) -> bool:
        """Flag the running job of `key` so that its end wakes the claimers; False when it ended meanwhile (then the
        key is free: claim again)."""
        flagged = self._store.coll.update_one(
            {"serialKey": key, "status": RUNNING},
            {"$set": {WAITERS_FIELD: True}},
            **self._hint(SERIAL_INDEX_NAME, "update"),
        )
        return flagged.matched_count == 1

    def _claim_of(self, queue: str, due: dict[str, Any], *, fair: bool) -> Callable[[dict[str, Any]], Claimed | None]:
        """The claim of one job of `due` with a given update (a slot's, see ConcurrencySlots.claim_in_a_slot): in
        CLAIM_ORDER, or in a fair queue the next job of its rotation (fair_keys.FairRotation: one findAndModify per
        turn it tries, as a plain claim's)."""
        if not fair:
            return partial(self._claim_one, due)
        return lambda take: self._store.fairness.claim(
            queue, due, lambda keyed, order: self._claim_one(keyed, take, order=order)
        )

    def _claim_one(
        self,
        due: dict[str, Any],
        take: dict[str, Any],
        order: dict[str, Any] | None = None,
    ) -> Claimed | None:
        """The first job of `due` in CLAIM_ORDER through bb_claim, or in `order` (its sort and hint: a fair claim's)."""
        # A hand-edited job failed on the way is not the end of the queue: the job behind it is claimed in its place
        # (given up as empty, the queue would wait for its next wake-up with jobs in it).
        coll, strict = self._store.coll, self._strict
        if order is None:
            # A claim of one job by its _id (a rate per key's) must not walk the queue when it is gone.
            order = {"sort": CLAIM_ORDER, **self._hint("_id_" if "_id" in due else "bb_claim", "findAndModify")}
        for _ in range(MAX_MALFORMED_SKIPS):
            try:
                with _claiming:
                    doc = hinted(
                        coll,
                        lambda: strict.find_one_and_update(
                            due,
                            take,
                            CLAIMED_FIELDS,
                            **order,
                            return_document=ReturnDocument.AFTER,
                        ),
                    )
            except InvalidBSON as exc:
                self._fail_unreadable(take, exc)  # the write landed: the job is ours, and fails
                continue
            except (ConnectionFailure, OperationFailure) as exc:
                if is_transient(exc):
                    try:
                        doc = self._landed_unseen(take)
                    except InvalidBSON as unreadable:
                        self._fail_unreadable(take, unreadable)
                        continue
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
        return self._through_outages(lambda: self._strict.find_one(_taken_by(take), CLAIMED_FIELDS))

    def _fail_unreadable(self, take: dict[str, Any], exc: InvalidBSON) -> None:
        """Fail the job the claim `take` took whose fields hold text that is not UTF-8 (another program wrote it):
        read with U+FFFD in place of its bad bytes, its message would run altered, or its id find no job. Found by
        the claim's own marks, not by its id, which may be the text in question."""
        coll, mine = self._store.coll, _taken_by(take)
        doc = self._through_outages(lambda: coll.find_one(mine, CLAIMED_FIELDS)) or {}
        fields = ", ".join(not_utf8_fields(doc)) or "a field"
        self._fail_held(doc.get("_id"), mine, f"{fields} holds text that is not UTF-8 ({exc})")

    def any_due(self, queues: Iterable[str]) -> bool:
        """Whether a job of any of `queues` is due: a safety poll's one read for them all (the claim's index, and
        the first due job found ends it)."""
        coll = self._store.coll
        due = due_query({"$in": list(queues)}, self._store.now())
        return hinted(coll, lambda: coll.find_one(due, {"_id": 1}, **self._hint("bb_claim"))) is not None

    def claim_many(
        self,
        queue: str,
        owner: str,
        limit: int,
        limits: QueueLimits | None = None,
        busy_keys: set[str] | None = None,
        rate_holds: RateHolds | None = None,
    ) -> list[Claimed]:
        """Move up to `limit` due jobs of `queue` to running: one round trip for one job, two for a batch, also in a
        queue with a concurrency limit (each job in a slot of its own: ConcurrencySlots.take_in_slots), and in a fair
        queue one read per turn of its rotation among the jobs (FairRotation.heads). A queue with a rate, or with
        serial keys at its head, claims one job per round trip (each takes its own start or key).
        LimitReached once the limits are met, with the jobs taken before; `busy_keys` as for claim.

        The head of the queue is read, then taken with one write fenced on each job's status and attempts: a job
        another worker took in between is not taken again, and the write is safe to repeat. Only when it was not
        all ours, or its outcome is unknown, does a third read say which jobs are.
        """
        store, coll = self._store, self._store.coll
        slots = None if limits is None else limits.concurrency
        batch = min(limit, slots or limit)  # a limit below what is asked: no more can start at once
        if (
            busy_keys
            or (limits is not None and limits.rate is not None)
            or batch <= 1
            or (slots and not store.server.update_pipelines)
        ):
            # A rate takes a start per job, and a busy key asks for the jobs around it: one job per round trip; so do
            # a concurrency limit's slots where the server has no update pipelines to spread a batch over them.
            return self._claim_each(queue, owner, limit, limits, busy_keys, rate_holds)
        due, taken = claim_query(queue, owner, store.now())
        strict = self._strict
        try:
            if limits is not None and limits.fair:
                # The jobs of the next turns of the rotation, a read per turn among them (one while one key alone has
                # due jobs); taken below as any batch is.
                head = store.fairness.heads(queue, due, batch)
            else:
                head = hinted(
                    coll,
                    lambda: list(
                        strict.find(due, CLAIMED_FIELDS, sort=CLAIM_ORDER, limit=batch, **self._hint("bb_claim"))
                    ),
                )
        except InvalidBSON:  # text that is not UTF-8 at the head: the claims of one job fail its job
            return self._claim_each(queue, owner, limit, limits, busy_keys)
        if not all(type(doc.get("attempts")) is int and type(doc.get("_id")) is str for doc in head):
            # A hand-edited document (an _id that may not even hash, a document say): the claims of one job deal
            # with it, within the queue's limits, and take the jobs behind it.
            return self._claim_each(queue, owner, limit, limits, busy_keys)
        if any("serialKey" in doc for doc in head):
            # Two jobs of a key in one updateMany would stop it at the second: jobs with keys are claimed one by one.
            return self._claim_each(queue, owner, limit, limits, busy_keys)
        if not head:
            return []
        ids = {"$in": [doc["_id"] for doc in head]}  # found through the _id index; the fence checks each one
        mine = {"_id": ids, "status": RUNNING, "leaseOwner": owner, **attempts_fence(head, shift=1)}
        take = store.slots.take_in_slots(head, taken, slots) if slots else self._take_all(head, ids, taken)
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
                    for doc in self._through_outages(lambda: list(coll.find(mine, {"_id": 1}, **self._hint("_id_"))))
                }
                head = [doc for doc in head if doc["_id"] in won]
        jobs = [
            claimed(doc, doc["attempts"] + 1) for doc in head if not self._failed_malformed(doc, doc["attempts"] + 1)
        ]
        if len(jobs) < len(head) and not slots:
            # Hand-edited jobs failed on the way are not the end of the queue: the claims of one job take their place.
            jobs += self._claim_each(queue, owner, len(head) - len(jobs), limits, busy_keys)
        elif slots and len(jobs) < limit and (len(head) < asked or batch < limit or len(jobs) < len(head)):
            # A guessed slot was taken, or the limit is below what was asked: the claims of one job go on, and read
            # the free slots, or flag their holders and say the limit is reached, as a claim of one job does.
            try:
                jobs += self._claim_each(queue, owner, limit - len(jobs), limits, busy_keys)
            except LimitReached as exc:
                raise LimitReached(exc.queue, exc.limit, jobs + exc.claimed, retry_in=exc.retry_in) from None
        return jobs

    def _take_all(self, head: list[dict[str, Any]], ids: dict[str, Any], taken: dict[str, Any]) -> Callable[[], int]:
        """The write that takes every job of `head` still queued at its attempts: one updateMany, how many it took."""
        return lambda: (
            self._store.coll.update_many(
                {"_id": ids, "status": QUEUED, **attempts_fence(head)}, taken, **self._hint("_id_", "update")
            ).modified_count
        )

    def _claim_each(
        self,
        queue: str,
        owner: str,
        wanted: int,
        limits: QueueLimits | None,
        busy_keys: set[str] | None,
        rate_holds: RateHolds | None = None,
    ) -> list[Claimed]:
        jobs: list[Claimed] = []
        busy = set() if busy_keys is None else busy_keys
        while len(jobs) < wanted:
            try:
                job = self.claim(queue, owner, limits, busy, rate_holds)
            except LimitReached as exc:
                raise LimitReached(exc.queue, exc.limit, jobs, retry_in=exc.retry_in) from None
            if job is None:
                break
            jobs.append(job)
        return jobs

    def _failed_malformed(self, doc: dict[str, Any], attempts: Any) -> bool:
        """Whether the claimed `doc` (now at `attempts`) is malformed: then it ends failed here, once, naming the
        field, and is never delivered (a job delivered under another id would run, stay running, and run again)."""
        reason = malformed({**doc, "attempts": attempts})
        if reason is None:
            return False
        self._fail_held(doc.get("_id"), {"_id": doc["_id"], "status": RUNNING, "attempts": attempts}, reason)
        return True

    def _fail_held(self, job_id: Any, held: dict[str, Any], reason: str) -> None:
        """Fail the job this claim holds (the filter `held`) that no worker can run, once, naming the cause."""
        logger.error("job %r is malformed and cannot be run: %s", job_id, reason)
        now = self._store.now()
        result = self._through_outages(
            lambda: self._store.coll.update_one(
                held,
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

    def _fail_unclaimable(self, due: dict[str, Any], reason: str, unclaimable: dict[str, Any] | None = None) -> bool:
        """Fail the job at the head of `due` that no claim can take, as the filter `unclaimable` says (by default:
        its attempts the claim could not count on, not a number or one past counting): whether there was one. Only
        such a job: another claim may have failed the job this one met, and a sound job be at the head now."""
        head = first_due(self._store.coll, due, {"_id": 1}, self._hint)
        if head is None:
            return False
        if unclaimable is None:
            unclaimable = {"attempts": {"$not": {"$gte": 0, "$lt": UNCOUNTABLE_ATTEMPTS}}}
        result = self._store.coll.update_one(
            {"_id": head["_id"], "status": QUEUED, **unclaimable},
            {
                "$set": {
                    "status": FAILED,
                    "lastError": f"malformed job document: {reason}"[: lifecycle.MAX_ERROR_LENGTH],
                    "updatedAt": self._store.now(),
                    "finishedAt": self._store.now(),
                },
                "$unset": RELEASED_AT_END,
            },
        )
        if result.modified_count:
            logger.error("job %s is malformed and cannot be claimed: %s", head["_id"], reason)
            metrics.record("failed", result.modified_count)
        return result.modified_count == 1

    def _through_outages(self, write: Callable[[], Any]) -> Any:
        return through_outages(write, patience=self._store.settle_patience)


def _taken_by(take: dict[str, Any]) -> dict[str, Any]:
    """The filter of the job a claim of one job took with `take`: its owner and moment, which no other write of this
    process sets both at once."""
    return {"status": RUNNING, **{name: take["$set"][name] for name in ("leaseOwner", "updatedAt", "startedAt")}}
