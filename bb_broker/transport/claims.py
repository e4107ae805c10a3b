"""Claims made ahead on a thread of their own, for a backlogged queue consumed on Celery's event loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from queue import Empty, SimpleQueue

from bb_broker.jobs.document import Claimed
from bb_broker.threads import start_supervised


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
    through another, then rings the loop. So the channel's held jobs and backlog (Channel._held,
    Channel._backlogged) change on the consuming thread only, when it takes a landed claim in
    (Channel._take_landed_claims)."""

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
