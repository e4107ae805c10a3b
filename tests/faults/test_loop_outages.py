"""A worker's event loop through a server that fails, restarts or goes away: it reconnects and loses nothing."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import Celery
from kombu import Connection, Consumer, Queue
from pymongo import MongoClient
from pymongo.database import Database

from tests.support.faults import fail_point
from tests.support.servers import EmbeddedServer, with_database
from tests.support.workers import Worker, producer, send, settled, wait_for

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


#: Celery 5.7.0 (d4eb32a78) keeps a prefork process running a task busy through a reconnect; before, the next task
#: received could be written to it, behind that task. The workers here run Celery's prefork pool.
FREE_PROCESSES_TAKE_TASKS_AFTER_A_RECONNECT = celery.VERSION >= (5, 7)
#: What a worker of an earlier Celery says of it as it starts (bb_broker.worker.startup).
QUEUES_BEHIND_A_RUNNING_TASK = "pool may queue a task behind a running one after a lost broker connection"


@dataclass
class Running:
    """A worker with a task under way: its database, the producer's app, and the gate that lets the task go on."""

    db: Database
    worker: Worker
    app: Celery
    gate: Path
    task_id: str = ""
    #: A task sent after the reconnect.
    after: str = ""


def _reconnect_under(task: str, server: EmbeddedServer, tmp_path: Path, *, database: str, **worker: Any) -> Running:
    """A worker running `task` (held until the gate file is made), made to lose its connection and reconnect: the
    next claim fails twice (pymongo's own retry included), and Celery takes the connection for lost."""
    url = with_database(server.url, database)
    client = MongoClient(server.url, tz_aware=True)
    running = Running(client[database], Worker(url, log_dir=tmp_path, name="w0", **worker), producer(url),
                      tmp_path / "gate")  # fmt: skip
    running.worker.start()
    running.task_id = send(running.app, task, str(running.gate))
    app, task_id = running.app, running.task_id
    wait_for(lambda: running.db.runs.find_one({"taskId": task_id}), message="the task acked late under way")
    wait_for(lambda: any(task["id"] == task_id for tasks in (app.control.inspect(timeout=1).active() or {}).values()
                         for task in tasks),
             message="the worker lists the task as running")  # fmt: skip
    fail_point(
        client, 2, failCommands=["findAndModify"], errorCode=NETWORK_TIMEOUT, errorLabels=["RetryableWriteError"]
    )
    running.after = send(app, "add", 1, 1)
    wait_for(lambda: "Connection to broker lost" in running.worker.log(), message="the worker reconnects")
    if FREE_PROCESSES_TAKE_TASKS_AFTER_A_RECONNECT:
        wait_for(settled(running.db, running.after, "succeeded"), timeout=60,
                 message="the worker runs tasks after the reconnect")  # fmt: skip
    else:
        # Celery 5.4 to 5.6 queue it behind the task under way (AsynPool.flush forgets the busy process, on every
        # broker): claimed now, it runs once that task ends.
        claimed = {"taskId": running.after, "status": {"$in": ["running", "succeeded"]}}
        wait_for(lambda: running.db.jobs.find_one(claimed), timeout=60, message="the worker claims after the reconnect")
    return running


@pytest.mark.parametrize("cancelled", [False, True], ids=["runs on", "cancelled by celery"])
def test_a_task_acked_late_runs_once_through_a_reconnect_and_its_worker_stays_up(
    own_server: EmbeddedServer, tmp_path: Path, cancelled: bool
) -> None:
    # Kombu restores the unacked messages of a lost connection: the job of an acks_late task still running went back
    # to the queue, ran a second time at the same attempt beside the first run, and the first run's ack, on the closed
    # channel, then ended the worker ("Unrecoverable error: AttributeError").
    # Cancelled: Celery's worker_cancel_long_running_tasks_on_connection_loss stops the run on the reconnect, for
    # the broker to deliver its message again; its job then goes back, and runs once more (nothing settles a
    # cancelled run: kept, it stayed `running` until the stale sweep).
    env = {"BB_CANCEL_ON_CONNECTION_LOSS": "1" if cancelled else "0"}
    # Room for a second run beside the first.
    running = _reconnect_under("hold_until_acked_late", own_server, tmp_path, database="late", concurrency=3, env=env)
    db, worker, late = running.db, running.worker, running.task_id
    said = QUEUES_BEHIND_A_RUNNING_TASK in worker.log()
    assert said == (not FREE_PROCESSES_TAKE_TASKS_AFTER_A_RECONNECT), worker.log()[-3000:]
    running.gate.touch()
    wait_for(settled(db, late, "succeeded"), timeout=60, message="the task acked late succeeded")
    wait_for(settled(db, running.after, "succeeded"), timeout=60, message="the task sent after the reconnect ran")
    # Its ack went to the closed channel. The worker goes on: its next task acked late runs and settles too.
    again = send(running.app, "hold_until_acked_late", str(running.gate))
    wait_for(lambda: worker.process.poll() is not None or settled(db, again, "succeeded")(),
             timeout=60, message="the worker ran its next task, or ended")  # fmt: skip
    assert worker.process.poll() is None, worker.log()[-3000:]
    assert "Unrecoverable error" not in worker.log()
    assert db.runs.count_documents({"taskId": late}) == (2 if cancelled else 1), list(db.runs.find({"taskId": late}))
    doc = db.jobs.find_one({"taskId": late})
    assert doc["status"] == "succeeded" and doc["attempts"] == 1, doc
    assert [(entry["n"], entry["outcome"]) for entry in doc["history"]] == [(1, "succeeded")], doc["history"]


def test_a_task_running_through_a_reconnect_keeps_its_job_for_longer_than_its_lease(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    # Celery 5.4 to 5.6 empty the worker's reserved requests on a reconnect, runs under way included: their jobs kept
    # no lease, and the stale sweep gave a run still going to a second one after stale_after.
    stale_after = 4.0
    running = _reconnect_under("hold_until_acked_late", own_server, tmp_path, database="late_leased",
                               concurrency=3, options={"stale_after": stale_after})  # fmt: skip
    db, late = running.db, running.task_id
    since = db.jobs.find_one({"taskId": late})["updatedAt"]
    kept = {"taskId": late, "updatedAt": {"$gt": since + timedelta(seconds=2 * stale_after)}}
    wait_for(lambda: db.jobs.find_one(kept), timeout=60, message="its lease kept fresh for two of its lengths")
    held = db.jobs.find_one({"taskId": late})
    assert held["status"] == "running" and held["attempts"] == 1, held
    assert db.runs.count_documents({"taskId": late}) == 1, list(db.runs.find({"taskId": late}))
    running.gate.touch()
    done = wait_for(settled(db, late, "succeeded"), timeout=60, message="the task acked late succeeded")
    assert done["attempts"] == 1 and db.runs.count_documents({"taskId": late}) == 1, done


def test_a_task_acked_late_whose_process_dies_after_a_reconnect_fails_its_attempt(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    # Its message was restored with the lost connection while its run went on; Celery's rejection of it when its
    # pool process died (reject_on_worker_lost) found no such delivery: Kombu raised KeyError, and the job stayed
    # `running` until the stale sweep. Celery 5.7 reports the death at once. Celery 5.4 to 5.6 forget the job under
    # way at the reconnect (AsynPool.flush), so the death reports nothing and the worker holds its request for good:
    # its job's lease lapses (stale_after), and the stale sweep runs it again (before, the job stayed `running` for
    # as long as the worker ran).
    options = {} if FREE_PROCESSES_TAKE_TASKS_AFTER_A_RECONNECT else {"stale_after": 6.0}
    running = _reconnect_under(
        "hold_until_then_exit_acked_late", own_server, tmp_path, database="late_lost", options=options
    )
    running.gate.touch()  # every attempt's process dies from here on: the job fails after its last
    failed = wait_for(settled(running.db, running.task_id, "failed"), timeout=60, message="the job failed at last")
    assert failed["attempts"] == 3 and "WorkerLostError" in failed["lastError"], failed
    assert running.worker.process.poll() is None, running.worker.log()[-3000:]
    assert "Unrecoverable error" not in running.worker.log()


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
    assert app.control.rate_limit("tests.support.e2e_app.add", "1/h", reply=True, timeout=10)
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


def test_jobs_held_unstarted_through_a_reconnect_go_back_unspent_once_the_server_answers(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    # Celery restores the unacked messages of the connection it lost; the release of each held job failed on the
    # absent server, Kombu dumped them as "UNABLE TO RESTORE", and the jobs stayed `running` in a lease nobody
    # renewed until the stale sweep gave them back as lost, an attempt used.
    url = with_database(own_server.url, "restore") + "?serverSelectionTimeoutMS=3000"  # the loop notices in 3 s
    db = MongoClient(own_server.url, tz_aware=True).restore
    # Without heartbeats the outage reaches the consumer: its next claim fails and Celery reconnects. (With them,
    # the heartbeat's publish, retried on the event loop until the server answers, holds the loop through it.)
    # stale_after 600: no sweep within the test, so only a release explains the jobs going back.
    worker = Worker(url, log_dir=tmp_path, name="w0", concurrency=1, env={"BB_PREFETCH_MULTIPLIER": "4"},
                    options={"stale_after": 600.0}, extra_args=("--without-heartbeat",))  # fmt: skip
    worker.start()
    app = producer(url)
    gate = tmp_path / "gate"
    blocker = send(app, "hold_until", str(gate))
    wait_for(lambda: db.runs.find_one({"taskId": blocker}), message="the pool process busy")
    held = [send(app, "add", i, i) for i in range(2)]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": held}, "status": "running"}) == 2,
             message="two jobs claimed, waiting for the pool")  # fmt: skip
    own_server.stop()
    wait_for(lambda: "Cannot connect to" in worker.log().partition("Connection to broker lost")[2],
             timeout=120, message="the worker lost its connection, restored its messages and reconnects")  # fmt: skip
    own_server.start()
    gate.touch()
    ids = [blocker, *held]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == 3,
             timeout=180, message="every job succeeded, long before a stale sweep")  # fmt: skip
    for doc in db.jobs.find({"taskId": {"$in": held}}):
        # As after a plain release: the claim given back used no attempt, and left no history entry.
        assert doc["attempts"] == 1, doc
        assert [(entry["n"], entry["outcome"]) for entry in doc["history"]] == [(1, "succeeded")], doc["history"]
    assert sorted(run["taskId"] for run in db.runs.find({"taskId": {"$in": held}})) == sorted(held)
    assert "UNABLE TO RESTORE" not in worker.log()
    assert worker.process.poll() is None


def test_a_batch_held_by_a_consumer_closed_while_its_server_is_gone_goes_back_once_the_server_answers(
    own_server: EmbeddedServer,
) -> None:
    # The jobs a batch claim holds undelivered, and the delivered ones nobody acked, are given back when the
    # consumer closes; with the server gone they stayed `running` until the stale sweep spent an attempt on each.
    url = with_database(own_server.url, "batch") + "?serverSelectionTimeoutMS=2000"
    db = MongoClient(own_server.url, tz_aware=True).batch
    app = producer(url)
    ids = [send(app, "add", i, i) for i in range(6)]
    options = {"stale_after": 600.0}
    delivered: list[str] = []
    # Another consumer of this process stays: its lease keeper (one per collection) makes the releases.
    with Connection(url, transport_options=options) as staying:
        Consumer(staying.channel(), queues=[Queue("elsewhere")], accept=["json"]).consume()
        leaving = Connection(url, transport_options=options)
        consumer = Consumer(leaving.channel(), queues=[Queue("celery")], accept=["json"], prefetch_count=5,
                            callbacks=[lambda body, message: delivered.append(message.job_id)])  # fmt: skip
        consumer.consume()
        leaving.drain_events(timeout=10)  # one job
        leaving.drain_events(timeout=10)  # then a batch: one delivered, three held
        assert len(delivered) == 2 and db.jobs.count_documents({"status": "running"}) == 5
        own_server.stop()
        leaving.close()  # as Kombu and Celery close a connection they lost
        own_server.start()
        wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "queued"}) == 6,
                 message="the five claimed jobs back in the queue")  # fmt: skip
    # As a plain release leaves them: no attempt used, no history entry, no lease.
    for doc in db.jobs.find({"taskId": {"$in": ids}}):
        assert doc["attempts"] == 0 and "history" not in doc and "leaseOwner" not in doc, doc
