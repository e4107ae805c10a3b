"""Push wake-ups: a change stream brings the work to an idle worker, which then does not poll."""

from __future__ import annotations

import contextlib
import socket
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Consumer, Producer, Queue

from tests.support.spies import record_changes
from tests.support.workers import producer, send, settled, wait_for


@pytest.mark.change_streams
def test_new_delayed_and_retried_jobs_arrive_by_wakeup(broker_url, db, worker_factory) -> None:
    worker = worker_factory()
    app = producer(broker_url)
    wait_for(lambda: app.control.inspect(timeout=1).ping(), message="remote control answered")
    before = db.command("serverStatus")["opcounters"]["update"]
    later = send(app, "add", 2, 2, countdown=10)  # ten idle seconds, ended by its runAfter timer
    wait_for(settled(db, later, "succeeded"), timeout=60, message="the delayed task succeeded")
    writes = db.command("serverStatus")["opcounters"]["update"] - before
    # claim + settle + a lease sweep or two; a worker polling its two queues every second would make ~20 more
    assert writes < 12, f"{writes} update commands while idle: the worker is polling"
    now = send(app, "add", 1, 1)
    flaky = send(app, "fail_until", 2)  # its retry is an update with a future runAfter
    for task_id in (now, flaky):
        wait_for(settled(db, task_id, "succeeded"), timeout=60, message=f"{task_id} succeeded")
    assert "no change streams" not in worker.log()


def test_without_change_streams_the_worker_polls(broker_url, db, worker_factory) -> None:
    worker_factory(options={"use_change_streams": False})
    app = producer(broker_url)
    task_ids = [send(app, "add", 1, 1), send(app, "fail_until", 2), send(app, "add", 2, 2, countdown=1)]
    for task_id in task_ids:
        wait_for(settled(db, task_id, "succeeded"), timeout=60, message=f"{task_id} succeeded by polling")


@pytest.mark.change_streams
def test_news_for_a_queue_it_does_not_consume_leaves_a_consumer_idle(broker_url, db) -> None:
    # Flower consumes only its events queue: a job published to `celery` used to mark a queue no poll of it would
    # ever clear, and its event thread spun through drain_events at a core's worth of CPU.
    with Connection(broker_url) as conn:
        channel = conn.channel()
        polls = []
        real_get = channel._get
        channel._get = lambda queue, timeout=None: polls.append(queue) or real_get(queue, timeout)
        consumer = Consumer(channel, queues=[Queue("mine")], accept=["json"], callbacks=[lambda *_: None])
        consumer.consume()
        wakeups = wait_for(lambda: conn.transport.wakeups if conn.transport.wakeups.available else None,
                           message="the change stream is live")  # fmt: skip
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)  # the first look at its queue
        changes = record_changes(wakeups)
        send(producer(broker_url), "add", 1, 1)  # to `celery`, which this consumer does not consume
        wait_for(lambda: changes, message="the change stream reported the new job")
        polls.clear()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=2)
    assert len(polls) < 20, f"{len(polls)} polls of {set(polls)} in 2 s of idling: the consumer spins"


@pytest.mark.change_streams
def test_connections_opened_and_closed_one_after_another_never_run_the_pool_dry(broker_url) -> None:
    # Celery's test manager opens a connection per test to inspect the worker. Each consuming connection started a
    # change-stream watcher that outlived it and kept a pooled connection for good: after maxPoolSize of them every
    # read of the process waited for a pool slot (pymongo's "Timed out while checking out a connection").
    url = f"{broker_url}?maxPoolSize=3&waitQueueTimeoutMS=5000"
    for round_ in range(6):
        with Connection(url) as conn, Consumer(conn, [Queue(f"reply.{round_}", auto_delete=True)], accept=["json"]):
            wait_for(lambda: conn.transport.wakeups.available, timeout=30, message=f"round {round_}'s change stream")
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)  # nobody answers: the consumer looks and waits, as an inspect does
    with Connection(url) as conn:
        queue = Queue("reply.last", auto_delete=True)
        got: list[object] = []
        with Consumer(conn, [queue], accept=["json"], callbacks=[lambda body, message: got.append(body)]):
            Producer(conn.channel()).publish({"hello": "again"}, routing_key=queue.name)
            wait_for(lambda: got or _drain(conn), timeout=30, message="the message on the last connection")
    assert got == [{"hello": "again"}]


def _drain(conn: Connection) -> None:
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=0.5)


LONE_TASKS = 4


def test_a_lone_task_costs_an_idle_worker_one_claim_and_no_read_of_plain_messages(
    broker_url, db, worker_factory, tmp_path
) -> None:
    # What the change stream told of is what the worker reads: a task's insert is one job in `celery`, so the claim
    # that takes it is the only read; a read of bb_messages, or a second claim finding `celery` empty, came back
    # with every lone task (the bench's probes) before. Safety polls (which read everything) are out of the way.
    log = tmp_path / "reads.log"
    worker = worker_factory(options={"safety_poll_interval": 3600}, env={"BB_TEST_READ_LOG": str(log)})
    app = producer(broker_url)
    pidbox = f"{worker.name}@{socket.gethostname()}.celery.pidbox"

    def ping() -> None:  # a round trip through the worker's loop: what it did before the reply is done
        # One ping, however slow the machine: a second one sent after a late reply would be a second pidbox claim in
        # the window counted below. With a destination, the call returns at the first reply.
        wait_for(lambda: app.control.ping(destination=[pidbox.split(".celery.")[0]], timeout=30), message="a pong")

    def reads() -> Counter[tuple[str, str, str]]:
        return Counter(tuple(line.split()) for line in log.read_text().splitlines())

    ping()  # the worker's first looks at its queues (everything, once) are behind this
    first = send(app, "add", 0, 0)
    wait_for(settled(db, first, "succeeded"), message="the first task")
    ping()
    before = reads()
    for n in range(LONE_TASKS):
        task_id = send(app, "add", n, n)
        wait_for(settled(db, task_id, "succeeded"), message=f"lone task {n}")
    ping()
    window = reads() - before
    assert window == {
        ("findAndModify", "jobs", "celery"): LONE_TASKS,  # one claim per task, nothing else on `celery`
        ("findAndModify", "bb_messages", pidbox): 1,  # the last ping, and no claim there
    }, window


def test_a_pool_processs_client_looks_at_the_server_once_a_minute_and_the_main_processs_as_pymongo_does(
    broker_url, worker_factory
) -> None:
    # A pool process's client serves its clock and the rare settle it writes itself: pymongo's monitors checking the
    # server every 10 s (two `hello`s each time) cost an idle worker 0.2 operations a second per pool process.
    worker = worker_factory(concurrency=2, env={"BB_RESULT_BACKEND": "broker"})
    app = producer(broker_url)
    app.conf.result_backend = broker_url
    pool = [app.send_task("tests.support.e2e_app.pool_monitoring").get(timeout=60) for _ in range(4)]
    hostname = f"{worker.name}@{socket.gethostname()}"
    replies = app.control.broadcast("monitoring", reply=True, timeout=10, destination=[hostname]) or []
    (main,) = [reply for answer in replies for reply in answer.values()]
    assert main["heartbeat_seconds"] == 10.0  # pymongo's default: the worker's watcher and leases need no other
    assert {run["heartbeat_seconds"] for run in pool} == {60.0}
    assert main["pid"] not in {run["pid"] for run in pool}


def test_an_idle_workers_safety_poll_is_one_read_per_collection_for_all_its_queues_and_finds_what_the_stream_missed(
    broker_url, db, worker_factory, tmp_path
) -> None:
    # A safety poll used to claim and take in each queue the worker consumes: two reads per queue every
    # safety_poll_interval. Now one read per collection covers them all, and a queue is read only where one says
    # something waits. A job moved by hand from another queue is no news to the change stream: the safety poll finds it.
    log = tmp_path / "reads.log"
    worker = worker_factory(
        options={"safety_poll_interval": 1.0}, extra_args=("-Q", "a,b,c"), env={"BB_TEST_READ_LOG": str(log)}
    )
    pidbox = f"{worker.name}@{socket.gethostname()}.celery.pidbox"
    consumed = {"a", "b", "c", pidbox}

    def reads() -> list[tuple[str, str, frozenset[str]]]:
        lines = log.read_text().splitlines() if log.exists() else []
        return [(name, coll, frozenset(queues.split(","))) for name, coll, queues in (line.split() for line in lines)]

    wait_for(lambda: any(queues == consumed for _, _, queues in reads()), message="a safety poll of every queue")
    before = len(reads())
    wait_for(lambda: len(reads()) >= before + 8, message="four more safety polls")
    window = reads()[before:]
    assert all(name == "find" and queues == consumed for name, _, queues in window), window
    assert {coll for _, coll, _ in window} == {"jobs", "bb_messages"}

    app = producer(broker_url)
    task_id = send(app, "add", 2, 3, queue="elsewhere")  # a queue the worker does not consume
    wait_for(lambda: db.jobs.find_one({"taskId": task_id, "status": "queued"}), message="the job stored")
    db.jobs.update_one({"taskId": task_id}, {"$set": {"queue": "b"}})
    wait_for(settled(db, task_id, "succeeded"), timeout=30, message="the moved job, run")
    assert ("findAndModify", "jobs", frozenset({"b"})) in reads()[before:]  # read where the probe found it


def _resident_kb(pid: int) -> int:
    """The resident memory of process `pid`, in kB, as `top` shows it."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def _delayed_jobs(queue: str, count: int, due: datetime) -> list[dict[str, Any]]:
    """`count` queued jobs of `queue` due at `due`, as a publish with a countdown writes them."""
    now = datetime.now(UTC)
    return [
        {"_id": f"delayed-{queue}-{n}", "kind": "tests.support.e2e_app.add", "taskId": f"delayed-{queue}-{n}",
         "queue": queue, "priority": 0, "payload": {}, "status": "queued", "attempts": 0, "runAfter": due,
         "createdAt": now, "updatedAt": now}
        for n in range(count)
    ]  # fmt: skip


@pytest.mark.timeout(1200)  # 22,000 jobs into the indexes: over 300 s on a 2-core machine at a load of 45
def test_delayed_jobs_of_a_queue_it_does_not_consume_cost_its_worker_no_memory(broker_url, db, worker_factory) -> None:
    # The change stream tells every worker of every job: each kept a timer per future runAfter before it looked at
    # the queue, 170 bytes a job in every worker (8.4 MB for 50,000 jobs scheduled a day ahead on another queue).
    worker = worker_factory(options={"safety_poll_interval": 3600})
    assert worker.process is not None
    app = producer(broker_url)
    tomorrow = datetime.now(UTC) + timedelta(days=1)

    def seen_by_the_worker(batch: str) -> None:
        # The stream is ordered: once the worker ran a task published after the jobs, it was told of each of them.
        task_id = send(app, "add", 1, 1)
        wait_for(settled(db, task_id, "succeeded"), timeout=600, message=f"a task after the {batch} jobs")

    # A first round settles the worker's memory (its reads, its pools) at what jobs on another queue make it.
    db.jobs.insert_many(_delayed_jobs("warm-up", 2_000, tomorrow))
    seen_by_the_worker("warm-up")
    before = _resident_kb(worker.process.pid)
    for start in range(0, 20_000, 5_000):
        db.jobs.insert_many(_delayed_jobs(f"elsewhere-{start}", 5_000, tomorrow))
    seen_by_the_worker("20,000 delayed")
    grown = _resident_kb(worker.process.pid) - before
    assert grown < 1_500, f"the worker's main process grew by {grown} kB for 20,000 delayed jobs it does not run"
