"""Queue controls, kept in the `bb_queues` collection: an operator pauses a queue, or limits how many of its jobs run
at once, once, and every worker's claims obey it (see docs/guides/flow-control.md for the limits)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import DuplicateKeyError

from bb_broker.jobs.lifecycle import whole_number, yes_or_no
from bb_broker.server import unique_refusals

#: The collection of queue controls: one document per queue that was ever paused or limited, `_id` the queue's name.
QUEUES_COLLECTION = "bb_queues"
#: What a control document's `_id` is to be read as a queue's: a string. Another one (written by hand or by another
#: client) names no queue, and read as one it broke every worker's claim and the listings (unhashable, unsortable).
QUEUE_NAME = {"$type": "string"}

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: Set on the jobs holding a limited queue's slots when a claim found none free; its removal when one of them ends
#: (HOLDS_RELEASED) wakes the claimers held back. Only a limit reached writes it: a limited queue whose jobs never
#: wait for a slot costs no change event per job.
SLOT_WAITERS_FIELD = "slotWaiters"
#: The looks a claim takes at the slots when they are freed faster than it flags their holders.
MAX_SLOT_LOOKS = 3

#: Seconds a pause or a change of limits waits after its write before it answers, and for which a worker's claims
#: trust what it read of its queues' controls: each claim carries the deadline of that read (read time + this, on the
#: server's clock: JobStore.claim's `until`), and a claim that reaches the server after it takes nothing. So a claim
#: that lands after a pause answered was made knowing of the pause, or takes nothing, without one more read per
#: claim; a worker reads the controls again every half of this while it claims (docs/guides/flow-control.md).
CONTROL_SETTLE = 1.0

#: The largest concurrency limit: a claim of a limited queue picks one of its N slots (see JobStore.claim).
MAX_CONCURRENCY = 10_000


class Unchanged:
    """A limit set_limits leaves as it is."""


UNCHANGED = Unchanged()


class LimitError(ValueError):
    """A limit that cannot be set: the message says which and why; nothing was changed."""


def parse_concurrency(value: object) -> int:
    """A concurrency limit as an operator types it (a whole number from 1 to MAX_CONCURRENCY), else LimitError."""
    text = str(value).strip()
    # ASCII digits only: str.isdigit() takes '²', which int() refuses; a sign is refused with the rest.
    if not (text.isascii() and text.isdigit()) or len(text) > 6 or not 1 <= int(text) <= MAX_CONCURRENCY:
        raise LimitError(f"a concurrency limit is a whole number from 1 to {MAX_CONCURRENCY}, not {text!r}")
    return int(text)


def parse_fair(value: object) -> bool:
    """Whether a queue is to be fair, as an operator gives it (a bool, or true/false, 1/0, yes/no, on/off), else
    LimitError."""
    fair = yes_or_no(value)
    if fair is None:
        raise LimitError(f"fair is true or false, not {str(value)[:40]!r}")
    return fair


#: A rate's periods, as an operator writes them, in seconds.
RATE_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: The most starts a rate lets through per period.
MAX_RATE = 1_000_000


#: What follows a rate for one of each rate key (`10/m per key`) rather than one for the whole queue.
PER_KEY = "per key"


@dataclass(frozen=True)
class Rate:
    """At most `starts` job starts per `period` seconds, in any period: starts spaced evenly, `spacing_us` apart, as
    Celery's own `rate_limit` spaces them in one worker (a token bucket that holds one token), but across every worker
    (see JobStore.claim). `per_key`: so many for each rate key (the jobs' `rateKey`, see rate_keys.py; the jobs
    without one count as one more key), rather than for the queue."""

    starts: int
    period: float
    per_key: bool = False

    @property
    def spacing_us(self) -> int:
        """The least time between two starts, in microseconds (rounded up: never more than `starts` per period)."""
        return math.ceil(self.period * 1_000_000 / self.starts)

    def __str__(self) -> str:
        unit = next((name for name, seconds in RATE_PERIODS.items() if seconds == self.period), None)
        text = f"{self.starts}/{unit}" if unit else f"{self.starts} per {self.period:g} s"
        return f"{text} {PER_KEY}" if self.per_key else text


def moment_us(now: datetime) -> int:
    """`now` in microseconds since the epoch, as a rate counter keeps its moments: at the claim's moment as the job's
    `startedAt` keeps it (BSON dates hold milliseconds), so that starts counted from the jobs are spaced as the
    counter spaced them."""
    return (now - EPOCH) // timedelta(milliseconds=1) * 1000


@dataclass(frozen=True)
class RateStart:
    """One start taken from a queue's rate: its counter's _id (`key`), the moment it was taken at and the `next` it
    set, in microseconds since the epoch, to give the start back with (see RateCounters.take_start)."""

    key: dict[str, Any]
    taken_at: int
    next: int

    @property
    def queue(self) -> str:
        return str(self.key["queue"])

    @property
    def expires_at(self) -> datetime:
        """When the counter is of no more use (its next start has come: a counter gone lets a start through as it
        would), for the TTL index on RATES_COLLECTION that removes the counters of keys no longer seen."""
        return EPOCH + timedelta(microseconds=self.next)

    @classmethod
    def at(cls, queue: str, rate: Rate, now: datetime, rate_key: str | None = None) -> RateStart:
        """A start of `queue` at `now`, of the rate key `rate_key`'s own counter when the rate is per key."""
        taken_at = moment_us(now)
        key: dict[str, Any] = {"queue": queue, "starts": rate.starts, "period": rate.period}
        if rate.per_key:
            key["key"] = rate_key
        return cls(key, taken_at, taken_at + rate.spacing_us)


def parse_rate(value: object) -> Rate:
    """A rate as an operator types it, N/s, N/m, N/h or N/d (N a whole number from 1), followed by `per key` for a
    rate of each rate key, else LimitError."""
    text = str(value).strip()
    count, _, unit = text.partition("/")
    count, unit = count.strip(), unit.strip()
    unit, _, per = unit.partition(" ")
    if not (count.isascii() and count.isdigit()) or len(count) > 7 or not 1 <= int(count) <= MAX_RATE:
        raise LimitError(f"a rate is N/s, N/m, N/h or N/d with N a whole number from 1 to {MAX_RATE}, not {text!r}")
    if unit not in RATE_PERIODS:
        raise LimitError(f"a rate's period is s, m, h or d (10/m: ten starts a minute), not {unit!r} in {text!r}")
    if per and " ".join(per.split()) != PER_KEY:
        raise LimitError(f"what follows a rate is '{PER_KEY}' (10/m {PER_KEY}) or nothing, not {per.strip()!r}")
    return Rate(int(count), RATE_PERIODS[unit], per_key=bool(per))


class LimitReached(Exception):
    """A claim took no more jobs of `queue`: its limit (`limit`, as a person reads it) is reached. `claimed`: the
    jobs a batch claim took before it was; `retry_in`: seconds until the limit lets a job start again, when known
    (a rate's next start), else None (a concurrency limit: when a job ends)."""

    def __init__(
        self, queue: str, limit: str, claimed: list[Any] | None = None, *, retry_in: float | None = None
    ) -> None:
        super().__init__(queue, limit)
        self.queue = queue
        self.limit = limit
        self.claimed = claimed or []
        self.retry_in = retry_in

    def __str__(self) -> str:
        return f"queue {self.queue}: {self.limit} reached"


@dataclass(frozen=True)
class QueueLimits:
    """What limits the claims of one queue, as its control document says; None: no such limit."""

    #: At most this many of the queue's jobs `running` at once, across every worker.
    concurrency: int | None = None
    #: At most so many of the queue's jobs started per period, across every worker.
    rate: Rate | None = None
    #: Claims rotate across the jobs' fair keys (fair_keys.py).
    fair: bool = False

    @classmethod
    def of(cls, control: Mapping[str, Any]) -> QueueLimits:
        """The limits of a control document; a value no operation writes (edited by hand) limits nothing."""
        given = control.get("concurrency")
        concurrency = int(given) if whole_number(given) and 1 <= given <= MAX_CONCURRENCY else None
        starts, period = control.get("rateStarts"), control.get("ratePeriod")
        per_key = control.get("ratePerKey", False)
        rate = None
        # A period is one of RATE_PERIODS' (as a float or an int: a server may give back either), never a bool.
        if (
            isinstance(period, (int, float))
            and not isinstance(period, bool)
            and period in RATE_PERIODS.values()
            and whole_number(starts)
            and 1 <= starts <= MAX_RATE
            and type(per_key) is bool
        ):
            rate = Rate(int(starts), float(period), per_key=per_key)
        # A rate per key picks the job whose key's start it takes: fairness is refused beside it (set_limits), and a
        # hand edit that sets both keeps the rate.
        fair = control.get("fair") is True and not (rate is not None and rate.per_key)
        return cls(concurrency=concurrency, rate=rate, fair=fair)

    def __bool__(self) -> bool:
        return self.concurrency is not None or self.rate is not None or self.fair

    def described(self) -> str:
        """The limits as a person reads them ("no limit" for none)."""
        shown = []
        if self.concurrency is not None:
            shown.append(f"at most {self.concurrency} running at once")
        if self.rate is not None:
            shown.append(f"at most {self.rate} started")
        if self.fair:
            shown.append("fair per key")
        return ", ".join(shown) or "no limit"


class QueueControls:
    """Pause and resume queues durably: the state outlives every process, and a worker started later reads it."""

    def __init__(self, db: Database, *, collection: str = QUEUES_COLLECTION, settle: float = CONTROL_SETTLE) -> None:
        self.coll: Collection = db[collection]
        self.settle = settle

    def _settled(self) -> None:
        """Wait out CONTROL_SETTLE after a write that pauses or limits: a claim made knowing the old controls is
        answered meanwhile, or reads the control after it (KnownQueue), so the change holds for every claim that lands
        after the answer."""
        time.sleep(self.settle)

    def pause(self, queue: str, *, by: str, now: datetime) -> bool:
        """Pause `queue`; False when it was paused already (the first pause keeps its author)."""
        try:
            # Upserted when the queue has no document yet; a paused one does not match and its _id collides.
            with unique_refusals(self.coll.database):
                self.coll.update_one(
                    {"_id": queue, "paused": {"$ne": True}},
                    {"$set": {"paused": True, "pausedBy": by, "pausedAt": now}},
                    upsert=True,
                )
        except DuplicateKeyError:
            # Paused already, maybe a moment ago: by this very call, whose first write landed and lost its answer and
            # which pymongo made again, or by another operator's call still settling. Answered after the settle too.
            self._settled()
            return False
        self._settled()
        return True

    def resume(self, queue: str, *, by: str, now: datetime) -> bool:
        """Resume `queue`; False when it was not paused."""
        result = self.coll.update_one(
            {"_id": queue, "paused": True},
            {"$set": {"paused": False, "resumedBy": by, "resumedAt": now}, "$unset": {"pausedBy": "", "pausedAt": ""}},
        )
        return result.modified_count == 1

    def paused(self) -> dict[str, dict[str, Any]]:
        """Every paused queue, with who paused it and when."""
        return {doc.pop("_id"): doc for doc in self.coll.find({"_id": QUEUE_NAME, "paused": True})}

    def set_limits(
        self,
        queue: str,
        *,
        concurrency: int | None | Unchanged = UNCHANGED,
        rate: Rate | None | Unchanged = UNCHANGED,
        fair: bool | Unchanged = UNCHANGED,
        by: str,
        now: datetime,
    ) -> None:
        """Set `queue`'s limits for every worker: a concurrency limit, a rate, None to remove one, UNCHANGED to leave
        it, and whether its claims are `fair` across its jobs' fair keys; each worker learns of it as it learns of a
        pause. A concurrency limit lowered below the jobs running drains: no job is stopped. A fair queue with a rate
        per key is refused (LimitError): each picks the next job its own way."""
        changes: dict[str, Any] = {"limitedBy": by, "limitedAt": now}
        removed: dict[str, Any] = {}
        if fair is True or (isinstance(rate, Rate) and rate.per_key):
            current = QueueLimits.of(self.control(queue))
            fair_after = current.fair if isinstance(fair, Unchanged) else fair
            rate_after = current.rate if isinstance(rate, Unchanged) else rate
            if fair_after and rate_after is not None and rate_after.per_key:
                raise LimitError(f"a queue is fair or has a rate {PER_KEY}, not both: remove the one it has first")
        if fair is True:
            changes["fair"] = True
        elif fair is False:
            removed["fair"] = ""
        if concurrency is None:
            removed["concurrency"] = ""
        elif not isinstance(concurrency, Unchanged):
            changes["concurrency"] = parse_concurrency(concurrency)
        if rate is None:
            removed |= {"rateStarts": "", "ratePeriod": "", "ratePerKey": ""}
        elif not isinstance(rate, Unchanged):
            changes |= {"rateStarts": rate.starts, "ratePeriod": rate.period}
            if rate.per_key:
                changes["ratePerKey"] = True
            else:
                removed["ratePerKey"] = ""
        update: dict[str, Any] = {"$set": changes, **({"$unset": removed} if removed else {})}
        self.coll.update_one({"_id": queue}, update, upsert=True)
        self._settled()

    def control(self, queue: str) -> dict[str, Any]:
        """`queue`'s control document as it is now (empty when it was never paused or limited): one read by _id."""
        return self.coll.find_one({"_id": queue}) or {}

    def controls(self) -> dict[str, dict[str, Any]]:
        """Every queue that is paused or limited, with its control document (pausedBy, concurrency, limitedBy...)."""
        selector = {
            "_id": QUEUE_NAME,
            "$or": [
                {"paused": True},
                {"concurrency": {"$exists": True}},
                {"rateStarts": {"$exists": True}},
                {"fair": True},
            ],
        }
        return {doc.pop("_id"): doc for doc in self.coll.find(selector)}


#: Seconds a consumer trusts its read of the paused queues while a live change stream would report any change.
WATCHED_MAX_AGE = 60.0


@dataclass(frozen=True)
class KnownQueue:
    """One queue's control as a consumer knows it, and since when: `read_at`, the monotonic clock just before the
    read that told.

    A claim made on it and answered less than CONTROL_SETTLE after `read_at` landed less than that after the read,
    and a pause or a limit answers only CONTROL_SETTLE after its write: so one that answered before the claim landed
    was written before the read, which saw it. Only a claim answered later may have landed after such an answer
    (`answered_in_time`); the claimer reads its queue's control once more for it. Elapsed time on this process's
    clock, no clock compared with the server's: it holds on every server."""

    paused: bool
    limits: QueueLimits
    read_at: float

    def answered_in_time(self) -> bool:
        """Whether a claim made on this and answered just now surely landed while this was still true."""
        return time.monotonic() - self.read_at < CONTROL_SETTLE


class KnownControls:
    """What a consumer knows of the paused and limited queues (`queue in known` when it is paused, `limits(queue)`),
    read again when `version()` changes (its change stream saw a queue control change, or came back after an
    outage) and otherwise after `max_age` seconds, or after WATCHED_MAX_AGE while `version()` is not None (a live
    change stream would have said). One read serves both: a consumer pays nothing more for the limits."""

    def __init__(
        self, controls: QueueControls, *, max_age: float, version: Callable[[], int | None] = lambda: None
    ) -> None:
        self.controls = controls
        self.max_age = max_age
        self._version = version
        self._lock = threading.Lock()
        self._names: frozenset[str] = frozenset()
        self._limits: dict[str, QueueLimits] = {}
        self._read_at = float("-inf")
        self._read_version: int | None = -1

    def __contains__(self, queue: str) -> bool:
        with self._lock:
            self._read_if_old()
            return queue in self._names

    def limits(self, queue: str) -> QueueLimits:
        """The limits of `queue` (falsy when it has none)."""
        with self._lock:
            self._read_if_old()
            return self._limits.get(queue) or QueueLimits()

    def of(self, queue: str) -> KnownQueue:
        """What is known of `queue` for a claim: read again once the last read is half CONTROL_SETTLE old, so that a
        claim made now still has most of the settle time to be answered in (KnownQueue)."""
        with self._lock:
            if time.monotonic() - self._read_at >= CONTROL_SETTLE / 2:
                self._read()
            else:
                self._read_if_old()
            return KnownQueue(queue in self._names, self._limits.get(queue) or QueueLimits(), self._read_at)

    def learnt(self, queue: str, control: Mapping[str, Any]) -> None:
        """`queue`'s control as a claim just read it: known at once, and everything is read again at the next look
        (other queues may have changed with it)."""
        with self._lock:
            paused = control.get("paused") is True
            self._names = self._names | {queue} if paused else self._names - {queue}
            limits = QueueLimits.of(control)
            self._limits = {name: known for name, known in self._limits.items() if name != queue}
            if limits:
                self._limits[queue] = limits
            self._read_at = float("-inf")

    def _read_if_old(self) -> None:
        max_age = self.max_age if self._version() is None else max(self.max_age, WATCHED_MAX_AGE)
        if time.monotonic() - self._read_at >= max_age or self._version() != self._read_version:
            self._read()

    def _read(self) -> None:
        # The version and the clock first: a change after them is seen at the next check, or by the claim's own read.
        now, version = time.monotonic(), self._version()
        controls = self.controls.controls()
        self._names = frozenset(name for name, control in controls.items() if control.get("paused") is True)
        self._limits = {name: limits for name, control in controls.items() if (limits := QueueLimits.of(control))}
        self._read_at, self._read_version = now, version
