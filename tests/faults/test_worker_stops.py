"""A worker keeps working through pool resizes and stops on SIGTERM; its release at exit gives up on a gone server."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from pathlib import Path

from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.clock import ServerClock
from bb_broker.jobs import leases
from bb_broker.jobs.leases import LeaseKeeper
from bb_broker.jobs.store import JobStore
from tests.support.servers import EmbeddedServer
from tests.support.workers import Worker, producer, send, wait_for

#: Far above a healthy stop on a loaded machine, far below a wedged worker's forever.
STOP_BOUND = 60.0
#: The release at exit gives up after SHUTDOWN_PATIENCE (5 s); it used to wait out 30 s of server selection per call.
#: A correctness bound, not a benchmark.
RELEASE_WITHOUT_SERVER_BOUND = 25.0


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
        wait_for(lambda: pool_processes(app) == 4, message="the grown pool")
        assert app.control.pool_shrink(shrink, reply=True, limit=1, timeout=10)
    ids = [send(app, "add", i, i) for i in range(6)]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == len(ids),
             timeout=90, message="every task after the resizes ran")  # fmt: skip
    assert stops_on_sigterm(worker) == 0


def test_the_release_at_exit_gives_up_on_a_server_that_is_gone_within_seconds(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(leases, "_process_sources", [lambda: []])  # a Celery worker's requests: it ran here
    server = EmbeddedServer(tmp_path / "data")
    server.start()
    db = MongoClient(server.url, tz_aware=True).gone
    store = JobStore(db, clock=ServerClock(db))
    store.now()  # a worker has long measured the server's clock by the time it stops
    keeper = LeaseKeeper(store, owner="w0")
    atexit.unregister(keeper._release_at_exit)  # released here, not again when pytest exits
    keeper.remove_source(lambda: [])
    server.stop()
    # Its clock sync and two updates used to wait out 30 s of server selection each.
    release = threading.Thread(target=keeper._release_at_exit, args=(os.getpid(),))
    release.start()
    release.join(RELEASE_WITHOUT_SERVER_BOUND)
    assert not release.is_alive(), f"the release at exit still waits after {RELEASE_WITHOUT_SERVER_BOUND}s"
    # What it could not release is the stale sweep's, said once.
    assert caplog.text.count("could not release this worker's jobs at exit") == 1


def test_a_process_whose_consumers_all_closed_has_nothing_to_release_at_exit(tmp_path: Path, caplog) -> None:
    # A plain Kombu consumer (or a test process) closed its channels, which gave their jobs back: its exit must not
    # wait on, or warn about, a server that has gone since.
    server = EmbeddedServer(tmp_path / "data")
    server.start()
    db = MongoClient(server.url, tz_aware=True).closed
    keeper = LeaseKeeper(JobStore(db, clock=ServerClock(db)), owner="w0")
    atexit.unregister(keeper._release_at_exit)
    keeper.remove_source(lambda: [])
    server.stop()
    keeper._release_at_exit(os.getpid())
    assert "could not release" not in caplog.text


#: A whole idle worker with its server gone, asked to stop: it used to take ~180 s (every call at shutdown waited out
#: 30 s of server selection). A correctness bound well below that, not a benchmark.
STOP_WITHOUT_SERVER_BOUND = 30.0


def test_an_idle_worker_whose_server_is_gone_stops_within_seconds(own_server: EmbeddedServer, tmp_path: Path):
    url = own_server.url.replace("mongodb://", "bbmongo://") + "/gone"
    worker = Worker(url, log_dir=tmp_path, name="orphan", extra_args=("-E",))
    worker.start()
    app = producer(url)
    wait_for(lambda: app.control.inspect(timeout=1).ping(), message="the worker answers")
    app.close()
    own_server.stop()
    code = stops_on_sigterm(worker, STOP_WITHOUT_SERVER_BOUND)
    log = worker.log()
    assert code == 0, log[-3000:]
    # What it could not hand back is left to the stale sweep, said once.
    assert log.count("could not release this worker's jobs at exit") == 1, log[-3000:]
