"""A Celery worker runs its event loop on bbmongo:// and Celery's own flow control decides what it claims."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from kombu import Connection, Consumer, Queue
from kombu.asynchronous import Hub
from pymongo import MongoClient, monitoring
from pymongo.database import Database
from pymongo.errors import OperationFailure

from bb_broker.transport.transport import ServerUnavailable
from tests.support.servers import with_database
from tests.support.workers import consumer_loops, producer, send, settled, wait_for

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

    def reserved() -> set[str]:
        return {r["id"] for rs in (app.control.inspect(timeout=2).reserved() or {}).values() for r in rs}

    # Both are waiting in the worker once it claimed them (the second may come a claim after the first).
    wait_for(lambda: reserved() == set(waiting), timeout=30, message="both requests reserved")

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
    wait_for(lambda: db.runs.count_documents(started) == 1, message="the pool process started its task")
    assert db.jobs.count_documents({"status": "running"}) == 2

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


class ClaimWrites(monitoring.CommandListener):
    """The batch claims' writes (an update of queued jobs) this process sends, and the thread that sent each; with a
    gate, each waits there (before it reaches the server) until the test opens it."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.gate: threading.Event | None = None
        self.arrived = threading.Event()
        self.landed = threading.Event()
        self.listening = False
        self._requests: set[int] = set()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        updates = event.command.get("updates") if event.command_name == "update" else None
        # A claim's write: queued jobs set running (the lease keeper's sweep also updates queued jobs: malformed ones).
        claims = updates and updates[0].get("q", {}).get("status") == "queued"
        claims = claims and (updates[0].get("u") or {}).get("$set", {}).get("status") == "running"
        if not (self.listening and claims):
            return
        self.threads.append(threading.current_thread().name)
        self._requests.add(event.request_id)
        self.arrived.set()
        if self.gate is not None:
            self.gate.wait(30)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.request_id in self._requests:
            self.landed.set()

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


CLAIM_WRITES = ClaimWrites()
monitoring.register(CLAIM_WRITES)  # for the clients made from here on; it records only while a test listens


@pytest.fixture
def claim_writes() -> Iterator[ClaimWrites]:
    CLAIM_WRITES.__init__()
    CLAIM_WRITES.listening = True
    yield CLAIM_WRITES
    CLAIM_WRITES.listening = False
    if CLAIM_WRITES.gate is not None:
        CLAIM_WRITES.gate.set()


def consume_on_hub(conn: Connection, hub: Hub, on_message, prefetch_count: int) -> Consumer:
    conn.transport.register_with_event_loop(conn.connection, hub)
    consumer = Consumer(conn.channel(), queues=[Queue("celery")], accept=["json"], prefetch_count=prefetch_count,
                        callbacks=[on_message])  # fmt: skip
    consumer.consume()
    return consumer


def test_a_backlog_is_claimed_off_the_event_loops_thread_and_each_job_delivered_once(
    broker_url: str, db: Database, claim_writes: ClaimWrites
) -> None:
    # The event loop hands the jobs it holds to the pool while the server answers the next claim: it never waits
    # on the server for a queue known to have work.
    ids = [send(producer(broker_url), "add", i, i) for i in range(30)]
    hub, delivered, unacked = Hub(), [], []

    def on_message(body, message) -> None:
        delivered.append(message.job_id)
        unacked.append(message)

    def turn() -> bool:
        while unacked:  # acked between turns, as Celery acks when a pool process starts a task
            unacked.pop().ack()
        next(loop)
        return len(delivered) == len(ids)

    with Connection(broker_url, transport_options={"safety_poll_interval": 3600}) as conn:
        consume_on_hub(conn, hub, on_message, prefetch_count=8)
        loop = hub.create_loop()
        wait_for(turn, message="the backlog delivered on the hub")
    assert sorted(delivered) == sorted(d["_id"] for d in db.jobs.find({"taskId": {"$in": ids}}))
    assert claim_writes.threads and set(claim_writes.threads) == {"bb-claims-ahead"}


def test_what_a_claim_brings_for_a_consumer_cancelled_meanwhile_goes_back_to_the_queue(
    broker_url: str, db: Database, claim_writes: ClaimWrites
) -> None:
    ids = [send(producer(broker_url), "add", i, i) for i in range(12)]
    hub, delivered = Hub(), []
    claim_writes.gate = threading.Event()  # the batch claim waits, on its way to the server, until opened

    def on_message(body, message) -> None:
        delivered.append(message)  # never acked: it stays held, as a task waiting in a worker

    with Connection(broker_url, transport_options={"safety_poll_interval": 3600}) as conn:
        consumer = consume_on_hub(conn, hub, on_message, prefetch_count=8)
        loop = hub.create_loop()
        wait_for(lambda: next(loop) or claim_writes.arrived.is_set(), message="a batch claim on its way")
        consumer.cancel()  # the worker stops consuming while the claim is out
        claim_writes.gate.set()
        wait_for(claim_writes.landed.is_set, message="the batch claim carried out")
        # The claim lands (its jobs are taken on the server) and, with nobody to hand them to, gives them back:
        # only the one delivered job is held, the rest wait for another worker, no attempt used.
        wait_for(lambda: db.jobs.count_documents({"status": "queued", "attempts": 0}) == len(ids) - len(delivered),
                 message="the batch given back")  # fmt: skip
        assert len(delivered) == 1 and db.jobs.count_documents({"status": "running"}) == 1


def test_an_error_a_claim_meets_off_the_loop_is_raised_on_the_loop(own_server, claim_writes: ClaimWrites) -> None:
    # Celery learns of a broken connection from what the loop raises: a claim on another thread must not hide it.
    url = with_database(own_server.url, "ahead_error")
    for i in range(12):
        send(producer(url), "add", i, i)
    hub, delivered = Hub(), []
    claim_writes.gate = threading.Event()
    client = MongoClient(own_server.url)
    with Connection(url, transport_options={"safety_poll_interval": 3600}) as conn:
        consume_on_hub(conn, hub, lambda body, message: delivered.append(message), prefetch_count=8)
        loop = hub.create_loop()
        wait_for(lambda: next(loop) or claim_writes.arrived.is_set(), message="a batch claim on its way")
        # Its write meets a router that lost its shard (HostUnreachable: an answer that passes with time, which a
        # multi-document write is not retried on): Celery must hear of it, to connect again. (An answer that does
        # not pass with time backs the queue off instead: test_server_profiles.py.)
        client.admin.command("configureFailPoint", "failCommand", mode={"times": 1},
                             data={"failCommands": ["update"], "errorCode": 6, "errorLabels": []})  # fmt: skip
        claim_writes.gate.set()
        with pytest.raises(ServerUnavailable) as raised:  # a connection error: Celery connects again
            wait_for(lambda: next(loop) and False, message="the claim's error raised on the loop")
    assert isinstance(raised.value.__cause__, OperationFailure) and raised.value.__cause__.code == 6
    assert len(delivered) == 1


@pytest.mark.change_streams
def test_a_job_queued_while_a_batch_claim_is_out_is_delivered_without_waiting_for_a_safety_poll(
    broker_url: str, db: Database, claim_writes: ClaimWrites
) -> None:
    app = producer(broker_url)
    ids = [send(app, "add", i, i) for i in range(4)]
    hub, delivered = Hub(), []
    claim_writes.gate = threading.Event()
    with Connection(broker_url, transport_options={"safety_poll_interval": 3600}) as conn:
        consume_on_hub(conn, hub, lambda body, message: delivered.append(message.job_id), prefetch_count=8)
        loop = hub.create_loop()
        # One job claimed on the loop, then a batch claim of the rest sent off it, held on its way to the server.
        wait_for(lambda: next(loop) or claim_writes.arrived.is_set(), message="a batch claim on its way")
        late = send(app, "add", 9, 9)  # read by no claim out: only the change stream tells of it
        wait_for(lambda: db.jobs.count_documents({"taskId": late}) == 1, message="the late job stored")
        claim_writes.gate.set()  # the claim lands with the three it read, fewer than it had room for
        wait_for(lambda: next(loop) or len(delivered) == 5, message="every job, the late one too")
    assert sorted(delivered) == sorted(d["_id"] for d in db.jobs.find({"taskId": {"$in": [*ids, late]}}))
