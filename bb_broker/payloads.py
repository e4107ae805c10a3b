"""Kombu messages to and from the `payload` of a job document, readable where it can be."""

from __future__ import annotations

import base64
import json
from typing import Any

from kombu.utils import json as kombu_json

#: Our delivery details ride in the headers of a delivered message; they are never stored.
JOB_ID_HEADER = "bb_job_id"
ATTEMPTS_HEADER = "bb_attempts"
DELIVERY_HEADERS = (JOB_ID_HEADER, ATTEMPTS_HEADER)
#: How many of a task's Celery retries are the broker's (a failed attempt run again), so that `request.retries`
#: minus this is the task's own retries. Kept in the payload: each attempt's message carries it on.
BROKER_RETRIES_HEADER = "bb_broker_retries"
#: The job ids a task message's publish chose, per queue, kept in the producer's properties (Kombu retries a
#: publish with the same properties dict), never stored in the payload.
PUBLISH_ID_PROPERTY = "bb_publish_id"

_INT64 = (-(2**63), 2**63 - 1)
#: Values BSON stores and JSON gives back as they are (int is not here: it must fit in 64 bits).
_PLAIN_SCALARS = frozenset({str, float, bool, type(None)})


class PayloadError(ValueError):
    """A stored payload cannot be turned back into a message."""


def is_task_message(message: dict[str, Any]) -> bool:
    """Celery task messages (protocol 2) carry the task name in their headers."""
    headers = message.get("headers") or {}
    return isinstance(headers, dict) and isinstance(headers.get("task"), str) and "id" in headers


def to_document(message: dict[str, Any], decoded_body: bytes) -> dict[str, Any]:
    """The payload an admin reads: args and kwargs as BSON when the body is JSON, else the raw body."""
    headers = {k: v for k, v in (message.get("headers") or {}).items() if k not in DELIVERY_HEADERS}
    properties = dict(message.get("properties") or {})
    properties.pop("body_encoding", None)
    properties.pop("delivery_tag", None)
    properties.pop(PUBLISH_ID_PROPERTY, None)
    envelope = {
        "headers": headers,
        "properties": properties,
        "contentType": message.get("content-type"),
        "contentEncoding": message.get("content-encoding"),
    }
    if not _bson_safe(envelope):
        # Headers or properties BSON cannot hold faithfully: keep the whole message as Kombu's own transports do,
        # in Kombu's JSON, which gives datetimes, UUIDs, decimals and bytes back as they were.
        raw = {**message, "headers": headers, "properties": properties, "body": None}
        try:
            text = kombu_json.dumps(raw)
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"the message's headers or properties cannot be stored: {exc}") from None
        return {"raw": text, "body": base64.b64encode(decoded_body).decode("ascii")}
    readable = _readable_body(message, decoded_body)
    if readable is None:
        readable = {"body": base64.b64encode(decoded_body).decode("ascii"), "bodyFormat": "base64"}
    return {**readable, **envelope}


def _readable_body(message: dict[str, Any], body: bytes) -> dict[str, Any] | None:
    if message.get("content-type") != "application/json" or message.get("content-encoding") not in ("utf-8", None):
        return None
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not _bson_safe(value):
        return None
    if (
        isinstance(value, list)
        and len(value) == 3
        and isinstance(value[0], list)
        and isinstance(value[1], dict)
        and isinstance(value[2], dict)
    ):
        return {"args": value[0], "kwargs": value[1], "options": value[2]}
    return {"body": value, "bodyFormat": "json"}


def _bson_safe(value: Any) -> bool:
    """True when BSON stores the value and gives the same JSON back: plain keys, 64-bit ints.

    Runs on every publish, so it walks the value with a stack and tests the exact built-in types first (a message is
    made of them); subclasses take the isinstance tests after.
    """
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _PLAIN_SCALARS:
            continue
        if kind is dict or (kind is not list and isinstance(item, dict)):
            for key in item:
                if not isinstance(key, str) or not key or key[0] == "$" or "." in key or "\x00" in key:
                    return False
            pending.extend(item.values())
        elif kind is list or isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, (str, float, bool)):
            continue
        elif isinstance(item, int):
            if not _INT64[0] <= item <= _INT64[1]:
                return False
        else:
            return False
    return True


def to_message(payload: Any) -> dict[str, Any]:
    """Rebuild the kombu message (body not base64-encoded) from a stored payload."""
    if not isinstance(payload, dict):
        raise PayloadError(f"payload is a {type(payload).__name__}, not a document")
    try:
        if "raw" in payload:
            message = kombu_json.loads(payload["raw"])
            message["body"] = _binary_body(payload["body"], message.get("content-encoding"))
        else:
            if "args" in payload:
                body: Any = json.dumps([payload["args"], payload["kwargs"], payload["options"]])
            elif payload.get("bodyFormat") == "json":
                body = json.dumps(payload["body"])
            else:
                body = _binary_body(payload["body"], payload["contentEncoding"])
            message = {
                "body": body,
                "headers": dict(payload["headers"]),
                "properties": dict(payload["properties"]),
                "content-type": payload["contentType"],
                "content-encoding": payload["contentEncoding"],
            }
    except (KeyError, TypeError, ValueError, LookupError) as exc:
        raise PayloadError(f"payload is not a stored message: {type(exc).__name__}: {exc}") from None
    if not isinstance(message.get("headers"), dict) or not isinstance(message.get("properties"), dict):
        raise PayloadError("payload headers and properties must be documents")
    message["properties"]["body_encoding"] = None
    message["properties"].setdefault("delivery_info", {})
    return message


def _binary_body(encoded: str, encoding: str | None) -> bytes | str:
    body = base64.b64decode(encoded, validate=True)
    return body if encoding in (None, "binary") else body.decode(encoding)
