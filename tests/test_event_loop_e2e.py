"""A Celery worker runs its event loop on bbmongo:// and Celery's own flow control decides what it claims."""

from __future__ import annotations

import pytest
from kombu import Connection, Consumer, Queue
from kombu.asynchronous import Hub
from pymongo.database import Database

from tests.workers import consumer_loops, producer, send, settled, wait_for

#: Long enough that a worker blocked behind these tasks could not answer anything while they run.
BUSY_SECONDS = 120


@pytest.mark.parametrize(
    ("pool", "loop"),
    [("prefork", "asynloop"), ("threads", "asynloop"), ("gevent", "synloop"), ("solo", "asynloop")],
)
def test_the_worker_runs_celerys_event_loop_except_on_a_green_pool(app, worker_factory, pool, loop) -> None:
    worker_factory(pool=pool)
    [answer] = wait_for(lambda: list(consumer_loops(app).values()), message="the worker's consumer loop")
    assert answer == {"loop": loop, "hub": loop == "asynloop"}


def test_a_saturated_worker_answers_remote_control_and_its_revokes_take_effect(
    app, db: Database, worker_factory
) -> None:
    # Every pool process busy for longer than the test, and jobs claimed behind them (Celery's default prefetch).
    worker_factory(concurrency=2, env={"BB_PREFETCH_MULTIPLIER": "4"})
    busy = [send(app, "sleep", BUSY_SECONDS) for _ in range(2)]
    waiting = [send(app, "add", i, i) for i in range(2)]
    wait_for(lambda: db.runs.count_documents({"taskId": {"$in": busy}}) == 2, message="both processes busy")

    # Remote control is answered while no process is free: ping, and the requests waiting in the worker.
    assert wait_for(lambda: app.control.ping(timeout=2), timeout=30, message="a ping answer")
    reserved = wait_for(
        lambda: {r["id"] for rs in (app.control.inspect(timeout=2).reserved() or {}).values() for r in rs},
        timeout=30,
        message="the reserved requests",
    )
    assert reserved == set(waiting)

    # A revoke of a waiting request and one that terminates a running task: both answered and both take effect,
    # the freed process then runs what was not revoked.
    assert app.control.revoke(waiting[0], reply=True, timeout=10)
    assert app.control.revoke(busy[0], terminate=True, reply=True, timeout=10)
    terminated = wait_for(settled(db, busy[0], "failed"), message="the terminated task failed")
    assert "terminated" in terminated["lastError"]
    assert wait_for(settled(db, waiting[1], "succeeded"), message="the task behind it ran")
    revoked = wait_for(settled(db, waiting[0], "failed"), message="the revoked waiting task failed")
    assert revoked["lastError"] == "revoked before it ran"
    assert db.runs.count_documents({"taskId": waiting[0]}) == 0


def test_pool_grow_raises_what_the_worker_claims_as_celerys_prefetch_says(app, db: Database, worker_factory) -> None:
    # One process and a prefetch multiplier of 1: a task running and one claimed behind it, the rest stay queued.
    busy = [send(app, "sleep", BUSY_SECONDS) for _ in range(10)]
    worker_factory(concurrency=1)
    started = {"taskId": {"$in": busy}, "phase": "start"}
    wait_for(lambda: db.jobs.count_documents({"status": "running"}) == 2, message="one running, one claimed")
    assert db.runs.count_documents(started) == 1

    # Two more processes: Celery raises the prefetch to three, which the transport follows.
    assert app.control.pool_grow(2, reply=True, limit=1, timeout=10)
    wait_for(lambda: db.runs.count_documents(started) == 3, message="three running")
    wait_for(lambda: db.jobs.count_documents({"status": "running"}) == 6, message="three running, three claimed")
    assert db.jobs.count_documents({"status": "queued"}) == 4


def test_a_kombu_consumer_on_a_hub_is_woken_by_news_and_by_its_acks_and_leaves_the_hub_clean(
    broker_url: str, db: Database
) -> None:
    hub = Hub()
    unacked: list = []
    delivered: list[str] = []

    def on_message(body, message) -> None:
        delivered.append(message.job_id)
        unacked.append(message)

    def turn() -> int:
        # Acked between turns of the loop, as Celery acks when a pool process starts the task: with prefetch 1,
        # only the ack lets the next message in (no safety poll comes within the test).
        while unacked:
            unacked.pop().ack()
        next(loop)
        return len(delivered) == 3

    with Connection(broker_url, transport_options={"safety_poll_interval": 3600}) as conn:
        conn.transport.register_with_event_loop(conn.connection, hub)
        [doorbell] = hub.readers
        consumer = Consumer(conn.channel(), queues=[Queue("celery")], accept=["json"], prefetch_count=1,
                            callbacks=[on_message])  # fmt: skip
        consumer.consume()
        loop = hub.create_loop()
        ids = [send(producer(broker_url), "add", i, i) for i in range(3)]  # published after the consumer waits
        wait_for(turn, message="three deliveries on the hub")
        assert sorted(delivered) == sorted(d["_id"] for d in db.jobs.find({"taskId": {"$in": ids}}))
    # Closing the connection takes its doorbell off the hub.
    assert doorbell not in hub.readers
