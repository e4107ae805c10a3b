"""The broker URL's password never travels in plumbing messages: events, replies and results are masked as stored."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from kombu import Exchange, Queue, compression, serialization
from kombu.utils.json import loads
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.jobs.payloads import DECOMPRESSED_LIMIT
from bb_broker.transport.plumbing import MessageStore, payload_of
from tests.support.flower_process import FlowerProcess
from tests.support.servers import AUTH_PASSWORD, with_database
from tests.support.workers import Worker, producer, send, settled, wait_for

#: Quotes, a backslash and non-ASCII: each changes how a serializer or a repr() spells the password.
AWKWARD = "pa'ss\"w\\ord-é"


def kombu_message(data: Any, serializer: str, compress: str | None = None) -> dict[str, Any]:
    """A message as Kombu's virtual channel hands it to `_put`: serialized, maybe compressed, base64."""
    content_type, content_encoding, body = serialization.dumps(data, serializer=serializer)
    body = body.encode(content_encoding) if isinstance(body, str) else body
    headers: dict[str, Any] = {"hostname": "w@host"}
    if compress:
        body, headers["compression"] = compression.compress(body, compress)
    return {
        "body": base64.b64encode(body).decode(),
        "content-type": content_type,
        "content-encoding": content_encoding,
        "headers": headers,
        "properties": {"body_encoding": "base64", "delivery_info": {"exchange": "celeryev"}},
    }


def take_one(store: MessageStore, queue: str) -> dict[str, Any] | None:
    """The next message of `queue` as a consumer is handed it, taken off the queue; None when it has none."""
    taken, _ = store.take(queue, 1)
    return payload_of(taken[0]) if taken else None


def body_of(message: dict[str, Any]) -> Any:
    raw = base64.b64decode(message["body"])
    if message["headers"].get("compression"):
        raw = compression.decompress(raw, message["headers"]["compression"])
    content_type = message["content-type"]
    return serialization.loads(raw, content_type, message["content-encoding"], accept=[content_type])


@pytest.mark.parametrize(("serializer", "compress"), [("json", None), ("json", "zlib")])
def test_every_stored_message_has_the_password_masked_and_keeps_the_rest(db: Database, serializer, compress) -> None:
    url = f"mongodb://bb:{AWKWARD}@db.example:27017/jobs"
    failure = RuntimeError(f"could not log in to {url}")
    event = {
        "type": "task-failed",
        "exception": repr(failure),
        "traceback": f"Traceback ...\nRuntimeError: could not log in to {url}\n",
        "result": repr({"url": url}),
        "nested": [{"password": AWKWARD}, ("kept", 1, 2.5, None, True)],
    }
    store = MessageStore(db, secrets=(AWKWARD,))
    store.put("celeryev.spy", kombu_message(event, serializer, compress), 0)

    stored = db.bb_messages.find_one({"queue": "celeryev.spy"})
    fetched = take_one(store, "celeryev.spy")
    assert fetched is not None
    clean = body_of(fetched)
    for text in (json.dumps(stored, default=str), repr(clean), json.dumps(clean, default=repr, ensure_ascii=False)):
        assert "pa'ss" not in text and "ord-é" not in text and "ord-\\u00e9" not in text, text
    assert clean["exception"] == repr(RuntimeError("could not log in to mongodb://bb:**@db.example:27017/jobs"))
    assert clean["traceback"].endswith("could not log in to mongodb://bb:**@db.example:27017/jobs\n")
    assert clean["nested"][0] == {"password": "**"} and list(clean["nested"][1]) == ["kept", 1, 2.5, None, True]
    assert fetched["headers"]["hostname"] == "w@host"


@pytest.mark.parametrize(
    ("serializer", "compress"), [("pickle", None), ("pickle", "zlib"), ("yaml", None), ("raw", None)]
)
def test_a_body_the_broker_does_not_decode_is_stored_as_sent_with_why_and_its_headers_masked(
    db: Database, serializer: str, compress: str | None
) -> None:
    """Pickle runs code when loaded, a search and replace breaks binary framing (and YAML reads `**` as an alias)."""
    data = b"raw bytes naming " + AWKWARD.encode() if serializer == "raw" else {"password": AWKWARD}
    message = kombu_message(data, serializer, compress)
    message["headers"]["origin"] = f"mongodb://bb:{AWKWARD}@db.example/jobs"
    store = MessageStore(db, secrets=(AWKWARD,))
    store.put("replies", message, 0)
    stored = db.bb_messages.find_one({"queue": "replies"})
    assert "the broker never decodes" in stored["unmasked"] and message["content-type"] in stored["unmasked"]
    fetched = take_one(store, "replies")
    assert fetched is not None
    assert fetched["body"] == message["body"] and body_of(fetched) == data
    assert fetched["headers"] == {**message["headers"], "origin": "mongodb://bb:**@db.example/jobs"}


def test_a_message_without_the_password_is_stored_as_it_was(db: Database) -> None:
    message = kombu_message({"type": "worker-heartbeat", "freq": 2.0}, "json")
    store = MessageStore(db, secrets=(AWKWARD,))
    store.put("celeryev.spy", message, 0)
    assert take_one(store, "celeryev.spy") == message


DEEP = 100_000  # nested deeper than Python's parser goes


@pytest.mark.parametrize(
    ("content_type", "wrap"),
    [
        ("text/plain", ("", "")),
        ("application/json", ("", "")),
        ("application/json", ("[" * DEEP + '"', '"' + "]" * DEEP)),
        # Kombu's type markers whose decoders raise (AttributeError, decimal.InvalidOperation) on a bad value
        ("application/json", ('{"x": {"__type__": "bytes", "__value__": 5}, "m": "', '"}')),
        ("application/json", ('{"x": {"__type__": "decimal", "__value__": "x"}, "m": "', '"}')),
    ],
    ids=["text", "not-json", "too-deep-json", "bad-bytes-marker", "bad-decimal-marker"],
)
def test_a_body_no_serializer_reads_is_masked_as_text(db: Database, content_type: str, wrap: tuple[str, str]) -> None:
    text = f"{wrap[0]}not json: mongodb://bb:{AWKWARD}@db.example/jobs{wrap[1]}"  # plain text, or JSON that is not
    message = kombu_message({}, "json")
    message.update({"body": base64.b64encode(text.encode()).decode(), "content-type": content_type})
    store = MessageStore(db, secrets=(AWKWARD,))
    store.put("replies", message, 0)
    fetched = take_one(store, "replies")
    assert fetched is not None
    assert base64.b64decode(fetched["body"]).decode() == f"{wrap[0]}not json: mongodb://bb:**@db.example/jobs{wrap[1]}"


def spy_on_events(app) -> str:
    """A queue bound to every Celery event that nobody reads: its copies stay in bb_messages for the test to read."""
    with app.connection_for_write() as conn:
        Queue("events-spy", Exchange("celeryev", type="topic"), routing_key="#")(conn.default_channel).declare()
    return "events-spy"


def test_a_task_that_shows_the_broker_url_leaks_the_password_neither_to_events_nor_flower(
    auth_server, tmp_path: Path
) -> None:
    base = f"mongodb://bb:{AUTH_PASSWORD}@127.0.0.1:{auth_server.port}/?authSource=admin"
    url = with_database(base, "leakdb")
    db = MongoClient(base, tz_aware=True).leakdb
    app = producer(url)
    app.conf.result_backend = "rpc://"  # results travel back through the broker, as plumbing messages
    spy = spy_on_events(app)
    worker = Worker(
        url, log_dir=tmp_path, name="w0", options={"max_attempts": 1}, extra_args=("-E",),
        env={"BB_RESULT_BACKEND": "rpc://"},
    )  # fmt: skip
    worker.start()
    flower = FlowerProcess(url, log_dir=tmp_path, launcher="bb-broker")
    flower.start()
    try:
        wait_for(lambda: flower.get("/api/workers?status=1"), message="Flower receiving the worker's events")
        failing = send(app, "raise_message", f"could not log in to {url}")
        result = app.send_task("tests.support.e2e_app.echo", args=[url])
        echoed = result.id
        wait_for(settled(db, failing, "failed"), message="the failing task failed")
        wait_for(settled(db, echoed, "succeeded"), message="the echo succeeded")
        failed = wait_for(
            lambda: (t := flower.task(failing)).get("state") == "FAILURE" and t, message="the failure in Flower"
        )
        succeeded = wait_for(
            lambda: (t := flower.task(echoed)).get("state") == "SUCCESS" and t, message="the success in Flower"
        )
        assert "bb:**@127.0.0.1" in failed["exception"] and "bb:**@127.0.0.1" in succeeded["result"]
        # The result the caller waits for, as stored for it and as it receives it.
        reply = wait_for(lambda: db.bb_messages.find_one({"queue": app.backend.binding.name}), message="the result")
        assert AUTH_PASSWORD not in json.dumps(body_of(loads(reply["payload"])))
        assert result.get(timeout=60) == url.replace(AUTH_PASSWORD, "**")

        shown = [json.dumps(flower.get("/api/tasks")), flower.page(f"/task/{failing}"), flower.page(f"/task/{echoed}")]
        shown.append(flower.page("/tasks/datatable?draw=1&start=0&length=100&order[0][column]=0&columns[0][data]=name"))
        leaks = [text[max(text.find(AUTH_PASSWORD) - 100, 0) :][:200] for text in shown if AUTH_PASSWORD in text]
        assert not leaks, leaks

        copies = [loads(doc["payload"]) for doc in db.bb_messages.find({"queue": spy})]
        # On Celery's event loop a worker sends its task events in batches: a message's body is then a list.
        bodies = [body_of(message) for message in copies]
        events = [event for body in bodies for event in (body if isinstance(body, list) else [body])]
        assert {"task-failed", "task-succeeded"} <= {event["type"] for event in events}
        assert not [doc for doc in db.bb_messages.find() if AUTH_PASSWORD in json.dumps(doc, default=str)]
        assert not [event for event in events if AUTH_PASSWORD in json.dumps(event)]
        assert any("bb:**@127.0.0.1" in event.get("exception", "") for event in events)
    finally:
        flower.stop()
        worker.kill()


@pytest.mark.parametrize("shape", ["bomb", "unknown-compression"])
def test_a_compressed_body_the_broker_cannot_bound_is_stored_as_sent_never_expanded(db: Database, shape: str) -> None:
    # Masking reads a compressed JSON body: a bomb must not be expanded without a bound (a worker's memory), and a
    # compression Kombu does not know must not end the publish.
    message = kombu_message({"password": AWKWARD}, "json")
    if shape == "bomb":
        raw = zlib.compress(b"[" + b" " * (DECOMPRESSED_LIMIT + 1) + b"]", 9)
        message.update(body=base64.b64encode(raw).decode(), headers={**message["headers"], "compression": "zlib"})
    else:
        message["headers"]["compression"] = "application/x-made-up"
    store = MessageStore(db, secrets=(AWKWARD,))
    store.put("replies", message, 0)
    stored = db.bb_messages.find_one({"queue": "replies"})
    assert stored["unmasked"].startswith("body not masked: "), stored["unmasked"]
    fetched = take_one(store, "replies")
    assert fetched is not None and fetched["body"] == message["body"]
