"""Push wake-ups: a change stream tells a consumer which queues have work, so an idle worker does not poll."""

from __future__ import annotations

import bisect
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pymongo.database import Database
from pymongo.errors import OperationFailure, PyMongoError

from bb_broker.forks import reset_in_child
from bb_broker.jobs.document import waiting_query
from bb_broker.jobs.outages import Refusals
from bb_broker.jobs.queues import SLOT_WAITERS_FIELD
from bb_broker.jobs.serial import WAITERS_FIELD
from bb_broker.server import capabilities, passes_with_time
from bb_broker.threads import start_supervised
from bb_broker.transport.plumbing import BindingsWatch
from bb_broker.upstream import pymongo as upstream_pymongo

logger = logging.getLogger(__name__)

#: How long one getMore waits on the server for a change: an idle consumer's only steady cost.
AWAIT_MS = 10_000
#: Seconds between getMores while the changes only repeat what the consumer knows (its queues are already
#: marked): a busy queue would otherwise cost a getMore per job; news for a quiet queue waits at most this.
BUSY_PACE = 0.25
#: The first pace after news: paces double from here up to BUSY_PACE while repeats keep coming, so that a burst
#: (a few tasks queued for a saturated worker) costs a few getMores and holds back the news after it (a ping) by
#: milliseconds, not by a whole BUSY_PACE.
FIRST_PACE = 0.005
#: Repeats a paced read should bring: while they come fast (a burst of inserts), a pace is no longer than it takes
#: this many to come, so that the news after the burst waits milliseconds, not the pace the ramp reached. A stream
#: of repeats costs a getMore per this many repeats, or per BUSY_PACE when they come slower than that. At 32, a
#: backlog published at 1,200 tasks/s costs 0.03 getMores per task (0.05 at 16), and news waits at most ~27 ms.
PACED_CHANGES = 32
#: The fields whose removal from a job frees what another claim waits for: the flag that claims wait for a slot of
#: its queue's concurrency limit (set only once the limit is reached, see ConcurrencySlots._wait_for_slot), and the
#: flag that others wait for its serial key (see bb_broker.jobs.serial). `limitSlot` itself is not one: every job of a
#: limited queue has it, and a change event per job would wake nobody while the limit is not reached.
FREED_FIELDS = (SLOT_WAITERS_FIELD, WAITERS_FIELD)
#: Changes one getMore may return. A full batch means more are waiting: the watcher reads on without pacing.
CHANGE_BATCH = 1000
#: The due times of delayed jobs a connection keeps per queue it consumes (and for the retries, whose change does
#: not name their queue): the earliest ones. Past that, a queue's due times are read from its jobs again when the
#: first one it dropped comes, so that a million jobs scheduled ahead cost each worker this many, not a million.
DUE_TIMES_KEPT = 1000


@dataclass
class Look:
    """What one look at a queue reads: how many messages the changes told of, per collection (`jobs` and the plain
    `messages`), since the last look; 0 skips that read, math.inf (unknown) makes it. The consumer takes off what
    each read took, and what is left when the look ends (`Wakeups.looked`) is news for the next."""

    jobs: float = math.inf
    messages: float = math.inf
    #: A safety poll (its reads are everything, until the consumer's probe says where nothing waits, safety_polled).
    safety: bool = field(default=False, compare=False)

    def took(self, source: str, count: int, *, all_there_was: bool) -> None:
        """A read of `source` ("jobs" or "messages") took `count`; `all_there_was` when it found the queue empty."""
        left = 0.0 if all_there_was else max(getattr(self, source) - count, 0.0)
        setattr(self, source, left)


class Wakeups:
    """Which queues are worth polling now: those with news, those due by the clock, and all now and then."""

    def __init__(
        self,
        db: Database,
        *,
        jobs: str,
        messages: str,
        bindings: str | None = None,
        controls: str | None = None,
        clock: Callable[[], datetime],
        safety_poll_interval: float,
        busy_pace: float = BUSY_PACE,
        on_news: Callable[[], None] | None = None,
    ) -> None:
        self.available = False
        #: Set at each piece of news: the blocking loop waits on it; an event loop is told through `on_news`.
        self.event = threading.Event()
        self._on_news = on_news
        self._db = db
        self._messages = messages
        self._bindings = bindings
        self._bindings_watch = BindingsWatch.of(db[bindings]) if bindings else None
        self._controls = controls
        #: Goes up at each change to the queue controls (a queue paused or resumed): cached pauses are read again.
        self.controls_version = 0
        self._clock = clock
        self._safety = safety_poll_interval
        self._lock = threading.Lock()
        self._dirty: set[str] = set()  # queues with news since their last look
        #: What the news of each dirty queue told of, counted per collection (math.inf: an unknown amount).
        self._news: dict[str, Look] = {}
        self._inflight: set[str] = set()  # queues being looked at: a change to one is no news to the consumer
        #: Queues whose claim may be held back (a limit, a busy serial key): news once a running job gives back what
        #: held it (a slot, a key others wait for).
        self._waiting_for_freed: set[str] = set()
        #: Goes up each time such a job ends: a consumer's busy serial keys may be free again.
        self.freed = 0
        self._jobs_touched_at = 0.0
        self._last_poll: dict[str, float] = {}
        self._jobs = db[jobs]
        #: The due times (monotonic, ascending) of the delayed jobs of each consumed queue, each telling of the one job
        #: due then; under None, those of the retries (an update does not name its queue), for every job queue.
        #: DUE_TIMES_KEPT at most each: the first one dropped is kept in `_dropped_from`.
        self._due: dict[str | None, list[float]] = {}
        #: When the first due time `_due` dropped for a queue comes: its due times are read from the jobs then.
        self._dropped_from: dict[str | None, float] = {}
        #: The consumed queues whose due times are to be read from the jobs at their next look: those a consumer
        #: started on (their delayed jobs were no business of this connection's before), those whose dropped due
        #: times come, and all after the change stream was down (it may have missed some).
        self._unread: set[str] = set()
        #: For an unread queue whose dropped due times came: when the first of them came (monotonic). Its read starts
        #: there, not at the read's own moment: the look that the coming woke claimed what was due when it claimed,
        #: and a job that fell due between that claim and a later look's read would be neither claimed nor read.
        self._read_from: dict[str, float] = {}
        #: A rate's next start (wake_in) per queue: news of every job waiting for it.
        self._rate_due: dict[str, float] = {}
        #: The queues this connection's consumers read: only their changes are news or repeats to it. The rest
        #: (its own replies and events, other workers' queues) are marked, in case it consumes them later, and else
        #: only pace the watcher while they keep coming.
        self._consumed: frozenset[str] = frozenset()
        self._feed = _Feed.subscribe(self, db, (jobs, messages, bindings, controls), busy_pace)

    def stop(self) -> None:
        """The connection closed: no more wake-ups for it (the process's change stream ends with its last one)."""
        self._feed.unsubscribe(self)
        self.available = False

    # --- the consumer's side ------------------------------------------------

    def look(self, queue: str, *, job_queue: bool) -> Look | None:
        """Whether the consumer should look at `queue` now, and if so what to read there: None when nothing is
        known to be waiting. A look reads only what the changes told of, except on a safety poll (everything)."""
        if not self.available:
            return Look()  # no change stream: plain polling, of both collections
        if job_queue and self._unread:
            self._read_due_times()
        now = time.monotonic()
        with self._lock:
            self._fire_timers(now)
            last = self._last_poll.get(queue, float("-inf"))
            touched = job_queue and self._jobs_touched_at >= last
            safety = now - last >= self._safety
            if not (queue in self._dirty or touched or safety):
                self._inflight.discard(queue)
                return None
            self._dirty.discard(queue)
            self._inflight.add(queue)
            self._last_poll[queue] = now
            news = self._news.pop(queue, None) or Look(jobs=0.0, messages=0.0)
        if safety:
            return Look(safety=True)
        if touched:
            news.jobs = math.inf  # a job went back to queued somewhere (a retry, a release), or a queue resumed
        return news

    def due_for_safety_soon(self, queue: str) -> tuple[float, list[str]]:
        """The other consumed queues whose safety poll is at least half due, and when that was found (before the
        reads): a safety poll of `queue` covers them too, so that an idle worker's safety polls cost a read per
        collection, not per queue."""
        now = time.monotonic()
        with self._lock:
            others = [
                other
                for other in self._consumed
                if other != queue and now - self._last_poll.get(other, float("-inf")) >= self._safety / 2
            ]
        return now, others

    def safety_polled(self, queues: Collection[str], *, at: float, jobs: bool, messages: bool) -> None:
        """A safety poll that began `at` (due_for_safety_soon's time) covered `queues`: where it found something
        waiting (`jobs`, in the jobs of one of them at least; `messages`, in their plain messages), each queue reads
        there, as news. Their looks count from `at`: a job sent back to the queue during the reads is still news."""
        with self._lock:
            for queue in queues:
                self._last_poll[queue] = max(self._last_poll.get(queue, float("-inf")), at)
                if jobs or messages:
                    self._add_news(queue, jobs=math.inf if jobs else 0.0, messages=math.inf if messages else 0.0)

    def looked(self, queue: str, look: Look) -> None:
        """A look at `queue` is over: what it did not take of the news it read for is still news."""
        if self.available and (look.jobs or look.messages):
            with self._lock:
                self._add_news(queue, jobs=look.jobs, messages=look.messages)

    def more_jobs_may_wait(self, queue: str) -> None:
        """A claim made after its look ended (ClaimsAhead's) came back full: the next look at `queue` claims again."""
        if self.available:
            with self._lock:
                self._add_news(queue, jobs=math.inf)

    def wake_when_freed(self, queue: str) -> None:
        """The claims of `queue` are held back (a concurrency limit, a busy serial key): the next job that ends
        holding a slot or a waited-for key (of any queue: the change does not say which) is news for `queue`, once.
        No poll in between: a held-back queue costs nothing while what holds it back lasts."""
        with self._lock:
            self._waiting_for_freed.add(queue)

    def wake_in(self, queue: str, seconds: float) -> None:
        """`queue` is worth a look in `seconds` (a rate's next start), news or not: a look that claims until the rate
        stops it, not one job (a claim of one that the rate let through would leave the jobs behind it waiting for
        the safety poll)."""
        due = time.monotonic() + max(seconds, 0.0)
        with self._lock:
            # The earliest is enough: its look claims until the rate stops it, which sets the next.
            self._rate_due[queue] = min(due, self._rate_due.get(queue, math.inf))

    def _add_news(self, queue: str, *, jobs: float = 0.0, messages: float = 0.0) -> None:
        news = self._news.setdefault(queue, Look(jobs=0.0, messages=0.0))
        news.jobs += jobs
        news.messages += messages
        self._dirty.add(queue)

    def consume_only(self, queues: Collection[str]) -> None:
        """The queues this connection's consumers read from now on."""
        consumed = frozenset(queues)
        with self._lock:
            added = consumed - self._consumed
            for gone in self._consumed - consumed:
                self._forget_due_times(gone)
                self._unread.discard(gone)
                self._rate_due.pop(gone, None)
            for queue in added:
                # Its first look reads everything, and its due times: the changes of its delayed jobs before now
                # were another queue's, and kept nothing.
                self._last_poll.pop(queue, None)
                self._unread.add(queue)
            self._consumed = consumed
        if added:
            self._feed.cut_pace()  # the newcomer's news must not wait behind a pace

    def poke(self) -> None:
        """Something changed in this process (a prefetch slot freed): look again."""
        self._notify()

    def seconds_until_next_poll(self, consumed: Collection[str]) -> float:
        """How long the consumer may wait before it polls again; `consumed` are the queues it can take from now.

        News, due times and safety polls of the queues it cannot take from (a consumer at its prefetch limit) are
        not its business: they wait for the room an ack makes, and must not make it wake (or spin) meanwhile.
        """
        now = time.monotonic()
        with self._lock:
            self._inflight.clear()  # the consumer is about to wait: its polls have all come back
            fired = self._fire_timers(now)
            if not self._dirty.isdisjoint(consumed) or None in fired:
                return 0.0
            candidates = [due - now for due in self._next_due_times()]
            candidates += [self._last_poll.get(queue, float("-inf")) + self._safety - now for queue in consumed]
        return max(0.0, min(candidates, default=self._safety))

    def _fire_timers(self, now: float) -> set[str | None]:
        """Turn the due times that have come into news; the queues they were for (None: every job queue)."""
        fired: set[str | None] = set()
        for queue, times in list(self._due.items()):
            come = bisect.bisect_right(times, now)
            if not come:
                continue
            del times[:come]
            if not times:
                del self._due[queue]
            fired.add(queue)
            if queue is None:
                self._jobs_touched_at = now
            else:
                self._add_news(queue, jobs=float(come))  # one job each
        for queue, dropped_from in list(self._dropped_from.items()):
            if dropped_from <= now:
                # The first job it dropped is due: read what is due from then on (a look claims what is due now).
                del self._dropped_from[queue]
                fired.add(queue)
                reading = self._consumed if queue is None else {queue}
                for read in reading:
                    self._read_from[read] = min(dropped_from, self._read_from.get(read, math.inf))
                self._unread |= reading
                if queue is None:  # a retry's, of some queue: every job queue looks, and reads
                    self._jobs_touched_at = now
                else:
                    self._add_news(queue, jobs=math.inf)
        for queue, due in list(self._rate_due.items()):
            if due <= now:
                del self._rate_due[queue]
                fired.add(queue)
                self._add_news(queue, jobs=math.inf)
        return fired

    def _next_due_times(self) -> list[float]:
        """The earliest due time of each queue (its kept ones, the first it dropped, a rate's next start)."""
        return [
            *(times[0] for times in self._due.values()),
            *self._dropped_from.values(),
            *self._rate_due.values(),
        ]

    def _keep_due_time(self, queue: str | None, due: float) -> None:
        """Keep the monotonic time when a delayed job of `queue` is due; the latest go past DUE_TIMES_KEPT."""
        dropped_from = self._dropped_from.get(queue, math.inf)
        if due >= dropped_from:
            return  # read again from the jobs when the first one dropped comes
        times = self._due.setdefault(queue, [])
        bisect.insort(times, due)
        if len(times) > DUE_TIMES_KEPT:
            self._dropped_from[queue] = min(times.pop(), dropped_from)

    def _forget_due_times(self, queue: str) -> None:
        self._due.pop(queue, None)
        self._dropped_from.pop(queue, None)
        self._read_from.pop(queue, None)

    def _read_due_times(self) -> None:
        """Read when the delayed jobs of the unread queues are due, in place of the times kept for them: one read for
        them all, of their earliest DUE_TIMES_KEPT.

        What the changes tell of meanwhile is kept as well: a job inserted during the read may be kept twice, which
        costs a look that finds nothing. Every job due before the read was kept (the times that came are news) or
        is in what it finds, read from when a queue's first dropped due time came (`_read_from`); the looks that
        follow claim all that is due (news, from what called for the read)."""
        since = self._clock()  # before the times kept are let go: each one not come yet is after it
        at = time.monotonic()  # after the clock: a monotonic time taken back through the pair errs early, never late
        with self._lock:
            self._fire_timers(at)  # first: a queue whose dropped due times come now is read too
            unread, self._unread = self._unread, set()
            read_from = min((self._read_from.get(queue, at) for queue in unread), default=at)
            for queue in unread:
                self._forget_due_times(queue)
        if not unread:
            return
        # From when the first dropped due time came: a job due since then that no look claimed is found, and kept
        # with a time that has come (news at the next look).
        since -= timedelta(seconds=max(at - read_from, 0.0))
        try:
            waiting = self._jobs.find(
                waiting_query({"$in": sorted(unread)}, since),
                {"_id": 0, "queue": 1, "runAfter": 1},
                sort=[("runAfter", 1)],
                limit=DUE_TIMES_KEPT,
            )
            found = [(doc["queue"], self._comes_at(doc["runAfter"])) for doc in waiting]
        except PyMongoError:
            with self._lock:
                # Read at the next look (the claim's error reaches the consumer), from as far back.
                self._unread |= unread
                for queue in unread:
                    self._read_from[queue] = min(read_from, self._read_from.get(queue, math.inf))
            raise
        with self._lock:
            for queue, comes_at in found:
                if queue in self._consumed:  # not a consumer cancelled meanwhile
                    self._keep_due_time(queue, comes_at)
            if len(found) == DUE_TIMES_KEPT:
                # There may be more from the last one found on, of any of them: read again when it comes.
                last = found[-1][1]
                for queue in unread & self._consumed:
                    self._dropped_from[queue] = min(last, self._dropped_from.get(queue, math.inf))

    def _notify(self) -> None:
        self.event.set()
        if self._on_news is not None:
            self._on_news()

    # --- what the process's change stream reports ---------------------------

    def _went_live(self) -> None:
        with self._lock:
            self._last_poll.clear()  # anything may have happened while we were not watching
            self._unread |= self._consumed  # a job delayed meanwhile, too
            self.controls_version += 1  # a queue paused or resumed meanwhile, too
        self.available = True
        self._notify()

    def _went_dark(self) -> None:
        self.available = False
        self._notify()

    def _on_change(self, change: dict[str, Any]) -> Seen:
        """Note a change, and say what it is to this connection's consumers."""
        now = time.monotonic()
        if self._bindings_watch is not None and (change.get("ns") or {}).get("coll") == self._bindings:
            self._bindings_watch.changed()
            return Seen.NEWS  # rare, and nothing to poll
        if self._controls is not None and (change.get("ns") or {}).get("coll") == self._controls:
            with self._lock:
                self.controls_version += 1
                self._jobs_touched_at = now  # a resumed queue has work to claim
            self._notify()
            return Seen.NEWS
        in_messages = (change.get("ns") or {}).get("coll") == self._messages
        removed = (change.get("updateDescription") or {}).get("removedFields") or ()
        if any(name in removed for name in FREED_FIELDS):
            freed = self._on_freed()
            if not _requeued(change):
                return freed
            # A held job sent back to the queue (a retry, the stale sweep, a release) frees its slot or key too, and
            # is news of its own: the claims that found its key busy try it again, and its queue looks.
        if change["operationType"] == "insert":
            document = change.get("fullDocument") or {}
            queue, due = document.get("queue"), document.get("runAfter")
        else:
            queue, due = None, (change.get("updateDescription") or {}).get("updatedFields", {}).get("runAfter")
        if not isinstance(queue, str):
            # A hand-written document (a queue that is a list, a number): news for no queue by name, so every job
            # queue looks once, and the claim fails the job for its field.
            queue = None
        comes_at = self._comes_at(due)
        with self._lock:
            if comes_at > time.monotonic():
                if queue is None or queue in self._consumed:
                    self._keep_due_time(queue, comes_at)
                    seen = Seen.REPEAT  # a due time: nothing to poll before it comes
                else:
                    # Another queue's: nothing kept (a consumer that starts on it reads its due times then).
                    seen = Seen.OTHER
            elif queue is None:
                seen = Seen.NEWS
                self._jobs_touched_at = now
            else:
                if queue not in self._consumed:
                    seen = Seen.OTHER  # marked all the same: a consumer that starts on it later looks at once
                else:
                    seen = Seen.REPEAT if queue in self._dirty or queue in self._inflight else Seen.NEWS
                if in_messages:
                    self._add_news(queue, messages=1.0)
                else:
                    self._add_news(queue, jobs=1.0)
        if seen is not Seen.OTHER:
            self._notify()
        return seen

    def _on_freed(self) -> Seen:
        """A running job that held a slot of a limit, or a serial key others wait for, ended: the queues held back
        look again."""
        with self._lock:
            self.freed += 1
            waiting, self._waiting_for_freed = self._waiting_for_freed, set()
            for queue in waiting:
                self._add_news(queue, jobs=math.inf)
        if not waiting:
            return Seen.OTHER
        self._notify()
        return Seen.NEWS

    def _comes_at(self, due: Any) -> float:
        """The monotonic time when `due` (a runAfter) comes by the claims' clock; now for what is not a date.

        The clock is read first: a thread paused between the two readings (a loaded machine) makes the time late,
        never early. Taken the other way round, a pause of the change stream's thread kept a due time early by its
        length; the look it woke found the job not due yet, and nothing woke one again before the safety poll."""
        until = (due - self._clock()).total_seconds() if isinstance(due, datetime) else 0.0
        return time.monotonic() + until


class _Feed:
    """The change stream of one process, client and database, shared by every connection consuming there.

    One watcher per connection kept a pooled connection each, for good once the connection closed: a process that
    opened connections one after another (an inspect each, say) ran its client's pool dry. Now a closed connection
    only unsubscribes, and the stream ends after the wait it is in once nobody is subscribed.
    """

    _feeds: dict[tuple[Any, ...], _Feed] = {}
    _registry = threading.Lock()

    @classmethod
    def subscribe(cls, wakeups: Wakeups, db: Database, names: tuple[str | None, ...], busy_pace: float) -> _Feed:
        key = (id(db.client), db.name, *names)
        with cls._registry:
            feed = cls._feeds.get(key)
            if feed is None:
                feed = cls._feeds[key] = cls(key, db, names, busy_pace)
                feed.subscribers.append(wakeups)
                # Supervised: while a dead watcher restarts, its consumers poll (they are told it went dark).
                feed.thread = start_supervised("bb-broker-wakeups", feed._watch, after_crash=feed._crashed)
                return feed
            feed.subscribers.append(wakeups)
            if feed.live:  # told here, under the lock, so that a dark turn that follows reaches it after this
                wakeups._went_live()
        return feed

    def __init__(self, key: tuple[Any, ...], db: Database, names: tuple[str | None, ...], busy_pace: float) -> None:
        self._key = key
        self._db = db
        self._jobs, self._messages, self._bindings, self._controls = names
        self._bindings_watch = BindingsWatch.of(db[self._bindings]) if self._bindings else None
        self._busy_pace = busy_pace
        self.subscribers: list[Wakeups] = []
        self.live = False
        #: Set when the last subscriber left, or a consumer started reading a queue: pauses end early.
        self._idle = threading.Event()
        #: How long the watcher's last pace was (0 once news came): the next grows from it while repeats come.
        self._pace = 0.0
        self.thread: threading.Thread | None = None  # started by subscribe
        #: Answers to the stream the code does not recognise: said once and counted (polled through meanwhile).
        self._refusals = Refusals("change stream")

    def unsubscribe(self, wakeups: Wakeups) -> None:
        with self._registry:
            if wakeups in self.subscribers:
                self.subscribers.remove(wakeups)
            if not self.subscribers:
                self._idle.set()

    def cut_pace(self) -> None:
        self._idle.set()

    def _wanted(self) -> bool:
        """True while someone is subscribed; else the feed leaves the registry (a newcomer starts another)."""
        with self._registry:
            if self.subscribers:
                self._idle.clear()
                return True
            if self._feeds.get(self._key) is self:
                del self._feeds[self._key]
            return False

    def _each(self) -> list[Wakeups]:
        with self._registry:
            return list(self.subscribers)

    def _pipeline(self) -> list[dict[str, Any]]:
        jobs, messages = self._jobs, self._messages
        return [
            {"$match": {"$or": [
                {"ns.coll": jobs, "operationType": "insert", "fullDocument.status": "queued"},
                {"ns.coll": jobs, "operationType": "update", "updateDescription.updatedFields.status": "queued"},
                # A job ending with a slot of a concurrency limit, or with a serial key, that others wait for: only the
                # jobs of reached limits and contended keys have these fields.
                *({"ns.coll": jobs, "operationType": "update", "updateDescription.removedFields": name}
                  for name in FREED_FIELDS),
                # A queued job made due sooner (an operator's run-now) changes its runAfter alone: its status stays.
                {"ns.coll": jobs, "operationType": "update",
                 "updateDescription.updatedFields.runAfter": {"$exists": True}},
                {"ns.coll": messages, "operationType": "insert"},
                *([{"ns.coll": self._bindings}] if self._bindings else []),
                *([{"ns.coll": self._controls}] if self._controls else []),
            ]}},
            {"$project": {"ns.coll": 1, "operationType": 1, "fullDocument.queue": 1, "fullDocument.runAfter": 1,
                          "updateDescription.updatedFields.runAfter": 1, "updateDescription.updatedFields.status": 1,
                          "updateDescription.removedFields": 1}},
        ]  # fmt: skip

    def _watch(self) -> None:
        resume_token = None
        backoff = 0.5
        while self._wanted():
            try:
                if not capabilities(self._db).change_streams:
                    logger.info("no change streams on this deployment: polling every safety poll and due time")
                    break
                with self._db.watch(
                    self._pipeline(), max_await_time_ms=AWAIT_MS, batch_size=CHANGE_BATCH, resume_after=resume_token
                ) as stream:
                    self._went_live()
                    self._refusals.cleared(self._db.name)
                    backoff = 0.5
                    batch: set[Seen] = set()
                    changes, others_before = 0, False
                    last_batch = time.monotonic()
                    while stream.alive and self._wanted():
                        change = stream.try_next()  # the buffered batch, or one getMore (awaiting AWAIT_MS)
                        resume_token = stream.resume_token
                        if change is not None:
                            changes += 1
                            batch.add(self._on_change(change))
                        if upstream_pymongo.buffered_changes(stream) == 0:  # the next try_next is a getMore
                            now = time.monotonic()
                            if changes < CHANGE_BATCH and _worth_a_pace(batch, others_before):
                                coming = PACED_CHANGES * (now - last_batch) / max(changes, 1)
                                self._pace = max(FIRST_PACE, min(self._pace * 2, self._busy_pace, coming))
                                self._idle.wait(self._pace)  # the consumers know of these changes already
                            elif not batch or Seen.NEWS in batch:
                                self._pace = 0.0  # the repeats stopped: the next pace starts short again
                            others_before = batch == {Seen.OTHER}
                            last_batch = now
                            batch, changes = set(), 0
            except OperationFailure as exc:
                # Any refusal is an outage of the stream, polled through until it is back: the probe said the
                # deployment has change streams, and a worker is never ended by what the server answers here.
                if not passes_with_time(exc):
                    self._refusals.met(self._db.name, exc)  # said once per code, counted
                resume_token = None  # the history may be gone: start afresh, polling everything once
                self._went_dark(backoff)
            except PyMongoError:
                self._went_dark(backoff)
            backoff = min(backoff * 2, 10.0)
        with self._registry:
            if self._feeds.get(self._key) is self:
                del self._feeds[self._key]
        self._went_dark(0.0)

    def _went_live(self) -> None:
        if self._bindings_watch is not None:
            self._bindings_watch.went_live(self)  # tables read before now are read again once
        self.live = True
        for wakeups in self._each():
            wakeups._went_live()

    def _crashed(self) -> None:
        self._went_dark(0.0)

    def _went_dark(self, pause: float) -> None:
        if self._bindings_watch is not None:
            self._bindings_watch.went_dark(self)
        self.live = False
        for wakeups in self._each():
            wakeups._went_dark()
        if pause:
            self._idle.wait(pause)

    def _on_change(self, change: dict[str, Any]) -> Seen:
        """What a change is to the process: news to any connection, else a repeat to any, else nobody's business."""
        seen = {wakeups._on_change(change) for wakeups in self._each()}
        return next((kind for kind in (Seen.NEWS, Seen.REPEAT) if kind in seen), Seen.OTHER)


def _forget_parent_feeds() -> None:
    # The parent's watcher threads do not follow a fork: a child that consumes starts its own.
    _Feed._feeds = {}
    _Feed._registry = threading.Lock()


reset_in_child(_forget_parent_feeds)


class Seen(enum.Enum):
    """What a change is to a connection's consumers."""

    NEWS = "news"  # a queue it reads has work it did not know of: read on at once
    REPEAT = "repeat"  # work it knows of already (a queue marked, a due time set): no hurry
    OTHER = "other"  # a queue it does not read: its own replies and events, other workers' queues


def _requeued(change: dict[str, Any]) -> bool:
    """Whether an update sent its job back to the queue (which is news of its own, whatever else it did)."""
    return ((change.get("updateDescription") or {}).get("updatedFields") or {}).get("status") == "queued"


def _worth_a_pace(batch: set[Seen], others_before: bool) -> bool:
    """Whether the watcher should wait before its next read, having read `batch` (every change of a getMore).

    Pacing saves a getMore per change while changes tell the consumers nothing new. A read of news alone ends the
    pacing, and so, once, does news after a change they do not read (a ping's reply, after the ping it answers): only
    changes to queues nobody here reads that keep coming (other workers' busy queues) pace the watcher without
    repeats. News in a read with repeats is a burst going on, and told already: a consumer that takes each look's
    news (a worker claiming as fast as jobs come) makes the first change of every read news, which ended the pacing
    at a getMore per claim.
    """
    if not batch:
        return False
    if Seen.REPEAT in batch:
        return True
    return Seen.NEWS not in batch and others_before
