"""Task events on their way from a worker to the monitors: published on the worker's event loop through the outbox
(the loop never waits on the server for them; none is lost, reordered or stored twice), and read by the monitors
with as few round trips as the news allows."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kombu import Connection, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from bb_broker.transport.plumbing import MessageStore, Outbox, payload_of
from tests.support.servers import with_database
from tests.support.workers import ROOT, ClaimCommands, producer, send, settled, wait_for

EXCHANGE = Exchange("outbox", type="direct")
QUEUE = Queue("outbox.q", EXCHANGE, routing_key="outbox")
EVENTS = Queue("outbox.events", Exchange("outbox.ev", type="topic"), routing_key="task.#")


class Inserts(monitoring.CommandListener):
    """How many documents each insert into one database's bb_messages carried, as the process sent them."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.sizes: list[int] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.database_name == self.database and event.command.get("insert") == "bb_messages":
            self.sizes.append(len(event.command["documents"]))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def drained(conn: Connection, queue: Queue, into: list, count: int):
    """A wait_for condition: read what `queue` holds into `into` until it has `count`."""
    bound = queue(conn.channel())

    def read() -> bool:
        while (message := bound.get(no_ack=True)) is not None:
            into.append(message.payload)
        return len(into) >= count

    return read


def test_a_loop_threads_messages_are_published_while_the_server_is_down_and_stored_when_it_is_back(
    own_server,
) -> None:
    url = with_database(own_server.url, "outbox_down")
    with Connection(url, transport_options={"safety_poll_interval": 3600}) as conn:
        conn.transport.register_with_event_loop(conn.connection, Hub())
        channel = conn.channel()
        QUEUE(channel).declare()  # bound while the server answers
        publisher = Producer(channel, exchange=EXCHANGE, routing_key="outbox", auto_declare=False)
        publisher.publish({"n": 0})
        own_server.stop()
        # The event loop's thread goes on: a worker publishing its events does not wait for the server.
        for n in range(1, 6):
            publisher.publish({"n": n})
        own_server.start()
        with Connection(url) as reader:
            got: list = []
            wait_for(drained(reader, QUEUE, got, 6), message="the messages stored once the server is back")
    assert got == [{"n": n} for n in range(6)]


def test_what_a_loop_thread_published_is_stored_in_order_before_its_process_exits(own_server) -> None:
    # The process publishes on its loop's thread and ends at once, while the server holds its first write back:
    # its outbox stores everything before the process is gone.
    broker_url = with_database(own_server.url, "outbox_exit")
    client = MongoClient(own_server.url)
    client.admin.command("configureFailPoint", "failCommand", mode={"times": 1},
                         data={"failCommands": ["insert"], "blockConnection": True, "blockTimeMS": 1500})  # fmt: skip
    script = textwrap.dedent(f"""
        from kombu import Connection, Exchange, Producer, Queue
        from kombu.asynchronous import Hub
        import bb_broker  # noqa: F401
        queue = Queue("outbox.q", Exchange("outbox", type="direct"), routing_key="outbox")
        with Connection({broker_url!r}) as conn:
            conn.transport.register_with_event_loop(conn.connection, Hub())
            channel = conn.channel()
            queue(channel).declare()
            publisher = Producer(channel, exchange=queue.exchange, routing_key="outbox", auto_declare=False)
            for n in range(300):
                publisher.publish({{"n": n}})
    """)
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120)
    assert client.outbox_exit.bb_messages.count_documents({"queue": "outbox.q"}) == 300
    with Connection(broker_url) as reader:
        got: list = []
        wait_for(drained(reader, QUEUE, got, 300), message="the messages")
    assert got == [{"n": n} for n in range(300)]


def test_a_loops_events_linger_to_be_stored_together_and_a_reply_takes_them_along_at_once(
    broker_url: str, db: Database
) -> None:
    inserts = Inserts(db.name)
    monitoring.register(inserts)  # before this test's client (one per broker URL) is made
    with Connection(broker_url, transport_options={"events_linger": 3600}) as conn:
        conn.transport.register_with_event_loop(conn.connection, Hub())
        channel = conn.channel()
        for queue in (EVENTS, QUEUE):
            queue(channel).declare()
        events = Producer(channel, exchange=EVENTS.exchange, auto_declare=False)
        for n in range(5):
            events.publish({"event": n}, routing_key="task.succeeded")
            db.command("ping")  # a round trip, in which the outbox's writer could take what waits
            # Each waits in the outbox for the others: a monitor then reads a burst in one batch, not one by one.
            assert db.bb_messages.count_documents({}) == 0, f"event {n} was stored before the others"
        # A message to a direct exchange (a reply) lingers for nothing, and the events go with it, in order.
        Producer(channel, exchange=EXCHANGE, routing_key="outbox", auto_declare=False).publish({"reply": 0})
        wait_for(lambda: db.bb_messages.count_documents({}) == 6, message="the events and the reply stored")
    assert inserts.sizes == [6]
    with Connection(broker_url) as reader:
        got: list = []
        wait_for(drained(reader, EVENTS, got, 5), message="the events")
    assert got == [{"event": n} for n in range(5)]


def test_every_monitor_bound_to_the_events_reads_every_task_event_of_a_worker(
    broker_url: str, db: Database, worker_factory
) -> None:
    monitors = [Queue(f"monitor{n}", Exchange("celeryev", type="topic"), routing_key="task.#") for n in (1, 2)]
    with Connection(broker_url) as conn:
        for monitor in monitors:
            monitor(conn.channel()).declare()
        worker_factory(extra_args=("-E",))
        app = producer(broker_url)
        ids = [send(app, "add", n, n) for n in range(20)]
        for task_id in ids:
            wait_for(settled(db, task_id, "succeeded"), message="the tasks")
        for monitor in monitors:
            bodies: list = []
            seen: set = set()

            def read_all(bodies=bodies, seen=seen, monitor=monitor) -> bool:
                drained(conn, monitor, bodies, 0)()
                # On Celery's event loop a worker sends its task events in batches: a body is then a list.
                events = [event for body in bodies for event in (body if isinstance(body, list) else [body])]
                seen.clear()
                seen.update((event["type"], event["uuid"]) for event in events)
                return all((kind, i) in seen for i in ids for kind in ("task-received", "task-succeeded"))

            wait_for(read_all, message=f"{monitor.name}'s events")
            assert all(("task-started", i) in seen for i in ids)
            events = [event for body in bodies for event in (body if isinstance(body, list) else [body])]
            assert len(events) == len(set(map(repr, events))), "an event stored twice"


def test_two_waiting_messages_are_taken_with_a_round_trip_each_not_a_batchs_three(db: Database) -> None:
    # A monitor told of two events takes them with two findAndModify, not with a batch's read, mark and delete.
    commands = ClaimCommands(db.name)
    monitoring.register(commands)  # before the store's client is made
    host, port = db.client.address
    store = MessageStore(MongoClient(host, port, tz_aware=True)[db.name])
    for n in range(3):
        store.put("events", {"body": str(n), "properties": {}}, 0)
    with commands.recorded() as sent:
        first, exhausted = store.take("events", 2)
    assert ([payload_of(doc)["body"] for doc in first], exhausted) == (["0", "1"], False)
    assert sent == [("findAndModify", "bb_messages")] * 2
    with commands.recorded() as sent:
        rest, exhausted = store.take("events", 2)
    assert ([payload_of(doc)["body"] for doc in rest], exhausted) == (["2"], True)
    assert sent == [("findAndModify", "bb_messages")] * 2


def test_a_take_of_two_whose_second_read_fails_delivers_the_first(own_server) -> None:
    # The first findAndModify has deleted its message on the server: an error on the second must not drop it.
    client = MongoClient(own_server.url, tz_aware=True)
    store = MessageStore(client.second_read)
    for n in range(2):
        store.put("events", {"body": str(n), "properties": {}}, 0)
    client.admin.command("configureFailPoint", "failCommand", mode={"skip": 1},
                         data={"failCommands": ["findAndModify"], "errorCode": 2})  # fmt: skip
    try:
        taken, exhausted = store.take("events", 2)
    finally:
        client.admin.command("configureFailPoint", "failCommand", mode="off")
    assert ([payload_of(doc)["body"] for doc in taken], exhausted) == (["0"], False)
    assert [payload_of(doc)["body"] for doc in client.second_read.bb_messages.find()] == ["1"]


def test_the_outbox_drops_a_message_the_server_refuses_and_stores_the_next(own_server) -> None:
    # A refusal is not an outage: trying it again for ever would hold back every event and reply after it.
    client = MongoClient(own_server.url, tz_aware=True)
    store = MessageStore(client.refused)
    box = Outbox.of(store.messages)
    client.admin.command(
        "configureFailPoint", "failCommand", mode={"times": 1}, data={"failCommands": ["insert"], "errorCode": 13}
    )  # fmt: skip  (Unauthorized)
    store.put("q", {"body": "refused", "properties": {}}, 0, soon=True)
    assert box.flush(30) == 0
    store.put("q", {"body": "next", "properties": {}}, 0, soon=True)
    assert box.flush(30) == 0
    assert [payload_of(doc)["body"] for doc in client.refused.bb_messages.find()] == ["next"]
