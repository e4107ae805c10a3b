"""Heartbeats for the jobs a worker holds and the sweep that re-queues the jobs of dead workers."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Iterable

from pymongo.errors import PyMongoError

from .connection import shutdown_patience
from .store import JobStore

logger = logging.getLogger(__name__)

LiveJobs = Callable[[], Iterable[str]]

#: Sources of live job ids that outlive a channel (the Celery worker's own requests).
_process_sources: list[LiveJobs] = []


def add_process_source(source: LiveJobs) -> None:
    if source not in _process_sources:
        _process_sources.append(source)


class LeaseKeeper:
    """One thread per process and jobs collection: a live job's lease never runs out, a dead one's does."""

    _keepers: dict[str, LeaseKeeper] = {}
    _registry_lock = threading.Lock()

    @classmethod
    def for_store(cls, store: JobStore, owner: str) -> LeaseKeeper:
        key = f"{store.coll.database.client.address}/{store.coll.full_name}"
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
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bb-broker-leases", daemon=True)
        self._thread.start()
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
        for source in [*self._sources, *_process_sources]:
            ids.update(_snapshot(source))
        return ids

    def tick(self, *, sweep: bool) -> None:
        self.store.heartbeat(self.live_jobs(), self.owner)
        if sweep:
            self.store.requeue_stale()
            for expire in list(self._expiries):
                expire()

    def _run(self) -> None:
        policy = self.store.policy
        elapsed = policy.sweep_interval  # a worker that starts sweeps at once
        while not self._done.is_set():
            sweep = elapsed >= policy.sweep_interval
            if sweep:
                elapsed = 0.0
            try:
                self.tick(sweep=sweep)
            except PyMongoError as exc:
                logger.warning("lease upkeep failed, will try again: %s", type(exc).__name__)
            self._done.wait(policy.heartbeat_interval)
            elapsed += policy.heartbeat_interval


def _snapshot(source: LiveJobs) -> list[str]:
    # Sources are read from this thread while the consumer mutates them: retry a torn read.
    for _ in range(5):
        try:
            return [job_id for job_id in source() if job_id]
        except RuntimeError:
            continue
    return []


def _forget_parent_keepers() -> None:
    # The keeper thread does not survive a fork; a child that consumes starts its own.
    LeaseKeeper._keepers = {}
    LeaseKeeper._registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_keepers)
