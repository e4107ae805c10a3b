"""Heartbeats for the jobs a worker holds and the sweep that re-queues the jobs of dead workers."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable

import pymongo
from pymongo.errors import OperationFailure, PyMongoError

from bb_broker.connection import shutdown_patience
from bb_broker.forks import reset_in_child
from bb_broker.jobs import settles
from bb_broker.jobs.outages import Refusals, passes_with_time
from bb_broker.jobs.store import JobStore
from bb_broker.server import is_unrecognised
from bb_broker.threads import start_supervised

logger = logging.getLogger(__name__)

LiveJobs = Callable[[], Iterable[str]]

#: Sources of live job ids that outlive a channel (the Celery worker's own requests).
_process_sources: list[LiveJobs] = []


def add_process_source(source: LiveJobs) -> None:
    if source not in _process_sources:
        _process_sources.append(source)


#: Sources of the ids of the jobs whose runs have started in this process (the Celery worker's requests its pool
#: took): a consumer closed under them (a reconnect) keeps them, and each run goes on to settle its job.
_started_sources: list[LiveJobs] = []


def add_started_source(source: LiveJobs) -> None:
    if source not in _started_sources:
        _started_sources.append(source)


def started_here(job_id: str) -> bool:
    """Whether the run of `job_id` has started in this process and goes on: its job must not be given back."""
    return any(job_id in _snapshot(source) for source in list(_started_sources))


#: The most seconds a sweep waits for this process's settles to be written (LeaseKeeper.tick).
SETTLES_WAIT = 1.0

#: Seconds between tries of the releases a server that did not answer left to do (see release_later).
RELEASE_RETRY_INTERVAL = 1.0

#: Per jobs collection (JobStore.key): the jobs this process gave back while the server did not answer (a consumer
#: closed by a lost connection), job id -> the attempt its claim made. They stay `running` in this process's name
#: until the release is made: the lease keeper of that collection makes it once the server answers.
_unreleased: dict[Hashable, dict[str, int]] = {}
_unreleased_lock = threading.Lock()
#: One round of those releases at a time: a consumer starting to claim waits for the round on its way.
_giving_back = threading.Lock()


def release_later(store: JobStore, job_id: str, attempts: int) -> None:
    """Keep a release the server did not answer, to be made once it does (give_back_unreleased)."""
    with _unreleased_lock:
        _unreleased.setdefault(store.key, {})[job_id] = attempts


def unreleased(store: JobStore) -> list[str]:
    """The ids of the jobs whose release waits for the server: their lease is kept fresh meanwhile."""
    with _unreleased_lock:
        return list(_unreleased.get(store.key, {}))


def give_back_unreleased(store: JobStore, owner: str, *, live: Collection[str] = (), wait: float | None = None) -> int:
    """Make the releases kept by release_later; returns how many jobs went back to the queue.

    Each release is fenced on the claim it gives back (its attempt and `owner`): a job the stale sweep or another
    worker took since is left alone. A job `live` in this process again is kept for later: its claim may be new.
    `wait`: the most seconds to wait for a round another thread is making. Raises the error of a server that still
    does not answer; what was not released stays kept."""
    if not _giving_back.acquire(timeout=-1 if wait is None else wait):
        return 0
    try:
        return _give_back(store.key, store, owner, live)
    finally:
        _giving_back.release()


def _give_back(key: Hashable, store: JobStore, owner: str, live: Collection[str]) -> int:
    with _unreleased_lock:
        pending = _unreleased.pop(key, {})
    released = 0
    try:
        for job_id, attempts in list(pending.items()):
            if job_id in live:
                continue
            try:
                released += store.release(job_id, attempts, owner=owner)
            except PyMongoError as exc:
                if passes_with_time(exc):
                    raise
                if is_unrecognised(exc):
                    continue  # an answer that may pass (said where it was first met): kept for the next round
                logger.warning("could not give back job %s (%s); the stale sweep will", job_id, type(exc).__name__)
            del pending[job_id]
    finally:
        if pending:
            with _unreleased_lock:
                kept = _unreleased.setdefault(key, {})
                _unreleased[key] = {**pending, **kept}  # one kept meanwhile is the newer claim
    if released:
        logger.info("gave back %d jobs that never started, now that the server answers", released)
    return released


class LeaseKeeper:
    """One thread per process and jobs collection: a live job's lease never runs out, a dead one's does."""

    _keepers: dict[Hashable, LeaseKeeper] = {}
    _registry_lock = threading.Lock()

    @classmethod
    def for_store(cls, store: JobStore, owner: str) -> LeaseKeeper:
        key = store.key
        with cls._registry_lock:
            keeper = cls._keepers.get(key)
            if keeper is None or keeper._done.is_set() or not keeper._thread.is_alive():
                keeper = cls._keepers[key] = cls(store, owner)
        return keeper

    def __init__(self, store: JobStore, owner: str) -> None:
        self.store = store
        self.owner = owner
        self._sources: list[LiveJobs] = []
        self._expiries: list[Callable[[], int]] = []  # deletions a server without TTL indexes leaves to us
        self._sweep_held_since: float | None = None  # when this process's unwritten settles first held a sweep
        # The server's answers the code does not recognise, said once and counted per path. A sweep so refused is
        # backed off; a heartbeat keeps its cadence (backed off, its jobs' leases would run out and they would run
        # twice), and no sweep follows a refused one (this process's own leases may be as old as the cutoff).
        self._heartbeat_refusals = Refusals("heartbeat", store.secrets)
        self._sweep_refusals = Refusals("sweep", store.secrets)
        self._done = threading.Event()
        self._thread = start_supervised("bb-broker-leases", self._run)
        atexit.register(self._release_at_exit, os.getpid())

    def _release_at_exit(self, pid: int) -> None:
        # Whatever this process still holds when it exits (a cold shutdown killed its pool, say) was cut short.
        if os.getpid() != pid:
            return
        if self._done.is_set() and not _process_sources:
            return  # every consumer closed and gave its jobs back, and no Celery worker ran here
        try:
            with shutdown_patience():  # a server that is gone must not hold the exit
                self.store.release_owner(self.owner, "the worker shut down while the task ran")
        except PyMongoError as exc:
            logger.warning(
                "could not release this worker's jobs at exit (%s); the stale sweep will", type(exc).__name__
            )

    def add_expiry(self, expire: Callable[[], int]) -> None:
        """Run `expire` with each stale sweep: where the server has no TTL indexes, the sweep does their deletes."""
        if expire not in self._expiries:
            self._expiries.append(expire)

    def add_source(self, source: LiveJobs) -> None:
        self._sources.append(source)

    def remove_source(self, source: LiveJobs) -> None:
        """The last consumer gone, this process is no longer a worker: its keeper stops."""
        if source in self._sources:
            self._sources.remove(source)
        if not self._sources:
            self._done.set()

    def live_jobs(self) -> set[str]:
        ids: set[str] = set()
        # A finished task's job too, until its settle is written (settles.pending_jobs).
        for source in [*self._sources, *_process_sources, settles.pending_jobs]:
            ids.update(_snapshot(source))
        return ids

    def give_back_unreleased(self, wait: float | None = None) -> int:
        return give_back_unreleased(self.store, self.owner, live=self.live_jobs(), wait=wait)

    def tick(self, *, sweep: bool) -> bool:
        """Heartbeat the live jobs, and sweep if `sweep`; whether it swept."""
        # The releases the server missed come first: before this process's sweep (or the next one) could take
        # those jobs as lost; until they are made, their leases are kept fresh.
        if unreleased(self.store) and self._server_answers():
            self.give_back_unreleased()
        key = self.store.coll.full_name
        try:
            self.store.heartbeat(self.live_jobs().union(unreleased(self.store)), self.owner)
        except OperationFailure as exc:
            if not is_unrecognised(exc):
                raise
            self._heartbeat_refusals.met(key, exc)
            return False
        self._heartbeat_refusals.cleared(key)
        if not sweep or self._sweep_refusals.wait(key) > 0:
            return False  # a sweep backed off is made at a later tick
        # This process's settles first: those still in the relay's socket are in no heartbeat, and a sweep right
        # after an outage would take their jobs back before the settles behind it land. Not yet: the next tick;
        # but no longer than a settle keeps trying (settle_patience), so that slow writes never stop the sweeps.
        if not settles.written(min(SETTLES_WAIT, self.store.policy.heartbeat_interval)):
            now = time.monotonic()
            if self._sweep_held_since is None:
                self._sweep_held_since = now
            if now - self._sweep_held_since < self.store.settle_patience:
                logger.info("the stale sweep waits for this worker's settles held up by the server")
                return False
            logger.warning("this worker's settles are still unwritten after %g s: sweeping", self.store.settle_patience)
        self._sweep_held_since = None
        try:
            self.store.requeue_stale()
            self.store.fail_unclaimable_queued()
            for expire in list(self._expiries):
                expire()
        except OperationFailure as exc:
            if not is_unrecognised(exc):
                raise
            self._sweep_refusals.met(key, exc)
            return False
        self._sweep_refusals.cleared(key)
        return True

    def _run(self) -> None:
        policy = self.store.policy
        elapsed = policy.sweep_interval  # a worker that starts sweeps at once
        while not self._done.is_set():
            due = elapsed >= policy.sweep_interval
            if due:
                elapsed = 0.0
            began = time.monotonic()
            try:
                if not self.tick(sweep=due) and due:
                    elapsed = policy.sweep_interval  # held back by this process's settles: at the next tick
            except PyMongoError as exc:
                logger.warning("lease upkeep failed, will try again: %s", type(exc).__name__)
            # The next heartbeat a heartbeat_interval after this one began, however long the tick waited.
            self._wait(max(0.0, policy.heartbeat_interval - (time.monotonic() - began)))
            elapsed += policy.heartbeat_interval

    def _wait(self, seconds: float) -> None:
        """Wait until the next tick, giving back meanwhile, as soon as the server answers, what it missed."""
        deadline = time.monotonic() + seconds
        while not self._done.wait(min(RELEASE_RETRY_INTERVAL, max(deadline - time.monotonic(), 0.0))):
            if time.monotonic() >= deadline:
                return
            if unreleased(self.store) and self._server_answers():
                try:
                    self.give_back_unreleased()
                except PyMongoError as exc:
                    logger.warning("could not give back the jobs a lost connection held (%s)", type(exc).__name__)

    def _server_answers(self) -> bool:
        # A quiet look first: a release tried on a server that is still gone retries (and says so) for a minute.
        try:
            with pymongo.timeout(RELEASE_RETRY_INTERVAL):
                self.store.coll.database.command("ping")
        except PyMongoError:
            return False
        return True


def _snapshot(source: LiveJobs) -> list[str]:
    # Sources are read from the keeper's thread while their owners change them (a channel's consuming thread its
    # delivered and held jobs, Celery's event loop its reserved requests, a WeakSet whose iteration raises when it
    # changes meanwhile): retry a torn read.
    for _ in range(5):
        try:
            return [job_id for job_id in source() if job_id]
        except RuntimeError:
            continue
        except Exception:  # one source's fault must not stop the heartbeats of every other job of the process
            logger.exception("bb_broker: the jobs held by %r could not be read: their leases are not renewed", source)
            return []
    return []


def _forget_parent_keepers() -> None:
    # The keeper thread does not survive a fork; a child that consumes starts its own.
    global _unreleased_lock, _giving_back
    LeaseKeeper._keepers = {}
    LeaseKeeper._registry_lock = threading.Lock()
    _unreleased.clear()  # the parent's claims, on the parent's clients
    _unreleased_lock, _giving_back = threading.Lock(), threading.Lock()


reset_in_child(_forget_parent_keepers)
