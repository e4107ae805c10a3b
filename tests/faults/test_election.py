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

import pytest
from pymongo.database import Database

from tests.support import wire
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


def server_clock_offset(db: Database) -> float:
    """The server's clock minus this process's (the jobs' times are the server's), in seconds."""
    before = time.time()
    local_time = db.client.admin.command("hello")["localTime"].replace(tzinfo=dt.UTC).timestamp()
    return local_time - (before + time.time()) / 2


def test_jobs_run_once_through_an_election_and_workers_claim_again_at_the_primarys_return(
    replica_set, db: Database, tmp_path
) -> None:
    proxy, url = replica_set
    workers = [Worker(url, log_dir=tmp_path, name=f"w{n}", concurrency=2) for n in range(3)]
    for worker in workers:
        worker.start()
    app = producer(url)
    during: list[str] = []
    try:
        before = [send(app, "sleep", 0.8) for _ in range(16)]
        # Some are running, more are queued, when the primary steps down.
        wait_for(lambda: db.runs.count_documents({"phase": "start"}) >= 4, 60, "jobs running")
        offset = server_clock_offset(db)
        election = proxy.hold_election(ELECTION_SECONDS)
        # A web process publishing meanwhile: its inserts wait for the next primary (pymongo's server selection).
        publisher = threading.Thread(target=lambda: during.extend(send(app, "sleep", 0.5) for _ in range(12)))
        time.sleep(1.0)  # the member is a secondary by now: these are published during the election
        publisher.start()
        assert election.ended.wait(ELECTION_SECONDS + 30)
        publisher.join(60)
        assert len(during) == 12
        ids = before + during
        wait_for(all_succeeded(db, ids), 180, "every job succeeded")
    finally:
        app.close()

    docs = list(db.jobs.find({"taskId": {"$in": ids}}))
    assert {doc["attempts"] for doc in docs} == {1}, [(d["taskId"], d["attempts"], d.get("history")) for d in docs]
    assert all(len(doc["history"]) == 1 for doc in docs), [d["history"] for d in docs if len(d["history"]) != 1]
    starts = Counter(run["taskId"] for run in db.runs.find({"taskId": {"$in": ids}, "phase": "start"}))
    assert starts == dict.fromkeys(ids, 1), starts  # each body ran exactly once

    start, end = election.started_at + offset, election.ended_at + offset
    started = sorted(doc["startedAt"].timestamp() for doc in docs)
    # pymongo stayed on the proxy: nothing was claimed while the set had no primary (a claim sent just before the
    # step-down may land just after it), and every command went through.
    assert not [t for t in started if start + 0.5 < t < end], [t - start for t in started]
    assert proxy.relayed > 0
    through = [doc for doc in docs if doc["startedAt"].timestamp() < start and doc["finishedAt"].timestamp() > start]
    claim_again = min(t for t in started if t >= end) - end
    print(
        f"\nelection: {len(through)} jobs running through it, refused {proxy.profile.refused}, "
        f"{proxy.interrupted} writes interrupted, first claim {claim_again:.2f} s after the primary's return"
    )
    assert claim_again < CLAIM_AGAIN_WITHIN, claim_again

    for worker in workers:
        assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
        assert "Unrecoverable error" not in worker.log(), worker.log()[-3000:]


def _statements(command: dict) -> list[dict]:
    return [s for s in command.get("updates") or [] if isinstance(s, dict)]


#: The broker's writes on held jobs that a step-down may interrupt once the server applied them: a batch claim (one
#: updateMany, which pymongo does not retry), a claim of one job (findAndModify, retried by pymongo as a retryable
#: write), and a settle (fenced on the job's attempt).
IN_FLIGHT = {
    "batch claim": lambda c: (
        c.get("update") == "jobs"
        and any(s.get("multi") and s.get("q", {}).get("status") == "queued" for s in _statements(c))
    ),
    "claim of one job": lambda c: c.get("findAndModify") == "jobs" and c.get("query", {}).get("status") == "queued",
    "settle": lambda c: (
        c.get("update") == "jobs"
        and any(s.get("q", {}).get("status") == "running" and "attempts" in s.get("q", {}) for s in _statements(c))
    ),
}


@pytest.mark.parametrize("write", sorted(IN_FLIGHT))
def test_a_write_the_step_down_interrupts_after_it_was_applied_loses_nothing_and_runs_nothing_twice(
    write, replica_set, db: Database, tmp_path
) -> None:
    proxy, url = replica_set
    app = producer(url)
    try:
        # A batch claim takes what is queued when the worker starts; a lone job is claimed by findAndModify.
        first = [send(app, "sleep", 0.3) for _ in range(6 if write == "batch claim" else 0)]
        election = proxy.hold_election(ELECTION_SECONDS, at=IN_FLIGHT[write])
        worker = Worker(url, log_dir=tmp_path, name="w0", concurrency=4)
        worker.start()
        ids = first + ([] if first else [send(app, "sleep", 0.3)])
        assert election.ended.wait(ELECTION_SECONDS + 60), "the write never came"
        ids += [send(app, "sleep", 0.3) for _ in range(4)]
        wait_for(
            lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == len(ids),
            120,
            "every job succeeded",
        )
    finally:
        app.close()
    assert proxy.interrupted >= 1
    docs = list(db.jobs.find({"taskId": {"$in": ids}}))
    assert [(doc["attempts"], len(doc["history"])) for doc in docs] == [(1, 1)] * len(ids), docs
    starts = Counter(run["taskId"] for run in db.runs.find({"taskId": {"$in": ids}, "phase": "start"}))
    assert starts == dict.fromkeys(ids, 1), starts
    assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
    assert "Unrecoverable error" not in worker.log(), worker.log()[-3000:]
