"""At 100k jobs, the claims, the stale sweep, statuses() and the operator's lists and look-ups read through an index,
with no in-memory sort."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, SUCCEEDED, Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.store import (
    CommandLog,
    FakeClock,
    assert_each_reads_through_an_index,
    assert_lists_read_through_an_index,
)

JOBS = 100_000
BATCH = 5_000
QUEUES = ("celery", "mail", "reports")


def job(i: int, clock: FakeClock) -> dict:
    """The shape publish() writes, in the mix a long-lived deployment holds: mostly finished, some waiting."""
    status = (SUCCEEDED,) * 6 + (QUEUED, QUEUED, RUNNING, FAILED)
    created = clock.now - timedelta(seconds=JOBS - i)
    state = status[i % len(status)]
    return {
        "_id": f"{i:026d}",
        "kind": "app.task",
        "taskId": f"task-{i}",
        "queue": QUEUES[i % len(QUEUES)],
        "priority": i % 10,
        "payload": {"args": [i], "kwargs": {}, "options": {}},
        "status": state,
        "attempts": 0 if state == QUEUED else 1 + i % 3,
        "runAfter": created + timedelta(seconds=(i % 7) * 30),  # some due, some not yet
        "createdAt": created,
        "updatedAt": created,
        **({"leaseOwner": f"host:{i % 16}:w"} if state == RUNNING else {}),
        **({"finishedAt": created} if state in (SUCCEEDED, FAILED) else {}),
    }


@pytest.mark.heavy
@pytest.mark.timeout(1800)  # inserting 100k jobs into eight indexes takes minutes on the Python stand-in
def test_claim_sweep_and_statuses_read_through_an_index_at_100k_jobs(mongo_url: str, db: Database) -> None:
    clock = FakeClock()
    store = JobStore(db, Policy(stale_after=300.0), clock=clock)
    store.ensure_indexes(retention=0)  # the fake clock is months back: a TTL would expire the succeeded jobs
    for start in range(0, JOBS, BATCH):
        db.jobs.insert_many([job(i, clock) for i in range(start, start + BATCH)], ordered=False)
    assert db.jobs.estimated_document_count() == JOBS

    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        watched = JobStore(client[db.name], Policy(stale_after=300.0), clock=clock)
        claimed = watched.claim("mail", "w")
        batch = watched.claim_many("mail", "w", 8)
        recovered = watched.requeue_stale()
        counts = watched.statuses()
    assert claimed is not None and len(batch) == 8 and sum(recovered) > 0  # each query had work to find among the 100k
    assert sum(counts.values()) == JOBS

    names = [c["findAndModify"] if "findAndModify" in c else next(iter(c)) for c in log.commands]
    assert names == ["jobs", "find", "update", "update", "update", "aggregate"], names
    assert_each_reads_through_an_index(db, log.commands)

    # The Jobs tab's lists (every filter shape), look-ups by job id and task id, and counts.
    lists = CommandLog()
    with MongoClient(mongo_url, event_listeners=[lists], tz_aware=True) as client:
        assert_lists_read_through_an_index(Operations(JobStore(client[db.name], clock=clock)), db, lists)
