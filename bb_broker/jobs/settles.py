"""Group commit of the settling writes a worker makes on the jobs it ran.

A pool process used to settle each task in a synchronous `update_one` before it could take the next one: a round
trip per task, and the largest share of the pool's CPU (docs/explanation/performance.md). Now a settle is written
by a thread that groups it with the others made meanwhile. A settle made while no write is in flight goes at once,
alone: no added latency when the worker is idle. Those made while a write is in flight go together in the next
one, one unordered bulk of updates (SettleWriter), each still fenced on its own attempt: a stale settle in a batch
changes nothing while the others land. A write that meets an outage, or a server answer the code does not
recognise (logged once, counted in bb_broker_server_errors_total, backed off), is tried again for the store's
`settle_patience`; fenced, the settles that had landed already change nothing the second time.

Which thread writes: in a prefork worker, the main process's (SettleRelay). Its pool processes send each settle
over a socket pair made before they were forked, so the settles of all the pool processes go out together, and a
pool process spends on a settle a datagram instead of pymongo's round trip. While settles reach the relay a few
milliseconds apart (a backlog), a write waits for the next ones, so that several share it (SettleRelay._hold). A send
never waits: a settle too large for a datagram, or sent while the socket's buffer is full (the main process's
writes held up by an outage) or after the main process is gone, the pool process writes itself, at once, before its
task's result goes back to the main process (JobStore.settle_soon). Every settle in a worker whose pool is not
forked (threads, solo, gevent, eventlet) goes to a writer thread of its process (GroupCommit). A script calling the
result backend writes its settle at once (worker/settle.py).

The crash window this opens: a finished task waits for its settle at most the write in flight, the relay's wait for
the next settle (up to `settle_linger`, 10 ms) and its own write (a round trip or two; through an outage, up to
`settle_patience`). Meanwhile the job stays live: the lease keeper of the process that writes it heartbeats it
(pending_jobs), and sweeps only once that process's settles are written (written). If the process holding it dies
(the main process, for a relayed settle: a pool process that dies after sending it loses nothing), the job is
still `running` in the worker's name and its heartbeats stop: the stale sweep takes it back after `stale_after`
and it runs again, as a job of a worker lost in the middle of its task does.

Threads: whoever submits (a pool process's main thread, a threads pool's threads) only puts on the writer's queue
or sends on the relay's socket; the writer thread, or the relay's thread in the main process, alone takes from it
and writes. `flush` waits until what was submitted before it is written: a pool process flushes its own writer as
it exits (worker_process_shutdown), a worker's main process its writer and its relay as it stops.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import select
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import bson
from bson.codec_options import CodecOptions
from pymongo import UpdateOne
from pymongo.collection import Collection
from pymongo.errors import BulkWriteError, PyMongoError

from bb_broker import metrics
from bb_broker.forks import reset_in_child
from bb_broker.jobs.document import DOES_NOT_FIT, UNENCODABLE, unwritable_cause
from bb_broker.jobs.lifecycle import RUNNING
from bb_broker.jobs.outages import Refusals, through_refusals
from bb_broker.server import too_large_write_error, unrecognised_write_error
from bb_broker.threads import start_supervised

logger = logging.getLogger(__name__)

#: A settle whose result and tracebacks are larger than this is written alone, at once, as before group commit: it
#: would slow its batch, and what does not fit in its document then fails the task in Celery's own way (the result
#: backend raises ResultTooLarge in the task's process). A smaller one that can never be written (its job's
#: arguments fill the document, or BSON cannot encode a value of it) is replaced in the writer by its
#: `if_unwritable`.
GROUP_COMMIT_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Settle:
    """One settling write on a held job: the fence that makes it its attempt's, and what it changes."""

    job_id: str
    fence: dict[str, Any]
    update: dict[str, Any]
    #: The counter (bb_broker/metrics.py) the settle adds to once it lands: succeeded, retried or failed.
    outcome: metrics.Event
    #: The settle to write instead when this one can never be written, given why (document.unwritable_cause: the
    #: job document would exceed MongoDB's limit, or BSON cannot encode a value): it fails the job for good, saying
    #: so, never to be retried or left running. Built only then.
    if_unwritable: Callable[[str], Settle]
    #: What this settle settles, as that failure names it ("the task's result"), for a writer in another process
    #: (SettleRelay), which cannot call if_unwritable: None for the store's own (store.JOB_SETTLE).
    subject: str | None = None

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


class SettleWriter:
    """Writes a batch of settles in one round trip; used by one thread at a time (its GroupCommit's or its relay's).

    `refusals`: where the server's answers the code does not recognise are said and backed off (its store's)."""

    def __init__(self, coll: Collection, *, patience: float, refusals: Refusals | None = None) -> None:
        self.coll = coll
        self.patience = patience
        self.refusals = refusals or Refusals("settle")

    def write(self, batch: list[Settle]) -> None:
        """Write `batch`; what cannot be written is logged, its jobs left to the stale sweep."""
        try:
            if batch:
                self._write(batch)
        except Exception:
            # Left `running`, each of these jobs is taken back by the stale sweep and runs again.
            logger.exception("the settles of %d jobs were not written: %s", len(batch), _ids(batch))

    def _write(self, batch: list[Settle]) -> None:
        if len(batch) == 1:
            # The same command as a bulk of one, without pymongo's bulk bookkeeping: 10-15% less of the writer's
            # CPU per write, and a lone settle is the most common batch of an idle or lightly loaded worker.
            self._write_alone(batch[0])
            return
        requests = [UpdateOne(settle.fence, settle.update) for settle in batch]
        too_large: list[Settle] = []
        alone: list[Settle] = []  # refused with an answer the code does not recognise: tried again, each alone
        try:
            result = self._through_refusals(lambda: self.coll.bulk_write(requests, ordered=False))
            modified = result.modified_count
        except BulkWriteError as exc:
            # An unordered bulk carries out every statement it can: only those named in writeErrors did not land.
            failed = {error["index"]: error for error in exc.details.get("writeErrors", [])}
            modified = exc.details.get("nModified", 0)
            for index, error in failed.items():
                if too_large_write_error(error):
                    too_large.append(batch[index])
                elif unrecognised_write_error(error):
                    alone.append(batch[index])
                else:
                    logger.error("the settle of job %s was refused: %s", batch[index].job_id, error.get("errmsg"))
            batch = [settle for index, settle in enumerate(batch) if index not in failed]
        except UNENCODABLE:
            # pymongo refused a statement before sending it (too large, or a value BSON cannot encode), maybe after
            # sending others of the bulk: each alone, fenced, so that those which landed change nothing the second
            # time, and the one refused is replaced.
            for settle in batch:
                self._write_alone(settle)
            return
        self._count(batch, modified)
        for settle in too_large:
            self._replace(settle, DOES_NOT_FIT)
        for settle in alone:
            self._write_alone(settle)

    def _write_alone(self, settle: Settle) -> None:
        try:
            done = self._update_one(settle)
        except Exception as exc:
            cause = unwritable_cause(exc)
            if cause is None:
                raise
            self._replace(settle, cause)
            return
        if done:
            metrics.record(settle.outcome)

    def _replace(self, settle: Settle, cause: str) -> None:
        """Write what stands for a settle that can never be written (`cause`): its job fails for good, saying why.
        When that cannot be written either (what made the settle unwritable is in the attempt's entry it keeps), the
        replacement's own: the store's failure, which holds nothing of the task's."""
        for _ in range(2):
            logger.error("the settle of job %s %s: the job fails on that", settle.job_id, cause)
            settle = settle.if_unwritable(cause)
            try:
                if self._update_one(settle):
                    metrics.record(settle.outcome)
                return
            except Exception as exc:
                again = unwritable_cause(exc)
                if again is None:
                    raise
                cause = again
        raise RuntimeError(f"no settle of job {settle.job_id} could be written: {cause}")

    def _update_one(self, settle: Settle) -> bool:
        return self._through_refusals(lambda: self.coll.update_one(settle.fence, settle.update)).modified_count == 1

    def _through_refusals(self, write: Callable[[], Any]) -> Any:
        # Dropped, a settle's job stays `running` until the stale sweep runs its task again: an answer the code does
        # not recognise is outlasted as an outage is, for as long.
        return through_refusals(write, patience=self.patience, refusals=self.refusals, key=self.coll.full_name)

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


#: The writers of this process, flushed as it exits (see flush_all).
_writers: weakref.WeakSet[GroupCommit | SettleRelay] = weakref.WeakSet()

#: What a relayed settle's update may do: a settle sets, unsets and pushes its history entry.
SETTLE_OPERATORS = frozenset({"$set", "$unset", "$push"})
#: The counters a settle adds to (Settle.outcome).
SETTLE_OUTCOMES = frozenset({"succeeded", "retried", "failed"})
#: Dates read back as they were sent (aware, UTC), so that a settle's updatedAt compares with the stored one.
_RELAYED: CodecOptions[dict[str, Any]] = CodecOptions(tz_aware=True)


class GroupCommit:
    """The settles of one jobs collection in one process, group-committed by a writer thread (see the module)."""

    #: The most settles one write carries: a bulk is split by pymongo past 100,000 statements or 48 MB anyway.
    max_batch = 1000

    def __init__(self, writer: SettleWriter) -> None:
        self.writer = writer
        #: The process this writer belongs to: its thread does not follow a fork.
        self.pid = os.getpid()
        # A C queue: a put wakes the writer without the lock ping-pong of a Condition (a tenth of a pool process's
        # CPU in a drain, `py-spy record --gil`). Besides settles it carries flush's markers, set once the settles
        # put before them are written.
        self._queue: queue.SimpleQueue[Settle | threading.Event] = queue.SimpleQueue()
        self._writing = False  # the writer's, read by submit: whether a write is in flight
        #: The jobs submitted and not yet written, with how many of their settles are: counted up by submit, down by
        #: the writer once it wrote them. A count, not a set: a job settled again while its first write is in flight
        #: stays pending until its second is written too.
        self._unwritten: Counter[str] = Counter()
        self._unwritten_lock = threading.Lock()  # a Counter's updates are Python code, not one call under the GIL
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def pending_jobs(self) -> frozenset[str]:
        with self._unwritten_lock:
            return frozenset(self._unwritten)

    def submit(self, settle: Settle) -> None:
        """Write `settle` as soon as the write in flight, if any, is answered."""
        idle = not self._writing and self._queue.empty()  # this one goes alone, now
        with self._unwritten_lock:
            self._unwritten[settle.job_id] += 1
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
        if not self._unwritten:
            return True  # submit counts a settle before queueing it, the writer only once it is written
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
                self.writer.write(batch)
            finally:
                self._writing = False
                with self._unwritten_lock:
                    self._unwritten -= Counter(_ids(batch))  # drops the jobs whose count reaches 0
                for marker in markers:
                    marker.set()


class SettleRelay:
    """The settles of a prefork worker's pool processes, written by its main process (see the module).

    Made in the worker's main process before its pool forks: a socket pair the pool processes inherit, a
    datagram a settle (BSON, checked where it is read), so that nothing outside the worker's own processes can
    send one and none of them can send code. A pool process's send is the whole of its share; the relay's thread
    in the main process takes every datagram waiting, writes them in one round trip, and takes those that came
    meanwhile. A settle too large for a datagram, or one sent when the main process is gone, is the pool process's
    own to write, at once (JobStore.settle_soon), as before the relay.

    Threads: a pool process's threads only send; in the main process the relay's thread alone receives and
    writes, and `flush` waits for it."""

    #: The largest settle a datagram carries (its result and tracebacks well under it): the pool process writes a
    #: larger one itself, which keeps the socket's buffer (wmem_default, about 200 KB) for many small ones.
    max_bytes = 32 * 1024
    #: How many typical gaps between settles a held write waits for the next settle. Two pool processes often end
    #: together, and then the mean gap is half the time to the next settle: at 1.5 gaps a pair that came together
    #: was written without a third; at 2.5 a third joins it more often.
    hold_gaps = 2.5

    def __init__(
        self,
        store: Callable[[], Any],
        replacement: Callable[[Any, Settle, bool, str], Settle],
        *,
        linger: float = 0.0,
    ) -> None:
        """`store` gives the main process's JobStore (on first use); `replacement(store, settle, with_result, cause)`
        the settle that fails a relayed settle's job when it can never be written, for `cause` (Settle.if_unwritable,
        which stays in the pool process): `with_result` when the settle carried the result backend's fields. `linger`
        (the `settle_linger` transport option) is the longest a settle waits for the next ones, and it waits only
        while settles come closer together than that (_hold): 0 writes each at once."""
        #: The main process: the only one that receives (a pool process sends).
        self.owner_pid = os.getpid()
        self._store = store
        self._replacement = replacement
        self.linger = linger
        self._receiving, self._sending = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._receiving.set_inheritable(False)
        self._readable = select.poll()  # the relay thread's wait for the next settle (_hold)
        self._readable.register(self._receiving, select.POLLIN)
        self._flushes: dict[int, threading.Event] = {}
        self._flush_lock = threading.Lock()
        self._flush_count = itertools.count()
        self._thread: threading.Thread | None = None
        self._writer: SettleWriter | None = None
        # The relay thread's: the store, and when the last settle came and how far apart they come.
        self._store_of_main: Any = None
        self._last_arrival: float | None = None
        self._typical_gap: float | None = None
        #: The jobs of the settles received and not yet written: replaced whole by the relay's thread, read by the
        #: lease keeper's (the Celery requests of these jobs are done, and they must stay live until written).
        self._unwritten: frozenset[str] = frozenset()
        self._closed = False
        reset_in_child(partial(_close_receiving_end, weakref.ref(self)))
        _writers.add(self)

    def pending_jobs(self) -> frozenset[str]:
        return self._unwritten

    def start(self) -> None:
        """Start receiving, in the main process."""
        if self._thread is None:
            self._thread = start_supervised("bb-settle-relay", self._run)

    def send(self, settle: Settle) -> bool:
        """In a pool process: hand `settle` to the main process; False when it is this process's to write."""
        if os.getpid() == self.owner_pid:
            return False
        with_result = "state" in settle.update.get("$set", {})
        message = {
            "job": settle.job_id,
            "attempts": settle.fence.get("attempts"),
            "update": settle.update,
            "outcome": settle.outcome,
            "subject": settle.subject,
            "withResult": with_result,
        }
        try:
            data = bson.encode(message)
        except Exception:  # a value BSON cannot hold: this process's own writer says so where it writes
            return False
        if len(data) > self.max_bytes:
            return False
        try:
            # One record of the socket pair (SOCK_SEQPACKET): whole, whichever pool process sends at the same time.
            # Never waiting (MSG_DONTWAIT): while the main process's writes are held up (an outage) and the socket's
            # buffer is full, this process writes its settles itself rather than stop at the end of each task.
            return self._sending.send(data, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT) == len(data)
        except OSError:  # the buffer is full, or the main process is gone (its end closed)
            return False

    def flush(self, timeout: float | None = None) -> bool:
        """In the main process: wait until every settle received so far is written; True in a pool process, whose
        sends are in the main process's hands once sent, and once closed."""
        if os.getpid() != self.owner_pid or self._thread is None or self._closed:
            return True
        written = threading.Event()
        with self._flush_lock:
            token = next(self._flush_count)
            self._flushes[token] = written
        deadline = None if timeout is None else time.monotonic() + timeout
        marker = bson.encode({"flush": token})
        try:
            while True:
                try:
                    # MSG_DONTWAIT: a blocking send would set nothing on the socket the pool processes share, but
                    # this one must give up at the deadline when the buffer stays full.
                    self._sending.send(marker, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        return False
                    time.sleep(0.01)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            return written.wait(remaining)
        except OSError:
            return False
        finally:
            with self._flush_lock:
                self._flushes.pop(token, None)

    def close(self) -> None:
        """Stop receiving (what was received is written first) and close both ends."""
        self.flush(5.0)
        self._closed = True
        self._receiving.shutdown(socket.SHUT_RDWR)  # the relay's thread wakes from its recv and ends
        if self._thread is not None:
            self._thread.join(5.0)
        self._receiving.close()
        self._sending.close()

    def _run(self) -> None:
        while not self._closed:
            datagrams = [self._receiving.recv(self.max_bytes)]
            if self._closed:
                return
            self._note_arrival()
            self._receive_waiting(datagrams)
            batch: list[Settle] = []
            flushed: list[int] = []
            try:
                self._read_all(datagrams, batch, flushed)
                if batch:
                    self._hold(batch, flushed)
                    self._writer_of_main().write(batch)
            finally:
                self._unwritten = frozenset()
                with self._flush_lock:
                    for token in flushed:
                        marker = self._flushes.get(token)
                        if marker is not None:
                            marker.set()

    def _receive_waiting(self, datagrams: list[bytes]) -> None:
        while len(datagrams) < GroupCommit.max_batch:
            try:
                datagrams.append(self._receiving.recv(self.max_bytes, socket.MSG_DONTWAIT))
            except BlockingIOError:
                return
            self._note_arrival()

    def _read_all(self, datagrams: list[bytes], batch: list[Settle], flushed: list[int]) -> None:
        for data in datagrams:
            try:
                read = self._read(data)
            except Exception:  # one datagram's fault must not cost the others their write
                logger.exception("a relayed settle could not be read, dropped")
                continue
            if isinstance(read, int):
                flushed.append(read)
            elif read is not None:
                batch.append(read)
        self._unwritten = frozenset(_ids(batch))

    def _note_arrival(self) -> None:
        now = time.monotonic()
        if self._last_arrival is not None:
            gap = min(now - self._last_arrival, 1.0)
            self._typical_gap = gap if self._typical_gap is None else 0.75 * self._typical_gap + 0.25 * gap
        self._last_arrival = now

    def _hold(self, batch: list[Settle], flushed: list[int]) -> None:
        """Wait for the next settles, when settles have been coming closer together than `linger` (a worker
        draining a backlog, whose tasks end a few milliseconds apart): each next one up to `hold_gaps` times their
        typical gap after the last, all of them within `linger` of the first, and they go in the same write.
        PostgreSQL's commit_delay, bounded by what the recent settles say. A lone task, or tasks that end further
        apart, are settled at once; so is one a flush waits for."""
        gap = self._typical_gap
        if flushed or self.linger <= 0 or gap is None or gap >= self.linger:
            return
        began = time.monotonic()
        while not flushed and len(batch) < GroupCommit.max_batch:
            now = time.monotonic()
            left = min(began + self.linger, now + self.hold_gaps * gap) - now
            if left <= 0 or not self._readable.poll(left * 1000) or self._closed:
                return
            datagrams: list[bytes] = []
            self._receive_waiting(datagrams)
            self._read_all(datagrams, batch, flushed)
            gap = self._typical_gap or gap

    def _main_store(self) -> Any:
        # Looked up once: the lookup reads the app's conf, a few percent of the main process's CPU per settle.
        if self._store_of_main is None:
            self._store_of_main = self._store()
        return self._store_of_main

    def _writer_of_main(self) -> SettleWriter:
        if self._writer is None:
            self._writer = self._main_store().settle_writer()
        return self._writer

    def _read(self, data: bytes) -> Settle | int | None:
        """A datagram as a settle (or a flush's token); None, logged, when it is not one a pool process sends."""
        try:
            message = bson.decode(data, codec_options=_RELAYED)
        except (bson.errors.InvalidBSON, ValueError) as exc:
            logger.error("a relayed settle is not BSON, dropped: %s", exc)
            return None
        if isinstance(message.get("flush"), int) and len(message) == 1:
            return int(message["flush"])
        job_id, attempts, update = message.get("job"), message.get("attempts"), message.get("update")
        outcome, subject = message.get("outcome"), message.get("subject")
        changes = update.get("$set") if isinstance(update, dict) else None
        if not (
            isinstance(job_id, str)
            and type(attempts) is int
            and isinstance(update, dict)
            and set(update) <= SETTLE_OPERATORS
            and all(isinstance(value, dict) and value for value in update.values())
            # every settle sets the job's status and its updatedAt (Settle.landed_in reads them back)
            and isinstance(changes, dict)
            and isinstance(changes.get("status"), str)
            and isinstance(changes.get("updatedAt"), datetime)
            and outcome in SETTLE_OUTCOMES
            and (subject is None or isinstance(subject, str))
        ):
            logger.error("a relayed settle is not one a pool process sends, dropped: %r", sorted(message))
            return None
        fence = {"_id": job_id, "status": RUNNING, "attempts": attempts}
        store, with_result = self._main_store(), message.get("withResult") is True
        settle = Settle(
            job_id, fence, update, outcome, lambda cause: self._replacement(store, settle, with_result, cause), subject
        )
        return settle


def _close_receiving_end(relay: weakref.ref[SettleRelay]) -> None:
    # In a forked child: a pool process keeps only the sending end. Once the main process is gone, a send fails and
    # the pool process writes its settle itself, where a receiving end still open here would take it to nobody.
    alive = relay()
    if alive is not None:
        alive._receiving.close()


def _ids(batch: list[Settle]) -> list[str]:
    return [settle.job_id for settle in batch]


def pending_jobs() -> list[str]:
    """The jobs whose settles this process's writers have yet to write. Their Celery requests are done, but they
    are live until written: the lease keeper keeps their leases fresh (an outage can hold a write for
    `settle_patience`), as it did while a pool process wrote its own settle before returning its task's result."""
    return [job_id for writer in list(_writers) for job_id in writer.pending_jobs()]


def written(timeout: float) -> bool:
    """Whether every settle this process's writers had (sent to its relay or not yet received) is written within
    `timeout` seconds: the lease keeper sweeps only then (leases.py), or it could take such a job back."""
    deadline = time.monotonic() + timeout
    return all(writer.flush(max(0.0, deadline - time.monotonic())) for writer in list(_writers))


def flush_all(timeout: float) -> None:
    """Wait (up to `timeout` seconds each) for the settles this process's writers still have: before it exits."""
    for writer in list(_writers):
        if not writer.flush(timeout):
            logger.error("settles were still unwritten at exit; the stale sweep runs their jobs again")


@reset_in_child
def _forget_parent_writers() -> None:
    _writers.clear()  # their threads stayed in the parent; a relay's sends need no flush


atexit.register(flush_all, 10.0)
