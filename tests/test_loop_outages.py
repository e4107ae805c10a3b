"""A worker's event loop through a server that fails, restarts or goes away: it reconnects and loses nothing."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from pymongo import MongoClient

from tests.servers import EmbeddedServer, with_database
from tests.test_faults import fail_point
from tests.workers import Worker, producer, send, settled, wait_for

#: NetworkTimeout: what a router answers when a shard did not, a transient error a command may be tried again after.
NETWORK_TIMEOUT = 89


@pytest.mark.parametrize(
    ("command", "labels", "backlog"),
    [
        ("findAndModify", ["RetryableWriteError"], False),  # a lone job's claim (a write: the server labels it)
        ("find", [], True),  # the read that opens a batch claim, on its thread (a read: no label)
    ],
)
def test_a_transient_error_on_a_claim_is_a_reconnect_not_the_end_of_the_worker(
    own_server: EmbeddedServer, tmp_path: Path, command: str, labels: list[str], backlog: bool
) -> None:
    # pymongo tries such a command once more and then raises OperationFailure, which Celery (broker_channel_error_retry
    # off, its default) took for unrecoverable: the worker exited and its queue waited for a restart by hand.
    url = with_database(own_server.url, "transient")
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.transient
    env = {"BB_PREFETCH_MULTIPLIER": "4"} if backlog else {}  # room for 8: a backlog is claimed in batches
    worker = Worker(url, log_dir=tmp_path, name="w0", env=env)
    worker.start()
    app = producer(url)
    first = send(app, "add", 0, 0)
    wait_for(settled(db, first, "succeeded"), message="the worker runs tasks")
    ids = [send(app, "sleep", 0.2) for _ in range(12)] if backlog else []
    if backlog:
        wait_for(lambda: db.runs.count_documents({"taskId": {"$in": ids}}) >= 1, message="the backlog under way")
    fail_point(client, 2, failCommands=[command], errorCode=NETWORK_TIMEOUT, errorLabels=labels)
    ids += [send(app, "add", i, i) for i in range(3)]
    wait_for(lambda: worker.process.poll() is not None
             or db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == len(ids),
             timeout=120, message="every job succeeded after the errors")  # fmt: skip
    assert worker.process.poll() is None, worker.log()[-3000:]  # reconnected, not exited
    assert "Unrecoverable error" not in worker.log()
    per_task = list(db.runs.aggregate([{"$match": {"taskId": {"$in": ids}, "phase": {"$ne": "end"}}},
                                       {"$group": {"_id": "$taskId", "n": {"$sum": 1}}}]))  # fmt: skip
    assert len(per_task) == len(ids) and all(row["n"] == 1 for row in per_task), per_task


#: A worker told to stop while its server is gone: far above a stop that gives up on the server after its patience
#: (5 s for all it holds), far below one that tried each held job's release for a minute. A bound, not a benchmark.
STOP_WITHOUT_SERVER_BOUND = 45.0


def test_a_worker_holding_jobs_stops_within_seconds_when_its_server_is_gone_and_the_jobs_run_later(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    url = with_database(own_server.url, "held")
    db = MongoClient(own_server.url, tz_aware=True).held
    options = {"stale_after": 4.0}
    worker = Worker(url, log_dir=tmp_path, name="w0", concurrency=1, env={"BB_PREFETCH_MULTIPLIER": "4"},
                    options=options)  # fmt: skip
    worker.start()
    app = producer(url)
    # Celery keeps rate-limited requests waiting in the worker, unacked: jobs held and not started.
    assert app.control.rate_limit("tests.e2e_app.add", "1/h", reply=True, timeout=10)
    ids = [send(app, "add", i, i) for i in range(5)]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == 1
             and db.jobs.count_documents({"taskId": {"$in": ids}, "status": "running"}) == 4,
             message="one task ran, four held by the worker")  # fmt: skip
    own_server.stop()
    worker.signal(signal.SIGTERM)
    try:
        code = worker.wait(STOP_WITHOUT_SERVER_BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still stopping after {STOP_WITHOUT_SERVER_BOUND}s:\n{worker.log()[-3000:]}") from None
    assert code == 0, worker.log()[-3000:]
    # What it could not give back, the stale sweep gives to the next worker: each task runs once.
    own_server.start()
    Worker(url, log_dir=tmp_path, name="w1", options=options).start()
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == 5,
             timeout=90, message="the held jobs ran on the next worker")  # fmt: skip
    assert sorted(run["taskId"] for run in db.runs.find({"taskId": {"$in": ids}})) == sorted(ids)
