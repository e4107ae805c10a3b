"""Orphans and holders (ops.queries) on a real server, from documents written as the lifecycle writes them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import FilterError, JobFilter
from bb_broker.ops.operations import Operations
from tests.support.store import FakeClock

STALE_AFTER = 60.0
A = "box-a:101:01JOWNERA0000000000000000"
B = "box-b.example.org:202:01JOWNERB0000000000000000"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ops(db: Database, clock: FakeClock) -> Operations:
    store = JobStore(db, Policy(max_attempts=3, stale_after=STALE_AFTER), clock=clock)
    store.ensure_indexes(retention=0)
    return Operations(store)


def running(db: Database, clock: FakeClock, job_id: str, owner: str | None, heartbeat_ago: float) -> None:
    """A running job as a claim and its heartbeats leave it: held by `owner`, last heartbeat `heartbeat_ago` s ago."""
    started = clock.now - timedelta(seconds=heartbeat_ago + 30)
    doc = {"_id": job_id, "taskId": f"t-{job_id}", "kind": "app.add", "queue": "celery", "status": "running",
           "attempts": 1, "priority": 0, "createdAt": started, "startedAt": started, "runAfter": started,
           "updatedAt": clock.now - timedelta(seconds=heartbeat_ago)}  # fmt: skip
    if owner is not None:
        doc["leaseOwner"] = owner
    db.jobs.insert_one(doc)


def test_running_jobs_whose_lease_ran_out_are_orphaned(ops: Operations, db: Database, clock: FakeClock) -> None:
    running(db, clock, "01J000000000000000000000A1", A, heartbeat_ago=5)  # alive
    running(db, clock, "01J000000000000000000000A2", A, heartbeat_ago=STALE_AFTER + 1)  # lost
    running(db, clock, "01J000000000000000000000B1", B, heartbeat_ago=STALE_AFTER * 10)  # lost
    db.jobs.insert_one({"_id": "01J000000000000000000000Q1", "status": "queued", "queue": "celery",
                        "updatedAt": clock.now - timedelta(days=1)})  # fmt: skip
    orphans = JobFilter.parse({"orphaned": "1"}, ops.now(), stale_after=STALE_AFTER)
    assert orphans.status == "running" and orphans.as_dict() == {"status": "running", "orphaned": "1"}
    assert [doc["_id"] for doc in ops.list_jobs(orphans).jobs] == [
        "01J000000000000000000000B1",
        "01J000000000000000000000A2",
    ]
    assert ops.count(orphans) == 2 == ops.orphaned_count()
    everything = ops.list_jobs(JobFilter()).jobs
    assert {doc["_id"] for doc in everything if doc.get("orphaned")} == {
        "01J000000000000000000000A2",
        "01J000000000000000000000B1",
    }
    # The requeue action takes exactly the orphans of a filter; the sweep then has none left to find.
    assert ops.count(orphans, "requeue") == 2
    clock.advance(STALE_AFTER)  # the live job's heartbeat is late now too, but its lease is only gone from here
    assert ops.orphaned_count() == 3
    assert ops.store.requeue_stale() == (3, 0)
    assert ops.orphaned_count() == 0 and ops.list_jobs(orphans).jobs == []


def test_the_orphaned_filter_says_what_is_wrong(ops: Operations) -> None:
    with pytest.raises(FilterError, match="orphaned jobs are running: status failed has none"):
        JobFilter.parse({"orphaned": "1", "status": "failed"}, ops.now())
    with pytest.raises(FilterError, match="orphaned must be 1 .* or 0, not 'maybe'"):
        JobFilter.parse({"orphaned": "maybe"}, ops.now())
    assert JobFilter.parse({"orphaned": "0"}, ops.now()) == JobFilter()


def test_holders_say_what_each_worker_holds(ops: Operations, db: Database, clock: FakeClock) -> None:
    for n in range(12):
        running(db, clock, f"01J0000000000000000000A{n:03d}", A, heartbeat_ago=5 + n)
    running(db, clock, "01J000000000000000000000B1", B, heartbeat_ago=STALE_AFTER + 1)
    running(db, clock, "01J000000000000000000000X1", None, heartbeat_ago=1)  # a hand-written one: no owner
    running(db, clock, "01J000000000000000000000X2", "by hand", heartbeat_ago=1)
    db.jobs.update_one({"_id": "01J000000000000000000000X2"}, {"$unset": {"updatedAt": ""}})
    holders = {holder["owner"]: holder for holder in ops.holders()}
    assert set(holders) == {A, B, None, "by hand"}
    a = holders[A]
    assert (a["host"], a["pid"], a["running"], a["orphaned"]) == ("box-a", 101, 12, 0)
    assert a["jobs"] == [f"01J0000000000000000000A{n:03d}" for n in range(10)]  # the first ten, in id order
    assert a["lastHeartbeat"] == clock.now - timedelta(seconds=5)
    assert a["since"] == clock.now - timedelta(seconds=5 + 11 + 30)
    b = holders[B]
    assert (b["host"], b["pid"], b["running"], b["orphaned"]) == ("box-b.example.org", 202, 1, 1)
    assert (holders[None]["host"], holders[None]["pid"]) == (None, None)
    # No heartbeat at all is not a lease that ran out (the stale sweep does not take it either).
    assert holders["by hand"]["orphaned"] == 0 and holders["by hand"]["pid"] is None
