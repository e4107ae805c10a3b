"""A channel's claims: what its consumer claims and holds (within the queue's limits and pause, past the serial keys
found busy and the rate keys held, on the deadline of what it knows of the queue), what it gives back, and the claims
made ahead on a thread of their own for a backlogged queue consumed on Celery's event loop."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Protocol

from pymongo.errors import OperationFailure, PyMongoError

from bb_broker.jobs import leases
from bb_broker.jobs.document import Claimed, attempt_entry
from bb_broker.jobs.outages import Refusals, passes_with_time
from bb_broker.jobs.queues import KnownQueue, LimitReached, QueueLimits
from bb_broker.jobs.rate_keys import RateHolds
from bb_broker.server import is_unrecognised
from bb_broker.threads import start_supervised
from bb_broker.transport.qos import BATCH_MIN
from bb_broker.upstream import kombu as upstream_kombu

if TYPE_CHECKING:
    from bb_broker.jobs.queues import KnownControls, QueueControls
    from bb_broker.jobs.store import JobStore
    from bb_broker.options import BrokerOptions
    from bb_broker.transport.qos import JobQoS
    from bb_broker.transport.wakeups import Wakeups

logger = logging.getLogger(__name__)

#: lastError of a job whose run Celery cancelled as its worker stopped cold: its attempt ran, and counts.
CUT_SHORT = "the worker shut down while the task ran (a cold shutdown cancelled it)"


class ClaimOnItsWay(Empty):
    """Nothing to deliver yet: a claim for the queue is on its way, and rings the event loop when it lands."""


@dataclass(frozen=True)
class LandedClaim:
    """What a claim ClaimsAhead made brought back: the jobs of `queue` it took (up to `wanted`), or the error it met."""

    queue: str
    wanted: int
    jobs: list[Claimed] = field(default_factory=list)
    error: BaseException | None = None


class ClaimsAhead:
    """On Celery's event loop, the claims of a backlogged queue run on a thread of their own: the loop keeps handing
    the jobs it has to the pool while the server answers, instead of waiting for it between batches.

    Two threads, nothing changed by both. The consuming thread (the event loop's) asks for a claim (`start`), takes
    what landed (`landed`), alone knows which claim is on its way, and says which queues it consumes no more
    (`give_up`); this class's thread only runs the claims it is handed through one queue and hands each result back
    through another, then rings the loop. So the channel's held jobs and backlog (Claimer's) change on the consuming
    thread only, when it takes a landed claim in (Claimer.take_landed)."""

    def __init__(
        self,
        claim: Callable[[str, int], list[Claimed]],
        ring: Callable[[], None],
        release: Callable[[Collection[Claimed]], None],
    ) -> None:
        self._claim = claim
        self._ring = ring
        self._release = release
        self._requests: SimpleQueue[tuple[str, int] | None] = SimpleQueue()  # None: closed
        self._landed: SimpleQueue[LandedClaim] = SimpleQueue()
        self._on_its_way: tuple[str, int] | None = None  # the consuming thread's alone
        # What no consumer here takes any more: a claim of it that lands, this thread gives back at once (the
        # consuming thread may be gone, or not look again). Told under the lock a landing claim looks under, so that
        # each claim is either handed over or given back, never left in the queue for no one.
        self._handing = threading.Lock()
        self._unwanted: set[str] = set()
        self._closed = False
        # A daemon: a claim stuck on a server that is gone must not hold the process at exit.
        start_supervised("bb-claims-ahead", self._run)

    def busy_with(self, queue: str) -> bool:
        return self._on_its_way is not None and self._on_its_way[0] == queue

    @property
    def pending(self) -> int:
        """Jobs the claim on its way may bring."""
        return 0 if self._on_its_way is None else self._on_its_way[1]

    def start(self, queue: str, wanted: int) -> None:
        """Claim up to `wanted` jobs of `queue` in the background (unless a claim is on its way); rings when done."""
        if self._on_its_way is None and not self._closed:
            with self._handing:
                self._unwanted.discard(queue)
            self._on_its_way = (queue, wanted)
            self._requests.put((queue, wanted))

    def give_up(self, queue: str) -> None:
        """`queue` is consumed here no more: the jobs a claim of it brings from now on go back at once."""
        with self._handing:
            self._unwanted.add(queue)

    def landed(self) -> LandedClaim | None:
        """The claim that landed, if one did: no claim is on its way after it."""
        try:
            landed = self._landed.get_nowait()
        except Empty:
            return None
        self._on_its_way = None
        return landed

    def close(self) -> list[LandedClaim]:
        """Stop; returns what landed and was not taken (a claim that lands later, this thread gives back)."""
        with self._handing:
            self._closed = True
        self._requests.put(None)
        taken = []
        while (landed := self.landed()) is not None:
            taken.append(landed)
        return taken

    def _run(self) -> None:
        while (request := self._requests.get()) is not None:
            if self._closed:
                return
            queue, wanted = request
            try:
                landed = LandedClaim(queue, wanted, self._claim(queue, wanted))
            except BaseException as exc:
                landed = LandedClaim(queue, wanted, error=exc)
            with self._handing:
                unwanted = self._closed or queue in self._unwanted
                # Handed over empty when unwanted: the consuming thread still learns that the claim landed.
                self._landed.put(replace(landed, jobs=[]) if unwanted else landed)
            if unwanted:
                self._release(landed.jobs)  # its consumer was cancelled while the claim was on its way
            self._ring()


class ClaimsTransport(Protocol):
    """What the claims ask of their channel's transport."""

    @property
    def wakeups(self) -> Wakeups | None: ...

    @property
    def on_event_loop(self) -> bool: ...

    def ring(self) -> None: ...


class ClaimingChannel(Protocol):
    """What the claims ask of their channel (transport/channel.py's): its store, its consumer's name and room, its
    options, the queue controls as it knows them, and its transport's wake-ups."""

    @property
    def connection(self) -> ClaimsTransport | None: ...  # None once Kombu closed the channel

    @property
    def jobs(self) -> JobStore: ...

    @property
    def owner(self) -> str: ...

    @property
    def options(self) -> BrokerOptions: ...

    @property
    def queue_controls(self) -> QueueControls: ...

    @property
    def known_controls(self) -> KnownControls: ...

    @property
    def qos(self) -> JobQoS: ...


class Claimer:
    """A channel's claims of jobs, and the jobs claimed in a batch that wait to be delivered.

    Which thread owns what: the jobs held (claimed in a batch, not yet delivered), the backlog (the job queues whose
    last claim came back full), the claims ahead and the error one met are the consuming thread's alone (the event
    loop's, or the one in drain_events): ClaimsAhead's claims reach them through its queue (take_landed), and the
    lease keeper's thread only reads the ids held (held_ids). The claims themselves (_claim_many) run on the consuming
    thread and on ClaimsAhead's: what they keep between claims (the serial keys found busy, the rate keys held) is
    under a lock."""

    def __init__(self, channel: ClaimingChannel, *, secrets: tuple[str, ...]) -> None:
        self._channel = channel
        self._held: dict[str, deque[Claimed]] = {}  # claimed in a batch, not yet delivered
        self._backlogged: set[str] = set()  # job queues whose last claim came back full
        self._ahead: ClaimsAhead | None = None  # on an event loop, once a queue is backlogged
        self._claim_error: BaseException | None = None  # met by ClaimsAhead's last claim, raised by the next _get
        # Serial keys found busy, per queue: skipped by the claims until a job holding a key ends (the wake-ups'
        # `freed` count moves), or for a safety poll's interval at most (a change the stream did not carry). Claims
        # run on the consuming thread and on ClaimsAhead's: under a lock.
        self._busy_lock = threading.Lock()
        self._busy_keys: dict[str, set[str]] = {}
        self._busy_read_at: dict[str, tuple[int | None, float]] = {}
        # Under a rate per key, the keys whose next start is ahead, per queue (see rate_keys.py): skipped until then.
        # Under the same lock; each claim gets a copy, and what it learnt replaces it.
        self._rate_holds: dict[str, RateHolds] = {}
        #: Queues whose claims met a server answer the code does not recognise: backed off (jobs/outages.py).
        self._refusals = Refusals("claim", secrets)

    # --- the consuming thread's --------------------------------------------------

    def next_job(self, queue: str) -> Claimed:
        """The next job of `queue` to deliver: one held from a batch, else claimed here and now (a batch where the
        queue is backlogged, started in the background on an event loop: ClaimOnItsWay). Empty: none to take."""
        held = self._held.setdefault(queue, deque())
        if not held:
            if queue in self._channel.known_controls:
                raise Empty()
            wanted = self._batch_size(queue)
            ahead = self._claims_ahead(queue) if wanted > 1 else None  # a batch; one job is one round trip
            if ahead is not None:
                ahead.start(queue, wanted)
                self._channel.qos.claimed()
                raise ClaimOnItsWay()
            self._take(queue, wanted)
            if not held:
                raise Empty()
        return held.popleft()

    def error_met(self) -> BaseException | None:
        """The error the last claim made ahead met, once: the next _get raises it, where the event loop hands it to
        Celery (to reconnect)."""
        error, self._claim_error = self._claim_error, None
        return error

    def held_count(self, queue: str) -> int:
        """How many jobs of `queue` wait here, claimed and not delivered."""
        return len(self._held.get(queue, ()))

    def queue_backlogged(self, queue: str) -> bool:
        """Whether the last claim of `queue` came back full."""
        return queue in self._backlogged

    def is_holding(self) -> bool:
        """Whether jobs claimed in a batch wait here to be delivered."""
        self.take_landed()
        return any(self._held.values())

    def is_backlogged(self) -> bool:
        """Whether a queue the channel consumes had more jobs than its last claim took."""
        self.take_landed()
        return not self._backlogged.isdisjoint(upstream_kombu.consumed_queues(self._channel))

    def in_flight(self, queue: str) -> bool:
        """Whether a claim of `queue` is on its way in the background (it rings the event loop when it lands)."""
        return self._ahead is not None and self._ahead.busy_with(queue)

    def backed_off(self, queue: str) -> float:
        """Seconds `queue` stays backed off from a server answer the code does not recognise (refused); 0: none."""
        return self._refusals.wait(queue)

    def give_back(self, queue: str) -> None:
        """Give back the jobs of `queue` held here, and those of a claim of it on its way if no consumer here takes
        it any more."""
        if self._ahead is not None and queue not in upstream_kombu.consumed_queues(self._channel):
            self._ahead.give_up(queue)
        self.take_landed()
        self.release(self._held.pop(queue, deque()))

    def close(self) -> None:
        """Stop the claims ahead, taking in what landed: the consumers' cancels give back what is held."""
        if self._ahead is not None:
            for landed in self._ahead.close():
                self._take_landed(landed)

    # --- the lease keeper's thread ---------------------------------------------

    def held_ids(self) -> list[str]:
        """The ids of the jobs held: read on the lease keeper's thread (copies, the consuming thread changes them)."""
        return [job.id for jobs in list(self._held.values()) for job in list(jobs)]

    # --- the claims (the consuming thread's and ClaimsAhead's) ---------------------

    def _take(self, queue: str, wanted: int) -> None:
        """Claim up to `wanted` jobs of `queue` into the held ones, here and now."""
        jobs = self._claim_many(queue, wanted)
        self._note_backlog(queue, taken=len(jobs), wanted=wanted)
        self._held.setdefault(queue, deque()).extend(jobs)

    def _claim_many(self, queue: str, wanted: int) -> list[Claimed]:
        known = self._channel.known_controls.of(queue)
        if known.paused:
            return []
        limits = known.limits
        wakeups = self._wakeups()
        freed_before = wakeups.freed if wakeups is not None and wakeups.available else None
        with self._busy_lock:
            read_at = self._busy_read_at.get(queue)
            if (
                freed_before is None
                or read_at is None
                or read_at[0] != freed_before
                or time.monotonic() - read_at[1] >= self._channel.options.safety_poll_interval / 2
            ):
                # A job that held a slot or a busy key ended since (or nothing would say so), or the keys were found
                # busy half a safety poll's interval ago (so that the next safety poll, its interval after the last,
                # always finds them expired): try every key again.
                self._busy_keys.pop(queue, None)
                read_at = None
            busy = set(self._busy_keys.get(queue, ()))
            kept_holds = self._rate_holds.get(queue)
            rate = limits.rate
            holds = None
            if rate is not None and rate.per_key:
                holds = RateHolds(
                    rate, dict(kept_holds.until) if kept_holds is not None and kept_holds.rate == rate else {}
                )
        if wakeups is not None and (limits.concurrency is not None or limits.rate is not None):
            # Asked before the claim, so that a slot freed while it is on its way still wakes this consumer.
            wakeups.wake_when_freed(queue)
        jobs = self._claim_within(queue, wanted, known, busy, holds, wakeups)
        if busy and wakeups is not None:
            wakeups.wake_when_freed(queue)
            if wakeups.freed != freed_before:  # freed while the claim was on its way: its wake-up may be missed
                busy = set()
                wakeups.more_jobs_may_wait(queue)
        with self._busy_lock:
            self._busy_keys[queue] = busy
            self._busy_read_at[queue] = (freed_before, time.monotonic() if read_at is None else read_at[1])
            if holds is None:
                self._rate_holds.pop(queue, None)
            else:
                self._rate_holds[queue] = holds
        return jobs

    def _claim_within(
        self,
        queue: str,
        wanted: int,
        known: KnownQueue,
        busy: set[str],
        holds: RateHolds | None,
        wakeups: Wakeups | None,
    ) -> list[Claimed]:
        """The store's claim of up to `wanted` jobs of `queue` within its limits as `known`, and what holds it back:
        a limit reached (a wake-up when it lets jobs start again), a server answer the code does not recognise (the
        queue backed off meanwhile, the others go on), a pause or limit written as the claim was.

        A pause or a limit is a write to bb_queues, and a claim a write to jobs. A pause answers only CONTROL_SETTLE
        after its write: a claim answered within that time of the read of what is `known` landed knowing of every
        pause that had answered by then (KnownQueue). One answered later (a slow link, a stalled process, a failover)
        is checked by one read of the queue's control after it (_still_claimable), and its jobs go back unspent if
        the queue was paused or limited meanwhile."""
        if (backed_off := self._refusals.wait(queue)) > 0:
            if wakeups is not None:
                wakeups.wake_in(queue, backed_off)
            return []
        jobs = self._claim_of_store(queue, wanted, known.limits, busy, holds, wakeups)
        if not jobs or known.answered_in_time():
            return jobs or []
        try:
            claimable = self._still_claimable(queue, known.limits)
        except PyMongoError as exc:
            self.release(jobs)  # unread, a pause cannot be ruled out: the jobs go back before the error goes on
            if isinstance(exc, OperationFailure):
                return self.refused(queue, exc, wakeups)
            raise
        if not claimable:
            self.release(jobs)  # never started: no attempt spent
            if wakeups is not None:
                wakeups.more_jobs_may_wait(queue)  # under its new limits, or at its resume
            return []
        return jobs

    def _claim_of_store(
        self,
        queue: str,
        wanted: int,
        limits: QueueLimits,
        busy: set[str],
        holds: RateHolds | None,
        wakeups: Wakeups | None,
    ) -> list[Claimed] | None:
        """The store's claim; None when the server refused it (the queue backed off)."""
        try:
            jobs = self._channel.jobs.claim_many(queue, self._channel.owner, wanted, limits, busy, holds)
        except LimitReached as exc:
            # The next claim comes when a job of the queue ends somewhere, or a rate's next start is due (or at the
            # safety poll).
            jobs = exc.claimed
            if exc.retry_in is not None and wakeups is not None:
                wakeups.wake_in(queue, exc.retry_in)
        except OperationFailure as exc:
            # Nothing claimed (a claim of one job is one write, and a batch's outcome is read back).
            self.refused(queue, exc, wakeups)
            return None
        self._refusals.cleared(queue)
        return jobs

    def _still_claimable(self, queue: str, limits: QueueLimits) -> bool:
        """Whether `queue` is, after the claim's write, neither paused nor limited otherwise than the claim knew: the
        claim was answered too late to be sure it landed before a pause answered (_claim_within).

        One read of the queue's control after the claim orders the two writes. A pause that answered before the
        claim is seen here, and the claimed jobs go back unspent; so pause and limits hold from the moment they
        answer, however late this worker hears of them (its change stream, or pause_check_interval without one). A
        pause that lands after this read finds the jobs claimed before it: they run (docs/guides/flow-control.md)."""
        control = self._channel.queue_controls.control(queue)
        if control.get("paused") is not True and QueueLimits.of(control) == limits:
            return True
        self._channel.known_controls.learnt(queue, control)
        logger.info("queue %s was paused or limited as it was claimed: its jobs go back", queue)
        return False

    def _note_backlog(self, queue: str, *, taken: int, wanted: int) -> None:
        if taken < wanted:
            self._backlogged.discard(queue)
        else:
            self._backlogged.add(queue)

    def take_landed(self) -> None:
        """Take in what ClaimsAhead's claims brought back: on the consuming thread, as every change of the held jobs."""
        if self._ahead is None:
            return
        while (landed := self._ahead.landed()) is not None:
            self._take_landed(landed)

    def _take_landed(self, landed: LandedClaim) -> None:
        if landed.error is not None:
            self._claim_error = landed.error
            return
        queue, jobs = landed.queue, landed.jobs
        self._note_backlog(queue, taken=len(jobs), wanted=landed.wanted)
        if queue not in upstream_kombu.consumed_queues(self._channel):
            self.release(jobs)  # a consumer cancelled while its claim was on the way gets nothing
            return
        self._held.setdefault(queue, deque()).extend(jobs)
        wakeups = self._wakeups()
        if len(jobs) == landed.wanted and wakeups is not None:
            # The look that sent this claim handed its news to it: a full batch says there may be more.
            wakeups.more_jobs_may_wait(queue)

    def _claims_ahead(self, queue: str) -> ClaimsAhead | None:
        """The background claimer, for a backlogged queue consumed on an event loop; None: claim here and now."""
        connection = self._channel.connection
        if queue not in self._backlogged or connection is None or not connection.on_event_loop:
            return None
        if self._ahead is None:
            self._ahead = ClaimsAhead(self._claim_many, connection.ring, self.release)
        return self._ahead

    def _batch_size(self, queue: str) -> int:
        # One job unless work is known to be waiting (a lone task is then one round trip, not two), and never
        # more than the consumer can start: a claimed job must not wait behind a busy pool.
        if queue not in self._backlogged or queue not in upstream_kombu.consumed_queues(self._channel):
            return 1
        held = sum(len(jobs) for jobs in self._held.values()) + (self._ahead.pending if self._ahead else 0)
        size = min(self._channel.qos.claimable() - held, self._channel.options.max_claim_batch)
        return size if size >= BATCH_MIN else 1

    def fail_undeliverable(self, job: Claimed, reason: str) -> bool:
        """Fail a claimed job whose message Celery cannot take, once: an attempt that never started. False where the
        attempt was no longer the job's (a sweep or an operator wrote first), and this failed nothing."""
        entry = attempt_entry(
            job.attempts,
            worker=self._channel.owner,
            started_at=None,
            finished_at=self._channel.jobs.now(),
            outcome="failed",
            error=reason,
        )
        jobs = self._channel.jobs
        failed = jobs.fail(job.id, job.attempts, reason, retryable=False, attempt=entry) is not None
        return failed or jobs.failed_with(job.id, job.attempts, reason)

    def release(self, jobs: Collection[Claimed]) -> None:
        """Give back claimed jobs that never started (release_job)."""
        for job in jobs:
            self.release_job(job.id, job.attempts)

    def release_job(self, job_id: str, attempts: int) -> None:
        """Give back a job that never started, now or, when the server does not answer (a lost connection being
        closed), once it does: the lease keeper makes the release then, and keeps the lease fresh until it does."""
        try:
            self._channel.jobs.release(job_id, attempts, owner=self._channel.owner)
        except PyMongoError as exc:
            if passes_with_time(exc) or is_unrecognised(exc):  # an outage, or an answer that may pass: tried again
                leases.release_later(self._channel.jobs, job_id, attempts)
                logger.warning(
                    "could not give back job %s (%s); it goes back once the server answers", job_id, type(exc).__name__
                )
            else:
                logger.warning("could not give back job %s (%s); the stale sweep will", job_id, type(exc).__name__)

    def recover_cut_short(self, job_id: str, attempts: int) -> None:
        """Settle a job whose run Celery cancelled here as lost: its attempt counted, back to the queue or failed on
        its last; when the server does not answer, the stale sweep does the same later."""
        try:
            self._channel.jobs.recover_cut_short(job_id, attempts, self._channel.owner, CUT_SHORT)
        except PyMongoError as exc:
            logger.warning("could not settle job %s, cut short (%s); the stale sweep will", job_id, type(exc).__name__)

    def refused(self, queue: str, exc: OperationFailure, wakeups: Wakeups | None) -> list[Claimed]:
        """A claim of `queue` met `exc`: an outage is raised (Celery reconnects: transport.py); any other answer backs
        this queue off while the others go on."""
        if passes_with_time(exc):
            raise exc
        pause = self._refusals.met(queue, exc)
        if wakeups is not None:
            wakeups.wake_in(queue, pause)
        return []

    def _wakeups(self) -> Wakeups | None:
        connection = self._channel.connection  # None once Kombu closed the channel
        return connection.wakeups if connection is not None else None
