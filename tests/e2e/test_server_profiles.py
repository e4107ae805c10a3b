"""The deployments our users run, played by a wire proxy in front of the stand-in (tests/support/wire.py): a standalone
server (no change streams: 40573), `mongos` routers, an engine that refuses what FerretDB 2.5 refuses (`hint` on
findAndModify and `$changeStream` with 115, a unique index's refusal reported as code 1), and one that refuses update
pipelines as Amazon DocumentDB does (code 9). On each, real workers run the everyday scenarios; none may exit, lose
a job or run one twice. And a server answer the code has never seen, mid-claim, backs that queue off instead of
ending the worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker import DuplicateJob
from bb_broker.jobs.queues import CONTROL_SETTLE
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support import wire
from tests.support.beat_process import TICK, Beat, assert_one_job_per_slot, slot_jobs
from tests.support.faults import fail_point
from tests.support.servers import with_database
from tests.support.workers import Worker, all_succeeded, producer, send, wait_for

PROFILES = {
    "standalone": wire.standalone,
    "mongos": wire.router,
    "ferretdb": wire.ferretdb,
    "documentdb": wire.amazon_documentdb,
}


@pytest.fixture(params=sorted(PROFILES))
def deployment(request: pytest.FixtureRequest, mongo_url: str, db: Database) -> Iterator[tuple[wire.WireProxy, str]]:
    proxy = wire.WireProxy(mongo_url, PROFILES[request.param]())
    yield proxy, with_database(f"mongodb://{proxy.address}", db.name)
    proxy.close()


@pytest.fixture
def results_producer(deployment: tuple[wire.WireProxy, str]) -> Iterator[Celery]:
    app = producer(deployment[1])
    app.conf.result_backend = deployment[1]
    yield app
    app.close()


def start(url: str, tmp_path: Path, name: str, *args: str) -> Worker:
    worker = Worker(url, log_dir=tmp_path, name=name, env={"BB_RESULT_BACKEND": url}, extra_args=args)
    worker.start()
    return worker


def still_up(*workers: Worker) -> None:
    for worker in workers:
        assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
        assert "Unrecoverable error" not in worker.log(), worker.log()[-3000:]


@pytest.mark.stand_in
def test_tasks_run_once_and_get_returns_their_results(deployment, results_producer, db: Database, tmp_path) -> None:
    proxy, url = deployment
    worker = start(url, tmp_path, "w0")
    results = [results_producer.send_task("tests.support.e2e_app.add", args=(n, 1)) for n in range(5)]
    # get() waits by a change stream where there is one, else by polling: it returns either way.
    assert [result.get(timeout=60) for result in results] == [1, 2, 3, 4, 5]
    docs = list(db.jobs.find({"taskId": {"$in": [result.id for result in results]}}))
    assert [doc["status"] for doc in docs] == ["succeeded"] * 5
    assert {doc["attempts"] for doc in docs} == {1}
    still_up(worker)
    if proxy.profile.name == "ferretdb":
        # The probe met the refusals once, and the worker chose its fallbacks there: said once, never failed on.
        lacks = [line for line in worker.log().splitlines() if " lacks " in line]
        assert lacks and "change_streams" in lacks[0] and "hint_find_and_modify" in lacks[0], worker.log()


@pytest.mark.stand_in
def test_a_limited_queue_and_serial_keys_hold_without_ending_a_worker(deployment, db: Database, tmp_path) -> None:
    _, url = deployment
    Operations(JobStore(db)).set_limits("limited", concurrency=1, by="tester")
    workers = [start(url, tmp_path, f"w{n}", "-Q", "limited,celery") for n in range(2)]
    app = producer(url)
    try:
        limited = [send(app, "sleep", 0.2, queue="limited") for _ in range(4)]
        serial = [send(app, "sleep", 0.2, serial_key="account") for _ in range(3)]
        ids = limited + serial
        wait_for(all_succeeded(db, ids), 120, "every job succeeded")
    finally:
        app.close()
    # Each ran once; the unique indexes' refusals (a slot, a busy key) were read as refusals, whatever their code.
    assert {doc["attempts"] for doc in db.jobs.find({"taskId": {"$in": ids}})} == {1}
    still_up(*workers)


@pytest.mark.parametrize(
    "commands",
    [["findAndModify", "update"], ["find"]],
    ids=["the claim's writes", "the reads: safety probe, plain messages, the claim's head and control"],
)
def test_a_server_answer_never_seen_mid_claim_backs_the_queue_off_and_the_worker_stays_up(
    commands, own_server, tmp_path
) -> None:
    client = MongoClient(own_server.url, tz_aware=True)
    url = with_database(own_server.url, "unknown_answers")
    worker = start(url, tmp_path, "w0")
    app = producer(url)
    try:
        first = send(app, "add", 1, 1)  # the worker has probed the server and claimed once
        wait_for(lambda: client.unknown_answers.jobs.find_one({"taskId": first, "status": "succeeded"}), 60, "first")
        time.sleep(CONTROL_SETTLE)  # what the worker read of its queue's control is old: its next claim reads it again
        # Every such command meets an answer no list in bb_broker names, four times over.
        # bb_broker's clients only (its appname): the test's own reads are no part of it.
        fail_point(client, 4, failCommands=commands, errorCode=54321, appName="bb_broker")
        task_id = send(app, "add", 2, 3)
        done = wait_for(
            lambda: client.unknown_answers.jobs.find_one({"taskId": task_id, "status": "succeeded"}),
            90,
            "the job succeeded once the server stopped refusing",
        )
    finally:
        app.close()
    assert done["attempts"] == 1
    still_up(worker)
    log = worker.log()
    assert "does not expect: " in log and "(code 54321" in log, log[-3000:]
    assert log.count("a claim of 'celery' with an error") == 1, log[-3000:]  # once per queue and code, not each try


# The standalone played in front of the embedded server; and the suite's own server, whatever its topology.
@pytest.mark.parametrize("profile", [pytest.param("standalone", marks=pytest.mark.stand_in), "suite server"])
def test_a_job_published_after_pause_answered_never_starts(profile, mongo_url, db: Database, tmp_path) -> None:
    # Without change streams (the standalone profile) nothing tells the worker of the pause: what it reads of the
    # queue's control for its claims stops them (at most half a second old, or read again after a late claim).
    proxy = wire.WireProxy(mongo_url, wire.standalone()) if profile == "standalone" else None
    url = (
        with_database(f"mongodb://{proxy.address}", db.name) if proxy is not None else with_database(mongo_url, db.name)
    )
    worker = Worker(url, log_dir=tmp_path, name="w0", extra_args=("-Q", "q,other"))
    worker.start()
    app = producer(url)
    try:
        warm = send(app, "add", 0, 0, queue="q")  # the worker has read the controls (none) and claims q
        wait_for(lambda: db.jobs.find_one({"taskId": warm, "status": "succeeded"}), 60, "the first job ran")
        assert Operations(JobStore(db)).pause("q", by="tester")
        held = [send(app, "add", n, n, queue="q") for n in range(3)]
        after = send(app, "add", 1, 1, queue="other")  # published after them: the worker has claimed since
        wait_for(lambda: db.jobs.find_one({"taskId": after, "status": "succeeded"}), 60, "the other queue's job ran")
        docs = list(db.jobs.find({"taskId": {"$in": held}}))
        assert [(doc["status"], doc["attempts"]) for doc in docs] == [("queued", 0)] * 3, docs
        assert "startedAt" not in docs[0] and not docs[0].get("history"), docs[0]
        assert Operations(JobStore(db)).resume("q", by="tester")
        wait_for(
            lambda: db.jobs.count_documents({"taskId": {"$in": held}, "status": "succeeded", "attempts": 1}) == 3,
            90,
            "the held jobs ran once the queue was resumed",
        )
    finally:
        app.close()
        if proxy is not None:
            proxy.close()
    still_up(worker)


def _is_claim(command: dict[str, Any]) -> bool:
    """A worker's claim of jobs: a findAndModify of the jobs collection, or an update of it that makes jobs run."""
    if command.get("findAndModify") == "jobs":
        return True
    updates = command.get("updates", []) if command.get("update") == "jobs" else []
    return any(isinstance(u.get("u"), dict) and u["u"].get("$set", {}).get("status") == "running" for u in updates)


@pytest.mark.stand_in
def test_a_claim_that_lands_after_a_pause_answered_gives_its_job_back(mongo_url, db: Database, tmp_path) -> None:
    # The worker's claim of a job is held on the wire (a slow link, a stalled process) until after `pause` answered.
    # Answered later than the settle time after the worker's read of the queue's control, the claim may have landed
    # after the pause: the worker reads the control once more, and the job goes back unspent. It never starts until
    # the resume.
    holding, release = threading.Event(), threading.Event()
    hold = threading.Event()

    def slow_link(command: dict[str, Any]) -> dict[str, Any] | None:
        if hold.is_set() and _is_claim(command):
            holding.set()
            release.wait(60)
        return None

    proxy = wire.WireProxy(mongo_url, wire.Profile("slow link", refuse=slow_link))
    url = with_database(f"mongodb://{proxy.address}", db.name)
    worker = Worker(url, log_dir=tmp_path, name="w0", extra_args=("-Q", "q,other"))
    worker.start()
    app = producer(url)
    try:
        warm = send(app, "add", 0, 0, queue="q")
        wait_for(lambda: db.jobs.find_one({"taskId": warm, "status": "succeeded"}), 60, "the first job ran")
        hold.set()
        late = send(app, "add", 1, 1, queue="q")
        assert holding.wait(60), "the worker never claimed the job"
        assert Operations(JobStore(db)).pause("q", by="tester")
        hold.clear()
        release.set()  # the claim reaches the server now, after the pause answered
        after = send(app, "add", 2, 2, queue="other")
        wait_for(lambda: db.jobs.find_one({"taskId": after, "status": "succeeded"}), 60, "the other queue's job ran")
        doc = db.jobs.find_one({"taskId": late})
        assert (doc["status"], doc["attempts"], doc.get("startedAt"), doc.get("history")) == ("queued", 0, None, None)
        assert "was paused or limited as it was claimed" in worker.log(), worker.log()[-3000:]  # taken, given back
        assert Operations(JobStore(db)).resume("q", by="tester")
        wait_for(
            lambda: db.jobs.find_one({"taskId": late, "status": "succeeded", "attempts": 1}), 60, "it ran once resumed"
        )
    finally:
        release.set()
        app.close()
        proxy.close()
    still_up(worker)


@pytest.mark.stand_in
def test_a_unique_job_is_refused_while_one_is_queued(deployment, db: Database, tmp_path) -> None:
    # The publish meets the unique index's refusal, in whatever code the engine gives it (code 1 on FerretDB).
    _, url = deployment
    app = producer(url)
    try:
        first = send(app, "add", 7, 7, unique=True)
        with pytest.raises(DuplicateJob) as refused:
            send(app, "add", 7, 7, unique=True)
        assert refused.value.task_id == first
    finally:
        app.close()
    assert db.jobs.count_documents({}) == 1


@pytest.mark.stand_in
def test_revoked_and_cancelled_queued_jobs_never_start(deployment, db: Database, tmp_path) -> None:
    _, url = deployment
    app = producer(url)
    try:
        revoked, cancelled, kept = (send(app, "add", n, n, queue="later") for n in range(3))
        app.control.revoke(revoked)
        Operations(JobStore(db)).act("cancel", cancelled, by="tester")  # the id a task's job is known by
        worker = start(url, tmp_path, "w0", "-Q", "later")
        wait_for(lambda: db.jobs.find_one({"taskId": kept, "status": "succeeded"}), 60, "the kept job ran")
    finally:
        app.close()
    for task_id in (revoked, cancelled):
        doc = db.jobs.find_one({"taskId": task_id})
        assert (doc["status"], doc["attempts"]) == ("failed", 0), doc
    still_up(worker)


@pytest.mark.stand_in
def test_a_worker_killed_mid_task_its_job_runs_again_elsewhere(deployment, db: Database, tmp_path) -> None:
    _, url = deployment
    victim = Worker(url, log_dir=tmp_path, name="victim", options={"stale_after": 3})
    victim.start()
    app = producer(url)
    try:
        task_id = send(app, "sleep", 5)  # still running when the kill comes, however loaded the machine
        wait_for(lambda: db.runs.find_one({"taskId": task_id}), 60, "the task started")
        victim.kill()
        survivor = Worker(url, log_dir=tmp_path, name="survivor", options={"stale_after": 3})
        survivor.start()
        done = wait_for(
            lambda: db.jobs.find_one({"taskId": task_id, "status": "succeeded"}), 90, "run again after the crash"
        )
    finally:
        app.close()
    assert done["attempts"] == 2 and [entry["outcome"] for entry in done["history"]] == ["lost", "succeeded"]
    still_up(survivor)


@pytest.mark.stand_in
def test_two_beats_send_each_slot_once(deployment, db: Database, tmp_path) -> None:
    _, url = deployment
    beats = [Beat(url, tmp_path, f"b{n}", TICK).start() for n in range(2)]
    wait_for(lambda: len(slot_jobs(db)) >= 8, 120, "8 slots sent")
    assert_one_job_per_slot(slot_jobs(db))
    for beat in beats:
        assert beat.process is not None and beat.process.poll() is None, beat.log()[-3000:]
