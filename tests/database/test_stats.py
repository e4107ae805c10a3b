"""The charts' numbers (ops.stats) from documents written as the lifecycle writes them: counts and percentiles."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.cli import main
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import FilterError, JobFilter
from bb_broker.ops.operations import Operations
from bb_broker.ops.stats import Window, job_stats, percentile, summarize_ahead
from bb_broker.ops.summaries import Summaries
from tests.support.servers import AUTH_PASSWORD
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


# --- the summaries of closed quarter hours ---------------------------------------------------------------------------
# A day's window in the fake clock's time: 00:15 yesterday to 00:15, 96 quarter hours; summarized until 23:45 (five
# minutes before 00:00, floored to its quarter hour), the quarter hours after read from the jobs.
DAY = timedelta(days=1)


def three_finished_at_23(db: Database, now: datetime) -> None:
    """Three jobs that finished in the quarter hour of 23:00 (the day's interval 91), one after a lost attempt; one
    at 22:00 (interval 87)."""
    finished(db, now, "a1", queue="a", status="succeeded", ago=3600, wait=1, run=2)
    finished(db, now, "a2", queue="a", status="succeeded", ago=3590, wait=3, run=4)
    finished(db, now, "b1", queue="b", status="failed", ago=3000, wait=2, run=5,
             history=[entry(now, 1, "lost", 3100), entry(now, 2, "failed", 3000)])  # fmt: skip
    finished(db, now, "old", queue="a", status="succeeded", ago=7200, wait=1, run=1)


def nonzero(series: dict[str, list[Any]]) -> dict[str, dict[int, Any]]:
    """Each series' intervals with a value, the series with none left out."""
    found = {name: {n: v for n, v in enumerate(values) if v} for name, values in series.items()}
    return {name: values for name, values in found.items() if values}


def test_a_days_chart_summarizes_its_closed_quarter_hours_once_and_reads_only_the_rest_from_the_jobs(
    ops: Operations, db: Database, clock: FakeClock, mongo_url: str
) -> None:
    now = clock.now
    three_finished_at_23(db, now)
    finished(db, now, "t1", queue="a", status="succeeded", ago=120, wait=1, run=1)  # 23:58, after the summaries

    first = job_stats(ops, JobFilter(), DAY)
    assert first["summarizedUntil"] == "2025-12-31T23:45:00+00:00"
    (everything,) = first["series"].values()
    found = nonzero(everything)
    assert found["succeeded"] == {87: 1, 91: 2, 94: 1} and found["failed"] == {91: 1} and found["retried"] == {91: 1}
    assert (everything["runP50"][91], everything["runP95"][91]) == (4, 5)  # of 2, 4, 5
    assert (everything["waitP50"][91], everything["waitP95"][91]) == (2, 3)  # of 1, 3, 2
    # One marker per summarized quarter hour (00:15 to 23:30, 94 of them), and a group per queue and kind with jobs.
    assert db.bb_stats.count_documents({"group": False}) == 94
    groups = {(doc["at"].strftime("%H:%M"), doc["queue"]): doc for doc in db.bb_stats.find({"group": True})}
    assert sorted(groups) == [("22:00", "a"), ("23:00", "a"), ("23:00", "b")]
    assert (groups[("23:00", "a")]["succeeded"], sorted(groups[("23:00", "a")]["runs"])) == (2, [2000, 4000])
    assert (groups[("23:00", "b")]["failed"], groups[("23:00", "b")]["retried"]) == (1, 1)

    # Kept as it was: a job deleted since (retention, an operator) is still counted where it finished; a job that
    # finished after the summaries is read from the jobs.
    db.jobs.delete_one({"_id": "a1"})
    finished(db, now, "t2", queue="b", status="failed", ago=60, wait=0, run=1)
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        again = job_stats(Operations(JobStore(client[db.name], Policy(), clock=clock)), JobFilter(), DAY)
    found = nonzero(again["series"]["all"])
    assert found["succeeded"] == {87: 1, 91: 2, 94: 1} and found["failed"] == {91: 1, 94: 1}
    aggregates = [command for command in log.commands if "aggregate" in command]
    assert len(aggregates) == 2  # the quarter hours since 23:45 only
    assert all(str(command["pipeline"][0]["$match"]["updatedAt"]["$gte"]).startswith("2025-12-31 23:45")
               for command in aggregates)  # fmt: skip
    assert not [command for command in log.commands if "update" in command]  # nothing written the second time
    assert_each_reads_through_an_index(db, [command for command in log.commands if "find" in command])


def test_a_weeks_chart_by_queue_and_one_queues_chart_draw_on_the_same_summaries(
    ops: Operations, db: Database, clock: FakeClock
) -> None:
    now = clock.now
    three_finished_at_23(db, now)
    finished(db, now, "t1", queue="a", status="succeeded", ago=120, wait=1, run=1)  # 23:58, after the summaries
    job_stats(ops, JobFilter(), DAY)  # summarizes the day: the week's chart summarizes only the six days before it

    week = job_stats(ops, JobFilter(), timedelta(weeks=1), by="queue")
    assert week["summarizedUntil"] == "2025-12-31T23:45:00+00:00" and set(week["series"]) == {"a", "b"}
    # The hour of 23:00 (the week's interval 166): a1 and a2 from its summarized quarter, t1 from the jobs.
    assert nonzero(week["series"]["a"])["succeeded"] == {165: 1, 166: 3}
    assert nonzero(week["series"]["b"]) == {"failed": {166: 1}, "retried": {166: 1}, "waitP50": {166: 2},
                                            "waitP95": {166: 2}, "runP50": {166: 5}, "runP95": {166: 5}}  # fmt: skip
    # Every quarter hour from the week's start (01:00 on the 25th) to 23:45, once: 166 hours and three quarters.
    assert db.bb_stats.count_documents({"group": False}) == 667

    only_b = job_stats(ops, JobFilter(queue="b"), DAY)["series"]
    assert nonzero(only_b["all"])["failed"] == {91: 1} and sum(only_b["all"]["succeeded"]) == 0
    of_kind = job_stats(ops, JobFilter(kind="app.a"), DAY)["series"]
    assert nonzero(of_kind["all"])["succeeded"] == {87: 1, 91: 2, 94: 1}
    # Any other filter reads the jobs, as before: a status is the job's now, which no summary knows.
    failed = job_stats(ops, JobFilter(status="failed"), DAY)
    assert failed["summarizedUntil"] is None and nonzero(failed["series"]["all"])["failed"] == {91: 1}


def test_a_chart_that_may_not_keep_summaries_gives_the_same_numbers_and_writes_nothing(
    ops: Operations, db: Database, clock: FakeClock
) -> None:
    three_finished_at_23(db, clock.now)
    read_only = job_stats(ops, JobFilter(), DAY, keep_summaries=False)
    assert "bb_stats" not in db.list_collection_names()
    assert read_only["series"] == job_stats(ops, JobFilter(), DAY)["series"]
    assert db.bb_stats.count_documents({}) > 0
    # A read-only chart draws on the summaries there are.
    assert job_stats(ops, JobFilter(), DAY, keep_summaries=False)["series"] == read_only["series"]


def test_hand_edited_summaries_count_nothing_they_cannot_and_fail_no_chart(
    ops: Operations, db: Database, clock: FakeClock
) -> None:
    three_finished_at_23(db, clock.now)
    job_stats(ops, JobFilter(), DAY)
    db.bb_stats.update_one({"group": True, "queue": "a", "succeeded": 2},
                           {"$set": {"succeeded": "two", "runs": "slow", "waits": [None, "x", 5000]}})  # fmt: skip
    db.bb_stats.update_one({"group": True, "queue": "b"}, {"$set": {"at": "noon", "failed": 7}})
    (everything,) = job_stats(ops, JobFilter(), DAY)["series"].values()
    found = nonzero(everything)
    assert found["succeeded"] == {87: 1} and "failed" not in found  # "two" counts nothing; b's has no interval
    assert (everything["waitP50"][91], everything["runP50"][91]) == (5, None)
    # Infinity and NaN (mongosh literals): an int() of Infinity raised OverflowError, the chart's 500; a time of
    # either was sent as JSON's non-token `Infinity`, which a browser's JSON.parse refuses.
    db.bb_stats.update_one({"group": True, "queue": "a", "succeeded": "two"},
                           {"$set": {"succeeded": math.inf, "waits": [math.inf, math.nan, 5000]}})  # fmt: skip
    (everything,) = job_stats(ops, JobFilter(), DAY)["series"].values()
    assert nonzero(everything)["succeeded"] == {87: 1} and everything["waitP50"][91] == 5


def test_charts_summarizing_the_same_quarter_hours_at_once_agree_and_keep_one_summary_each(
    db: Database, clock: FakeClock, mongo_url: str
) -> None:
    three_finished_at_23(db, clock.now)
    clients = [MongoClient(mongo_url, tz_aware=True) for _ in range(4)]
    try:
        readers = [Operations(JobStore(client[db.name], Policy(), clock=clock)) for client in clients]
        with ThreadPoolExecutor(len(readers)) as charts:
            answers = list(charts.map(lambda reader: job_stats(reader, JobFilter(), DAY)["series"], readers))
    finally:
        for client in clients:
            client.close()
    assert all(answer == answers[0] for answer in answers)
    assert nonzero(answers[0]["all"])["succeeded"] == {87: 1, 91: 2}
    assert db.bb_stats.count_documents({"group": False}) == 94 and db.bb_stats.count_documents({"group": True}) == 3
    assert job_stats(Operations(JobStore(db, Policy(), clock=clock)), JobFilter(), DAY)["series"] == answers[0]


def test_a_database_user_who_may_only_read_gets_the_chart_and_writes_no_summary(auth_server, clock: FakeClock) -> None:
    admin_url = f"mongodb://bb:{AUTH_PASSWORD}@127.0.0.1:{auth_server.port}/?authSource=admin"
    with MongoClient(admin_url, tz_aware=True) as admin:
        three_finished_at_23(admin.charts, clock.now)
        admin.charts.command("createUser", "viewer", pwd="v1ew-only", roles=[{"role": "read", "db": "charts"}])
        with MongoClient(f"mongodb://viewer:v1ew-only@127.0.0.1:{auth_server.port}/?authSource=charts",
                         tz_aware=True) as viewer:  # fmt: skip
            viewing = Operations(JobStore(viewer.charts, Policy(), clock=clock))
            chart = job_stats(viewing, JobFilter(), DAY)
            # Nor does it take a turn at summarizing ahead (a worker or Flower of such a user summarizes nothing).
            assert not Summaries(viewing.coll, clock).take_turn("viewer@host:1", timedelta(minutes=10))
        assert nonzero(chart["series"]["all"])["succeeded"] == {87: 1, 91: 2}
        assert "bb_stats" not in admin.charts.list_collection_names()


def test_summarizing_ahead_writes_the_weeks_closed_quarter_hours_and_the_charts_then_write_none(
    ops: Operations, db: Database, clock: FakeClock, mongo_url: str
) -> None:
    assert summarize_ahead(ops) == 0 and "bb_stats" not in db.list_collection_names()  # no job, nothing to summarize
    three_finished_at_23(db, clock.now)
    assert summarize_ahead(ops) == 667 and summarize_ahead(ops) == 0  # from 01:00 on the 25th to 23:30
    assert db.bb_stats.count_documents({"group": False}) == 667
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        reader = Operations(JobStore(client[db.name], Policy(), clock=clock))
        chart = job_stats(reader, JobFilter(), DAY)
    assert nonzero(chart["series"]["all"])["succeeded"] == {87: 1, 91: 2}
    # The chart reads the jobs since 23:45 only, and writes nothing: every quarter hour before has its summary.
    aggregates = [command for command in log.commands if "aggregate" in command]
    assert {str(command["pipeline"][0]["$match"]["updatedAt"]["$gte"])[:16] for command in aggregates} == {
        "2025-12-31 23:45"}  # fmt: skip
    assert not [command for command in log.commands if "update" in command]
    assert db.bb_stats.count_documents({"group": False}) == 667 and db.bb_stats.count_documents({"group": True}) == 3


def test_one_process_of_the_fleet_summarizes_ahead_at_a_time_until_its_turn_runs_out(
    db: Database, clock: FakeClock, mongo_url: str
) -> None:
    """Every worker and every Flower that may write runs a summarizing thread; only the holder of the turn summarizes,
    renewing it at each pass, and a holder that stopped (died) leaves it to the next once it runs out."""
    turn = timedelta(minutes=10)
    with MongoClient(mongo_url, tz_aware=True) as other:
        first, second = Summaries(db.jobs, clock), Summaries(other[db.name].jobs, clock)
        with ThreadPoolExecutor(8) as pool:  # eight processes asking at once: one gets it
            taken = list(pool.map(lambda n: (first, second)[n % 2].take_turn(f"w{n}@host:{n}", turn), range(8)))
        assert taken.count(True) == 1
        holder = f"w{taken.index(True)}@host:{taken.index(True)}"
        assert first.take_turn(holder, turn) and not second.take_turn("w9@host:9", turn)  # renewed by its holder
        clock.advance(9 * 60)
        assert first.take_turn(holder, turn)  # its pass renews it: ten minutes from now
        clock.advance(9 * 60)
        assert not second.take_turn("w9@host:9", turn)
        clock.advance(61)  # the holder stopped passing: its turn ran out
        assert second.take_turn("w9@host:9", turn) and not first.take_turn(holder, turn)
    (doc,) = list(db.bb_stats.find())
    assert doc["by"] == "w9@host:9" and doc["until"] == clock.now + turn
    # A pass is under way while its holder's turn runs and until it ends the pass; a hand-edited turn is none.
    turns = Summaries(db.jobs, clock)
    assert turns.summarizing_now() == "w9@host:9"
    turns.end_pass("w9@host:9")
    assert turns.summarizing_now() is None
    db.bb_stats.update_one({"_id": doc["_id"]}, {"$set": {"passing": "w9@host:9", "until": clock.now + 10 * turn}})
    assert turns.summarizing_now() is None  # a turn no pass takes: a far future written by hand
    db.bb_stats.update_one({"_id": doc["_id"]}, {"$set": {"passing": "w1@host:1", "until": clock.now + turn}})
    assert turns.summarizing_now() is None  # taken over by a process that writes no `passing` (an older version)
    db.bb_stats.update_one({"_id": doc["_id"]}, {"$set": {"until": "later"}})  # a hand edit: no moment at all
    assert Summaries(db.jobs, clock).take_turn("w1@host:1", turn)  # is a turn run out, not one held for good
    # The turn is no summary: the charts' reads and the summaries' expiry do not see it.
    assert Summaries(db.jobs, clock).summarized(clock.now - timedelta(days=40), clock.now + turn) == set()


def test_a_pass_summarizes_only_in_the_turns_holder_and_a_failed_pass_gives_the_turn_up(
    own_server, clock: FakeClock
) -> None:
    from pymongo.errors import OperationFailure

    from bb_broker.ops.stats import SummarizingAhead
    from tests.support.faults import fail_point

    with (
        MongoClient(own_server.url, tz_aware=True) as admin,
        MongoClient(own_server.url, tz_aware=True, appname="failing-summarizer") as failing,
    ):
        three_finished_at_23(admin.charts, clock.now)
        ours = SummarizingAhead(Operations(JobStore(admin.charts, Policy(), clock=clock)), "worker@a:1")
        theirs = SummarizingAhead(Operations(JobStore(failing.charts, Policy(), clock=clock)), "worker@b:2")
        assert ours.pass_once() == 667 and theirs.pass_once() is None  # one holder; the other reads nothing more
        assert ours.pass_once() == 0  # its turn renewed: nothing left to summarize
        admin.charts.bb_stats.delete_many({"group": False})  # as if new quarter hours had closed since
        clock.advance(2 * SummarizingAhead.interval + 1)  # the holder stopped passing: its turn ran out
        fail_point(admin, 1, failCommands=["aggregate"], appName="failing-summarizer", errorCode=2)
        with pytest.raises(OperationFailure):
            theirs.pass_once()  # it took the turn, and its pass failed
        assert ours.pass_once() == 668  # at once: the failed pass gave the turn up (the 667, and 23:45 closed since)


def test_a_jobs_tab_chart_summarizes_a_quarter_hour_itself_while_a_pass_is_under_way_and_leaves_it_the_rest(
    ops: Operations, db: Database, clock: FakeClock, mongo_url: str
) -> None:
    """The first charts after an upgrade (or a week without workers) find every quarter hour unsummarized: the Jobs
    tab's chart reads at most one of them from the jobs while a process's pass summarizing ahead is under way,
    draws the rest as gaps, and fills them in once that pass is over."""
    now = clock.now  # 2026-01-01 00:00; the day's intervals from 00:15 on the 31st, a quarter hour each
    for hours in range(1, 13):  # a job at each hour from 12:00 to 23:00 (intervals 47, 51, ... 91)
        finished(db, now, f"h{hours}", queue="a", status="succeeded", ago=3600 * hours, wait=1, run=2)
    finished(db, now, "live", queue="a", status="failed", ago=120, wait=0, run=1)  # 23:58: read from the jobs
    complete = job_stats(ops, JobFilter(), DAY, keep_summaries=False)["series"]["all"]  # as the CLI reads it
    assert nonzero(complete)["succeeded"] == {n: 1 for n in range(47, 92, 4)} and nonzero(complete)["failed"] == {94: 1}

    # Nobody holds the turn: the tab's chart summarizes all it needs itself, as the CLI does.
    alone = job_stats(ops, JobFilter(), DAY, leave_to_holder=True)
    assert alone["pending"] == [] and alone["summarizing"] is None and alone["series"]["all"] == complete
    db.bb_stats.delete_many({})

    assert Summaries(db.jobs, clock).take_turn("worker@a:1", timedelta(minutes=10))  # a worker's pass begins
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        first = job_stats(Operations(JobStore(client[db.name], Policy(), clock=clock)), JobFilter(), DAY,
                          leave_to_holder=True)  # fmt: skip
    # The chart summarized the newest quarter hour (23:30) only, and read the jobs from 23:30 on.
    marked = sorted(doc["at"].strftime("%H:%M") for doc in db.bb_stats.find({"group": False}))
    assert marked == ["23:30"]
    aggregates = [command for command in log.commands if "aggregate" in command]
    assert {str(command["pipeline"][0]["$match"]["updatedAt"]["$gte"])[:16] for command in aggregates} == {
        "2025-12-31 23:30", "2025-12-31 23:45"}  # fmt: skip
    # The 93 quarter hours before 23:30 are left to the worker: no numbers there (23:00's job included).
    assert first["summarizing"] == "worker@a:1" and len(first["pending"]) == 93
    assert first["pending"][0] == "2025-12-31T00:15:00+00:00" and first["pending"][-1] == "2025-12-31T23:15:00+00:00"
    series = first["series"]["all"]
    assert all(value is None for values in series.values() for value in values[:93])
    assert {name: values[93:] for name, values in series.items()} == {
        name: values[93:] for name, values in complete.items()} and series["failed"][94] == 1  # fmt: skip

    from bb_broker.ops.stats import SummarizingAhead

    # The worker's pass: the week's closed quarter hours (from 01:00 on the 25th to 23:30) but the chart's one.
    assert SummarizingAhead(ops, "worker@a:1").pass_once() == 667 - 1
    filled = job_stats(ops, JobFilter(), DAY, leave_to_holder=True)
    assert filled["pending"] == [] and filled["summarizing"] is None and filled["series"]["all"] == complete
    # A window longer than the pass's week: only the week is left to it, the quarter hours before are summarized here.
    db.bb_stats.delete_many({})
    assert Summaries(db.jobs, clock).take_turn("worker@a:1", timedelta(minutes=10))
    fortnight = job_stats(ops, JobFilter(), timedelta(days=14), leave_to_holder=True)
    assert fortnight["pending"][0] == "2025-12-25T01:00:00+00:00" and len(fortnight["pending"]) == 167
    assert all(value == 0 for value in fortnight["series"]["all"]["succeeded"][:168])  # before the week: summarized
    assert SummarizingAhead(ops, "worker@a:1").pass_once() == 667 - 1
    # Only a pass under way has quarter hours left to it: between passes, a chart summarizes all it needs itself.
    db.bb_stats.delete_many({"group": False})
    between = job_stats(ops, JobFilter(), DAY, leave_to_holder=True)
    assert between["pending"] == [] and between["series"]["all"] == complete
    assert db.bb_stats.count_documents({"group": False}) == 94


def test_a_kind_of_megabytes_or_not_a_string_is_counted_under_one_name_and_every_chart_stays_up(
    ops: Operations, db: Database, clock: FakeClock, broker_url: str
) -> None:
    # A summary holds its queue and kind twice (its _id and its fields): one job with a kind of 8.6 MB made its
    # upsert pass the server's 16 MB (17420), and every chart that summarized that quarter hour failed, the Jobs
    # tab's and `bb-broker stats` alike, for as long as the job was kept.
    now = clock.now
    three_finished_at_23(db, now)
    db.jobs.update_one({"_id": "a1"}, {"$set": {"kind": "k" * 8_600_000}})
    db.jobs.update_one({"_id": "a2"}, {"$set": {"kind": 5}})
    by_kind = job_stats(ops, JobFilter(), DAY, "kind")
    assert by_kind["summarizedUntil"] == "2025-12-31T23:45:00+00:00"
    assert {name: nonzero(series).get("succeeded") for name, series in by_kind["series"].items()} == {
        "(not a name)": {91: 2}, "app.a": {87: 1}, "app.b": None
    }  # fmt: skip
    kept = {doc["kind"]: doc["succeeded"] for doc in db.bb_stats.find({"group": True, "queue": "a"})}
    assert kept == {"(not a name)": 2, "app.a": 1}
    assert nonzero(job_stats(ops, JobFilter(), DAY)["series"]["all"])["succeeded"] == {87: 1, 91: 2}

    # `bb-broker stats` on the server's own clock, the huge kind among the jobs it reads and summarizes.
    done = datetime.now(UTC) - timedelta(hours=1)
    times = {"runAfter": done, "startedAt": done, "finishedAt": done, "updatedAt": done}
    db.jobs.insert_one({"_id": "huge-now", "queue": "a", "kind": "k" * 8_600_000, "status": "succeeded",
                        "attempts": 1, **times})  # fmt: skip
    runner = CliRunner()
    table = runner.invoke(main, ["stats", "--since", "1d", "--broker", broker_url])
    assert table.exit_code == 0, table.output[-2000:]
    listed = runner.invoke(main, ["stats", "--since", "1d", "--by", "kind", "--json", "--broker", broker_url])
    assert listed.exit_code == 0, listed.output[-2000:]
    assert sum(json.loads(listed.output)["series"]["(not a name)"]["succeeded"]) == 1


def test_a_pages_chart_that_reads_its_jobs_past_its_time_asks_for_a_narrower_filter(
    own_server, clock: FakeClock
) -> None:
    from tests.support.faults import fail_point

    with (
        MongoClient(own_server.url, tz_aware=True) as admin,
        MongoClient(own_server.url, tz_aware=True, appname="chart-reader", event_listeners=[log := CommandLog()]) as c,
    ):
        three_finished_at_23(admin.charts, clock.now)
        ops = Operations(JobStore(c.charts, Policy(), clock=clock))
        failed_only = JobFilter.parse({"status": "failed"}, clock.now)  # no summary serves a status: the jobs read
        job_stats(ops, failed_only, timedelta(days=31), max_ms=10_000)
        charts = [command for command in log.commands if command.get("aggregate") == "jobs"]
        assert len(charts) == 2 and {command.get("maxTimeMS") for command in charts} == {10_000}
        # The server's MaxTimeMSExpired (50), as a month of jobs read past the page's time would have it.
        fail_point(admin, 1, failCommands=["aggregate"], appName="chart-reader", errorCode=50)
        with pytest.raises(FilterError, match="took over 10000 ms: narrow the filter"):
            job_stats(ops, failed_only, timedelta(days=31), max_ms=10_000)
        log.commands.clear()
        job_stats(ops, failed_only, timedelta(days=31))  # the CLI's: no time limit
        assert all("maxTimeMS" not in command for command in log.commands if command.get("aggregate") == "jobs")
