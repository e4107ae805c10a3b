"""Group commit of the settling writes a worker's process makes on the jobs it ran.

A pool process used to settle each task in a synchronous `update_one` before it could take the next one: a round
trip per task, and the largest share of the pool's CPU (docs/explanation/performance.md). Here the settles of one
jobs collection in one process go to a writer thread of their own. A settle submitted while no write is in flight
goes at once, alone: no added latency when the worker is idle. Those submitted while a write is in flight go
together in the next one, one unordered bulk of updates, each still fenced on its own attempt: a stale settle in a
batch changes nothing while the others land. A write that meets an outage is tried again for the store's
`settle_patience`; fenced, the settles that had landed already change nothing the second time.

The crash window this opens: a finished task waits for its settle at most the write in flight and its own (a
round trip or two; through an outage, up to `settle_patience`). If its process dies then, the job is still
`running` in the worker's name but no longer in its heartbeats (Celery has the task's outcome): the stale sweep
takes it back after `stale_after` and it runs again, as a job of a worker lost in the middle of its task does.

Threads: whoever submits (a pool process's main thread, a threads pool's threads) only puts on the writer's queue;
the writer thread alone takes from it and writes. `flush` waits until what was submitted before it is written: a
pool process flushes as it exits (worker_process_shutdown), a worker's main process as it stops.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pymongo import UpdateOne
from pymongo.collection import Collection
from pymongo.errors import BulkWriteError, DocumentTooLarge, OperationFailure, PyMongoError

from bb_broker.forks import reset_in_child
from bb_broker.jobs.document import DOCUMENT_TOO_LARGE
from bb_broker.jobs.outages import through_outages
from bb_broker.ops import metrics
from bb_broker.threads import start_supervised

logger = logging.getLogger(__name__)

#: A settle whose result and tracebacks are larger than this is written alone, at once, as before group commit: it
#: would slow its batch, and what does not fit in its document then fails the task in Celery's own way (the result
#: backend raises ResultTooLarge in the task's process). A smaller one that does not fit (its job's arguments fill
#: the document) is replaced in the writer by its `if_too_large`.
GROUP_COMMIT_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Settle:
    """One settling write on a held job: the fence that makes it its attempt's, and what it changes."""

    job_id: str
    fence: dict[str, Any]
    update: dict[str, Any]
    #: The counter (ops/metrics.py) the settle adds to once it lands: succeeded, retried or failed.
    outcome: metrics.Event
    #: The settle to write instead when this one would make the job document exceed MongoDB's limit (a result or
    #: a traceback too large beside the job's arguments): built only then.
    if_too_large: Callable[[], Settle]

    def landed_in(self, doc: dict[str, Any]) -> bool:
        """Whether `doc`, read after the write, is the job as this settle left it (each settle sets its updatedAt)."""
        changes = self.update.get("$set", {})
        stored, written = doc.get("updatedAt"), changes.get("updatedAt")
        if not (isinstance(stored, datetime) and isinstance(written, datetime)):
            return False
        # BSON keeps a date to the millisecond, and a client without tz_aware reads it back naive (in UTC)
        same_write = _to_the_millisecond(stored) == _to_the_millisecond(written)
        return same_write and doc.get("status") == changes.get("status")


def _to_the_millisecond(moment: datetime) -> datetime:
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return aware.replace(microsecond=aware.microsecond - aware.microsecond % 1000)


#: The writers of this process, flushed as it exits (see flush_all).
_writers: weakref.WeakSet[GroupCommit] = weakref.WeakSet()


class GroupCommit:
    """The settles of one jobs collection in one process, group-committed by a writer thread (see the module)."""

    #: The most settles one write carries: a bulk is split by pymongo past 100,000 statements or 48 MB anyway.
    max_batch = 1000

    def __init__(self, coll: Collection, *, patience: float) -> None:
        self.coll = coll
        self.patience = patience
        #: The process this writer belongs to: its thread does not follow a fork.
        self.pid = os.getpid()
        # A C queue: a put wakes the writer without the lock ping-pong of a Condition (a tenth of a pool process's
        # CPU in a drain, `py-spy record --gil`). Besides settles it carries flush's markers, set once the settles
        # put before them are written.
        self._queue: queue.SimpleQueue[Settle | threading.Event] = queue.SimpleQueue()
        self._writing = False  # the writer's, read by submit: whether a write is in flight
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, settle: Settle) -> None:
        """Write `settle` as soon as the write in flight, if any, is answered."""
        idle = not self._writing and self._queue.empty()  # this one goes alone, now
        self._queue.put(settle)
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = start_supervised("bb-settles", self._run)
                    _writers.add(self)
        if idle:
            # Let the writer take the GIL at once, rather than when this thread next blocks (Celery's bookkeeping
            # of the task, its log line, the result's way back to the main process): a lone settle then lands as
            # soon as a synchronous one did.
            time.sleep(0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every settle submitted so far is written or given up; False when `timeout` ran out first."""
        if self.pid != os.getpid() or self._thread is None:
            return True  # a parent's writer, in a forked child (its settles are the parent's), or one never used
        written = threading.Event()
        self._queue.put(written)
        return written.wait(timeout)

    def _run(self) -> None:
        while True:
            batch: list[Settle] = []
            markers: list[threading.Event] = []
            item = self._queue.get()
            while True:
                if isinstance(item, threading.Event):
                    markers.append(item)
                else:
                    batch.append(item)
                if len(batch) >= self.max_batch or self._queue.empty():
                    break
                item = self._queue.get_nowait()
            self._writing = True
            try:
                if batch:
                    self._write(batch)
            except Exception:
                # Left `running`, each of these jobs is taken back by the stale sweep and runs again.
                logger.exception("the settles of %d jobs were not written: %s", len(batch), _ids(batch))
            finally:
                self._writing = False
                for marker in markers:
                    marker.set()

    def _write(self, batch: list[Settle]) -> None:
        requests = [UpdateOne(settle.fence, settle.update) for settle in batch]
        too_large: list[Settle] = []
        try:
            result = through_outages(lambda: self.coll.bulk_write(requests, ordered=False), patience=self.patience)
            modified = result.modified_count
        except BulkWriteError as exc:
            # An unordered bulk carries out every statement it can: only those named in writeErrors did not land.
            failed = {error["index"]: error for error in exc.details.get("writeErrors", [])}
            modified = exc.details.get("nModified", 0)
            for index, error in failed.items():
                if error.get("code") in DOCUMENT_TOO_LARGE:
                    too_large.append(batch[index])
                else:
                    logger.error("the settle of job %s was refused: %s", batch[index].job_id, error.get("errmsg"))
            batch = [settle for index, settle in enumerate(batch) if index not in failed]
        except DocumentTooLarge:
            # pymongo refused a statement before sending it, maybe after sending others of the bulk: each alone,
            # fenced, so that those which landed change nothing the second time.
            for settle in batch:
                self._write_alone(settle)
            return
        self._count(batch, modified)
        for settle in too_large:
            self._replace(settle)

    def _write_alone(self, settle: Settle) -> None:
        try:
            done = self._update_one(settle)
        except (DocumentTooLarge, OperationFailure) as exc:
            if isinstance(exc, OperationFailure) and exc.code not in DOCUMENT_TOO_LARGE:
                raise
            self._replace(settle)
            return
        if done:
            metrics.record(settle.outcome)

    def _replace(self, settle: Settle) -> None:
        """Write what stands for a settle that does not fit in its job's document."""
        logger.error("the settle of job %s does not fit in its document: the job fails on that", settle.job_id)
        replacement = settle.if_too_large()
        if self._update_one(replacement):
            metrics.record(replacement.outcome)

    def _update_one(self, settle: Settle) -> bool:
        write = lambda: self.coll.update_one(settle.fence, settle.update)  # noqa: E731
        return through_outages(write, patience=self.patience).modified_count == 1

    def _count(self, batch: list[Settle], modified: int) -> None:
        if modified < len(batch):
            # Some were fenced off (their worker lost its lease): count only those that landed.
            try:
                found = self.coll.find({"_id": {"$in": _ids(batch)}}, {"status": 1, "updatedAt": 1})
                docs = {doc["_id"]: doc for doc in found}
            except PyMongoError:
                logger.warning("could not count which of %d settles landed", len(batch))
                return
            batch = [settle for settle in batch if settle.landed_in(docs.get(settle.job_id, {}))]
        for settle in batch:
            metrics.record(settle.outcome)


def _ids(batch: list[Settle]) -> list[str]:
    return [settle.job_id for settle in batch]


def flush_all(timeout: float) -> None:
    """Wait (up to `timeout` seconds each) for the settles this process's writers still have: before it exits."""
    for writer in list(_writers):
        if not writer.flush(timeout):
            logger.error("settles were still unwritten at exit; the stale sweep runs their jobs again")


@reset_in_child
def _forget_parent_writers() -> None:
    _writers.clear()  # their threads stayed in the parent


atexit.register(flush_all, 10.0)
