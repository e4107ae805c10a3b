"""Kombu messages to and from the `payload` of a job document, readable where it can be."""

from __future__ import annotations

import base64
import bz2
import json
import lzma
import reprlib
import sys
import zlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import bson
from bson.errors import InvalidDocument
from kombu import compression
from kombu.utils import json as kombu_json

from bb_broker.jobs import unique
from bb_broker.jobs.document import MAX_KIND_LENGTH, task_id_of, utf8_encodable
from bb_broker.jobs.lifecycle import whole_number
from bb_broker.jobs.rate_keys import MAX_RATE_KEY_LENGTH, RATE_KEY_HEADER, is_rate_key
from bb_broker.jobs.refusals import PublishRefused
from bb_broker.jobs.serial import MAX_SERIAL_KEY_LENGTH, SERIAL_KEY_HEADER, is_serial_key

#: Our delivery details ride in the headers of a delivered message; they are never stored.
JOB_ID_HEADER = "bb_job_id"
ATTEMPTS_HEADER = "bb_attempts"
#: The task id a job first ran under, delivered with a job an operator's retry of it revoked renamed (its document's
#: `renamedFrom`): a chord counts the part of a header task under it (bb_broker.results.chords).
RENAMED_FROM_HEADER = "bb_renamed_from"
DELIVERY_HEADERS = (JOB_ID_HEADER, ATTEMPTS_HEADER, RENAMED_FROM_HEADER)
#: How many of a task's Celery retries are the broker's (a failed attempt run again), so that `request.retries`
#: minus this is the task's own retries. Kept in the payload: each attempt's message carries it on.
BROKER_RETRIES_HEADER = "bb_broker_retries"
#: The job ids a task message's publish chose, per queue, kept in the producer's properties (Kombu retries a
#: publish with the same properties dict), never stored in the payload.
PUBLISH_ID_PROPERTY = "bb_publish_id"
#: The header of a task message a periodic entry sent (bb_broker.beat): the entry's name, which the job keeps in its
#: `schedule` field, so that the jobs of an entry are found through the partial index bb_list_schedule.
SCHEDULE_HEADER = "bb_beat_entry"
#: The longest entry name (it is part of each slot's unique key too: bb_broker.jobs.unique.MAX_UNIQUE_KEY_LENGTH).
MAX_SCHEDULE_LENGTH = 200

#: The most a compressed body may expand to: a body compressed to fit a job document (MongoDB's 16 MB limit) from a
#: few times that. Past it, a small stored body (a decompression bomb) would take a worker's memory; its job fails.
DECOMPRESSED_LIMIT = 4 * 16 * 1024 * 1024
#: A compressed body decompressed to at most this is stored readable (args and kwargs), as an uncompressed one is; a
#: larger one stays compressed, with room to spare under the document limit, and shows as its base64 body.
READABLE_DECOMPRESSED_LIMIT = 8 * 1024 * 1024

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
    readable = _readable_body(message, _decompressed_for_reading(message, decoded_body))
    if readable is None:
        readable = {"body": base64.b64encode(decoded_body).decode("ascii"), "bodyFormat": "base64"}
    return {**readable, **envelope}


def _decompressed_for_reading(message: dict[str, Any], body: bytes) -> bytes | None:
    """The body as a reader wants it: decompressed (bounded) when the message is compressed; None when it is not kept
    readable (too large to store decompressed, or a compression this module cannot bound)."""
    method = (message.get("headers") or {}).get("compression")
    if not method:
        return body
    plain = decompress_bounded(body, method)
    return plain if plain is not None and len(plain) <= READABLE_DECOMPRESSED_LIMIT else None


def _readable_body(message: dict[str, Any], body: bytes | None) -> dict[str, Any] | None:
    parts = body_parts(message, body)
    return parts if parts and _bson_safe(list(parts.values())) else None


def body_parts(message: dict[str, Any], body: bytes | None) -> dict[str, Any]:
    """A JSON body's parts as a job keeps them readable: a task's args, kwargs and options, or the whole body; empty
    for a body that is not JSON (or not UTF-8)."""
    if body is None:
        return {}
    if message.get("content-type") != "application/json" or message.get("content-encoding") not in ("utf-8", None):
        return {}
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
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
    """True when BSON stores the value and gives the same JSON back: plain keys, 64-bit ints, strings that UTF-8
    can hold (JSON carries a lone surrogate, BSON does not).

    Runs on every publish, so it walks the value with a stack and tests the exact built-in types first (a message is
    made of them); subclasses take the isinstance tests after.
    """
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is str or (kind not in _PLAIN_SCALARS and isinstance(item, str)):
            if not utf8_encodable(item):
                return False
            continue
        if kind in _PLAIN_SCALARS:
            continue
        if kind is dict or (kind is not list and isinstance(item, dict)):
            for key in item:
                if not isinstance(key, str) or not key or key[0] == "$" or "." in key or "\x00" in key:
                    return False
                if not utf8_encodable(key):  # a key BSON cannot hold as the same text
                    return False
            pending.extend(item.values())
        elif kind is list or isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, (float, bool)):
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
            if not isinstance(message, dict):
                raise TypeError(f"the raw message is a {type(message).__name__}, not a JSON object")
            message["body"] = _binary_body(payload["body"], message.get("content-encoding"), message.get("headers"))
        else:
            for part in ("headers", "properties"):
                if not isinstance(payload[part], dict):  # dict() would take a list of pairs, or fail unnamed
                    raise TypeError(f"{part} is a {type(payload[part]).__name__}, not a document")
            headers = dict(payload["headers"])
            stored_plain = "args" in payload or payload.get("bodyFormat") == "json"
            if stored_plain and _known_compression(headers.get("compression")):
                # Stored decompressed (readable): delivered so, without the header that would have Kombu decompress it
                # again (Kombu's own restore of a message drops it the same way). A header naming no method Kombu
                # has is a hand-written one: it stays, for check_envelope to name.
                del headers["compression"]
            if "args" in payload:
                body: Any = json.dumps([payload["args"], payload["kwargs"], payload["options"]])
            elif payload.get("bodyFormat") == "json":
                body = json.dumps(payload["body"])
            else:
                body = _binary_body(payload["body"], payload["contentEncoding"], headers)
            message = {
                "body": body,
                "headers": headers,
                "properties": dict(payload["properties"]),
                "content-type": payload["contentType"],
                "content-encoding": payload["contentEncoding"],
            }
    except (KeyError, TypeError, ValueError, LookupError, RecursionError) as exc:  # Recursion: nested beyond reason
        raise PayloadError(f"payload is not a stored message: {type(exc).__name__}: {exc}") from None
    if not isinstance(message.get("headers"), dict) or not isinstance(message.get("properties"), dict):
        raise PayloadError("payload headers and properties must be documents")
    message["properties"]["body_encoding"] = None
    if message["properties"].get("delivery_info") is None:
        message["properties"]["delivery_info"] = {}  # none, as check_envelope reads a null (where the claim writes)
    return message


def _binary_body(encoded: str, encoding: str | None, headers: Any) -> bytes | str:
    body = base64.b64decode(encoded, validate=True)
    if encoding is None or encoding == "binary" or (isinstance(headers, dict) and headers.get("compression")):
        return body  # compressed bytes are no text: Kombu decompresses them, then reads them in their encoding
    return body.decode(encoding)


class MalformedTaskMessage(PublishRefused, ValueError):
    """A task message with a header, property or body part a Celery worker cannot run it with: a publish refuses it,
    a claim fails its job (once: retried, it would be just as malformed)."""

    def __init__(self, field: str, expected: str, value: Any) -> None:
        super().__init__(f"malformed message: {field} must be {expected}, got {_shown(value)}")
        self.field, self.expected, self.value = field, expected, value


class CompressedBodyError(MalformedTaskMessage):
    """A compressed body that does not decompress, or expands past DECOMPRESSED_LIMIT: refused at publish, its job
    failed at claim."""

    def __init__(self, reason: str) -> None:
        ValueError.__init__(self, f"malformed message: {reason}")
        self.field, self.expected, self.value = "the body's compression", "a body that decompresses", None


#: Decompressors that stop at a given output size, by the function Kombu registered for a compression method (so an
#: alias or a method registered again under another name is recognised by what it runs, not by its name).
_BOUNDED_DECOMPRESSORS: dict[Callable[..., Any], Callable[[], Any]] = {
    zlib.decompress: zlib.decompressobj,
    bz2.decompress: bz2.BZ2Decompressor,
    lzma.decompress: lzma.LZMADecompressor,
}
#: Those whose stdlib decompress() reads stream after stream (zlib's reads one and ignores what follows).
_MULTI_STREAM = frozenset({bz2.BZ2Decompressor, lzma.LZMADecompressor})


def decompress_bounded(body: bytes, method: str, limit: int = DECOMPRESSED_LIMIT) -> bytes | None:
    """`body` decompressed as Kombu would with `method`, never holding more than `limit` bytes of output; None when
    the method is not one whose output can be bounded here (left to Celery, which decompresses it itself).

    Raises CompressedBodyError when it does not decompress or expands past `limit`."""
    try:
        decoder = compression.get_decoder(method)
    except KeyError:
        raise CompressedBodyError(f"unknown compression {method!r}") from None
    factory = _BOUNDED_DECOMPRESSORS.get(decoder)
    if factory is None:
        return None
    parts: list[bytes] = []
    size, remaining = 0, body
    while True:
        decompressor = factory()
        try:
            part = decompressor.decompress(remaining, limit + 1 - size)
        except (zlib.error, OSError, lzma.LZMAError, EOFError, ValueError) as exc:
            if parts:
                break  # trailing bytes after a whole stream, which the stdlib's decompress ignores too
            raise CompressedBodyError(
                f"the body's compression {method!r}: the body does not decompress: {exc}"
            ) from None
        parts.append(part)
        size += len(part)
        if size > limit:
            raise CompressedBodyError(
                f"the body's compression {method!r} expands it past {limit} bytes, the most a message may decompress to"
            )
        if not decompressor.eof:
            raise CompressedBodyError(
                f"the body's compression {method!r}: the body ends before its compressed stream does"
            )
        remaining = decompressor.unused_data
        if not remaining or factory not in _MULTI_STREAM:
            return b"".join(parts)
    return b"".join(parts)


#: Headers Celery keeps as text (ids, names, reprs): a number or a list in one ends up as a dict key, a log format
#: argument or an id compared with strings.
_TEXT_HEADERS = ("shadow", "root_id", "parent_id", "group", "argsrepr", "kwargsrepr", "origin", "lang")
#: Properties the same way (Celery's request reads them; reply_to names a queue).
_TEXT_PROPERTIES = ("correlation_id", "reply_to")
#: What a Celery worker finds in the embed, the third part of a protocol 2 body: lists of signatures, or one.
_SIGNATURE_LISTS = ("callbacks", "errbacks", "chain")
#: The span of dates whose conversion to another timezone stays a date (two days clear of years 1 and 9999).
_MOMENTS = (datetime.min.replace(tzinfo=UTC) + timedelta(days=2), datetime.max.replace(tzinfo=UTC) - timedelta(days=2))


def check_envelope(message: dict[str, Any]) -> None:
    """Raise MalformedTaskMessage naming the first header or property of a task message a worker would choke on.

    Celery's worker reads these outside the task's own error handling (its request, its strategy, the pool's call): a
    `timelimit` it cannot unpack or an `id` it cannot hash ends the worker, not the task."""
    headers, properties = message.get("headers"), message.get("properties")
    if not isinstance(headers, dict):
        raise MalformedTaskMessage("the headers", "a document", headers)
    if not isinstance(properties, dict):
        raise MalformedTaskMessage("the properties", "a document", properties)
    for name in ("task", "id"):
        if not isinstance(headers.get(name), str) or not headers[name]:
            raise MalformedTaskMessage(f"header {name!r}", "a non-empty string", headers.get(name))
    if len(headers["task"]) > MAX_KIND_LENGTH:  # the job's `kind`, kept twice in the charts' summaries
        expected = f"a task name of at most {MAX_KIND_LENGTH} characters"
        raise MalformedTaskMessage("header 'task'", expected, headers["task"])
    for name in _TEXT_HEADERS:
        _check(headers, name, "header", _text_or_none, "a string or null")
    _check(headers, "timelimit", "header", _time_limits, "[hard, soft] seconds, each a non-negative number or null")
    for name in ("eta", "expires"):
        _check(headers, name, "header", _iso_moment, "an ISO 8601 date and time (years 1 to 9999) or null")
    for name in ("retries", "replaced_task_nesting", BROKER_RETRIES_HEADER):
        _check(headers, name, "header", _count, "a non-negative integer", absent_only=True)
    _check(headers, "group_index", "header", _count_or_none, "a non-negative integer or null")
    _check(headers, "ignore_result", "header", _bool_or_none, "true, false or null")
    _check(headers, "stamped_headers", "header", _texts_or_none, "a list of strings or null")
    _check(headers, "stamps", "header", _document_or_none, "a document or null")
    _check(headers, "compression", "header", _known_compression, f"one of {compression.encoders()} or null")
    if (unique_problem := unique.header_problem(headers)) is not None:
        name, expected, value = unique_problem
        raise MalformedTaskMessage(f"header {name!r}", expected, value)
    expected_name = f"a non-empty string of at most {MAX_SCHEDULE_LENGTH} characters (a periodic entry's name)"
    _check(headers, SCHEDULE_HEADER, "header", _schedule_name, expected_name, absent_only=True)
    expected_serial = f"a non-empty string of at most {MAX_SERIAL_KEY_LENGTH} characters"
    _check(headers, SERIAL_KEY_HEADER, "header", is_serial_key, expected_serial, absent_only=True)
    expected_rate_key = f"a non-empty string of at most {MAX_RATE_KEY_LENGTH} characters"
    _check(headers, RATE_KEY_HEADER, "header", is_rate_key, expected_rate_key, absent_only=True)
    for name in _TEXT_PROPERTIES:
        _check(properties, name, "property", _text_or_none, "a string or null")
    _check(properties, "priority", "property", is_priority, "an integer from 0 to 255 or null")
    _check(properties, "delivery_info", "property", _document_or_none, "a document or null")
    for name in ("exchange", "routing_key"):  # where a Celery retry of the task is published
        value = (properties.get("delivery_info") or {}).get(name)
        if not _text_or_none(value):
            raise MalformedTaskMessage(f"property 'delivery_info.{name}'", "a string or null", value)
    for name in ("content-type", "content-encoding"):
        if not _text_or_none(message.get(name)):
            raise MalformedTaskMessage(f"{name!r}", "a string or null", message.get(name))
    check_publish_ids(properties)  # never stored: one in a stored payload was written by hand


def check_publish_ids(properties: dict[str, Any]) -> None:
    """The job ids a publish chose, per queue (PUBLISH_ID_PROPERTY): Kombu's retry of a publish carries them; a
    producer that sets the property itself must give text ids (they become the jobs' `_id`)."""
    chosen = properties.get(PUBLISH_ID_PROPERTY)
    if chosen is None:
        return
    if not isinstance(chosen, dict) or not all(
        isinstance(queue, str) and isinstance(job_id, str) and job_id for queue, job_id in chosen.items()
    ):
        raise MalformedTaskMessage(
            f"property {PUBLISH_ID_PROPERTY!r}", "a document of queue name to non-empty string job id", chosen
        )


def check_body(message: dict[str, Any], payload: dict[str, Any], *, whole_canvas: bool = False) -> None:
    """Raise MalformedTaskMessage naming the part of a JSON task body a worker would choke on: protocol 2 is
    `[args (list), kwargs (document), embed (document)]`, and the embed's callbacks, errbacks, chain and chord are
    signatures. `payload` is the message's stored document (read there when the body is kept readable).
    `whole_canvas` (a publish): each of those signatures must also pass check_signature.

    A body in another serializer is left to Celery, which decodes it only if the app accepts that content: parsing it
    here would deserialize what the worker may refuse. A compressed one is decompressed first (bounded: see
    decompress_bounded), whatever its serializer, and left to Celery only in a compression that cannot be bounded."""
    method = (message.get("headers") or {}).get("compression")
    stored_plain = "args" in payload or payload.get("bodyFormat") == "json"
    raw = message.get("body")
    if method and not stored_plain:
        raw = decompress_bounded(raw.encode("utf-8") if isinstance(raw, str) else bytes(raw or b""), method)
        if raw is None:
            return
    if message.get("content-type") != "application/json":
        return
    if "args" in payload:
        body: Any = [payload.get("args"), payload.get("kwargs"), payload.get("options")]
    elif payload.get("bodyFormat") == "json":
        body = payload.get("body")
    else:
        try:
            body = json.loads(
                raw if isinstance(raw, str) else bytes(raw or b"").decode(message.get("content-encoding") or "utf-8")
            )
        except (LookupError, ValueError, TypeError, RecursionError):  # an unknown encoding, bytes not in it, not JSON
            raise MalformedTaskMessage("the body", "JSON, as its content type says", "something else") from None
    if not isinstance(body, list) or len(body) != 3:
        raise MalformedTaskMessage("the body", "[args, kwargs, embed] (Celery's task protocol 2)", body)
    args, kwargs, embed = body
    if not isinstance(args, list):
        raise MalformedTaskMessage("the body's args", "a list", args)
    if not isinstance(kwargs, dict):
        raise MalformedTaskMessage("the body's kwargs", "a document", kwargs)
    if not isinstance(embed, dict):
        raise MalformedTaskMessage("the body's embed", "a document", embed)
    for name in _SIGNATURE_LISTS:
        signatures = embed.get(name)
        if signatures is not None and not (isinstance(signatures, list) and all(map(_signature, signatures))):
            raise MalformedTaskMessage(f"the embed's {name!r}", "a list of signatures or null", signatures)
    if embed.get("chord") is not None:
        # Checked whole at delivery too: a header's last part publishes the body after its own body ran, and refused
        # then the chord never completes (a callback refused then is dropped before the body runs: worker/receivers.py).
        check_signature(embed["chord"], "the embed's 'chord'")
    if whole_canvas:
        check_canvas(embed)


def deliverable_message(payload: Any) -> dict[str, Any]:
    """The message of a job's stored `payload` as a claim hands it to a worker (its delivery headers not yet added):
    PayloadError when it is no stored message, MalformedTaskMessage naming the header, property or body part a worker
    would choke on (check_envelope, check_body)."""
    message = to_message(payload)
    check_envelope(message)
    check_body(message, payload)
    return message


def check_canvas(embed: dict[str, Any]) -> None:
    """check_signature for every signature a task message carries for later (its embed's callbacks, errbacks and
    chain; check_body checks its chord), at the message's own publish: a worker publishes them only after the task's
    body ran, too late to refuse anything but the signature itself."""
    for name in _SIGNATURE_LISTS:
        for index, signature in enumerate(embed.get(name) or ()):
            check_signature(signature, f"the embed's {name!r}[{index}]")


def signature_task_id(signature: Any) -> str | None:
    """The task id a signature's publish gives its task (its option `task_id`), which a waiter may hold
    (`AsyncResult(id).get()`), when it is one: a string of 1 to MAX_TASK_ID_LENGTH characters BSON can hold."""
    options = signature.get("options") if isinstance(signature, dict) else None
    return task_id_of(options.get("task_id") if isinstance(options, dict) else None)


def chord_body_id(payload: Any) -> str | None:
    """The task id of the chord body a stored task message carries in its embed (signature_task_id), if any."""
    embed = payload.get("options") if isinstance(payload, dict) else None
    return signature_task_id(embed.get("chord")) if isinstance(embed, dict) else None


#: The canvas types Celery's `signature()` rebuilds from a message (celery.canvas, Signature.register_type), and the
#: kwargs of each that hold signatures: a list of them, or one (a chord's header may be either).
_CANVAS_PARTS: dict[str | None, tuple[str, ...]] = {
    None: (),
    "chain": ("tasks",),
    "group": ("tasks",),
    "chord": ("header", "body"),
    "chunks": ("task",),
    "xmap": ("task",),
    "xstarmap": ("task",),
}
#: A signature's options a publish of it turns into its message's headers (as celery.app.amqp.as_task_v2 does).
_OPTION_HEADERS = {
    "shadow": "shadow",
    "group_id": "group",
    "group_index": "group_index",
    "root_id": "root_id",
    "parent_id": "parent_id",
    "eta": "eta",
    "retries": "retries",
    "ignore_result": "ignore_result",
    "stamped_headers": "stamped_headers",
    "stamps": "stamps",
    "replaced_task_nesting": "replaced_task_nesting",
    "compression": "compression",
}
#: What stands for the task id a signature without one gets at its publish.
_ID_AT_PUBLISH = "(chosen at its publish)"


def check_signature(signature: Any, where: str) -> None:
    """Raise MalformedTaskMessage, naming `where` it is and what, when a signature (a callback, errback, chain step or
    chord body, at any depth) could not be published: Celery could not rebuild it (args, kwargs, options of the wrong
    type, an unknown canvas type), or the message its publish makes would be refused by check_envelope (a priority
    past 255, a time limit that is no number, a countdown no date holds)."""
    if not _signature(signature):
        raise MalformedTaskMessage(where, "a signature (a document naming its task)", signature)
    for name, valid, expected in (
        ("args", _list_or_none, "a list or null"),
        ("kwargs", _document_or_none, "a document or null"),
        ("options", _document_or_none, "a document or null"),
        ("immutable", _bool_or_none, "true, false or null"),
        ("subtask_type", _canvas_type, f"one of {sorted(filter(None, _CANVAS_PARTS))} or null"),
    ):
        if not valid(signature.get(name)):
            raise MalformedTaskMessage(f"{where}'s {name!r}", expected, signature.get(name))
    kwargs = signature.get("kwargs") or {}
    for part in _CANVAS_PARTS[signature.get("subtask_type")]:
        _check_signatures(kwargs.get(part), f"{where}'s {part!r}", one_allowed=part != "tasks")
    options = signature.get("options") or {}
    for name in ("link", "link_error", "chain"):
        if options.get(name) is not None:
            _check_signatures(options[name], f"{where}'s option {name!r}", one_allowed=name != "chain")
    if options.get("chord") is not None:
        check_signature(options["chord"], f"{where}'s option 'chord'")
    for name in ("countdown", "expires"):
        value = options.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not _seconds_from_now(value):
            raise MalformedTaskMessage(f"{where}'s option {name!r}", "a number of seconds a date holds", value)
    if not _document_or_none(options.get("headers")):
        raise MalformedTaskMessage(f"{where}'s option 'headers'", "a document or null", options["headers"])
    try:
        check_envelope(_envelope_of(signature["task"], options))
    except MalformedTaskMessage as exc:
        raise MalformedTaskMessage(f"{where}'s publish: {exc.field}", exc.expected, exc.value) from None


def _check_signatures(value: Any, where: str, *, one_allowed: bool) -> None:
    if one_allowed and isinstance(value, dict):
        check_signature(value, where)
        return
    if not isinstance(value, list):
        raise MalformedTaskMessage(where, "a signature or a list of them" if one_allowed else "a list of them", value)
    for index, signature in enumerate(value):
        check_signature(signature, f"{where}[{index}]")


def _envelope_of(task: str, options: dict[str, Any]) -> dict[str, Any]:
    """The headers and properties of the message a publish of a signature with these options makes, as far as
    check_envelope reads them (its options' `headers` are merged into the message's, as Celery does)."""
    headers: dict[str, Any] = {**(options.get("headers") or {}), "task": task}
    headers["id"] = options["task_id"] if options.get("task_id") is not None else _ID_AT_PUBLISH
    headers["timelimit"] = [options.get("time_limit"), options.get("soft_time_limit")]
    headers.update((header, options[name]) for name, header in _OPTION_HEADERS.items() if name in options)
    if not isinstance(options.get("expires"), (int, float)):  # a number of seconds: checked on its own
        headers["expires"] = options.get("expires")
    routing = {name: options.get(name) for name in ("exchange", "routing_key")}
    properties = {name: options.get(name) for name in ("priority", "reply_to")}
    return {"headers": headers, "properties": {**properties, "delivery_info": routing}}


def _seconds_from_now(value: float) -> bool:
    """A countdown or expiry in seconds whose date (now plus it, as Celery adds it) is one check_envelope accepts."""
    try:
        return _MOMENTS[0] <= datetime.now(UTC) + timedelta(seconds=value) <= _MOMENTS[1]
    except (OverflowError, ValueError):  # past timedelta's range, or NaN
        return False


def check_encodable(parts: dict[str, Any]) -> None:
    """Raise MalformedTaskMessage naming the first text among `parts` (each named as an error names it) that UTF-8
    cannot encode: a lone surrogate, as Python makes of bytes that are not UTF-8 (a file name's, through os.fsdecode).
    BSON stores text as UTF-8 only: pymongo would raise a bare UnicodeEncodeError at the insert."""
    for name, value in parts.items():
        if _bson_encodes(value):
            continue  # BSON's own encoder (C) met every text in it: none holds a lone surrogate; no walk needed
        if (found := unencodable_text(value)) is not None:
            path, text = found
            raise MalformedTaskMessage(f"{name}{path}", "text UTF-8 can encode (no lone surrogate)", text)


def _bson_encodes(value: Any) -> bool:
    """Whether BSON encodes `value` (a fast pass on every publish: the walk of unencodable_text costs a publish tens
    of microseconds per part); False for a lone surrogate and for anything else BSON refuses (a key that is not text,
    an int past 64 bits), which the walk then looks at."""
    try:
        bson.encode({"value": value})
    except (InvalidDocument, UnicodeError, OverflowError, TypeError, ValueError, RecursionError):
        return False
    return True


def unencodable_text(value: Any) -> tuple[str, str] | None:
    """The first text in `value` (itself, or a key or item of its documents and arrays, at any depth) that UTF-8
    cannot encode, with where it is (`[0]['name']`, "" for `value` itself); None when every text encodes."""
    pending: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if not utf8_encodable(item):
                return "".join(f"[{step!r}]" for step in path), item
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not utf8_encodable(key):
                    return "".join(f"[{step!r}]" for step in path) + " (a key)", key
                pending.append(((*path, key), child))
        elif isinstance(item, list | tuple):
            pending.extend(((*path, index), child) for index, child in reversed(list(enumerate(item))))
    return None


def _check(
    fields: dict[str, Any],
    name: str,
    kind: str,
    valid: Callable[[Any], bool],
    expected: str,
    *,
    absent_only: bool = False,
) -> None:
    """`absent_only`: null is not a value the field may take (Celery adds to it), only its absence is."""
    if name not in fields or (fields[name] is None and not absent_only):
        return
    if not valid(fields[name]):
        raise MalformedTaskMessage(f"{kind} {name!r}", expected, fields[name])


def _shown(value: Any) -> str:
    shown = reprlib.Repr()  # bounded: a hostile value may be megabytes long
    shown.maxstring = shown.maxother = 60
    return shown.repr(value)


def _number(value: Any) -> bool:
    # Compared, not given to math.isfinite: a JSON header holds an int of any size, and one no float holds raises
    # there (and in Celery, which takes time limits as floats). NaN and infinity fail the comparisons.
    return (whole_number(value) or isinstance(value, float)) and 0 <= value <= sys.float_info.max


def _time_limits(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(v is None or _number(v) for v in value)


def _iso_moment(value: Any) -> bool:
    if value == "":
        return True  # Celery's and our reading of "no date"
    if isinstance(value, datetime):
        moment = value  # a producer's own header, kept by Kombu's JSON as a date
    elif not isinstance(value, str):
        return False
    else:
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return False
    return _MOMENTS[0] <= moment.replace(tzinfo=UTC) <= _MOMENTS[1]


def _schedule_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_SCHEDULE_LENGTH


def _count(value: Any) -> bool:
    return whole_number(value) and value >= 0


def _count_or_none(value: Any) -> bool:
    return value is None or _count(value)


def _text_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _texts_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(item, str) for item in value))


def _bool_or_none(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _document_or_none(value: Any) -> bool:
    return value is None or isinstance(value, dict)


def _list_or_none(value: Any) -> bool:
    return value is None or isinstance(value, list)


def _canvas_type(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value in _CANVAS_PARTS)


def is_priority(value: Any) -> bool:
    """A message's priority property as a publish takes it (check_envelope): an integer from 0 to 255."""
    return whole_number(value) and 0 <= value <= 255


def _known_compression(value: Any) -> bool:
    return isinstance(value, str) and value in compression.encoders()


def _signature(value: Any) -> bool:
    """A Celery signature as its message carries it: a document naming its task (a group's or chain's too)."""
    return isinstance(value, dict) and isinstance(value.get("task"), str) and bool(value["task"])
