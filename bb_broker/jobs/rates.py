"""The starts of the rate-limited queues: one counter per queue and rate (and per key, under a rate per key) in
RATES_COLLECTION, taken by a claim before its write and given back when no job took it (see RateCounters.take_start).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from pymongo.collection import Collection as MongoCollection
from pymongo.errors import DuplicateKeyError

from bb_broker import metrics
from bb_broker.jobs.indexes import Hint, first_due
from bb_broker.jobs.queues import LimitReached, Rate, RateStart, moment_us
from bb_broker.jobs.rate_keys import RateHolds
from bb_broker.jobs.unique import shown
from bb_broker.server import unique_refusals

logger = logging.getLogger(__name__)

#: The counters of the rate-limited queues' starts, one document per queue and rate (see RateCounters.take_start).
RATES_COLLECTION = "bb_rates"
#: How far a rate counter's next start may be ahead of a claimer's clock beyond one spacing before it is taken for a
#: hand edit (or a clock far ahead) and replaced: the workers read the server's time (ServerClock) within milliseconds.
MAX_RATE_CLOCK_SKEW_US = 60_000_000
#: The tries one claim makes at a counter that changes under it before it waits a spacing.
MAX_RATE_TRIES = 3


class RateCounters:
    """The rate counters of the queues of one `jobs` collection (RATES_COLLECTION, in the same database)."""

    def __init__(self, jobs: MongoCollection, hint: Hint) -> None:
        self.jobs = jobs
        self.counters: MongoCollection = jobs.database[RATES_COLLECTION]
        self._hint = hint

    def head(self, due: dict[str, Any], holds: RateHolds, now: datetime) -> dict[str, Any] | None:
        """The next due job (its _id and rateKey) whose rate key is not held, under a rate per key."""
        held = holds.due(moment_us(now))
        if held is not None:
            due = {**due, "rateKey": held}
        return first_due(self.jobs, due, {"rateKey": 1}, self._hint)

    def raise_if_held(self, queue: str, holds: RateHolds, now: datetime, *, learnt: bool = False) -> None:
        """No job whose rate key is free was found: LimitReached until the first held key's next start, if a key is
        held; at once when this claim `learnt` held keys (more than one claim skips), so that the next claim leaves
        them out and finds the keys behind them."""
        retry_in = 0.0 if learnt else holds.retry_in(moment_us(now))
        if retry_in is not None:
            raise LimitReached(queue, f"rate limit {holds.rate}", retry_in=max(retry_in, 0.0))

    def take_start(self, queue: str, rate: Rate, now: datetime, rate_key: str | None = None) -> RateStart:
        """Take one start of `queue` at `now` within its `rate` (see RateStart); LimitReached, with the seconds until
        the next start, when the last one was less than the rate's spacing ago.

        One counter document per queue and rate in RATES_COLLECTION holds `next`, the earliest moment (in
        microseconds) the next start may be. The start is taken by moving `next` one spacing past now, only where it
        is not ahead of now: when it is, the filter matches nothing and the upsert's insert collides with the counter's
        _id, so of two workers at once only one moves it. Under a rate per key, `rate_key`'s own counter.

        A rate key's counter expires once its next start has come (`expireAt`, the TTL index indexes.RATE_EXPIRY): one
        that is gone lets a start through as it would have, and the counters of keys no longer seen do not pile up."""
        counters = self.counters
        start = RateStart.at(queue, rate, now, rate_key)
        for _ in range(MAX_RATE_TRIES):
            try:
                # A key's counter expires (one per key the rate meets); a queue's is the queue's for good.
                expiry = {"expireAt": start.expires_at} if rate.per_key else {}
                with unique_refusals(counters.database):
                    taken = counters.update_one(
                        {"_id": start.key, "next": {"$lte": start.taken_at}},
                        {"$set": {"next": start.next, **expiry}},
                        upsert=True,
                    )
            except DuplicateKeyError:
                retry_in = self._wait(start, rate)
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

    def _wait(self, start: RateStart, rate: Rate) -> float | None:
        """The seconds until the refused `start`'s counter lets the next one through; None to take it again: the
        counter let it through meanwhile, or held a `next` no claim writes (not a whole number, or further ahead than
        one spacing and MAX_RATE_CLOCK_SKEW_US: edited by hand, or written by a clock far ahead), which is logged and
        replaced, so that a bad counter never stops a queue."""
        counter = self.counters.find_one({"_id": start.key})
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
        self.counters.update_one({"_id": start.key, "next": next_at}, {"$set": {"next": start.taken_at}})
        return None

    def give_back(self, start: RateStart | None) -> None:
        """Undo a start no job took, unless another claim has taken the next one since."""
        if start is not None:
            self.counters.update_one({"_id": start.key, "next": start.next}, {"$set": {"next": start.taken_at}})
