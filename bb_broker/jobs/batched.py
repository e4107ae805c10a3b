"""Queued jobs inserted many at a time (bb_broker.bulk): each document as JobStore.publish writes it, the batch as one
unordered insert, and what each job became (published, refused, or not known) said per job.

The jobs' `_id`s are chosen before the first try and kept by the caller (see bulk.py), so that an insert tried again,
here after a lost connection or by a caller after an error, finds the jobs that landed instead of writing twins: a
duplicate `_id` holding the same task for the same queue is a job this batch published.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import bson
from bson.raw_bson import RawBSONDocument
from pymongo.collection import Collection as MongoCollection
from pymongo.errors import BulkWriteError, PyMongoError

from bb_broker import metrics
from bb_broker.jobs.document import MAX_DOCUMENT_BYTES, JobTooLarge
from bb_broker.jobs.lifecycle import QUEUED
from bb_broker.jobs.refusals import PublishRefused
from bb_broker.jobs.unique import DuplicateJob, Hold
from bb_broker.server import Capabilities, is_transient, server_words, too_large_write_error, write_error_words

#: Seconds an insert keeps trying through a failover or a restart before its jobs are reported as not known.
BATCH_PATIENCE = 30.0


def queued_job(
    *,
    job_id: str,
    kind: str,
    task_id: str,
    queue: str,
    priority: int,
    payload: dict[str, Any],
    due: datetime,
    now: datetime,
    unique: Hold | None = None,
    schedule: str | None = None,
    serial_key: str | None = None,
    rate_key: str | None = None,
    fair_key: str | None = None,
    canvas: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A new queued job's document (JobStore.publish's and a batch's)."""
    return {
        "_id": job_id,
        "kind": kind,
        "taskId": task_id,
        "queue": queue,
        "priority": priority,
        "payload": payload,
        "status": QUEUED,
        "attempts": 0,
        "runAfter": due,
        "createdAt": now,
        "updatedAt": now,
        **({} if unique is None else unique.fields()),
        **({} if schedule is None else {"schedule": schedule}),
        **({} if serial_key is None else {"serialKey": serial_key}),
        **({} if rate_key is None else {"rateKey": rate_key}),
        **({} if fair_key is None else {"fairKey": fair_key}),
        **(canvas or {}),
    }


class BatchingStore(Protocol):
    """What a batch's insert needs of the store it writes to (JobStore, which builds its own jobs with queued_job)."""

    coll: MongoCollection

    @property
    def server(self) -> Capabilities: ...

    @property
    def secrets(self) -> tuple[str, ...]: ...


class PublishUnknown(PublishRefused):
    """A job whose insert got no answer: it may be on the server or not. The same call again publishes it once."""


@dataclass
class Pending:
    """One job of a batch: its caller's `index` (the signature's place in the call), the document, its hold."""

    index: int
    document: dict[str, Any]
    unique: Hold | None = None

    @property
    def task_id(self) -> str:
        return str(self.document["taskId"])


@dataclass
class Outcome:
    """What each job of a batch became: published, or refused (a PublishRefused or DuplicateJob saying why)."""

    published: list[Pending] = field(default_factory=list)
    refused: list[tuple[Pending, Exception]] = field(default_factory=list)


def insert_queued(store: BatchingStore, jobs: Sequence[Pending], *, batch_size: int) -> Outcome:
    """Insert `jobs`, `batch_size` per unordered insert; never raises for one job (each is in the Outcome)."""
    outcome = Outcome()
    encoded: list[tuple[Pending, RawBSONDocument]] = []
    for job in jobs:
        raw = bson.encode(job.document)
        if len(raw) > MAX_DOCUMENT_BYTES:
            message = f"task message does not fit in a MongoDB document (limit {MAX_DOCUMENT_BYTES} bytes)"
            outcome.refused.append((job, JobTooLarge(f"{message}: {len(raw)} bytes")))
        else:
            encoded.append((job, RawBSONDocument(raw)))
    for start in range(0, len(encoded), batch_size):
        _insert_batch(store, encoded[start : start + batch_size], outcome)
    metrics.record("enqueued", len(outcome.published))
    return outcome


def _insert_batch(store: BatchingStore, batch: list[tuple[Pending, RawBSONDocument]], outcome: Outcome) -> None:
    deadline = time.monotonic() + BATCH_PATIENCE
    delay = 0.1
    while True:
        try:
            store.coll.insert_many([raw for _, raw in batch], ordered=False)
        except BulkWriteError as exc:
            _sort_refusals(store, batch, exc, outcome)
            return
        except PyMongoError as exc:
            if is_transient(exc) and time.monotonic() < deadline:
                # The same documents again: those that landed come back as duplicates of their own _id (ours).
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            _sort_unanswered(store, batch, exc, outcome)
            return
        outcome.published.extend(job for job, _ in batch)
        return


def _sort_refusals(
    store: BatchingStore, batch: list[tuple[Pending, RawBSONDocument]], exc: BulkWriteError, outcome: Outcome
) -> None:
    """An unordered insert's refusals, job by job: every job without a write error landed."""
    errors = {int(error["index"]): error for error in exc.details.get("writeErrors", [])}
    duplicates = [batch[i][0] for i, error in errors.items() if store.server.only_unique_refusals([error])]
    ours = _landed(store, duplicates)
    for position, (job, _) in enumerate(batch):
        error = errors.get(position)
        if error is None or job.document["_id"] in ours:
            outcome.published.append(job)
        elif store.server.only_unique_refusals([error]):
            outcome.refused.append((job, _duplicate(store, job, error)))
        elif too_large_write_error(error):
            message = f"task message does not fit in a MongoDB document (limit {MAX_DOCUMENT_BYTES} bytes)"
            outcome.refused.append((job, JobTooLarge(f"{message}: {error.get('errmsg', '')}")))
        else:
            refusal = PublishRefused(f"the server refused the job: {write_error_words(error, store.secrets)}")
            outcome.refused.append((job, refusal))


def _landed(store: BatchingStore, jobs: Sequence[Pending]) -> set[str]:
    """The `_id`s among `jobs` already on the server with the same task and queue: an earlier try's inserts."""
    if not jobs:
        return set()
    wanted = {job.document["_id"]: (job.task_id, job.document["queue"]) for job in jobs}
    found = store.coll.find({"_id": {"$in": list(wanted)}}, {"taskId": 1, "queue": 1})
    return {doc["_id"] for doc in found if (doc.get("taskId"), doc.get("queue")) == wanted[doc["_id"]]}


def _duplicate(store: BatchingStore, job: Pending, error: dict[str, Any]) -> Exception:
    """The refusal of a job a unique index refused: DuplicateJob naming the holder of its key."""
    if job.unique is not None:
        holder = store.coll.find_one({job.unique.field: job.unique.key}, {"taskId": 1})
        if holder is not None:
            metrics.record("refused_duplicate")
            return DuplicateJob(job.unique.key, holder.get("taskId"), holder["_id"])
    # Its _id taken by another task's job (an id reused by hand), or a key freed since the refusal: the caller's
    # next try with a fresh signature publishes it.
    return PublishRefused(f"a unique index refused the job: {error.get('errmsg', '')}")


def _sort_unanswered(
    store: BatchingStore, batch: list[tuple[Pending, RawBSONDocument]], exc: PyMongoError, outcome: Outcome
) -> None:
    """An insert that failed as a whole: the jobs found on the server landed; the others are refused (the server's
    words) when it can be read, not known when it cannot."""
    words = server_words(exc, store.secrets)
    try:
        landed = _landed(store, [job for job, _ in batch])
    except PyMongoError:
        for job, _ in batch:
            outcome.refused.append((job, PublishUnknown(f"the insert got no answer: {words}")))
        return
    for job, _ in batch:
        if job.document["_id"] in landed:
            outcome.published.append(job)
        else:
            outcome.refused.append((job, PublishRefused(f"the server refused the insert: {words}")))
