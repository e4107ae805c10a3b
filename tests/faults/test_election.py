"""A replica set through an election (issue 43): for 15 s the set has no primary (its member answers as a secondary,
refuses writes with NotWritablePrimary, and every open connection is dropped), then the primary is back. Real workers
with jobs running and queued through it: each job runs once and settles once, no worker exits, and the workers claim
again within seconds of the primary's return. The election is played by tests/support/wire.py's proxy, in front of the
stand-in; pymongo knows the set by the proxy's address only, so every command goes through it."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult
from pymongo.database import Database

from bb_broker.clock import ServerClock
from tests.faults.test_beat_outage import assert_slots_follow_the_policy
from tests.support import wire
from tests.support.beat_process import Beat, recorded, slot_jobs
from tests.support.servers import with_database
from tests.support.workers import Worker, all_succeeded, producer, send, wait_for

#: The election is played by a wire proxy in front of the embedded server (conftest's stand_in).
pytestmark = pytest.mark.stand_in

ELECTION_SECONDS = 15.0
#: How soon after the primary's return a worker claims again. Issue 43's figure is 5 s; this is looser for a busy
#: 2-core machine running the suite in parallel: the measured figure is printed (pytest -s) and in the report.
CLAIM_AGAIN_WITHIN = 10.0


@pytest.fixture
def replica_set(mongo_url: str, db: Database):
    if not mongo_url.startswith("mongodb://") or "," in mongo_url or "@" in mongo_url:
        pytest.fail("the proxy stands in front of one server without credentials: not this BB_TEST_MONGO_URL")
    proxy = wire.WireProxy(mongo_url, wire.replica_set())
    yield proxy, with_database(f"mongodb://{proxy.address}", db.name)
    proxy.close()


def results_producer(url: str) -> Celery:
    """A web process's app: it publishes, and waits for results on the job documents."""
    app = producer(url)
    app.conf.result_backend = url
    return app


def waiting_for(results: list[AsyncResult], got: list[Any]) -> threading.Thread:
    """A thread in `get()` on each of `results` (its values, or the error it raised, into `got`)."""

    def wait() -> None:
        try:
            got.extend(result.get(timeout=180) for result in results)
        except Exception as exc:  # what get() raised is the test's finding
            got.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def ran_once_at_first_attempt(db: Database, ids: list[str], bodies: list[str] | None = None) -> list[dict[str, Any]]:
    """Each job's document: asserted to be at attempt 1 with one history entry (its settle landed once, no attempt
    spent by a claim lost in the election nor taken back by a sweep), and the body of each of `bodies` (tasks that
    record their runs; all by default) to have begun once."""
    docs = list(db.jobs.find({"taskId": {"$in": ids}}))
    twice = [  # (job id, task id, attempts, [(n, outcome, error) of each history entry])
        (d["_id"], d["taskId"], d["attempts"], [(h.get("n"), h.get("outcome"), h.get("error")) for h in d["history"]])
        for d in docs
        if (d["attempts"], len(d["history"])) != (1, 1)
    ]
    assert not twice, twice
    bodies = ids if bodies is None else bodies
    starts = Counter(run["taskId"] for run in db.runs.find({"taskId": {"$in": bodies}, "phase": "start"}))
    assert starts == dict.fromkeys(bodies, 1), {task: n for task, n in starts.items() if n != 1}
    return docs


def still_up(*workers: Worker) -> None:
    for worker in workers:
        assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
        assert "Unrecoverable error" not in worker.log(), worker.log()[-3000:]


def server_clock_offset(db: Database) -> float:
    """The server's clock minus this process's (the jobs' times are the server's), in seconds."""
    before = time.time()
    local_time = db.client.admin.command("hello")["localTime"].replace(tzinfo=dt.UTC).timestamp()
    return local_time - (before + time.time()) / 2


#: A client's server selection shorter than the election (serverSelectionTimeoutMS=1500 in its URL, as deployments
#: that want an outage said quickly set it): each path meets the election as errors, not as pymongo's wait, and
#: the broker's own recovery carries it.
QUICK_SELECTION = "serverSelectionTimeoutMS=1500"
SHORT_ELECTION = 6.0


@pytest.mark.parametrize("selection", ["pymongo waits", "quick selection"])
def test_jobs_run_once_through_an_election_and_workers_claim_again_at_the_primarys_return(
    selection, replica_set, db: Database, tmp_path
) -> None:
    """The full 15 s election. With pymongo's server selection (30 s) the workers' commands wait for the next
    primary; with a quick one (QUICK_SELECTION) they fail meanwhile, and the broker's recovery carries each path.
    Tasks that write nothing themselves but for the long ones' start, before the election (a task's own write would
    fail in it, and the task with it)."""
    proxy, url = replica_set
    worker_url = f"{url}?{QUICK_SELECTION}" if selection == "quick selection" else url
    # Room for 8 jobs each (prefetch 4 x 2 processes): each worker holds jobs claimed in batches and not yet started
    # when the primary steps down. Two consume a queue of their own besides: two long jobs in each of their pools.
    env = {"BB_PREFETCH_MULTIPLIER": "4", "BB_RESULT_BACKEND": worker_url}
    workers = [
        Worker(worker_url, log_dir=tmp_path, name=f"w{n}", env=env, extra_args=("-Q", f"celery,w{n}")) for n in range(3)
    ]
    for worker in workers:
        worker.start()
    app = results_producer(url)  # a web process: pymongo's own server selection
    gate = tmp_path / "gate"
    during: list[str] = []
    got: list[Any] = []
    try:
        # Long jobs that end, and settle, while the set has no primary (the gate opens in it); a web process waits
        # for their results.
        hold = "tests.support.e2e_app.hold_until"
        long = [app.send_task(hold, args=(str(gate),), queue=f"w{n % 2}") for n in range(4)]
        before = [result.id for result in long] + [send(app, "identity", n) for n in range(16)]
        wait_for(lambda: db.runs.count_documents({"taskId": {"$in": before[:4]}}) == 4, 60, "the long jobs running")
        waiter = waiting_for(long, got)
        offset = server_clock_offset(db)
        election = proxy.hold_election(ELECTION_SECONDS)
        # A web process publishing meanwhile: its inserts wait for the next primary (pymongo's server selection).
        publisher = threading.Thread(target=lambda: during.extend(send(app, "identity", n) for n in range(12)))
        time.sleep(1.0)  # the member is a secondary by now: these are published during the election
        publisher.start()
        gate.touch()
        assert election.ended.wait(ELECTION_SECONDS + 30)
        publisher.join(60)
        assert len(during) == 12
        ids = before + during
        wait_for(all_succeeded(db, ids), 180, "every job succeeded")
        waiter.join(60)
    finally:
        app.close()

    docs = ran_once_at_first_attempt(db, ids, bodies=before[:4])
    assert got == [str(gate)] * 4, got  # get() waited through the election
    start, end = election.started_at + offset, election.ended_at + offset
    started = sorted(doc["startedAt"].timestamp() for doc in docs)
    # pymongo stayed on the proxy: nothing was claimed while the set had no primary (a claim sent just before the
    # step-down may land just after it), and every command went through.
    assert not [t for t in started if start + 0.5 < t < end], [t - start for t in started]
    assert proxy.relayed > 0
    through = [doc for doc in docs if doc["startedAt"].timestamp() < start < doc["finishedAt"].timestamp()]
    assert {doc["taskId"] for doc in through} >= set(before[:4])
    claim_again = min(t for t in started if t >= end) - end
    print(
        f"\nelection ({selection}): {len(through)} jobs running through it, refused {proxy.profile.refused}, "
        f"{proxy.interrupted} writes interrupted, first claim {claim_again:.2f} s after the primary's return"
    )
    assert claim_again < CLAIM_AGAIN_WITHIN, claim_again
    still_up(*workers)


def test_through_an_election_longer_than_server_selection_claims_settles_leases_and_get_lose_nothing(
    replica_set, db: Database, tmp_path
) -> None:
    proxy, url = replica_set
    url = f"{url}?{QUICK_SELECTION}"
    # A lease of 14 s (heartbeats every 2.8 s, sweeps every 7 s by both workers): longer than the election and a
    # heartbeat either side of it, so a lease renewed through it must not be lost to a sweep after it.
    options = {"stale_after": 14.0}
    env = {"BB_PREFETCH_MULTIPLIER": "4", "BB_RESULT_BACKEND": url}
    # Each also consumes a queue of its own: two long jobs in each pool (a worker whose pool is full could claim
    # one and hold it unstarted).
    workers = [
        Worker(url, log_dir=tmp_path, name=f"w{n}", options=options, env=env, extra_args=("-Q", f"celery,w{n}"))
        for n in range(2)
    ]
    for worker in workers:
        worker.start()
    app = results_producer(url)
    gate = tmp_path / "gate"
    got: list[Any] = []
    try:
        # Long jobs held in every pool process, and more claimed behind them (prefetch), when the primary steps down.
        # The long ones end during the election (the gate opens), and the held ones start then: tasks that write
        # nothing themselves (a task's own write would fail in the election, and the task with it).
        hold = "tests.support.e2e_app.hold_until"
        long = [app.send_task(hold, args=(str(gate),), queue=f"w{n % 2}") for n in range(4)]
        held = [send(app, "identity", n) for n in range(12)]
        ids = [result.id for result in long] + held
        wait_for(lambda: db.runs.count_documents({"taskId": {"$in": ids[:4]}}) == 4, 60, "the long jobs running")
        waiter = waiting_for(long, got)
        election = proxy.hold_election(SHORT_ELECTION)
        time.sleep(1.0)
        gate.touch()
        assert election.ended.wait(SHORT_ELECTION + 30)
        wait_for(all_succeeded(db, ids), 120, "every job succeeded")
        waiter.join(60)
    finally:
        app.close()

    ran_once_at_first_attempt(db, ids, bodies=ids[:4])
    assert got == [str(gate)] * 4, got
    # Every job was claimed before the primary stepped down (held, or running): no claim-again figure here.
    print(f"\nshort election: refused {proxy.profile.refused}, {proxy.interrupted} writes interrupted")
    still_up(*workers)


def _statements(command: dict) -> list[dict]:
    return [s for s in command.get("updates") or [] if isinstance(s, dict)]


#: The broker's writes on held jobs that a step-down may interrupt once the server applied them: a batch claim (one
#: updateMany, which pymongo does not retry), a claim of one job (findAndModify, retried by pymongo as a retryable
#: write), and a settle (fenced on the job's attempt).
IN_FLIGHT = {
    "batch claim": lambda c: (
        c.get("update") == "jobs"
        # The jobs read at the head of the queue, by id (the sweep's updateMany of queued jobs names none).
        and any(s.get("multi") and {"_id", "status"} <= s.get("q", {}).keys() for s in _statements(c))
    ),
    "claim of one job": lambda c: c.get("findAndModify") == "jobs" and c.get("query", {}).get("status") == "queued",
    "settle": lambda c: (
        c.get("update") == "jobs"
        and any(s.get("q", {}).get("status") == "running" and "attempts" in s.get("q", {}) for s in _statements(c))
    ),
}


@pytest.mark.parametrize("selection", ["pymongo waits", "quick selection"])
@pytest.mark.parametrize("write", sorted(IN_FLIGHT))
def test_a_write_the_step_down_interrupts_after_it_was_applied_loses_nothing_and_runs_nothing_twice(
    write, selection, replica_set, db: Database, tmp_path
) -> None:
    """With pymongo's server selection (30 s) longer than the election, its one retry of a claim of one job or of a
    settle waits for the next primary; with a quicker one (QUICK_SELECTION), that retry fails too, and the broker
    learns what the write did by itself. A lease of 14 s: a claim that landed unseen is swept back within the test.
    Tasks that write nothing themselves (one running in the election would fail on its own write): a job run twice
    shows as a second attempt."""
    proxy, url = replica_set
    quick = selection == "quick selection"
    seconds = SHORT_ELECTION if quick else ELECTION_SECONDS
    worker_url = f"{url}?{QUICK_SELECTION}" if quick else url
    app = producer(url)
    try:
        # A batch claim takes what is queued when the worker starts; a lone job is claimed by findAndModify.
        first = [send(app, "identity", 0) for _ in range(6 if write == "batch claim" else 0)]
        election = proxy.hold_election(seconds, at=IN_FLIGHT[write])
        worker = Worker(worker_url, log_dir=tmp_path, name="w0", concurrency=4, options={"stale_after": 14.0})
        worker.start()
        ids = first + ([] if first else [send(app, "identity", 0)])
        assert election.ended.wait(seconds + 60), "the write never came"
        ids += [send(app, "identity", 0) for _ in range(4)]
        wait_for(all_succeeded(db, ids), 120, "every job succeeded")
    finally:
        app.close()
    assert proxy.interrupted >= 1
    ran_once_at_first_attempt(db, ids, bodies=[])
    still_up(worker)


BEAT_ENTRIES = {
    "once-a-second": {"task": "tests.support.e2e_app.add", "schedule": 1.0, "args": [1, 2], "catch_up": "once"},
    "each-second": {"task": "tests.support.e2e_app.add", "schedule": 1.0, "args": [3, 4], "catch_up": "all"},
}


def test_two_beats_through_an_election_send_each_slot_once_and_lose_none(replica_set, db: Database, tmp_path) -> None:
    proxy, url = replica_set
    url = f"{url}?{QUICK_SELECTION}"
    beats = [Beat(url, tmp_path, f"b{n}", BEAT_ENTRIES, {"BB_BEAT_MISSED_AFTER": "2"}).start() for n in range(2)]
    wait_for(lambda: all(len(slot_jobs(db, name)) >= 3 for name in BEAT_ENTRIES), 60, "3 slots of each entry")
    election = proxy.hold_election(SHORT_ELECTION)
    assert election.ended.wait(SHORT_ELECTION + 30)
    returned = ServerClock(db)()

    def three_slots_after_the_return() -> bool:
        return all(slot_jobs(db, name)[-1]["slot"] >= returned + timedelta(seconds=3) for name in BEAT_ENTRIES)

    wait_for(three_slots_after_the_return, 60, "3 slots of each entry after the primary's return")
    for beat in beats:
        assert beat.process is not None and beat.process.poll() is None, beat.log()[-3000:]
    for name in BEAT_ENTRIES:
        jobs = slot_jobs(db, name)
        per_slot = Counter(job["payload"]["headers"]["bb_beat_slot"] for job in jobs)
        assert max(per_slot.values()) == 1, f"{name}: two jobs for one slot: {per_slot.most_common(3)}"
        entry = db.bb_schedules.find_one({"_id": name})
        assert_slots_follow_the_policy(jobs, entry)  # none lost: each slot sent, or covered by the catch-up policy
        entry, covered = recorded(db, name)
        assert entry["runCount"] == len(covered)
