"""The charts' numbers (ops.stats) from documents written as the lifecycle writes them: counts and percentiles."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import FilterError, JobFilter, Operations
from bb_broker.ops.stats import Window, job_stats, percentile
from tests.support.store import CommandLog, FakeClock, assert_each_reads_through_an_index


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ops(db: Database, clock: FakeClock) -> Operations:
    store = JobStore(db, Policy(), clock=clock)
    store.ensure_indexes(retention=0)
    return Operations(store)


def finished(db: Database, now: datetime, job_id: str, *, queue: str, status: str, ago: float, wait: float,
             run: float, history: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
    """A job as its settle leaves it: finished `ago` seconds before `now`, its last attempt waited `wait` s after its
    runAfter and ran `run` s."""
    done = now - timedelta(seconds=ago)
    started = done - timedelta(seconds=run)
    attempts = len(history) if history else 1
    entries = history or [{"n": 1, "outcome": status, "startedAt": started, "finishedAt": done}]
    db.jobs.insert_one({"_id": job_id, "queue": queue, "kind": f"app.{queue}", "status": status, "attempts": attempts,
                        "runAfter": started - timedelta(seconds=wait), "startedAt": started, "finishedAt": done,
                        "updatedAt": done, "createdAt": started, "history": entries})  # fmt: skip


def entry(now: datetime, n: int, outcome: str, ago: float) -> dict[str, Any]:
    return {"n": n, "outcome": outcome, "finishedAt": now - timedelta(seconds=ago)}


def test_counts_and_percentiles_per_interval(ops: Operations, db: Database, clock: FakeClock) -> None:
    now = clock.now  # 2026-01-01 00:00: the hour's window is 23:01 to 00:01, a minute per interval
    finished(db, now, "a1", queue="a", status="succeeded", ago=600, wait=1, run=2)  # 23:50: interval 49
    finished(db, now, "a2", queue="a", status="succeeded", ago=590, wait=3, run=4)
    finished(db, now, "b1", queue="b", status="succeeded", ago=570, wait=0, run=10,
             history=[entry(now, 1, "failed", 620), entry(now, 2, "succeeded", 570)])  # fmt: skip
    finished(db, now, "b2", queue="b", status="failed", ago=120, wait=2, run=5,
             history=[entry(now, 1, "lost", 130), entry(now, 2, "failed", 120)])  # fmt: skip
    finished(db, now, "old", queue="a", status="succeeded", ago=7200, wait=1, run=1)  # before the window
    db.jobs.insert_one({"_id": "c1", "queue": "c", "kind": "app.c", "status": "queued", "attempts": 1,
                        "updatedAt": now - timedelta(seconds=300), "runAfter": now,
                        "history": [entry(now, 1, "retry", 300)]})  # fmt: skip

    stats = job_stats(ops, JobFilter(), timedelta(hours=1))
    assert stats["from"] == "2025-12-31T23:01:00+00:00" and stats["until"] == "2026-01-01T00:01:00+00:00"
    assert stats["step"] == 60 and len(stats["intervals"]) == 60 and stats["intervals"][49].endswith("23:50:00+00:00")
    (everything,) = stats["series"].values()
    nonzero = {name: {n: v for n, v in enumerate(values) if v} for name, values in everything.items()}
    assert nonzero["succeeded"] == {49: 3} and nonzero["failed"] == {57: 1}
    # b1's first attempt (23:49:40), c1's own retry (23:55), b2's lost first attempt (23:57:50); not b2's last.
    assert nonzero["retried"] == {48: 1, 54: 1, 56: 1}
    assert everything["runP50"][49] == 4 and everything["runP95"][49] == 10  # nearest rank of 2, 4, 10
    assert everything["waitP50"][49] == 1 and everything["waitP95"][49] == 3  # of 0, 1, 3
    assert everything["runP50"][57] == 5 == everything["runP95"][57] and everything["waitP50"][57] == 2
    assert everything["runP50"][0] is None and everything["succeeded"][0] == 0

    by_queue = job_stats(ops, JobFilter(), timedelta(hours=1), by="queue")["series"]
    assert set(by_queue) == {"a", "b", "c"}
    assert by_queue["a"]["succeeded"][49] == 2 and by_queue["b"]["succeeded"][49] == 1
    assert by_queue["b"]["failed"][57] == 1 and sum(by_queue["c"]["retried"]) == 1
    only_b = job_stats(ops, JobFilter(queue="b"), timedelta(hours=1))["series"]
    assert list(only_b) == ["all"] and only_b["all"]["succeeded"][49] == 1 and sum(only_b["all"]["retried"]) == 2


def test_a_busy_intervals_percentiles_are_of_its_first_jobs_and_its_counts_stay_exact(
    ops: Operations, db: Database, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bb_broker.ops.stats

    monkeypatch.setattr(bb_broker.ops.stats, "TIMED_PER_GROUP", 3)  # so that five jobs make a busy interval
    now = clock.now
    for n, run in enumerate((1, 2, 3, 40, 50)):  # finished in this order within one minute
        finished(db, now, f"j{n}", queue="a", status="succeeded", ago=600 - n, wait=0, run=run)
    (everything,) = job_stats(ops, JobFilter(), timedelta(hours=1))["series"].values()
    assert everything["succeeded"][49] == 5
    assert everything["runP95"][49] == 3  # of the first three the server sent


def test_hand_edited_times_leave_their_job_counted_and_untimed_and_fail_no_chart(
    ops: Operations, db: Database, clock: FakeClock
) -> None:
    now = clock.now
    finished(db, now, "good", queue="a", status="succeeded", ago=600, wait=2, run=3)
    finished(db, now, "text-start", queue="a", status="succeeded", ago=600, wait=1, run=1)
    db.jobs.update_one({"_id": "text-start"}, {"$set": {"startedAt": "yesterday"}})
    finished(db, now, "no-due", queue="a", status="failed", ago=600, wait=1, run=7)
    db.jobs.update_one({"_id": "no-due"}, {"$set": {"runAfter": 12}})
    finished(db, now, "text-finish", queue="a", status="succeeded", ago=600, wait=1, run=1)
    db.jobs.update_one({"_id": "text-finish"}, {"$set": {"finishedAt": "soon"}})
    finished(db, now, "early", queue="a", status="succeeded", ago=600, wait=-5, run=3)  # runAfter after its start

    (everything,) = job_stats(ops, JobFilter(), timedelta(hours=1))["series"].values()
    # Counted: every job with a finishedAt date in the window; text-finish has none.
    assert (everything["succeeded"][49], everything["failed"][49]) == (3, 1)
    # Timed: good (wait 2, run 3), early (wait clamped to 0, run 3), no-due (run 7 only); text-start neither.
    assert (everything["waitP50"][49], everything["waitP95"][49]) == (0, 2)
    assert (everything["runP50"][49], everything["runP95"][49]) == (3, 7)


def test_windows_and_bad_values(ops: Operations, clock: FakeClock) -> None:
    day = Window.ending(clock.now, timedelta(days=1))
    assert (day.step, day.count) == (timedelta(minutes=15), 96)
    week = Window.ending(clock.now, timedelta(weeks=1))
    assert (week.step, week.count) == (timedelta(hours=1), 168) and week.end > clock.now >= week.start
    with pytest.raises(FilterError, match="from 1 minute to 31 days"):
        Window.ending(clock.now, timedelta(days=32))
    with pytest.raises(FilterError, match="by must be one of queue, kind"):
        job_stats(ops, JobFilter(), timedelta(hours=1), by="status")
    assert percentile([], 0.5) is None and percentile([3.0], 0.95) == 3.0
    assert percentile([float(n) for n in range(1, 101)], 0.95) == 95.0


def test_every_chart_reads_through_the_status_index(ops: Operations, db: Database, clock: FakeClock,
                                                   mongo_url: str) -> None:  # fmt: skip
    # The charts add no index of their own: the window is a range of bb_status_updated, which the sweeps use.
    from pymongo import MongoClient

    now = clock()
    for n, queue in enumerate(("mail", "celery", "mail")):
        finished(db, now, f"j{n}", queue=queue, status="succeeded", ago=60 * n, wait=1, run=2)
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        watched = Operations(JobStore(client[db.name], Policy(), clock=clock))
        for job_filter, by in ((JobFilter(), None), (JobFilter(queue="mail"), None), (JobFilter(kind="app.mail"), None),
                               (JobFilter(status="failed"), "queue"), (JobFilter(), "kind")):  # fmt: skip
            job_stats(watched, job_filter, timedelta(hours=1), by)
    aggregates = [command for command in log.commands if "aggregate" in command]
    assert len(aggregates) == 10  # two a chart: its finished jobs and its retried attempts
    assert_each_reads_through_an_index(db, aggregates)
    assert all(command["hint"] == "bb_status_updated" for command in aggregates)
