"""The shapes of Kombu that bb_broker/upstream/kombu.py relies on, and the virtual transport interface
bb_broker/transport implements: each test fails, naming the Kombu change and the function it breaks, before a user
meets the broken behaviour."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from bb_broker.upstream import kombu as upstream_kombu
from tests.support.upstream import parameters, source
from tests.support.upstream import where as where_in

where = partial(where_in, upstream_kombu)


def test_kombus_registry_keeps_each_serializers_content_type_and_encoding() -> None:
    assert upstream_kombu.serializer_content_types("json") == ("application/json", "utf-8"), (
        "kombu.serialization.registry._encoders changed shape: Kombu moved its serializer table; "
        + where("serializer_content_types")
    )


@pytest.fixture
def channel() -> Any:
    with Connection("memory://") as connection:
        yield connection.default_channel


def test_a_virtual_channels_consumers_queues_and_bindings(channel: Any) -> None:
    queue = Queue("contracts", Exchange("contracts", "direct"), routing_key="k")
    queue(channel).declare()
    assert upstream_kombu.exchange_table(channel.state, "contracts") == [("k", None, "contracts")], (
        "kombu.transport.virtual BrokerState.exchanges[...]['table'] no longer holds (routing key, pattern, queue) "
        "rows: Kombu changed its routing tables; " + where("exchange_table")
    )
    upstream_kombu.drop_bindings(channel.state, lambda row: row[2] != "contracts")
    assert upstream_kombu.exchange_table(channel.state, "contracts") == [], "the table is not the one Kombu routes by"
    channel.basic_consume("contracts", False, lambda message: None, "tag-1")
    assert upstream_kombu.has_consumers(channel) and upstream_kombu.consumed_queues(channel) == ["contracts"], (
        "kombu.transport.virtual.Channel._consumers or _active_queues changed: Kombu changed how a channel keeps its "
        "consumers; " + where("consumed_queues")
    )
    assert upstream_kombu.queue_of_consumer(channel, "tag-1") == "contracts", (
        "kombu.transport.virtual.Channel._tag_to_queue changed; " + where("queue_of_consumer")
    )
    assert isinstance(upstream_kombu.next_delivery_tag(channel), str), (
        "kombu.transport.virtual.Channel._next_delivery_tag() changed; " + where("next_delivery_tag")
    )


def test_a_topic_bindings_row_holds_the_pattern_its_routing_key_makes(channel: Any) -> None:
    Queue("topics", Exchange("topics", "topic"), routing_key="task.#")(channel).declare()
    (row,) = upstream_kombu.exchange_table(channel.state, "topics")
    assert row == ("task.#", upstream_kombu.topic_pattern("task.#"), "topics"), (
        "kombu.transport.virtual.exchange.TopicExchange.prepare_bind no longer stores key_to_pattern(routing key): "
        "Kombu changed how a topic exchange matches; " + where("topic_pattern")
    )
    exchange = channel.typeof("topics")
    assert exchange.lookup([row], "topics", "task.sent", None) == {"topics"}
    assert exchange.lookup([row], "topics", "other.sent", None) == set(), "the pattern is not the one Kombu routes by"


def test_a_virtual_qos_tracks_what_it_delivered(channel: Any) -> None:
    qos = channel.qos
    assert qos.can_consume_max_estimate() is None, "can_consume_max_estimate() without a prefetch limit is not None"
    qos.prefetch_count = 4
    qos.append(object(), "tag-1")
    assert "tag-1" in upstream_kombu.delivered_messages(qos) and qos.can_consume_max_estimate() == 3, (
        "kombu.transport.virtual.QoS._delivered or can_consume_max_estimate changed: Kombu changed how it counts "
        "unacked messages; " + where("delivered_messages")
    )
    upstream_kombu.ack_without_restore(qos, "tag-1")
    assert qos.can_consume_max_estimate() == 4, (
        "kombu.transport.virtual.QoS._quick_ack no longer settles a message; " + where("ack_without_restore")
    )
    qos.append(object(), "tag-2")
    qos.ack("tag-2")  # kept in _delivered, marked in _dirty, until the next append
    assert "tag-2" in qos._delivered and "tag-2" not in upstream_kombu.delivered_messages(qos), (
        "kombu.transport.virtual.QoS no longer marks an acked tag in _dirty; " + where("delivered_messages")
    )


def test_the_virtual_transport_methods_bbmongo_overrides_keep_their_parameters() -> None:
    from kombu.transport import virtual

    from bb_broker.transport.channel import Channel
    from bb_broker.transport.transport import Transport

    overridden = {
        virtual.Channel: ("_get", "_put", "_size", "_purge", "_delete", "_new_queue", "_has_queue", "_lookup"),
        virtual.Transport: ("_deliver",),
    }
    for base, names in overridden.items():
        ours, module = (Channel, "channel") if base is virtual.Channel else (Transport, "transport")
        for name in names:
            kombus, mine = parameters(getattr(base, name)), parameters(getattr(ours, name))
            assert mine[: len(kombus)] == kombus or "args" in kombus, (
                f"kombu.transport.virtual.{base.__name__}.{name} now takes {kombus}, bbmongo:// overrides it with "
                f"{mine}: Kombu changed its virtual transport interface; see bb_broker/transport/{module}.py"
            )
    assert "self._queue_bind(exchange, *meta)" in source(virtual.Channel.queue_bind), (
        "kombu.transport.virtual.Channel.queue_bind no longer calls _queue_bind(exchange, routing key, pattern, "
        "queue): bbmongo:// stores its bindings there; see bb_broker/transport/channel.py"
    )
    assert "self.channel._put_fanout(" in source(virtual.exchange.FanoutExchange.deliver), (
        "kombu's FanoutExchange.deliver no longer calls Channel._put_fanout; see bb_broker/transport/channel.py"
    )
