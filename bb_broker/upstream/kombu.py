"""Kombu's internals bb_broker reads: its serializer registry, and the virtual transport's QoS, Channel and
BrokerState (bb_broker/upstream/__init__.py has the rules).

Kombu is imported inside the functions: this module is imported while `kombu.transport` itself is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: The releases every function here was checked against (their sources read, the contract tests run on the newest).
CHECKED_AGAINST = "kombu 5.3.7, 5.4.2, 5.5.4, 5.6.2, 5.7.0"


def serializer_content_types(name: str) -> tuple[str, str]:
    """The (content type, content encoding) `kombu.serialization.loads` needs for the serializer registered as
    `name`. Kombu's registry keeps them only in its private `_encoders` table (Celery's BaseBackend reads it the same
    way); the public `name_to_type` has the content type but not the encoding. Checked against kombu 5.3.7, 5.4.2,
    5.5.4, 5.6.2, 5.7.0."""
    from kombu.serialization import registry  # type: ignore[attr-defined]  # celery-types' kombu stubs omit it

    content_type, content_encoding, _ = registry._encoders[name]
    return content_type, content_encoding


def delivered_messages(qos: Any) -> dict[str, Any]:
    """A virtual QoS's messages delivered and not yet acked or rejected, by delivery tag: `QoS._delivered` without
    the tags in `QoS._dirty`, which no public method lists. An ack (from any thread) only adds its tag to `_dirty`;
    Kombu drops it from `_delivered` at the next delivery, which a worker given nothing more never gets: counted as
    delivered, its job's lease was renewed for as long. Checked against kombu 5.3.7, 5.4.2, 5.5.4, 5.6.2, 5.7.0."""
    settled = set(qos._dirty)  # one C-level copy: acks from other threads add to it meanwhile
    return {tag: message for tag, message in list(qos._delivered.items()) if tag not in settled}


def ack_without_restore(qos: Any, delivery_tag: str) -> None:
    """Settle a delivered message on a virtual QoS as acked, without the channel's basic_ack (`QoS._quick_ack`, what
    the virtual QoS's own ack and reject end with). Checked against kombu 5.3.7, 5.4.2, 5.5.4, 5.6.2, 5.7.0."""
    qos._quick_ack(delivery_tag)


def has_consumers(channel: Any) -> bool:
    """Whether a virtual channel has consumers (`Channel._consumers`, the tags basic_consume adds). Checked against
    kombu 5.3.7, 5.4.2, 5.5.4, 5.6.2, 5.7.0."""
    return bool(channel._consumers)


def consumed_queues(channel: Any) -> list[str]:
    """The queues a virtual channel consumes (`Channel._active_queues`). Checked against kombu 5.3.7, 5.4.2, 5.5.4,
    5.6.2, 5.7.0."""
    return channel._active_queues


def queue_of_consumer(channel: Any, consumer_tag: str) -> str | None:
    """The queue a consumer tag of a virtual channel consumes (`Channel._tag_to_queue`). Checked against kombu
    5.3.7, 5.4.2, 5.5.4, 5.6.2, 5.7.0."""
    return channel._tag_to_queue.get(consumer_tag)


def next_delivery_tag(channel: Any) -> str:
    """A new delivery tag from a virtual channel (`Channel._next_delivery_tag`, what basic_get and the cycle give each
    message). Checked against kombu 5.3.7, 5.4.2, 5.5.4, 5.6.2, 5.7.0."""
    return channel._next_delivery_tag()


def exchange_table(state: Any, exchange: str) -> list[Any]:
    """This connection's bindings of an exchange, as Kombu's virtual BrokerState keeps them: the `table` of
    `state.exchanges[exchange]` (rows of (routing key, pattern, queue)); empty for an exchange it does not know.
    Kombu routes by `Channel.get_table`, which reads the same. Checked against kombu 5.3.7, 5.4.2, 5.5.4, 5.6.2,
    5.7.0."""
    return state.exchanges.get(exchange, {}).get("table", [])


def drop_bindings(state: Any, keep: Callable[[tuple[Any, ...]], bool], exchange: str | None = None) -> None:
    """Remove from this connection's exchange tables (one exchange's, or every one's) each row `keep` refuses.

    Kombu's queue_unbind edits the list `get_table` returns in place, which here is a copy (the stored bindings
    every connection routes by are added to it), and its queue_delete leaves the tables as they are: so the rows go
    from the tables themselves. Checked against kombu 5.3.7, 5.4.2, 5.5.4, 5.6.2, 5.7.0."""
    declared = state.exchanges.values() if exchange is None else [state.exchanges.get(exchange)]
    for meta in declared:
        if meta is not None:
            meta["table"] = [row for row in meta.get("table", []) if keep(tuple(row))]


@functools.lru_cache(maxsize=1024)
def topic_pattern(routing_key: str) -> str:
    """The pattern a virtual topic exchange matches routing keys against for a binding of `routing_key`: what its
    `prepare_bind` puts in the binding's row (`TopicExchange.key_to_pattern`, which reads no channel). Read here
    rather than from a stored binding, whose pattern is data. Checked against kombu 5.4.2, 5.5.4, 5.6.2, 5.7.0."""
    from kombu.transport.virtual.exchange import TopicExchange

    return str(TopicExchange(None).key_to_pattern(routing_key))
