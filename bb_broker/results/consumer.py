"""Waiting for results: a change stream on the jobs that can change them wakes the waiter, else it polls."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from celery import states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from pymongo.errors import OperationFailure, PyMongoError

from bb_broker.jobs.document import RESULTS_COLLECTION
from bb_broker.jobs.outages import Refusals
from bb_broker.server import capabilities, passes_with_time


class ResultSource(Protocol):
    """What the consumer reads through: the result backend (JobResultBackend), named by what it offers so that the
    backend's module and this one do not import each other."""

    jobs_collection: str
    #: The transport option `use_change_streams`: False, a waiting get() polls whatever the server offers.
    use_change_streams: bool

    @property
    def database(self) -> Any: ...

    def metas(self, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]: ...


#: The longest a waiting get() goes without reading the result, even with a change stream that said nothing.
SAFETY_READ = 10.0
#: The most task ids whose jobs a long-lived client remembers (beyond that, only those of the latest read).
REMEMBERED_JOBS = 10_000


class ResultConsumer:
    """The waiting side of JobResultBackend, as Celery's Redis backend has its ResultConsumer: it reads through the
    backend and watches what can change the results it waits for."""

    def __init__(self, backend: ResultSource, *, cache: Any) -> None:
        self.backend = backend
        #: The backend's cache of ready results (Celery's `self._cache`): a ready result is not read again.
        self._cache = cache
        #: False once the deployment said it has no change streams (a standalone server), or the transport options
        #: turn them off: then it polls.
        self.change_streams = backend.use_change_streams
        #: Answers to a wait's change stream the code does not recognise: said once and counted (the wait polls).
        self._refusals = Refusals("result wait")
        #: Task id -> its job's id, learnt by reads: what a waiting get() watches.
        self._job_ids: dict[str, str] = {}

    def remember_jobs(self, found: dict[str, str], read: list[str]) -> None:
        """The jobs a read found (task id -> job id), of the task ids it read, for a wait to watch."""
        self._job_ids.update(found)
        if len(self._job_ids) > REMEMBERED_JOBS:  # a long-lived client reads many ids: keep only what waits need
            self._job_ids = {task_id: self._job_ids[task_id] for task_id in read if task_id in self._job_ids}

    def get_many(
        self,
        task_ids: Iterable[str],
        timeout: float | None = None,
        interval: float = 0.5,
        on_message: Any = None,
        on_interval: Any = None,
        max_iterations: int | None = None,
        ready_states: frozenset[str] = states.READY_STATES,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (task id, meta) as each task is ready: woken by a change stream on their jobs, else polling."""
        pending = {str(task_id) for task_id in task_ids}
        yield from self._ready_in_cache(pending, ready_states)
        deadline = None if timeout is None else time.monotonic() + timeout
        stream, watched = None, None
        iterations = 0
        try:
            while pending:
                ready, outage = self._read(pending, ready_states, on_message)
                if on_interval is not None and (ready or iterations):
                    # After every read, as Redis's consumer calls it after every wait, the one that brought the
                    # result included: a parent's error (a chord's revoked header task, stored before the failure it
                    # caused) is raised before that failure. Not after a first read that found nothing: get() has
                    # just checked the parents itself.
                    on_interval()
                yield from ready
                if not pending:
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CeleryTimeoutError(f"Operation timed out ({timeout})") from outage
                iterations += 1
                if max_iterations and iterations >= max_iterations:
                    return
                # By text: a hand-written job's _id (an ObjectId) is no string to sort among the others.
                jobs = tuple(
                    sorted((self._job_ids[task_id] for task_id in pending if task_id in self._job_ids), key=str)
                )
                unknown = tuple(sorted(task_id for task_id in pending if task_id not in self._job_ids))
                try:
                    if outage is None and self.change_streams and (jobs, unknown) != watched:
                        if stream is not None:
                            stream.close()
                        stream, watched = None, None
                        stream, watched = self.watch(jobs, unknown, pending), (jobs, unknown)
                        if stream is not None:
                            continue  # read again at once: a change between the read and the watch is not missed
                    self._pause(None if outage is not None else stream, interval, remaining)
                except PyMongoError as exc:
                    if not passes_with_time(exc):
                        raise
                    stream, watched = self._closed(stream), None  # a new one once the server answers a read again
                    time.sleep(interval if remaining is None else min(interval, remaining))
        finally:
            if stream is not None:
                stream.close()

    def _read(
        self, pending: set[str], ready_states: frozenset[str], on_message: Any
    ) -> tuple[list[tuple[str, dict[str, Any]]], PyMongoError | None]:
        """One read's ready results (_ready_in_read); none and the error of an outage (a failover, a dropped
        connection) that met it: the wait reads again after a pause, until its timeout, as it would through a server
        that is slow to answer."""
        try:
            return list(self._ready_in_read(pending, ready_states, on_message)), None
        except PyMongoError as exc:
            if not passes_with_time(exc):
                raise
            return [], exc

    @staticmethod
    def _closed(stream: Any) -> None:
        """Close a change stream an outage met (closing it may meet the outage too)."""
        if stream is not None:
            with contextlib.suppress(PyMongoError):
                stream.close()

    def _ready_in_cache(self, pending: set[str], ready_states: frozenset[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (task id, meta) of the pending tasks whose ready result the cache holds, taking them out of
        `pending`: those are not read again."""
        for task_id in list(pending):
            cached = self._cache.get(task_id)
            if cached is not None and cached["status"] in ready_states:
                pending.discard(task_id)
                yield task_id, cached

    def _ready_in_read(
        self, pending: set[str], ready_states: frozenset[str], on_message: Any
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Read the pending tasks' metas once and yield (task id, meta) of those ready, taking them out of `pending`;
        a success is cached, and each ready meta goes to `on_message` first (Celery's callback)."""
        for task_id, meta in self.backend.metas(pending).items():
            if meta["status"] in ready_states:
                pending.discard(task_id)
                if meta["status"] == states.SUCCESS:
                    self._cache[task_id] = meta
                if on_message is not None:
                    on_message(meta)
                yield task_id, meta

    def watch(self, job_ids: Iterable[str], unknown_task_ids: Iterable[str], task_ids: Iterable[str]) -> Any:
        """A change stream on what can change these results: their jobs, a new job for any of the task ids (a
        replaced task's id comes back on its replacement's job, a task id not seen yet on its first), and
        bb_results documents of tasks without a job. None where the deployment has no change streams."""
        unknown = list(unknown_task_ids)
        jobs = self.backend.jobs_collection
        watched = [
            {"ns.coll": jobs, "documentKey._id": {"$in": list(job_ids)}},
            {"ns.coll": jobs, "operationType": "insert", "fullDocument.taskId": {"$in": list(task_ids)}},
            {"ns.coll": RESULTS_COLLECTION, "documentKey._id": {"$in": [f"task:{task_id}" for task_id in unknown]}},
        ]
        if not self.change_streams or not capabilities(self.backend.database).change_streams:
            self.change_streams = False  # a standalone server, FerretDB: poll
            return None
        try:
            return self.backend.database.watch(
                [{"$match": {"$or": watched}}, {"$project": {"documentKey": 1}}], max_await_time_ms=1000
            )
        except OperationFailure as exc:
            if passes_with_time(exc):
                raise
            # The probe found change streams: a refusal now is the server's, and this wait polls instead.
            self._refusals.met(self.backend.jobs_collection, exc)  # said once per code, counted
            return None

    def _pause(self, stream: Any, interval: float, remaining: float | None) -> None:
        """Until one of the watched jobs changes (or SAFETY_READ passes), or else `interval`."""
        if stream is None:
            time.sleep(interval if remaining is None else min(interval, remaining))
            return
        limit = SAFETY_READ if remaining is None else min(SAFETY_READ, remaining)
        started = time.monotonic()
        while time.monotonic() - started < limit:
            if stream.try_next() is not None:  # one awaiting getMore of up to a second
                return
