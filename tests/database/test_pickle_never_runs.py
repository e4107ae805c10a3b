"""A hostile pickle in `bb_messages` never runs in a consumer that accepts only JSON, whatever puts it back.

The broker URL has a password, so every message stored goes through the masking of secrets: it must mask what it can
read without running anything (JSON, text) and leave the rest as it was sent, saying so.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
from kombu.utils.json import loads
from pymongo import MongoClient
from pymongo.database import Database

import bb_broker  # noqa: F401 (registers bbmongo://)
from bb_broker.transport.plumbing import MessageStore
from tests.support.servers import AUTH_PASSWORD, EmbeddedServer, with_database
from tests.support.workers import wait_for

QUEUE = "hostile"
PICKLE = "application/x-python-serialize"


class Exploit:
    """What an attacker pickles: unpickling it creates `marker`, as it could run any command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return Path.touch, (self.marker,)


def hostile_message(marker: Path) -> dict[str, Any]:
    """A Kombu message, as the virtual transport stores it, whose pickle body creates `marker` when loaded."""
    return {
        "body": base64.b64encode(pickle.dumps({"hello": Exploit(marker)})).decode(),
        "content-type": PICKLE,
        "content-encoding": "binary",
        "headers": {},
        "properties": {
            "body_encoding": "base64",
            "delivery_info": {"exchange": QUEUE, "routing_key": QUEUE},
            "delivery_mode": 2,
            "priority": 0,
        },
    }


@pytest.fixture
def secured(auth_server: EmbeddedServer) -> Iterator[tuple[str, Database]]:
    """A broker URL with a password, and its database as an administrator sees it."""
    base = f"mongodb://bb:{AUTH_PASSWORD}@127.0.0.1:{auth_server.port}/?authSource=admin"
    client: MongoClient = MongoClient(base, tz_aware=True)
    yield with_database(base, "hostiledb"), client.hostiledb
    client.close()


def first_delivered(conn: kombu.Connection, got: list[kombu.Message]) -> kombu.Message:
    """Drain `conn` until its consumer has put a message in `got`."""

    def drained() -> list[kombu.Message]:
        with contextlib.suppress(TimeoutError):  # nothing came yet
            conn.drain_events(timeout=1)
        return got

    return wait_for(lambda: got or drained(), message="the hostile message delivered")[0]


def queue() -> kombu.Queue:
    return kombu.Queue(QUEUE, kombu.Exchange(QUEUE, type="direct"), routing_key=QUEUE)


def put_back_by_reject(message: kombu.Message, channel: Any, consumer: kombu.Consumer) -> None:
    message.reject(requeue=True)


def put_back_by_requeue(message: kombu.Message, channel: Any, consumer: kombu.Consumer) -> None:
    message.requeue()


def put_back_by_closing_the_channel(message: kombu.Message, channel: Any, consumer: kombu.Consumer) -> None:
    channel.close()


def put_back_by_closing_the_connection(message: kombu.Message, channel: Any, consumer: kombu.Consumer) -> None:
    channel.connection.client.close()


def put_back_by_basic_recover(message: kombu.Message, channel: Any, consumer: kombu.Consumer) -> None:
    channel.basic_recover(requeue=True)


def put_back_by_consumer_recover(message: kombu.Message, channel: Any, consumer: kombu.Consumer) -> None:
    consumer.recover(requeue=True)


@pytest.mark.parametrize("on_decode_error", [False, True], ids=["raw-consumer", "decode-error"])
@pytest.mark.parametrize(
    "put_back",
    [
        put_back_by_reject,
        put_back_by_requeue,
        put_back_by_closing_the_channel,
        put_back_by_closing_the_connection,
        put_back_by_basic_recover,
        put_back_by_consumer_recover,
    ],
)
def test_a_pickle_a_json_consumer_puts_back_is_never_unpickled_and_stays_in_its_queue(
    secured: tuple[str, Database], tmp_path: Path, put_back: Callable[..., None], on_decode_error: bool
) -> None:
    url, db = secured
    marker = tmp_path / "code-ran"
    with kombu.Connection(url) as conn:
        queue()(conn.default_channel).declare()
    # Written as a process without the password would store it (or by hand): nothing loads it on the way in.
    MessageStore(db).put(QUEUE, hostile_message(marker), 0)
    sent = db.bb_messages.find_one({"queue": QUEUE})["payload"]

    held: list[kombu.Message] = []
    conn = kombu.Connection(url)
    try:
        channel = conn.channel()
        if on_decode_error:  # the JSON consumer refuses the body and gives the message back
            consumer = kombu.Consumer(
                channel, [queue()], accept=["json"], callbacks=[lambda body, message: None],
                on_decode_error=lambda message, exc: held.append(message),
            )  # fmt: skip
        else:  # a consumer that reads no body at all
            consumer = kombu.Consumer(channel, [queue()], accept=["json"], on_message=held.append)
        consumer.consume()
        put_back(first_delivered(conn, held), channel, consumer)
    finally:
        conn.release()

    assert not marker.exists(), "the consumer unpickled the message"
    kept = db.bb_messages.find_one({"queue": QUEUE})
    assert kept is not None, "the message was lost"
    assert "the broker never decodes" in kept["unmasked"]
    assert db.bb_messages.count_documents({"queue": QUEUE}) == 1
    assert loads(kept["payload"])["body"] == loads(sent)["body"]  # as the attacker wrote it, for the operator


@pytest.mark.parametrize("compression", [None, "zlib"])
def test_a_pickle_published_as_it_came_through_a_password_url_is_stored_as_sent_and_never_loaded(
    secured: tuple[str, Database], tmp_path: Path, compression: str | None
) -> None:
    """A process that passes on a body it received (a relay, a migration) publishes bytes it never decoded."""
    url, db = secured
    marker = tmp_path / "code-ran"
    body = pickle.dumps(Exploit(marker))
    with kombu.Connection(url) as conn:
        kombu.Producer(conn.channel()).publish(
            body, exchange=queue().exchange, routing_key=QUEUE, declare=[queue()], content_type=PICKLE,
            content_encoding="binary", compression=compression,
        )  # fmt: skip
    assert not marker.exists(), "the publisher unpickled the body it passed on"
    kept = db.bb_messages.find_one({"queue": QUEUE})
    assert kept is not None and "the broker never decodes" in kept["unmasked"]
    got: list[kombu.Message] = []
    with kombu.Connection(url) as conn, kombu.Consumer(conn, [queue()], accept=["json"], on_message=got.append):
        first_delivered(conn, got).ack()
    assert got[0].body == body and not marker.exists()
