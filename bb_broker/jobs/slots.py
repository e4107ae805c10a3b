"""A queue's concurrency limit: each running job of a limited queue holds one of its slots 0..limit-1 (`limitSlot`,
set in the claim's own write, unset by whatever ends the attempt), and the unique index bb_limit_slot refuses a slot
another running job holds (see ConcurrencySlots.claim_in_a_slot)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from pymongo.collection import Collection as MongoCollection
from pymongo.errors import DuplicateKeyError

from bb_broker import metrics
from bb_broker.jobs.document import Claimed, attempts_fence, in_slot, in_slots
from bb_broker.jobs.indexes import Hint, first_due, hinted
from bb_broker.jobs.lifecycle import QUEUED, RUNNING
from bb_broker.jobs.queues import MAX_SLOT_LOOKS, SLOT_WAITERS_FIELD, LimitReached
from bb_broker.jobs.serial import SERIAL_INDEX_NAME, busy_key, is_serial_key
from bb_broker.server import unique_refusals


class ConcurrencySlots:
    """The concurrency slots of the limited queues of one `jobs` collection."""

    def __init__(self, jobs: MongoCollection, hint: Hint) -> None:
        self.jobs = jobs
        self._hint = hint

    def claim_in_a_slot(
        self,
        queue: str,
        due: dict[str, Any],
        take: dict[str, Any],
        limit: int,
        claim: Callable[[dict[str, Any]], Claimed | None],
    ) -> Claimed | None:
        """The claim of a queue limited to `limit` jobs running at once: `claim` makes it with the update it is given,
        `take` with one of the queue's slots 0..limit-1 set, and the unique index bb_limit_slot refuses a slot another
        running job holds. A first guess costs nothing more than the claim; only a refused one reads the slots taken
        (one read through that index), then tries the free ones, and with none free flags their holders
        (_wait_for_slot). Every write that ends the attempt unsets the slot, the stale sweep's too, so a dead worker's
        slot comes back with its job. Slots at `limit` and above (a limit lowered) are never taken again: their jobs
        drain."""
        for _ in range(MAX_SLOT_LOOKS):
            taken: set[int] = set()
            looked = False
            while free := [slot for slot in range(limit) if slot not in taken]:
                slot = random.choice(free)  # workers guessing at once spread over the slots
                try:
                    return claim(in_slot(take, slot, limit))
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

    def take_in_slots(self, head: list[dict[str, Any]], taken: dict[str, Any], limit: int) -> Callable[[], int]:
        """The write that takes the jobs of `head` in a queue limited to `limit` running at once, each in a slot of its
        own, guessed at random as a single claim's first guess is (claim_in_a_slot): one updateMany, as in a queue
        without a limit, how many it took. bb_limit_slot refuses a slot another running job holds, and that stops the
        updateMany there (the jobs it took before stay taken): 0, and the caller reads which jobs are its own."""
        slots = dict(zip((doc["_id"] for doc in head), random.sample(range(limit), len(head)), strict=True))
        fenced = {"_id": {"$in": list(slots)}, "status": QUEUED, **attempts_fence(head)}
        pipeline = in_slots(taken, slots, limit)

        def take() -> int:
            try:
                with unique_refusals(self.jobs.database):
                    return self.jobs.update_many(fenced, pipeline, **self._hint("_id_", "update")).modified_count
            except DuplicateKeyError as exc:
                pattern = (exc.details or {}).get("keyPattern")
                if pattern is not None and "limitSlot" not in pattern:
                    raise  # not a slot: no claim's write should meet another unique index
                return 0

        return take

    def _refused_by_serial_key(self, exc: DuplicateKeyError, due: dict[str, Any]) -> bool:
        """Whether a slot claim's refusal was the serial key's index, not the slot's: as the server says, or, where it
        names no index, by a read: the head's key is held by a running job."""
        ours = busy_key(exc)[0]
        if ours is not None:
            return ours
        head = first_due(self.jobs, due, {"serialKey": 1}, self._hint)
        key = None if head is None else head.get("serialKey")
        holder = {"serialKey": key, "status": RUNNING}
        return (
            is_serial_key(key)
            and self.jobs.find_one(holder, {"_id": 1}, **self._hint(SERIAL_INDEX_NAME, "find")) is not None
        )

    def _wait_for_slot(self, queue: str, limit: int) -> bool:
        """Flag the jobs holding `queue`'s slots below `limit` (SLOT_WAITERS_FIELD, each once), so that the first of
        them to end wakes the claimers held back; False when fewer hold them than the limit once they are flagged: a
        slot was freed before its holder was flagged, and nothing would report it, so the claim looks again."""
        holders = {"queue": queue, "limitSlot": {"$exists": True, "$lt": limit}}
        hinted(
            self.jobs,
            lambda: self.jobs.update_many(
                {**holders, SLOT_WAITERS_FIELD: {"$exists": False}},
                {"$set": {SLOT_WAITERS_FIELD: True}},
                **self._hint("bb_limit_slot", "update"),
            ),
        )
        counted = hinted(
            self.jobs, lambda: self.jobs.count_documents(holders, **self._hint("bb_limit_slot", "aggregate"))
        )
        return counted >= limit

    def _slots_taken(self, queue: str) -> set[int]:
        """The concurrency slots of `queue` its running jobs hold (read through bb_limit_slot).

        Only a running job holds a slot: every write that takes a job out of `running` unsets its slot in the same
        write. A slot on a job in another status is a hand edit (a job marked failed in a shell, a document written
        with one), which the index would refuse to every claim for good while no sweep looks at such a job: it is
        unset here, fenced on that job not running, and the slot is free."""
        holders = hinted(
            self.jobs,
            lambda: list(
                self.jobs.find(
                    {"queue": queue, "limitSlot": {"$exists": True}},
                    {"limitSlot": 1, "status": 1},
                    **self._hint("bb_limit_slot", "find"),
                )
            ),
        )
        if strays := [doc["_id"] for doc in holders if doc.get("status") != RUNNING]:
            self.jobs.update_many(
                {"_id": {"$in": strays}, "status": {"$ne": RUNNING}},
                {"$unset": {"limitSlot": "", SLOT_WAITERS_FIELD: ""}},
                **self._hint("_id_", "update"),
            )
        return {
            doc["limitSlot"] for doc in holders if type(doc.get("limitSlot")) is int and doc.get("status") == RUNNING
        }
