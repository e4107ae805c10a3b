"""Compressed task messages (`compression=`, `task_compression`) and compressed results (`result_compression`),
through real workers: a compressed task runs and shows its arguments as any other; a body that expands past what a
message may decompress to (a decompression bomb) fails its own job once, and the worker keeps going."""

from __future__ import annotations

import base64
import bz2
import lzma
import zlib
from collections.abc import Callable

import pytest
from kombu import Connection, Producer, Queue, compression
from pymongo.database import Database

import bb_broker
from bb_broker.contrib.flower.handlers import job_json
from bb_broker.jobs.payloads import DECOMPRESSED_LIMIT, READABLE_DECOMPRESSED_LIMIT
from bb_broker.upstream import celery as upstream_celery
from tests.support.workers import job, producer, send, settled, wait_for

T = "tests.support.e2e_app."

#: The compression methods that ship with Python, as a producer names them.
METHODS = ["zlib", "gzip", "bzip2", "lzma"]

#: A streaming compressor per method (Kombu's gzip is zlib's format), to make a bomb without holding it whole.
COMPRESSORS: dict[str, Callable[[], object]] = {
    "zlib": zlib.compressobj,
    "gzip": zlib.compressobj,
    "bzip2": bz2.BZ2Compressor,
    "lzma": lzma.LZMACompressor,
}


def _content_type(method: str) -> str:
    return compression.get_encoder(method)[1]


@pytest.mark.parametrize("method", METHODS)
def test_a_compressed_task_runs_with_its_compressed_result_and_shows_its_arguments(
    results_app, worker_factory, broker_url: str, db: Database, method: str
) -> None:
    worker = worker_factory(env={"BB_RESULT_BACKEND": broker_url, "BB_RESULT_COMPRESSION": method})
    sent = results_app.send_task(T + "add", args=(1, 2), compression=method)
    applied = results_app.signature(T + "add", args=(3, 4)).apply_async(compression=method)
    setting = producer(broker_url)
    setting.conf.update(result_backend=broker_url, task_compression=method)
    try:
        configured = setting.send_task(T + "add", args=(5,), kwargs={"y": 6})
        assert configured.get(timeout=120) == 11
    finally:
        setting.close()
    assert sent.get(timeout=120) == 3 and applied.get(timeout=60) == 7
    for result, args, kwargs in ((sent, [1, 2], {}), (applied, [3, 4], {}), (configured, [5], {"y": 6})):
        doc = job(db, result.id)
        assert doc["status"] == "succeeded" and doc["attempts"] == 1, doc.get("lastError")
        assert [entry["outcome"] for entry in doc["history"]] == ["succeeded"]
        # The job document and the Jobs tab read its arguments, as an uncompressed task's; the header says how it came.
        assert (doc["payload"]["args"], doc["payload"]["kwargs"]) == (args, kwargs)
        shown = job_json(doc)["payload"]
        assert (shown["args"], shown["kwargs"]) == (args, kwargs)
        assert shown["headers"]["compression"] == _content_type(method)
        # The result is stored compressed (result_compression is new in Celery 5.7: before, stored as it is), and
        # read back as any other.
        assert doc["state"] == "SUCCESS"
        assert doc["resultFormat"] == ("encoded:json" if upstream_celery.compressed_result_mark() else "json")
    assert bb_broker.statuses(db) == {"queued": 0, "running": 0, "succeeded": 3, "failed": 0}
    assert worker.process.poll() is None


def test_a_compressed_task_too_large_to_keep_readable_runs_from_its_compressed_body(
    results_app, worker_factory, broker_url: str, db: Database
) -> None:
    worker_factory(env={"BB_RESULT_BACKEND": broker_url})
    size = READABLE_DECOMPRESSED_LIMIT + 1024
    result = results_app.send_task(T + "length", args=("x" * size,), compression="zlib")
    assert result.get(timeout=120) == size
    doc = job(db, result.id)
    assert doc["status"] == "succeeded" and doc["attempts"] == 1, doc.get("lastError")
    # Kept compressed (it would fill most of a document decompressed): the body, not its arguments.
    assert "args" not in doc["payload"] and doc["payload"]["bodyFormat"] == "base64"
    assert doc["payload"]["headers"]["compression"] == "application/x-gzip"


def _bomb(method: str) -> bytes:
    """A small body that decompresses to just past DECOMPRESSED_LIMIT."""
    compressor = COMPRESSORS[method]()
    chunk, parts, left = b"0" * (1 << 20), [], DECOMPRESSED_LIMIT + 1
    while left > 0:
        parts.append(compressor.compress(chunk[: min(left, len(chunk))]))
        left -= len(chunk)
    parts.append(compressor.flush())
    return b"".join(parts)


def _hand_written(db: Database, app, body: bytes, method: str) -> str:
    """A published add(1, 2) whose stored payload is changed by hand to `body`, compressed with `method`."""
    task_id = send(app, "add", 1, 2)
    change = {
        "$set": {
            "payload.body": base64.b64encode(body).decode("ascii"),
            "payload.bodyFormat": "base64",
            "payload.headers.compression": _content_type(method),
        },
        "$unset": {"payload.args": "", "payload.kwargs": "", "payload.options": ""},
    }
    assert db.jobs.update_one({"taskId": task_id}, change).modified_count == 1
    return task_id


def test_a_decompression_bomb_fails_its_own_job_once_and_the_worker_keeps_going(
    app, db: Database, worker_factory
) -> None:
    bombs = {method: _hand_written(db, app, _bomb(method), method) for method in METHODS}
    well_formed = compression.compress(b'[[1, 2], {}, {"callbacks": ["junk"]}]', "zlib")[0]
    shape = _hand_written(db, app, well_formed, "zlib")  # decompressed, it is checked as any body
    truncated = _hand_written(db, app, compression.compress(b"[[1, 2], {}, {}]", "lzma")[0][:-8], "lzma")
    fine = _hand_written(db, app, compression.compress(b"[[40, 2], {}, {}]", "bzip2")[0], "bzip2")
    sentinel = send(app, "add", 20, 22)  # behind them all in the queue
    worker = worker_factory()
    wait_for(settled(db, sentinel, "succeeded"), timeout=120, message="the job behind the bombs")
    assert wait_for(settled(db, fine, "succeeded"), timeout=60, message="a compressed body written by hand")
    failures = [
        *((bombs[method], f"compression {_content_type(method)!r} expands it past {DECOMPRESSED_LIMIT} bytes")
          for method in METHODS),
        (shape, "'callbacks'"),
        (truncated, "compression 'application/x-lzma'"),
    ]  # fmt: skip
    for task_id, reason in failures:
        failed = wait_for(settled(db, task_id, "failed"), timeout=120, message=f"{reason} failed")
        assert failed["attempts"] == 1, (reason, failed.get("lastError"))
        assert "malformed message" in failed["lastError"] and reason in failed["lastError"], failed["lastError"]
        assert [entry["outcome"] for entry in failed["history"]] == ["failed"]
    assert worker.process.poll() is None, "the worker died"
    again = send(app, "add", 2, 2)
    wait_for(settled(db, again, "succeeded"), message="the worker still takes work")


@pytest.mark.parametrize("method", METHODS)
def test_a_decompression_bomb_is_refused_at_the_producer(broker_url: str, db: Database, method: str) -> None:
    """A producer that compresses the body itself and says so in the header, as another program may."""
    headers = {"task": T + "add", "id": f"bomb-{method}", "compression": _content_type(method)}
    with Connection(broker_url) as conn:
        producer = Producer(conn.default_channel)
        with pytest.raises(bb_broker.MalformedTaskMessage, match=f"compression {_content_type(method)!r} expands"):
            producer.publish(
                _bomb(method),
                routing_key="celery",
                headers=headers,
                content_type="application/json",
                content_encoding="utf-8",
                declare=[Queue("celery")],
            )
    assert db.jobs.count_documents({}) == 0
