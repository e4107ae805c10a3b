"""A consumer that may start several jobs claims them in one batch, keeps their leases, and gives back the unstarted."""

from __future__ import annotations

import signal
import socket
import threading
from collections import Counter

import pytest
from kombu import Connection, Consumer, Queue
from pymongo import monitoring
from pymongo.database import Database

from tests.support.workers import ClaimCommands, consumer_loops, producer, send, wait_for


@pytest.mark.parametrize("ending", ["cancel", "close"])
def test_a_consumer_batches_its_claims_keeps_their_leases_and_gives_back_the_unstarted(
    broker_url: str, db: Database, ending: str
) -> None:
    app = producer(broker_url)
    for i in range(6):
        send(app, "add", i, i)
    delivered = []
    with Connection(broker_url, transport_options={"stale_after": 2.5}) as conn:
        consumer = Consumer(conn.channel(), queues=[Queue("celery")], accept=["json"], prefetch_count=5,
                            callbacks=[lambda body, message: delivered.append(message.job_id)])  # fmt: skip
        consumer.consume()
        conn.drain_events(timeout=10)  # one job: nothing says more are waiting yet
        assert len(delivered) == 1 and db.jobs.count_documents({"status": "running"}) == 1
        conn.drain_events(timeout=10)  # more were: this claim takes what the consumer may still start, at once
        assert len(delivered) == 2 and db.jobs.count_documents({"status": "running"}) == 5

        # The jobs claimed but not yet delivered keep their lease: the heartbeats reach them, the sweep spares them.
        held = {d["_id"]: d["updatedAt"] for d in db.jobs.find({"status": "running", "_id": {"$nin": delivered}})}
        assert len(held) == 3
        wait_for(lambda: all(db.jobs.find_one({"_id": i})["updatedAt"] > at for i, at in held.items()),
                 message="heartbeats for the held jobs")  # fmt: skip
        assert db.jobs.count_documents({"status": "running"}) == 5

        if ending == "cancel":  # no longer consuming the queue: what it holds but never delivered goes back at once
            consumer.cancel()
            assert {d["_id"] for d in db.jobs.find({"status": "running"})} == set(delivered)
            assert db.jobs.count_documents({"_id": {"$in": list(held)}, "status": "queued", "attempts": 0}) == 3
    # closing gives back the held jobs and the delivered ones nobody acknowledged; none of it used an attempt
    assert [d["attempts"] for d in db.jobs.find({"status": "queued"})] == [0] * 6
    # and with its last consumer gone, this process stops keeping leases and sweeping
    wait_for(lambda: not any(t.name == "bb-broker-leases" for t in threading.enumerate()), message="keeper stops")


def test_celerys_default_prefetch_drains_a_backlog_once_each_and_shuts_down_clean(
    app, db: Database, worker_factory
) -> None:
    ids = [send(app, "add", i, i) for i in range(40)]
    drainer = worker_factory(env={"BB_PREFETCH_MULTIPLIER": "4"})  # two processes, eight jobs at a time
    wait_for(lambda: db.jobs.count_documents({"status": "succeeded"}) == 40, timeout=120, message="the backlog")
    assert {d["attempts"] for d in db.jobs.find()} == {1}
    assert sorted(r["taskId"] for r in db.runs.find()) == sorted(ids)  # each ran once
    drainer.signal(signal.SIGTERM)  # the next part is about one worker alone
    assert drainer.wait(60) == 0

    # A warm shutdown with jobs claimed ahead of a busy process: the running one finishes, the rest go back.
    slow = [send(app, "sleep", 1) for _ in range(6)]
    worker = worker_factory(concurrency=1, env={"BB_PREFETCH_MULTIPLIER": "4"})
    wait_for(lambda: db.runs.find_one({"taskId": {"$in": slow}}), message="a slow task started")
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    docs = list(db.jobs.find({"taskId": {"$in": slow}}))
    started = {r["taskId"] for r in db.runs.find({"taskId": {"$in": slow}, "phase": "start"})}
    assert {d["taskId"] for d in docs if d["status"] == "succeeded"} == started
    assert all(d["status"] == "queued" and d["attempts"] == 0 for d in docs if d["taskId"] not in started), docs


def test_a_worker_killed_holding_a_batch_loses_none_of_it(app, db: Database, worker_factory) -> None:
    slow = [send(app, "sleep", 3) for _ in range(6)]
    victim = worker_factory(concurrency=1, options={"stale_after": 3}, env={"BB_PREFETCH_MULTIPLIER": "4"})
    assert consumer_loops(app) == {"w0@" + socket.gethostname(): {"loop": "asynloop", "hub": True}}
    # On Celery's event loop: one task started, and the four its prefetch lets it take behind it, in a batch.
    wait_for(lambda: db.jobs.count_documents({"status": "running"}) == 5, message="the worker holds five jobs")
    victim.kill()
    runs = list(db.runs.find({"taskId": {"$in": slow}}))
    cut_short = {r["taskId"] for r in runs if r["phase"] == "start"} - {
        r["taskId"] for r in runs if r["phase"] == "end"
    }
    assert db.jobs.count_documents({"status": "running"}) == 5  # stranded with the dead worker

    worker_factory(options={"stale_after": 3})  # its sweep gives them back, and it runs them
    wait_for(lambda: db.jobs.count_documents({"status": "succeeded"}) == 6, timeout=120, message="all six ran")
    starts = Counter(r["taskId"] for r in db.runs.find({"phase": "start"}))
    assert {t: starts[t] for t in slow} == {t: 2 if t in cut_short else 1 for t in slow}


def consume_patiently(conn: Connection, prefetch: int, delivered: list) -> None:
    """Consume `celery` at `prefetch` into `delivered`, as a consumer as slow as it likes: a batch waits for room, not
    for time (batch_patience of an hour)."""
    channel = conn.channel()
    channel.qos.batch_patience = 3600.0
    consumer = Consumer(channel, queues=[Queue("celery")], accept=["json"], prefetch_count=prefetch,
                        callbacks=[lambda body, message: delivered.append(message)])  # fmt: skip
    consumer.consume()


def test_a_consumer_working_through_a_backlog_lets_room_build_up_for_a_batch(broker_url: str, db: Database) -> None:
    # Celery acks each task as a pool process starts it: claiming at each ack would take one job per round trip.
    # While jobs it took still wait in the worker, the consumer lets freed slots wait (batch_patience) and claims
    # a batch once there is room for one.
    commands = ClaimCommands(db.name)
    monitoring.register(commands)
    app = producer(broker_url)
    for i in range(12):
        send(app, "add", i, i)
    delivered: list = []
    with Connection(broker_url) as conn:
        consume_patiently(conn, 4, delivered)
        while len(delivered) < 4:  # one job, then a batch of the three more it may take, all handed out at once
            conn.drain_events(timeout=30)
        assert db.jobs.count_documents({"status": "running"}) == 4
        with commands.recorded() as sent:
            delivered.pop(0).ack()  # room for one while three wait in the worker: not worth a claim yet
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.2)
            assert sent == []
            delivered.pop(0).ack()
            delivered.pop(0).ack()  # room for three: one batch
            conn.drain_events(timeout=30)
        assert db.jobs.count_documents({"status": "running"}) == 7  # an ack leaves the job to Celery's signals
        assert ("findAndModify", "jobs") not in sent and ("update", "jobs") in sent, sent


@pytest.mark.parametrize(
    ("prefetch", "options", "filled"),
    [
        (8, {}, 8),  # one job, then a batch of seven
        (12, {"max_claim_batch": 4}, 9),  # one job, then two batches of four: room for three is not worth a claim
    ],
)
def test_a_larger_prefetch_claims_once_half_its_room_is_free(
    broker_url: str, db: Database, prefetch: int, options: dict, filled: int
) -> None:
    # Each claim reads the head of the queue, which costs the server more than the jobs it takes: at Celery's default
    # prefetch (4 per pool process) the consumer claims once half its room is free, while the other half still
    # waits in the worker for the pool, instead of at every third ack; never once more room than one claim takes.
    commands = ClaimCommands(db.name)
    monitoring.register(commands)
    app = producer(broker_url)
    for i in range(20):
        send(app, "add", i, i)
    delivered: list = []
    with Connection(broker_url, transport_options=options) as conn:
        consume_patiently(conn, prefetch, delivered)
        while len(delivered) < filled:
            conn.drain_events(timeout=30)
        assert db.jobs.count_documents({"status": "running"}) == filled
        with commands.recorded() as sent:
            while prefetch - len(delivered) < 3:
                delivered.pop(0).ack()  # room for three while the rest wait in the worker: not yet
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.2)
            assert sent == []
            delivered.pop(0).ack()  # half the room, or all one claim takes: one batch of four
            conn.drain_events(timeout=30)
        assert db.jobs.count_documents({"status": "running"}) == filled + 4
        assert ("findAndModify", "jobs") not in sent and sent.count(("update", "jobs")) == 1, sent


def test_no_room_is_waited_for_when_one_claim_takes_less_than_a_batch(broker_url: str, db: Database) -> None:
    # With max_claim_batch below a batch every claim is one job: letting freed slots wait would gain nothing.
    app = producer(broker_url)
    for i in range(12):
        send(app, "add", i, i)
    delivered: list = []
    with Connection(broker_url, transport_options={"max_claim_batch": 2}) as conn:
        consume_patiently(conn, 8, delivered)
        while len(delivered) < 8:
            conn.drain_events(timeout=30)
        delivered.pop(0).ack()
        conn.drain_events(timeout=30)  # the freed slot is claimed at once
        assert len(delivered) == 8 and db.jobs.count_documents({"status": "running"}) == 9
