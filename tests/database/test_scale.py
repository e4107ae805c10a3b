"""At 100k jobs, the claims, the stale sweep, statuses() and the operator's lists, look-ups, charts and argument
searches read through an index, with no in-memory sort; the charts' and searches' times are printed (run with -s, or
see docs/explanation/performance.md)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, SUCCEEDED, Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import JobFilter
from bb_broker.ops.operations import Operations
from bb_broker.ops.stats import Window, job_stats, summarize_ahead
from bb_broker.ops.summaries import Summaries
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
    """The shape the lifecycle writes, in the mix a long-lived deployment holds: mostly finished, some waiting, a
    third of the finished ones after a failed attempt or two (in their history)."""
    status = (SUCCEEDED,) * 6 + (QUEUED, QUEUED, RUNNING, FAILED)
    created = clock.now - timedelta(seconds=JOBS - i)
    state = status[i % len(status)]
    attempts = 0 if state == QUEUED else 1 + i % 3
    started = created - timedelta(seconds=i % 5)  # the last attempt's start, i % 5 s before its finish
    earlier = [
        {"n": n, "worker": "host:w", "startedAt": started, "finishedAt": started, "outcome": "failed"}
        for n in range(1, attempts)
    ]
    last = [{"n": attempts, "worker": "host:w", "startedAt": started, "finishedAt": created, "outcome": state}]
    return {
        "_id": f"{i:026d}",
        "kind": "app.task",
        "taskId": f"task-{i}",
        "queue": QUEUES[i % len(QUEUES)],
        "priority": i % 10,
        "payload": {"args": [i], "kwargs": {}, "options": {}},
        "status": state,
        "attempts": attempts,
        # Some queued jobs are due, some not yet; the others waited i % 7 s for their last attempt.
        "runAfter": created + timedelta(seconds=(i % 7) * 30)
        if state == QUEUED
        else started - timedelta(seconds=i % 7),
        "createdAt": created,
        "updatedAt": created,
        **({"leaseOwner": f"host:{i % 16}:w", "startedAt": started, "history": earlier} if state == RUNNING else {}),
        **(
            {"startedAt": started, "finishedAt": created, "history": earlier + last}
            if state in (SUCCEEDED, FAILED)
            else {}
        ),
    }


def fill(store: JobStore, db: Database, clock: FakeClock) -> None:
    store.ensure_indexes(retention=0)  # the fake clock is months back: a TTL would expire the succeeded jobs
    for start in range(0, JOBS, BATCH):
        db.jobs.insert_many([job(i, clock) for i in range(start, start + BATCH)], ordered=False)
    assert db.jobs.estimated_document_count() == JOBS


@pytest.mark.heavy
@pytest.mark.timeout(1800)  # inserting 100k jobs into eight indexes takes minutes on the Python stand-in
def test_claim_sweep_and_statuses_read_through_an_index_at_100k_jobs(mongo_url: str, db: Database) -> None:
    clock = FakeClock()
    store = JobStore(db, Policy(stale_after=300.0), clock=clock)
    fill(store, db, clock)

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


@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_charts_and_argument_searches_read_through_an_index_at_100k_jobs(mongo_url: str, db: Database) -> None:
    """The Jobs tab's charts and argument searches: each one query, through an index, with the numbers it must
    give; their times printed (-s)."""
    clock = FakeClock()
    fill(JobStore(db, clock=clock), db, clock)
    answers = CommandLog()
    timings: dict[str, float] = {}
    with MongoClient(mongo_url, event_listeners=[answers], tz_aware=True) as client:
        operations = Operations(JobStore(client[db.name], clock=clock))

        def timed(name: str, answer):
            began = time.perf_counter()
            result = answer()
            timings[name] = time.perf_counter() - began
            return result

        mail, week = JobFilter(queue="mail"), timedelta(days=7)
        windows = ((timedelta(hours=1), "1h"), (timedelta(days=1), "1d"), (timedelta(days=7), "7d"))
        # What a chart costs with nothing summarized, when it summarizes its whole window itself (and keeps nothing).
        timed("chart 7d, summarizing it all", lambda: job_stats(operations, JobFilter(), week, keep_summaries=False))
        # The first charts after an upgrade: a worker's pass summarizes the week in the background (its
        # bb-chart-summaries thread, at worker_ready), holding the turn, while the Jobs tab's charts summarize at most
        # a quarter hour themselves and leave the rest as gaps.
        # The turn is taken here and the pass ended here, so that the charts see it under way however fast it goes.
        turn = Summaries(db.jobs, clock)
        assert turn.take_turn("worker@test:1", timedelta(minutes=10))
        worker = Operations(JobStore(db, clock=clock))
        with ThreadPoolExecutor(1) as background:
            passing = background.submit(timed, "a worker's pass over the week", lambda: summarize_ahead(worker))
            tab_charts = {
                name: timed(f"tab chart {name}, worker summarizing", lambda length=length: job_stats(
                    operations, JobFilter(), length, leave_to_holder=True))
                for length, name in windows
            }  # fmt: skip
            assert passing.result() > 0
        turn.end_pass("worker@test:1")
        left_to_the_worker = {name: len(chart["pending"]) for name, chart in tab_charts.items()}
        # An hour's chart reads the jobs; a day's and a week's leave all but their newest quarter hour to the pass,
        # unless the pass had written its summaries before they looked (tests/database/test_stats.py shows it
        # without the race).
        assert left_to_the_worker["1h"] == 0 and left_to_the_worker["1d"] in (0, 93), left_to_the_worker
        assert left_to_the_worker["7d"] in (0, 167), left_to_the_worker
        first_charts = {}
        for length, name in windows:
            chart = timed(f"chart {name}", lambda length=length: job_stats(operations, JobFilter(), length))
            start = Window.ending(clock.now, length).start
            expected = db.jobs.count_documents({"status": {"$in": [SUCCEEDED, FAILED]}, "finishedAt": {"$gte": start}})
            assert sum(chart["series"]["all"]["succeeded"]) + sum(chart["series"]["all"]["failed"]) == expected, name
            first_charts[name] = chart
            # The tab's chart drawn while the worker summarized: the same numbers, but for the intervals it left as
            # gaps (no numbers at all), named as the worker's.
            left = {tab_charts[name]["intervals"].index(at) for at in tab_charts[name]["pending"]}
            assert not left or tab_charts[name]["summarizing"] == "worker@test:1"
            for series, values in chart["series"]["all"].items():
                drawn = tab_charts[name]["series"]["all"][series]
                assert [v for n, v in enumerate(drawn) if n not in left] == [
                    v for n, v in enumerate(values) if n not in left
                ] and all(drawn[n] is None for n in left), name
        # Every attempt before a job's last failed; every job waited i % 7 s and ran i % 5 s.
        retried = sum(max(job(i, clock)["attempts"] - 1, 0) for i in range(JOBS))
        week_chart = chart["series"]["all"]
        assert sum(week_chart["retried"]) == retried
        assert max(v for v in week_chart["runP95"] if v is not None) == 4
        assert max(v for v in week_chart["waitP95"] if v is not None) == 6
        by_queue = timed("chart 7d by queue", lambda: job_stats(operations, JobFilter(), week, "queue"))
        assert sorted(by_queue["series"]) == sorted(QUEUES)
        of_mail = timed("chart 7d of queue=mail", lambda: job_stats(operations, mail, week))
        assert sum(of_mail["series"]["all"]["succeeded"]) == sum(by_queue["series"]["mail"]["succeeded"])
        newest = JobFilter.parse({"args.0": str(JOBS - 1)}, clock.now)
        found = timed("search args.0", lambda: operations.list_jobs(newest))
        assert [row["taskId"] for row in found.jobs] == [f"task-{JOBS - 1}"]
        in_mail = JobFilter.parse({"args.0": str(JOBS - 3), "queue": "mail"}, clock.now)  # JOBS - 3 is mail's
        assert [
            row["taskId"] for row in timed("search args.0 in mail", lambda: operations.list_jobs(in_mail)).jobs
        ] == [f"task-{JOBS - 3}"]
        searched_chart = timed("chart 1d of a search", lambda: job_stats(operations, newest, timedelta(days=1)))
        assert sum(searched_chart["series"]["all"]["succeeded"]) + sum(searched_chart["series"]["all"]["failed"]) <= 1
        # The worker summarized every closed quarter hour: the charts read those, and the jobs of the last minutes
        # only, with the same numbers each time.
        for length, name in ((timedelta(days=1), "1d"), (timedelta(days=7), "7d")):
            again = timed(f"chart {name} again", lambda length=length: job_stats(operations, JobFilter(), length))
            assert again["summarizedUntil"] is not None and again["series"] == first_charts[name]["series"], name
        again_by_queue = timed("chart 7d by queue again", lambda: job_stats(operations, JobFilter(), week, "queue"))
        assert again_by_queue["series"] == by_queue["series"]
    assert_each_reads_through_an_index(db, answers.commands)
    print("\n".join(f"{name:<28} {seconds * 1000:8.0f} ms" for name, seconds in timings.items()))
    print(f"intervals the tab's charts left to the worker's pass: {left_to_the_worker}")
