"""Push wake-ups: a change stream brings the work to an idle worker, which then does not poll."""

from __future__ import annotations

import contextlib

import pytest
from kombu import Connection, Consumer, Producer, Queue

from tests.workers import producer, send, settled, wait_for


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
        changes = wakeups.changes_seen
        send(producer(broker_url), "add", 1, 1)  # to `celery`, which this consumer does not consume
        wait_for(lambda: wakeups.changes_seen > changes, message="the change stream reported the new job")
        polls.clear()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=2)
    assert len(polls) < 20, f"{len(polls)} polls of {set(polls)} in 2 s of idling: the consumer spins"


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
