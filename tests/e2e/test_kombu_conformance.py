"""Plain Kombu and Celery on bbmongo:// as on any Kombu transport: routing, expiry, requeue, failover, URLs."""

from __future__ import annotations

import base64
import datetime
import json
import socket
import threading
import uuid
from contextlib import closing
from decimal import Decimal

import kombu
import pytest
from bson import ObjectId
from kombu.exceptions import ChannelError
from pymongo import MongoClient, monitoring
from pymongo.database import Database

import bb_broker  # noqa: F401 (registers bbmongo://)
from bb_broker.jobs.payloads import PayloadError, to_document, to_message
from bb_broker.transport.plumbing import TAKE_LEASE, TAKER, BindingsWatch, MessageStore, payload_of
from tests.support.workers import ClaimCommands, job, send, settled, wait_for


def dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def consume_one(conn: kombu.Connection, queue: kombu.Queue, timeout: float = 30.0) -> tuple[object, kombu.Message]:
    got: list[tuple[object, kombu.Message]] = []

    def on_message(body: object, message: kombu.Message) -> None:
        got.append((body, message))
        message.ack()

    with kombu.Consumer(conn, [queue], callbacks=[on_message], accept=["json"]):
        wait_for(lambda: got or conn.drain_events(timeout=0.5) or got, timeout, f"a message on {queue.name}")
    return got[0]


@pytest.fixture(autouse=True)
def _no_drain_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    # drain_events(timeout) raises socket.timeout when nothing came: for wait_for that is "not yet".
    original = kombu.Connection.drain_events

    def drain(self: kombu.Connection, **kwargs: object) -> None:
        try:
            original(self, **kwargs)
        except TimeoutError:
            return None

    monkeypatch.setattr(kombu.Connection, "drain_events", drain)


def test_plain_kombu_message_on_a_durable_queue_reaches_a_consumer_on_another_connection(broker_url: str) -> None:
    queue = kombu.Queue("plain_durable", kombu.Exchange("plain_direct", type="direct"), routing_key="plain")
    with kombu.Connection(broker_url) as producer_conn, kombu.Connection(broker_url) as consumer_conn:
        kombu.Producer(producer_conn.channel()).publish(
            {"hello": "world"}, exchange=queue.exchange, routing_key="plain", declare=[queue]
        )
        body, message = consume_one(consumer_conn, queue)
    assert body == {"hello": "world"}
    assert message.delivery_info["routing_key"] == "plain"


def test_fanout_bound_on_one_connection_reaches_a_consumer_that_only_names_its_queue(broker_url: str) -> None:
    exchange = kombu.Exchange("fan_elsewhere", type="fanout")
    with kombu.Connection(broker_url) as declarer:
        kombu.Queue("fan_member", exchange).declare(channel=declarer.channel())
    with kombu.Connection(broker_url) as producer_conn, kombu.Connection(broker_url) as consumer_conn:
        kombu.Producer(producer_conn.channel(), exchange=exchange).publish({"to": "all"})
        body, _ = consume_one(consumer_conn, kombu.Queue("fan_member"))
    assert body == {"to": "all"}


def test_a_direct_exchange_routes_to_a_queue_another_connection_bound_whatever_this_one_bound(broker_url: str) -> None:
    # A worker answers each requester's `inspect` on its own reply queue, all bound to one direct exchange: once the
    # worker's connection had bound a reply queue of its own, it routed by its own bindings only, and every later
    # reply to another requester was dropped (Celery's test_revoked_by_headers_complex_canvas: inspect got None).
    exchange = kombu.Exchange("replies_direct", type="direct")
    mine, theirs = kombu.Queue("mine", exchange, "mine"), kombu.Queue("theirs", exchange, "theirs")
    with kombu.Connection(broker_url) as publisher_conn, kombu.Connection(broker_url) as requester_conn:
        producer = kombu.Producer(publisher_conn.channel())
        producer.publish({"to": "me"}, exchange=exchange, routing_key="mine", declare=[mine])
        theirs.declare(channel=requester_conn.channel())
        producer.publish({"to": "them"}, exchange=exchange, routing_key="theirs")
        producer.publish({"to": "me again"}, exchange=exchange, routing_key="mine")
        body, message = consume_one(requester_conn, theirs)
        assert (body, message.delivery_info["routing_key"]) == ({"to": "them"}, "theirs")
        assert [consume_one(requester_conn, mine)[0] for _ in range(2)] == [{"to": "me"}, {"to": "me again"}]


def test_failover_from_a_dead_url_to_a_live_one(broker_url: str) -> None:
    database = broker_url.rsplit("/", 1)[1]
    dead = dead_port()
    live_port = int(broker_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    conn = kombu.Connection(f"bbmongo://127.0.0.1:{dead}/{database};{broker_url}", connect_timeout=2)
    with conn:
        conn.ensure_connection(max_retries=3, interval_start=0, interval_step=0)
        assert (conn.hostname, conn.port, conn.virtual_host) == ("127.0.0.1", live_port, database)
        with closing(conn.SimpleQueue("after_failover")) as queue:
            queue.put({"n": 1})
            assert queue.get(timeout=30).payload == {"n": 1}


def test_a_message_past_its_expiration_is_never_delivered(broker_url: str, db: Database) -> None:
    with kombu.Connection(broker_url) as conn, closing(conn.SimpleQueue("expiring")) as queue:
        queue.put({"n": "expired"}, expiration=0.001)
        queue.put({"n": "kept"})
        expired = db.bb_messages.find_one({"queue": "expiring"}, sort=[("_id", 1)])
        wait_for(lambda: datetime.datetime.now(datetime.UTC) > expired["expiresAt"], message="the first expired")
        message = queue.get(timeout=30)
        assert message.payload == {"n": "kept"}
        message.ack()
        assert queue.qsize() == 0


def test_a_requeued_plain_message_comes_back_marked_redelivered(broker_url: str) -> None:
    with kombu.Connection(broker_url) as conn, closing(conn.SimpleQueue("requeued")) as queue:
        queue.put({"n": 1})
        first = queue.get(timeout=30)
        assert not first.delivery_info.get("redelivered")
        first.requeue()
        second = queue.get(timeout=30)
        assert second.payload == {"n": 1} and second.delivery_info["redelivered"] is True
        second.ack()


def test_reject_with_requeue_redelivers_at_once_marked_redelivered(app, db, worker_factory) -> None:
    # backoff_base 600: a requeue that waited out a backoff would not be back within the test.
    worker_factory(options={"backoff_base": 600})
    task_id = send(app, "reject_once")
    done = wait_for(settled(db, task_id, "succeeded"), message="the redelivery succeeded")
    runs = list(db.runs.find({"taskId": task_id}).sort("at"))
    assert [r["redelivered"] for r in runs] == [False, True]
    assert done["attempts"] == 2


def test_a_reject_with_requeue_after_the_message_was_acked_puts_the_job_back_at_once(app, db, worker_factory) -> None:
    # Without acks_late Celery acks the message as the task starts, and its rejection reaches no message: the job
    # stayed running, held by nobody, until its lease ran out (stale_after, 300 s: the test would time out).
    worker_factory(options={"backoff_base": 600})
    task_id = send(app, "reject_once_acked_at_start")
    done = wait_for(settled(db, task_id, "succeeded"), message="the job ran again at once and succeeded")
    assert [r["attempt"] for r in db.runs.find({"taskId": task_id}).sort("at")] == [1, 2]
    first = done["history"][0]
    assert done["attempts"] == 2 and (first["outcome"], first["error"]) == (
        "failed",
        "the worker rejected the task and requeued it",
    )


def test_a_task_every_worker_requeues_fails_after_max_attempts(app, db, worker_factory) -> None:
    worker_factory(options={"backoff_base": 600, "max_attempts": 3})
    task_id = send(app, "reject_always")
    failed = wait_for(settled(db, task_id, "failed"), message="the poison pill failed")
    assert failed["attempts"] == 3 and "requeued" in failed["lastError"]
    assert db.runs.count_documents({"taskId": task_id}) == 3


def test_headers_json_cannot_hold_are_stored_and_delivered_as_they_were(app, db, worker_factory) -> None:
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    task_id = app.send_task("tests.support.e2e_app.header_value", args=("when",), headers={"when": when}).id
    assert "raw" in job(db, task_id)["payload"]
    worker_factory()
    wait_for(settled(db, task_id, "succeeded"), message="the task ran")
    assert db.runs.find_one({"taskId": task_id})["value"] == repr(when)


def test_payload_round_trip_keeps_kombu_json_types_and_names_what_cannot_be_stored() -> None:
    odd = {"when": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC), "id": uuid.uuid4(), "amount": Decimal("1.5")}
    message = {
        "body": b"[[], {}, {}]",
        "headers": {"task": "t", "id": "1", **odd},
        "properties": {"correlation_id": "1", "blob": b"\x00\xff"},
        "content-type": "application/json",
        "content-encoding": "utf-8",
    }
    back = to_message(to_document(message, message["body"]))
    assert {k: back["headers"][k] for k in odd} == odd and back["properties"]["blob"] == b"\x00\xff"
    with pytest.raises(PayloadError, match="cannot be stored"):
        to_document({**message, "headers": {"task": "t", "id": "1", "x": object()}}, message["body"])


def test_kombu_and_celery_see_host_port_and_database_not_the_url(broker_url: str) -> None:
    hosts = broker_url.split("://", 1)[1].split("/", 1)[0]
    host, port = hosts.rsplit(":", 1)
    secret_url = broker_url.replace("://", "://someone:s3cret@", 1)
    conn = kombu.Connection(secret_url)
    conn.transport  # noqa: B018 (the transport takes the URL apart)
    info = conn.info()
    assert (info["hostname"], info["port"], info["userid"]) == (host, int(port), "someone")
    assert info["virtual_host"] == broker_url.rsplit("/", 1)[1]
    assert conn.as_uri() == secret_url.replace("s3cret", "**")
    assert conn.as_uri(include_password=True) == secret_url
    conn.release()


def test_plain_messages_read_in_batches_by_racing_takers_each_go_to_one(db: Database) -> None:
    # Two consumers in different processes take from one queue at once: a batch read must not hand a message to both.
    host, port = db.client.address
    stores = [MessageStore(MongoClient(host, port, tz_aware=True)[db.name]) for _ in range(2)]
    for i in range(300):
        stores[0].put("shared", {"body": str(i), "properties": {}}, 0)
    taken: list[list[str]] = [[], []]

    start = threading.Barrier(2)

    def take_all(k: int) -> None:
        start.wait()
        while True:
            batch, exhausted = stores[k].take("shared", 7)
            taken[k].extend(payload_of(doc)["body"] for doc in batch)
            if exhausted:
                return

    threads = [threading.Thread(target=take_all, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(taken[0] + taken[1], key=int) == [str(i) for i in range(300)]
    assert taken[0] and taken[1]  # both took some: the race happened
    assert db.bb_messages.count_documents({}) == 0


def test_messages_a_take_marked_and_never_deleted_are_taken_again_after_the_lease(db: Database) -> None:
    # A consumer that marked messages and lost the server before deleting them (and then went away) leaves them
    # marked: after TAKE_LEASE they are anyone's again, while a take under way keeps its own.
    store = MessageStore(db)
    store.ensure_indexes()
    for i in range(4):
        store.put("marked", {"body": str(i), "properties": {}}, 0)
    ids = [doc["_id"] for doc in db.bb_messages.find({}, sort=[("_id", 1)])]
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=TAKE_LEASE * 2)
    db.bb_messages.update_many({"_id": {"$in": ids[:2]}}, {"$set": {TAKER: ObjectId.from_datetime(long_ago)}})
    db.bb_messages.update_one({"_id": ids[2]}, {"$set": {TAKER: ObjectId()}})  # a take under way
    taken, _ = store.take("marked", 10)
    assert [payload_of(doc)["body"] for doc in taken] == ["0", "1", "3"]
    assert [doc["_id"] for doc in db.bb_messages.find()] == [ids[2]]


def test_a_consumer_reads_plain_messages_in_batches_and_gives_back_what_it_did_not_deliver(
    broker_url: str, db: Database
) -> None:
    queue = kombu.Queue("batched", kombu.Exchange("batched", type="direct"), routing_key="b")
    commands = ClaimCommands(db.name)
    monitoring.register(commands)  # before this test's client (one per broker URL) is made
    with kombu.Connection(broker_url) as producer_conn:
        producer = kombu.Producer(producer_conn.channel())
        for i in range(20):
            producer.publish({"n": i}, exchange=queue.exchange, routing_key="b", declare=[queue])
    delivered: list[int] = []
    with kombu.Connection(broker_url) as conn:
        consumer = kombu.Consumer(conn, [queue], callbacks=[lambda body, message: delivered.append(body["n"])],
                                  accept=["json"], no_ack=True)  # fmt: skip
        consumer.consume()
        wait_for(lambda: conn.drain_events(timeout=0.5) or delivered, message="the first message")
        consumer.cancel()  # the rest of its batch goes back, as it was
    assert delivered == [0]
    assert db.bb_messages.count_documents({"queue": "batched"}) == 19
    with (
        commands.recorded() as sent,
        kombu.Connection(broker_url) as conn,
        kombu.Consumer(
            conn, [queue], callbacks=[lambda body, message: delivered.append(body["n"])], accept=["json"], no_ack=True
        ),
    ):
        wait_for(lambda: conn.drain_events(timeout=0.5) or len(delivered) == 20, message="the rest")
    assert delivered == list(range(20))  # each once, in order
    assert 0 < [target for _, target in sent].count("bb_messages") < 10  # in batches, not a read per message


def test_a_fanout_message_requeued_by_one_queue_goes_back_to_that_queue_only(broker_url: str, db: Database) -> None:
    # Each queue bound to a fanout exchange got its copy at publish time: a consumer of one that requeues its copy
    # must not hand the others a second one (their consumer groups would process the message twice).
    exchange = kombu.Exchange("fan_requeue", type="fanout")
    first, second = kombu.Queue("fan_requeue_a", exchange), kombu.Queue("fan_requeue_b", exchange)
    with kombu.Connection(broker_url) as conn:
        channel = conn.channel()
        first.declare(channel=channel)
        second.declare(channel=channel)
        kombu.Producer(channel, exchange=exchange).publish({"to": "all"})
        with closing(conn.SimpleQueue(first)) as queue:
            message = queue.get(timeout=30)
            message.requeue()
            again = queue.get(timeout=30)
            assert again.payload == {"to": "all"} and again.delivery_info["redelivered"] is True
            again.ack()
    assert db.bb_messages.count_documents({"queue": "fan_requeue_b"}) == 1
    assert db.bb_messages.count_documents({"queue": "fan_requeue_a"}) == 0


def test_a_requeued_plain_message_keeps_its_expiration(broker_url: str, db: Database) -> None:
    # As on RabbitMQ, a message given back (requeue, reject, a consumer closing with it unacked) keeps the expiry it
    # was published with: held past it, it is never delivered again.
    with kombu.Connection(broker_url) as conn, closing(conn.SimpleQueue("requeue_expiring")) as queue:
        queue.put({"n": "short-lived"}, expiration=1.0)
        expires_at = db.bb_messages.find_one({"queue": "requeue_expiring"})["expiresAt"]
        message = queue.get(timeout=30)
        wait_for(lambda: datetime.datetime.now(datetime.UTC) > expires_at, message="the message's expiry passed")
        message.requeue()
        queue.put({"n": "kept"})
        assert queue.get(timeout=30).payload == {"n": "kept"}


def test_a_queue_deleted_from_another_connection_is_gone_with_its_messages_and_bindings(
    broker_url: str, db: Database
) -> None:
    # As on RabbitMQ, queue_delete deletes the queue whoever declared it: its messages, and its bindings, so that
    # what is published afterwards is not kept for a queue nobody has.
    exchange = kombu.Exchange("fan_deleted", type="fanout")
    with kombu.Connection(broker_url) as declarer:
        channel = declarer.channel()
        kombu.Queue("deleted_elsewhere", exchange).declare(channel=channel)
        kombu.Producer(channel, exchange=exchange).publish({"n": 1})
    with kombu.Connection(broker_url) as other:
        other.channel().queue_delete("deleted_elsewhere")
    assert db.bb_messages.count_documents({"queue": "deleted_elsewhere"}) == 0
    assert db.bb_bindings.count_documents({"queue": "deleted_elsewhere"}) == 0


def test_a_deleted_exchange_routes_nothing_through_its_old_bindings(broker_url: str, db: Database) -> None:
    # Deleting an exchange deletes its bindings (AMQP, and Kombu's "Delete `exchange` and all its bindings"): one
    # declared again under the same name starts without them.
    exchange = kombu.Exchange("fan_recreated", type="fanout")
    with kombu.Connection(broker_url) as conn:
        channel = conn.channel()
        kombu.Queue("fan_recreated_member", exchange).declare(channel=channel)
        kombu.Producer(channel, exchange=exchange).publish({"n": "kept"})  # not empty: the queue itself stays
        channel.exchange_delete("fan_recreated")
        exchange(channel).declare()
        kombu.Producer(channel, exchange=exchange).publish({"n": "after"})
    assert db.bb_messages.count_documents({"queue": "fan_recreated_member"}) == 1  # "kept" only
    assert db.bb_bindings.count_documents({"exchange": "fan_recreated"}) == 0


@pytest.mark.change_streams
def test_a_topic_message_published_after_a_queue_was_bound_elsewhere_reaches_it(broker_url: str, db: Database) -> None:
    # Celery's events go to a topic exchange whose bindings a publisher keeps a moment: a queue bound since (by
    # another connection of this process, or another process the change stream told of) must get what is published
    # after the bind, as on RabbitMQ, not only what comes once the kept table is old enough to be read again.
    exchange = kombu.Exchange("topic_bound_late", type="topic")
    with kombu.Connection(broker_url) as publisher, kombu.Connection(broker_url) as binder:
        channel = publisher.channel()
        kombu.Queue("topic_early", exchange, routing_key="task.#").declare(channel=channel)
        producer = kombu.Producer(channel, exchange=exchange)
        producer.publish({"n": 0}, routing_key="task.sent")  # the bindings are read, and kept
        kombu.Queue("topic_late", exchange, routing_key="task.#").declare(channel=binder.channel())
        producer.publish({"n": 1}, routing_key="task.sent")
        assert db.bb_messages.count_documents({"queue": "topic_late"}) == 1
        # Bound by another process: once this one's change stream told of it, the kept table is read again.
        with kombu.Consumer(publisher, [kombu.Queue("topic_early")], callbacks=[lambda body, message: None]):
            watch = BindingsWatch.of(channel.plumbing.bindings)
            wait_for(lambda: watch.live_since is not None, message="the change stream live")
            seen = watch.changed_at
            db.bb_bindings.insert_one({"exchange": "topic_bound_late", "routing_key": "task.#", "queue": "topic_other"})
            wait_for(lambda: watch.changed_at > seen, message="the change stream told of the binding")
            producer.publish({"n": 2}, routing_key="task.sent")
        assert db.bb_messages.count_documents({"queue": "topic_other"}) == 1


def test_hand_written_bindings_route_as_their_routing_keys_say_or_not_at_all(broker_url: str, db: Database) -> None:
    # A binding's queue that is no name (a document) made every publish to its exchange fail (unhashable), one
    # without a routing key (natural for a fanout's) too (KeyError): every broadcast and event of the fleet. A
    # pattern of the document's own was compiled as a regex: "(" failed every publish, and none matched everything.
    topic, fanout = kombu.Exchange("hand_topic", type="topic"), kombu.Exchange("hand_fanout", type="fanout")
    with kombu.Connection(broker_url) as conn:
        channel = conn.channel()
        kombu.Queue("topic_bound", topic, routing_key="task.#").declare(channel=channel)
        fanout.declare(channel=channel)
        db.bb_bindings.insert_many(
            [
                {"exchange": "hand_topic", "routing_key": "task.#", "queue": {"a": 1}},
                {"exchange": "hand_topic", "routing_key": "other.*", "queue": "topic_other", "pattern": "("},
                {"exchange": "hand_topic", "routing_key": 7, "queue": "topic_number"},
                {"exchange": "hand_topic", "queue": "topic_no_key", "pattern": ".*"},
                {"exchange": "hand_fanout", "queue": "fanout_no_key"},
                {"exchange": "hand_fanout", "routing_key": "", "queue": ["a", "list"]},
            ]
        )
        kombu.Producer(channel, exchange=topic).publish({"n": 1}, routing_key="task.sent")
        kombu.Producer(channel, exchange=fanout).publish({"n": 2}, routing_key="")
    queues = sorted(doc["queue"] for doc in db.bb_messages.find({}, {"queue": 1}))
    assert queues == ["fanout_no_key", "topic_bound"]


def test_hand_written_plain_messages_are_delivered_or_set_aside_never_ending_the_consumer(
    broker_url: str, db: Database
) -> None:
    # What a person or another program writes into bb_messages: a message with only what Kombu's Message needs to
    # read (no delivery tag, no delivery_info), and payloads no one can turn back into a message.
    with kombu.Connection(broker_url) as conn, closing(conn.SimpleQueue("hand_written")) as queue:
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
        minimal = {"body": '{"n": "minimal"}', "content-type": "application/json", "content-encoding": "utf-8"}
        unreadable = ["{not json", '["a list"]', '{"body": "no properties"}', '{"properties": {"delivery_info": 1}}',
                      '{"properties": {}, "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"]  # fmt: skip
        for payload in [*unreadable, json.dumps({**minimal, "properties": {}, "headers": {}})]:
            db.bb_messages.insert_one({"queue": "hand_written", "priority": 0, "payload": payload, "expiresAt": until})
        queue.put({"n": "published"})
        first, second = queue.get(timeout=30), queue.get(timeout=30)
        assert (first.payload, second.payload) == ({"n": "minimal"}, {"n": "published"})
        assert first.delivery_tag and first.delivery_tag != second.delivery_tag
        first.ack()
        second.ack()
        # Kept where they were, each with why it was not delivered, until the queue's TTL takes it; never again read.
        aside = list(db.bb_messages.find({"queue": "hand_written"}, sort=[("_id", 1)]))
        assert [doc["payload"] for doc in aside] == unreadable
        assert all(doc["unreadable"] for doc in aside) and queue.qsize() == 0
        queue.put({"n": "after"})
        assert queue.get(timeout=30).payload == {"n": "after"}


def test_a_simple_queue_cleared_after_a_get_is_empty_though_its_consumer_read_ahead(
    broker_url: str, db: Database
) -> None:
    # A consumer reads plain messages in batches and delivers them one by one: those read and not yet delivered are
    # still the queue's. qsize() counts them, clear() (queue_purge) purges them and says so, and queue_delete deletes
    # them: none is delivered afterwards, nor stored again when the consumer closes.
    with kombu.Connection(broker_url) as conn:
        with closing(conn.SimpleQueue("cleared")) as queue:
            for i in range(5):
                queue.put({"n": i})
            queue.get(timeout=30).ack()
            assert queue.qsize() == 4
            assert queue.clear() == 4
            assert queue.qsize() == 0
            queue.put({"n": "after"})
            assert queue.get(timeout=30).payload == {"n": "after"}
        assert db.bb_messages.count_documents({"queue": "cleared"}) == 0
        with closing(conn.SimpleQueue("deleted")) as queue:
            for i in range(5):
                queue.put({"n": i})
            queue.get(timeout=30).ack()
            queue.consumer.channel.queue_delete("deleted")
            queue.put({"n": "unrouted"})  # its binding went too, also from this connection's own table
            assert queue.qsize() == 0
            queue.consumer.declare()  # the queue again, bound again
            queue.put({"n": "after"})
            assert queue.get(timeout=30).payload == {"n": "after"}
        assert db.bb_messages.count_documents({"queue": "deleted"}) == 0


def test_an_exchange_type_the_transport_does_not_route_is_refused_when_declared(broker_url: str, db: Database) -> None:
    # A headers exchange (RabbitMQ has one) was taken, then every bind and publish through it failed with a bare
    # KeyError('headers'): the declare says what is wrong, and nothing is stored for it.
    exchange = kombu.Exchange("by_headers", type="headers")
    refused = r"exchange type 'headers' .*direct, fanout, topic"
    with kombu.Connection(broker_url) as conn:
        channel = conn.channel()
        with pytest.raises(ChannelError, match=refused):
            exchange(channel).declare()
        with pytest.raises(ChannelError, match=refused):
            kombu.Queue("by_headers", exchange, binding_arguments={"x-match": "all", "k": "v"}).declare(channel=channel)
        with pytest.raises(ChannelError, match=refused):
            kombu.Producer(channel, exchange=exchange).publish({"n": 1}, headers={"k": "v"})
    assert db.bb_bindings.count_documents({}) == 0 and db.bb_messages.count_documents({}) == 0


def test_a_queue_unbound_from_an_exchange_gets_nothing_more_through_it(broker_url: str, db: Database) -> None:
    # Queue.unbind_from (queue_unbind) left the stored binding, and this connection's own copy of it: the queue kept
    # getting what the exchange routed, from every connection.
    exchange = kombu.Exchange("unbound", type="fanout")
    with kombu.Connection(broker_url) as conn, kombu.Connection(broker_url) as publisher:
        channel = conn.channel()
        queue = kombu.Queue("unbound_member", exchange)(channel)
        queue.declare()
        kombu.Producer(channel, exchange=exchange).publish({"n": "bound"})
        queue.unbind_from(exchange)
        for on in (publisher, conn):  # another connection, and the one that had bound it
            kombu.Producer(on.channel(), exchange=exchange).publish({"n": "after"})
        assert queue.get(no_ack=True).payload == {"n": "bound"}
        assert queue.get(no_ack=True) is None
    assert db.bb_bindings.count_documents({}) == 0


def test_an_auto_delete_queue_goes_with_its_consumer_and_gets_no_more_copies(broker_url: str, db: Database) -> None:
    # Each event receiver (Flower, `celery events`) reads Celery's events through an auto-delete queue of its own bound
    # to the topic exchange. Once it stopped, the queue stayed bound, and every later event was stored for it too: one
    # more copy of each event per receiver that ever ran. As RabbitMQ deletes an auto-delete queue with its consumer,
    # it leaves the exchange; what it was sent before stays until it expires.
    exchange = kombu.Exchange("events_gone", type="topic")
    receiver = kombu.Queue("receiver_gone", exchange, routing_key="#", auto_delete=True)
    kept = kombu.Queue("receiver_kept", exchange, routing_key="#")  # not auto-delete: stays bound with its messages
    with kombu.Connection(broker_url) as conn, kombu.Connection(broker_url) as publisher:
        with kombu.Consumer(conn, [receiver, kept], callbacks=[lambda body, message: message.ack()]):
            kombu.Producer(publisher.channel(), exchange=exchange).publish({"n": "while consumed"}, routing_key="a.b")
        for on in (publisher, conn):  # another connection, and the one that had bound it
            kombu.Producer(on.channel(), exchange=exchange).publish({"n": "after"}, routing_key="a.b")
    assert db.bb_bindings.distinct("queue") == ["receiver_kept"]
    stored = sorted(
        (doc["queue"], json.loads(base64.b64decode(payload_of(doc)["body"]))["n"]) for doc in db.bb_messages.find()
    )
    assert stored == [("receiver_gone", "while consumed")] + [("receiver_kept", "after")] * 2 + [
        ("receiver_kept", "while consumed")
    ]
