"""A worker keeps working through pool resizes, and stops within seconds, even when its server is gone."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from pymongo.database import Database

from tests.servers import EmbeddedServer, with_database
from tests.workers import Worker, producer, send, wait_for

#: Far above a healthy stop on a loaded machine, far below a wedged worker's forever.
STOP_BOUND = 60.0
#: A worker whose server is gone stops in about 10 s (a few calls of 3 s each); it used to take one to three
#: minutes, every call waiting out 30 s of server selection. A correctness bound, not a benchmark.
STOP_WITHOUT_SERVER_BOUND = 30.0


def stops_on_sigterm(worker: Worker, bound: float = STOP_BOUND) -> int:
    worker.signal(signal.SIGTERM)
    try:
        return worker.wait(bound)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker ignored SIGTERM for {bound}s:\n{worker.log()[-3000:]}") from None


def pool_processes(app) -> int:
    replies = app.control.inspect(timeout=10, limit=1).stats() or {}
    return next((len(stats["pool"]["processes"]) for stats in replies.values()), 0)


def test_pool_grow_then_shrink_leaves_a_worker_that_runs_every_task_and_stops(broker_url, db: Database, worker_factory):
    worker = worker_factory(concurrency=2)
    app = producer(broker_url)
    # Flower's buttons. A shrink SIGTERMs idle pool processes together, and one that died holding the pool's
    # job-queue lock used to wedge the rest: tasks were received and never started. The race is won or lost in
    # microseconds, so the grown processes are let start (more of them die together) and a few rounds follow.
    for grow, shrink in [(2, 3), (3, 3), (3, 3), (3, 3)]:
        assert app.control.pool_grow(grow, reply=True, limit=1, timeout=10)
        wait_for(lambda: pool_processes(app) == 4, message="the grown pool")  # noqa: B023
        assert app.control.pool_shrink(shrink, reply=True, limit=1, timeout=10)
    ids = [send(app, "add", i, i) for i in range(6)]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == len(ids),
             timeout=90, message="every task after the resizes ran")  # fmt: skip
    assert stops_on_sigterm(worker) == 0


def test_an_idle_worker_whose_server_is_gone_stops_within_seconds(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "data")
    server.start()
    try:
        worker = Worker(with_database(server.url, "gone"), log_dir=tmp_path, name="w0")
        worker.start()
    finally:
        server.stop()
    assert stops_on_sigterm(worker, STOP_WITHOUT_SERVER_BOUND) == 0
    # What it could not release is the stale sweep's, said once.
    assert worker.log().count("could not release this worker's jobs at exit") == 1
