"""A server answer no code of bb_broker recognises (failCommand with errorCode 54321), met by a real worker or beat
mid-settle, mid-sweep, mid-heartbeat and at a beat's tick: said once in the server's own words, counted in
bb_broker_server_errors_total, backed off and tried again. The worker or beat stays up; no job is lost or run twice.

Each fail point is armed once the worker has done a first job: the capability probe is not what meets it."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.clock import ServerClock
from tests.support.beat_process import TICK, Beat, slot_jobs
from tests.support.faults import fail_point, fail_point_off, fail_point_on, server_errors
from tests.support.servers import EmbeddedServer, with_database
from tests.support.workers import Worker, all_succeeded, producer, send, wait_for

UNKNOWN = {"errorCode": 54321}


def _worker(own_server: EmbeddedServer, tmp_path: Path, database: str, **options: Any) -> tuple[Worker, str]:
    """A worker serving its metrics, on `database` of the test's own server; its metrics' base URL."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    worker = Worker(
        with_database(own_server.url, database),
        log_dir=tmp_path,
        name="w0",
        options=options,
        env={"BB_METRICS_PORT": "0", "PROMETHEUS_MULTIPROC_DIR": str(shared)},
    )
    worker.start()
    found = wait_for(lambda: re.search(r"bb_broker metrics on (http://\S+)/metrics", worker.log()), 30, "metrics")
    return worker, found.group(1)


def _first_job_done(app: Celery, db: Database) -> None:
    first = send(app, "add", 1, 1)  # the worker has probed the server, claimed and settled once
    wait_for(lambda: db.jobs.find_one({"taskId": first, "status": "succeeded"}), 60, "the first job")


def _said_once(log: str, path: str) -> None:
    said = [line for line in log.splitlines() if f"answered a {path} of" in line and "does not expect" in line]
    assert len(said) == 1 and "(code 54321" in said[0], log[-4000:]


def _still_up(worker: Worker) -> None:
    assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
    assert "Unrecoverable error" not in worker.log(), worker.log()[-3000:]


def _starts(db: Database, task_id: str) -> int:
    """How many times the task's body began (each run of a task of tests/support/e2e_app.py records one)."""
    return db.runs.count_documents({"taskId": task_id})


def test_a_settle_meeting_an_unknown_answer_is_kept_and_lands_once(own_server: EmbeddedServer, tmp_path: Path) -> None:
    client: MongoClient = MongoClient(own_server.url, tz_aware=True)
    db = client.unknown_settle
    worker, metrics = _worker(own_server, tmp_path, db.name)
    app = producer(with_database(own_server.url, db.name))
    gate = tmp_path / "gate"
    try:
        _first_job_done(app, db)
        task_id = send(app, "hold_until", str(gate))
        wait_for(lambda: _starts(db, task_id) == 1, 60, "the task to start")
        fail_point_on(client, failCommands=["update"], **UNKNOWN)  # every settle (and heartbeat) is refused
        gate.touch()
        wait_for(lambda: server_errors(metrics).get("settle", 0) >= 2, 60, "the settle refused, then tried again")
        assert db.jobs.find_one({"taskId": task_id})["status"] == "running"
        fail_point_off(client)
        done = wait_for(lambda: db.jobs.find_one({"taskId": task_id, "status": "succeeded"}), 90, "the settle")
    finally:
        fail_point_off(client)
        app.close()
    assert done["attempts"] == 1 and _starts(db, task_id) == 1
    _still_up(worker)
    _said_once(worker.log(), "settle")
    assert "were not written" not in worker.log(), worker.log()[-3000:]


def test_a_sweep_meeting_an_unknown_answer_backs_off_and_the_next_sweep_requeues(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    client: MongoClient = MongoClient(own_server.url, tz_aware=True)
    db = client.unknown_sweep
    worker, metrics = _worker(own_server, tmp_path, db.name, stale_after=4.0)
    app = producer(with_database(own_server.url, db.name))
    try:
        _first_job_done(app, db)
        # A job a worker that is gone held: written as the claim leaves it, its lease long run out. Published to a
        # queue nobody consumes, taken off the collection and written back running once the fail point is armed.
        task_id = send(app, "add", 2, 3, queue="nobody")
        job = db.jobs.find_one_and_delete({"taskId": task_id})
        fail_point_on(client, failCommands=["update"], **UNKNOWN)
        lost = ServerClock(db)() - timedelta(hours=1)
        db.jobs.insert_one(
            {**job, "queue": "celery", "status": "running", "attempts": 1, "leaseOwner": "gone@host",
             "startedAt": lost, "updatedAt": lost}
        )  # fmt: skip
        wait_for(lambda: server_errors(metrics).get("sweep", 0) >= 1, 60, "the sweep refused")
        assert db.jobs.find_one({"taskId": task_id})["status"] == "running"
        fail_point_off(client)
        done = wait_for(lambda: db.jobs.find_one({"taskId": task_id, "status": "succeeded"}), 90, "the next sweep")
    finally:
        fail_point_off(client)
        app.close()
    assert done["attempts"] == 2 and _starts(db, task_id) == 1  # the lost attempt, then this worker's run
    assert [entry["outcome"] for entry in done["history"]] == ["lost", "succeeded"]
    _still_up(worker)
    _said_once(worker.log(), "sweep")


def test_heartbeats_meeting_an_unknown_answer_keep_the_job_and_it_runs_once(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    client: MongoClient = MongoClient(own_server.url, tz_aware=True)
    db = client.unknown_heartbeat
    worker, metrics = _worker(own_server, tmp_path, db.name, stale_after=10.0)  # a heartbeat every 2 s
    app = producer(with_database(own_server.url, db.name))
    gate = tmp_path / "gate"
    try:
        _first_job_done(app, db)
        task_id = send(app, "hold_until", str(gate))
        wait_for(lambda: _starts(db, task_id) == 1, 60, "the task to start")
        fail_point(client, 3, failCommands=["update"], **UNKNOWN)  # three lease renewals (or a sweep) refused
        wait_for(lambda: server_errors(metrics).get("heartbeat", 0) >= 1, 60, "a heartbeat refused")
        renewed = db.jobs.find_one({"taskId": task_id})["updatedAt"]
        wait_for(lambda: db.jobs.find_one({"taskId": task_id})["updatedAt"] > renewed, 60, "the lease renewed again")
        gate.touch()
        done = wait_for(lambda: db.jobs.find_one({"taskId": task_id, "status": "succeeded"}), 90, "the job")
    finally:
        app.close()
    assert done["attempts"] == 1 and _starts(db, task_id) == 1
    _still_up(worker)
    _said_once(worker.log(), "heartbeat")


def test_a_beat_meeting_an_unknown_answer_at_its_tick_stays_up_and_sends_at_the_next(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    client: MongoClient = MongoClient(own_server.url, tz_aware=True)
    db = client.unknown_beat
    beat = Beat(with_database(own_server.url, db.name), tmp_path, "b0", TICK).start()
    wait_for(lambda: len(slot_jobs(db)) >= 2, 60, "two slots sent")
    # Each slot's publish is refused, over and over.
    fail_point_on(client, failCommands=["insert"], **UNKNOWN)
    try:
        wait_for(lambda: "does not expect" in beat.log(), 60, "the beat to meet the answer")
        sent = len(slot_jobs(db))
        clock = ServerClock(db)
        later = clock() + timedelta(seconds=4)
        wait_for(lambda: clock() > later, 30, "a few ticks refused")
        assert len(slot_jobs(db)) == sent
    finally:
        fail_point_off(client)
    wait_for(lambda: len(slot_jobs(db)) >= sent + 2, 60, "the next ticks to send")
    assert beat.process is not None and beat.process.poll() is None, beat.log()[-3000:]
    said = [line for line in beat.log().splitlines() if "does not expect" in line]
    assert said and all("(code 54321" in line for line in said), beat.log()[-3000:]
    assert len(said) == 1, beat.log()[-3000:]  # once, however many looks met it


def test_a_change_stream_meeting_an_unknown_answer_is_polled_through_and_said_once(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    client: MongoClient = MongoClient(own_server.url, tz_aware=True)
    db = client.unknown_stream
    worker, metrics = _worker(own_server, tmp_path, db.name)
    app = producer(with_database(own_server.url, db.name))
    try:
        _first_job_done(app, db)
        # The worker's change stream (its wake-ups) is refused, at its next getMore and at each reopening; the test's
        # own commands are not (bb_broker's clients only).
        fail_point_on(client, failCommands=["aggregate", "getMore"], appName="bb_broker", **UNKNOWN)
        wait_for(lambda: "answered a change stream of" in worker.log(), 60, "the stream refused")
        ids = [send(app, "add", n, n) for n in range(3)]
        wait_for(all_succeeded(db, ids), 90, "the jobs, by polling")
    finally:
        fail_point_off(client)  # before /metrics is read: its gauges count the jobs with an aggregate
        app.close()
    assert server_errors(metrics).get("change stream", 0) >= 1
    _still_up(worker)
    _said_once(worker.log(), "change stream")
