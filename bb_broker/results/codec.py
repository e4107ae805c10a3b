"""How a result is kept in a document and read back: BSON when it came as JSON, else its encoded bytes."""

from __future__ import annotations

import copy
import json
from typing import Any

from bson import Binary
from kombu import compression
from kombu.exceptions import DecodeError
from kombu.serialization import loads
from kombu.utils.encoding import ensure_bytes

from bb_broker import connection
from bb_broker.jobs.document import MAX_DOCUMENT_BYTES, ResultTooLarge
from bb_broker.jobs.lifecycle import describe_error
from bb_broker.jobs.payloads import _bson_safe, decompress_bounded
from bb_broker.upstream import celery as upstream_celery
from bb_broker.upstream import kombu as upstream_kombu

#: Room left in a job document for everything that is not the result (payload, history, the rest).
RESULT_LIMIT = MAX_DOCUMENT_BYTES - 64 * 1024

#: Celery stores a compressed result (result_compression) behind this marker, then its method and a NUL
#: (celery.backends.base.compress_payload); None on a Celery that compresses no result (before 5.7).
_COMPRESSED_RESULT_MARK = upstream_celery.compressed_result_mark()


def decompressed_result(payload: bytes) -> bytes:
    """An encoded result as Celery wrote it, decompressed if it was (checked on Celery 5.5.3 and 5.7.0)."""
    if _COMPRESSED_RESULT_MARK is None or not payload.startswith(_COMPRESSED_RESULT_MARK):
        return payload
    method, _, body = payload[len(_COMPRESSED_RESULT_MARK) :].partition(b"\x00")
    name = method.decode("utf-8")
    # Bounded as a task message's body is: a job document edited by hand must not take the reader's memory.
    plain = decompress_bounded(body, name)
    return compression.decompress(body, name) if plain is None else plain


def stored(payload: str | bytes, serializer: str, *, compressed: bool) -> tuple[Any, str]:
    """An encoded value as the document keeps it: BSON when it came as JSON, else the encoded bytes; and its format."""
    size = len(ensure_bytes(payload))
    if size > RESULT_LIMIT:
        raise ResultTooLarge(
            f"the task's result is {size} bytes encoded, over the {RESULT_LIMIT} bytes a job document has room"
            " for (MongoDB's document limit is 16 MB): it was not stored"
        )
    if serializer == "json" and not compressed:
        readable = json.loads(payload)
        if _bson_safe(readable):
            return readable, "json"
    return Binary(ensure_bytes(payload)), f"encoded:{serializer}"


def loaded(value: Any, fmt: str | None, *, serializer: str, accept: Any) -> Any:
    """A value as stored() kept it (`fmt` its resultFormat), decoded; `serializer` reads a format that names none."""
    if fmt == "json":
        return loads(json.dumps(value), "application/json", "utf-8", accept=accept)
    if not isinstance(value, bytes):  # BSON's Binary is bytes; bytes(n) of a number n written by hand is n zero bytes
        raise DecodeError(f"a result stored as {fmt!r} is {type(value).__name__}, not bytes")
    serializer = (fmt or "").partition(":")[2] or serializer
    content_type, content_encoding = upstream_kombu.serializer_content_types(serializer)
    return loads(decompressed_result(value), content_type, content_encoding, accept=accept)


def masked(encoded: Any, secrets: tuple[str, ...]) -> Any:
    """An encoded exception with the URL's password masked (a copy: Celery goes on using the exception)."""
    if not secrets:
        return encoded
    if isinstance(encoded, BaseException):
        encoded = copy.copy(encoded)
    return connection.scrub_value(encoded, secrets)


def described(encoded: Any) -> str:
    """An exception as encode_result left it (a dict for JSON), described as lastError describes one."""
    if isinstance(encoded, BaseException):
        return describe_error(encoded)
    if isinstance(encoded, dict) and "exc_type" in encoded:
        message = encoded.get("exc_message")
        text = " ".join(map(str, message)) if isinstance(message, list | tuple) else str(message or "")
        return f"{encoded['exc_type']}: {text}" if text else str(encoded["exc_type"])
    return str(encoded)
