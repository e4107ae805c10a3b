"""The server's time, so that leases and due times do not depend on each worker's clock."""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from pymongo.database import Database
from pymongo.errors import PyMongoError

from bb_broker.forks import reset_in_child


def aware(moment: datetime) -> datetime:
    """A date as BSON gave it back (naive, in UTC) made timezone-aware; an aware one as it is."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _monotonic_time() -> datetime:
    # The monotonic clock as a date: a wall clock stepped by NTP or a resumed VM does not move it.
    return _EPOCH + timedelta(seconds=time.monotonic())


#: The server's time is read up to this many times in a row, the one of the shortest round trip kept: the offset may be
#: off by half a round trip, and on a loaded machine one took 800 ms (a retry's due time then came 400 ms early).
SAMPLES = 3
#: A round trip this short ends the sampling: its reading is good to a few milliseconds.
SHORT_ROUND_TRIP = timedelta(milliseconds=10)


class ServerClock:
    """The MongoDB server's time: its reading, re-taken every minute, carried forward by the monotonic clock."""

    resync_every = 60.0

    _shared: dict[tuple[int, int, str], ServerClock] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def of(cls, db: Database) -> ServerClock:
        """The process's clock for a client's database: whatever judges a due time in it judges by the same one.

        Each measurement is off by a millisecond or so; the change stream that says a job is due and the claim
        that takes it must not disagree by that much, or the claim finds nothing and the job waits a safety poll.
        """
        key = (os.getpid(), id(db.client), db.name)
        with cls._shared_lock:
            clock = cls._shared.get(key)
            if clock is None or clock._db.client is not db.client:
                clock = cls._shared[key] = cls(db)
            return clock

    def __init__(self, db: Database) -> None:
        self._db = db
        #: The server's time minus the monotonic clock's; until measured, the local wall clock's.
        self._offset = datetime.now(UTC) - _monotonic_time()
        self._synced_at: float | None = None
        self._lock = threading.Lock()
        self._measured = False
        #: Why the last attempt to read the server's time failed; None once one succeeds.
        self._failure: PyMongoError | None = None
        #: How far the offset may be off, in seconds: half the measuring round trip, and the millisecond the server's
        #: `localTime` is truncated to; unbounded until measured.
        self.uncertainty = float("inf")

    def __call__(self) -> datetime:
        if self._synced_at is None or time.monotonic() - self._synced_at > self.resync_every:
            self._sync()
        return _monotonic_time() + self._offset

    def at(self, monotonic: float) -> datetime:
        """The server's time when the monotonic clock read `monotonic` (give or take `uncertainty`)."""
        self()  # measured (again) where due
        return _EPOCH + timedelta(seconds=monotonic) + self._offset

    def reading(self) -> datetime:
        """The server's time, for a caller whose query goes to the same server next: when the last attempt to read it
        (at most a few seconds ago: see _sync) found the server unreachable, that error. Calling the clock instead
        carries on with the last offset, and the query would wait for the unreachable server a second time."""
        now = self()
        failure = self._failure
        if failure is not None:
            raise copy.copy(failure)  # one of its own for each caller: a traceback of its own
        return now

    def from_local(self, moment: datetime) -> datetime:
        """A time this process's clock gave (Celery's ETA: its `now` plus a countdown), on the server's clock."""
        try:
            return moment + (self() - datetime.now(UTC))
        except OverflowError:
            return moment  # an ETA at the end of time stays there

    def to_local(self, moment: datetime) -> datetime:
        """A time on the server's clock (a job's runAfter) on this process's clock, where Celery reads an ETA."""
        try:
            return moment - (self() - datetime.now(UTC))
        except OverflowError:
            return moment

    def _sync(self) -> None:
        # One measurement at a time. Once there is an offset nobody waits for a new one: a thread stuck measuring an
        # unreachable server must not hold up another's call (a release at exit with its own deadline), which uses
        # the last offset meanwhile. Before the first, everyone waits: local time may be far off the server's.
        if not self._lock.acquire(blocking=not self._measured):
            return
        try:
            if self._synced_at is not None and time.monotonic() - self._synced_at <= self.resync_every:
                return  # measured (or found unreachable) while this thread waited for the lock: not twice in a row
            best: tuple[timedelta, datetime, datetime] | None = None  # the shortest round trip's
            for _ in range(SAMPLES):
                before = _monotonic_time()
                try:
                    server_time = self._db.client.admin.command("hello")["localTime"]
                except (PyMongoError, KeyError) as exc:
                    # An unreachable server fails the write that follows; keep the last offset until then, and try
                    # again in 5 s.
                    self._synced_at = time.monotonic() - self.resync_every + 5
                    self._failure = exc if isinstance(exc, PyMongoError) else None
                    return
                after = _monotonic_time()
                if best is None or after - before < best[0]:
                    best = (after - before, aware(server_time), before + (after - before) / 2)
                if after - before <= SHORT_ROUND_TRIP:
                    break
            assert best is not None
            round_trip, server_time, midpoint = best
            self._offset = server_time - midpoint
            self.uncertainty = round_trip.total_seconds() / 2 + 0.001
            self._synced_at = time.monotonic()
            self._measured = True
            self._failure = None
        finally:
            self._lock.release()


def reading(clock: Callable[[], datetime]) -> datetime:
    """A store's time for a caller whose query goes to the server next: a ServerClock's reading (which raises when
    the server could not be reached: see ServerClock.reading), any other clock's time."""
    return clock.reading() if isinstance(clock, ServerClock) else clock()


def _forget_parent_clocks() -> None:
    # A lock another thread held at the fork would never be released in the child; the clocks are the parent's.
    ServerClock._shared = {}
    ServerClock._shared_lock = threading.Lock()


reset_in_child(_forget_parent_clocks)
