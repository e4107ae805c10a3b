"""Retry with changed arguments: a NEW job of the task, queue, options and headers of a job an operator names, with
the args and kwargs they give; validated and shown back (plan, then Rerun.preview) before it is sent (send), and
linked both ways in the two documents' `actions` (the new job's `replaces`, the original's `replacedBy`).

The original is left as it is, whatever its status, except a queued one, which is refused: it would still run, with
its old arguments, beside the new job; the operator cancels it first (the Jobs tab's Cancel, `bb-broker cancel`), as
nothing in Celery or Flower cancels a task behind its sender's back.

The new message is the original's, its id and body new, published through the broker (kombu, to the queue by name),
so that the transport's publish checks and stores it as any task's: a size over the document limit, a header no
worker could run, a unique key another job holds, each refused with nothing written. What a publish of the task
would make of its new arguments is made again: Celery's argsrepr and kwargsrepr, and a unique, serial or rate key
that came from the arguments (see _rekeyed). A Celery retry's count, an ETA and an expiry that has passed are not
carried over: the new job is due now, with all its attempts.
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bb_broker.jobs.document import MAX_DOCUMENT_BYTES, action_record, bson_kind, new_job_id, stored_not_utf8
from bb_broker.jobs.fair_keys import FAIR_KEY_HEADER, MAX_FAIR_KEY_LENGTH
from bb_broker.jobs.lifecycle import QUEUED
from bb_broker.jobs.payloads import (
    BROKER_RETRIES_HEADER,
    PUBLISH_ID_PROPERTY,
    MalformedTaskMessage,
    PayloadError,
    body_parts,
    decompress_bounded,
    is_priority,
    to_message,
    unencodable_text,
)
from bb_broker.jobs.rate_keys import MAX_RATE_KEY_LENGTH, RATE_KEY_HEADER
from bb_broker.jobs.refusals import PublishRefused
from bb_broker.jobs.serial import MAX_SERIAL_KEY_LENGTH, SERIAL_KEY_HEADER
from bb_broker.jobs.unique import (
    UNIQUE_KEY_HEADER,
    DuplicateJob,
    UniqueOptionError,
    UniqueOptions,
    digest,
    option_key,
)
from bb_broker.ops.operations import Operations
from bb_broker.ops.queries import no_job_has

#: The action's name, in the API's paths and in both jobs' `actions`.
ACTION = "retry-with-args"
#: What the preview shows where the new task's id goes: chosen when the job is sent, not before.
NEW_TASK_ID = "(new task id, chosen when sent)"
#: The content type whose bodies this action can write (Celery's `json` serializer).
JSON = "application/json"
#: Celery's own bound on argsrepr and kwargsrepr (Celery's `argsrepr_maxsize`, `kwargsrepr_maxsize`).
MAX_REPR = 1024
#: How much of the change a job's `actions` entry keeps (the new arguments are whole in the new job's payload).
MAX_CHANGE_SHOWN = 500
#: The headers a new job does not carry over: a Celery retry's count (the transport would take the message for a
#: retry of the running job), the broker's own retries, the ETA (the new job is due now).
DROPPED_HEADERS = ("retries", BROKER_RETRIES_HEADER, "eta")
#: Each flow-control key a header may carry: the header, the option family that makes it, its longest.
KEY_HEADERS = (
    (UNIQUE_KEY_HEADER, "unique", None),
    (SERIAL_KEY_HEADER, "serial", MAX_SERIAL_KEY_LENGTH),
    (RATE_KEY_HEADER, "rate", MAX_RATE_KEY_LENGTH),
    (FAIR_KEY_HEADER, "fair", MAX_FAIR_KEY_LENGTH),
)
#: How a send outlasts a failover (kombu's retry of a publish on a connection error).
PUBLISH_RETRY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0}
_DIGEST_KEY = re.compile(r":[0-9a-f]{64}\Z")


#: The original's message properties a new job carries, each with what kombu's publish takes of it (a stored one is
#: data: `delivery_mode: "fast"` ended the send in kombu's lookup of the mode's name).
CARRIED_PROPERTIES: dict[str, Callable[[Any], bool]] = {
    "reply_to": lambda value: isinstance(value, str),
    # A mode's name, or its number as an integer (kombu looks up anything else, 2.0 too, by name).
    "delivery_mode": lambda value: value in ("transient", "persistent") or (is_priority(value) and value in (1, 2)),
    "priority": is_priority,
}


class RerunRefused(Exception):
    """A retry with changed arguments not made, nothing written: `reason` is "bad input" (the arguments, a message the
    broker refuses), "not found" or "conflict" (the job cannot be sent again so: queued, not JSON, a key held)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def offered(doc: dict[str, Any]) -> bool:
    """Whether the Jobs tab offers a retry with changed arguments for this job: not queued, and a JSON message (a
    message kept whole, `raw`, is left to the API and the CLI, which read it)."""
    payload = doc.get("payload")
    return doc.get("status") != QUEUED and isinstance(payload, dict) and payload.get("contentType") == JSON


def parse_arguments(args_text: str | None, kwargs_text: str | None) -> tuple[list[Any] | None, dict[str, Any] | None]:
    """The args (a JSON list) and kwargs (a JSON object) an operator typed; None for one not given (the original's
    stays). Refused (bad input) before it is parsed when the text is over the document limit."""
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in (args_text, kwargs_text) if text)
    if size > MAX_DOCUMENT_BYTES:
        raise RerunRefused(
            "bad input", f"the arguments are {size} bytes: over a job document's limit ({MAX_DOCUMENT_BYTES} bytes)"
        )
    args = _parsed("args", args_text, list, "a JSON list, [1, 2]")
    kwargs = _parsed("kwargs", kwargs_text, dict, 'a JSON object, {"x": 3}')
    return args, kwargs


#: The deepest nesting of the arguments a retry with changed arguments sends: MongoDB keeps documents to 100 levels
#: (the job's own fields nest them two deeper), and the pages that show a job draw each level.
MAX_ARGUMENT_DEPTH = 64


def _shape_refusal(value: Any) -> str | None:
    """Why parsed JSON cannot be a task's arguments: nested past MAX_ARGUMENT_DEPTH, or a number JSON cannot write
    back (NaN, an infinity, 1e400 read as one); None when it can."""
    pending: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        where = "".join(f"[{step!r}]" for step in path)
        if isinstance(item, float) and not math.isfinite(item):
            return f"{where} is {item!r}, a number JSON has no way to write"
        if isinstance(item, dict | list):
            if len(path) >= MAX_ARGUMENT_DEPTH:
                return f" is nested deeper than {MAX_ARGUMENT_DEPTH} levels"
            children = item.items() if isinstance(item, dict) else enumerate(item)
            pending.extend(((*path, key), child) for key, child in children)
    return None


def _parsed(name: str, text: str | None, kind: type, expected: str) -> Any:
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested beyond reason
        raise RerunRefused("bad input", f"{name} is not JSON ({str(exc)[:200]}): give {expected}") from None
    if not isinstance(value, kind):
        raise RerunRefused("bad input", f"{name} must be {expected}, not {bson_kind(value)} {_shown(value)}")
    if (refusal := _shape_refusal(value)) is not None:
        raise RerunRefused("bad input", f"{name}{refusal}")
    if (found := unencodable_text(value)) is not None:  # JSON's escapes can write a lone surrogate: BSON cannot
        raise RerunRefused("bad input", f"{name}{found[0]} holds a lone surrogate {ascii(found[1])[:60]}")
    return value


@dataclass(frozen=True)
class Rerun:
    """A retry with changed arguments, checked and ready to send."""

    job_id: str
    task_id: str | None
    kind: str
    queue: str
    args: list[Any]
    kwargs: dict[str, Any]
    #: The original's message, as the new one is made of it (its body: [args, kwargs, embed]).
    headers: dict[str, Any]
    properties: dict[str, Any]
    embed: dict[str, Any]
    content_encoding: str
    #: What changed beside the arguments, as a person reads it.
    notes: tuple[str, ...]
    #: What the change was, as the two jobs' `actions` keep it.
    change: str

    def message(self, task_id: str) -> dict[str, Any]:
        """The headers, properties and body the new job is published with, under `task_id`."""
        headers = {**self.headers, "id": task_id}
        if headers.get("root_id") in (None, self.task_id):  # the original was its own root: the new one is
            headers["root_id"] = task_id
        properties = {**self.properties, "correlation_id": task_id}
        return {
            "headers": headers,
            "properties": properties,
            "body": [self.args, self.kwargs, self.embed],
            "content-type": JSON,
            "content-encoding": self.content_encoding,
        }

    def preview(self) -> dict[str, Any]:
        """What the operator confirms: the normalized arguments and the message that would be published."""
        return {
            "job": self.job_id,
            "taskId": self.task_id,
            "task": self.kind,
            "queue": self.queue,
            "args": self.args,
            "kwargs": self.kwargs,
            "message": self.message(NEW_TASK_ID),
            "notes": list(self.notes),
        }


def plan(
    operations: Operations,
    identifier: str,
    args: list[Any] | None,
    kwargs: dict[str, Any] | None,
    *,
    task_of: Callable[[str], Any] = lambda name: None,
) -> Rerun:
    """The retry of job `identifier` (a job id or Celery task id) with `args` and `kwargs` (None: the original's),
    checked; RerunRefused says why it cannot be. `task_of(name)`: the task registered under that name in this
    process (Flower's app, `bb-broker retry -A`), whose options make the keys that come from named arguments."""
    doc = operations.find(identifier)
    if doc is None:
        raise RerunRefused("not found", no_job_has(identifier))
    job_id = doc["_id"]
    if not isinstance(job_id, str):
        raise RerunRefused("conflict", f"job {reprlib.repr(job_id)} has an _id that is not a string")
    if altered := stored_not_utf8(operations.coll, doc):
        # Read with U+FFFD in place of its bytes, the new job would be sent altered: its message, its keys, its links.
        raise RerunRefused(
            "conflict", f"job {job_id} holds text that is not UTF-8 in {', '.join(altered)}: it cannot be sent again"
        )
    if doc.get("status") == QUEUED:
        raise RerunRefused(
            "conflict",
            f"job {job_id} is queued: it would still run with its old arguments; cancel it first, then retry it "
            "with changed arguments",
        )
    # Both are pushed to once the new job is sent: refused then, the new job would be out and the answer a failure,
    # and the operator's second try a second new job.
    for field in ("actions", "replacedBy"):
        if not isinstance(doc.get(field, []), list):
            kind = bson_kind(doc[field])
            raise RerunRefused("conflict", f"job {job_id}'s {field} is {kind}, not an array")
    try:
        message = to_message(doc.get("payload"))
    except PayloadError as exc:
        raise RerunRefused("conflict", f"job {job_id}'s message cannot be read: {exc}") from None
    headers = message["headers"]
    kind, queue = headers.get("task"), doc.get("queue")
    if not isinstance(kind, str) or not isinstance(queue, str):
        raise RerunRefused("conflict", f"job {job_id} has no task name or queue to send a new job to")
    content_type = message.get("content-type")
    if content_type != JSON:
        raise RerunRefused(
            "conflict",
            f"job {job_id} ({kind}) was sent as {content_type}, not JSON: retry with changed arguments writes JSON "
            "only (the task's serializer must be json)",
        )
    old = _body_of(message)
    if old is None:
        raise RerunRefused("conflict", f"job {job_id}'s body is not Celery's [args, kwargs, embed] in JSON")
    old_args, old_kwargs, embed = old
    new_args = old_args if args is None else args
    new_kwargs = old_kwargs if kwargs is None else kwargs
    notes: list[str] = []
    new_headers = {name: value for name, value in headers.items() if name not in DROPPED_HEADERS}
    new_headers.pop("compression", None)  # the new body is sent as it is
    if headers.get("eta"):
        notes.append(f"its ETA {headers['eta']} is dropped: the new job is due now")
    if _passed(headers.get("expires"), operations.now()):
        del new_headers["expires"]
        notes.append(f"its expiry {headers['expires']} has passed: the new job has none")
    new_headers["argsrepr"], new_headers["kwargsrepr"] = _repr(new_args), _repr(new_kwargs)
    task = task_of(kind)
    notes += _rekeyed(new_headers, kind, task, (old_args, old_kwargs), (new_args, new_kwargs))
    size = len(json.dumps([new_args, new_kwargs, embed]).encode("utf-8"))
    if size > MAX_DOCUMENT_BYTES:
        raise RerunRefused("bad input", f"the new body is {size} bytes: over a job document's limit")
    properties = _carried_properties(message["properties"], notes)
    change = _change(old_args, old_kwargs, new_args, new_kwargs)
    return Rerun(
        job_id=job_id,
        task_id=doc.get("taskId") if isinstance(doc.get("taskId"), str) else None,
        kind=kind,
        queue=queue,
        args=new_args,
        kwargs=new_kwargs,
        headers=new_headers,
        properties=properties,
        embed=embed,
        content_encoding=message.get("content-encoding") or "utf-8",
        notes=tuple(notes),
        change=change,
    )


def send(operations: Operations, rerun: Rerun, connection: Any, *, by: str) -> dict[str, Any]:
    """Publish the new job through the broker `connection` (a kombu Connection to this collection's broker), then
    record the link on both jobs; the new job's document. RerunRefused when the broker refuses the message (nothing
    is written then)."""
    from kombu import Producer

    task_id = str(uuid.uuid4())
    job_id = new_job_id()
    message = rerun.message(task_id)
    properties: dict[str, Any] = dict(message["properties"])
    priority = properties.pop("priority", None)
    try:
        with connection.channel() as channel:
            # To the queue by name (the default exchange): where the original was, whatever exchange sent it there.
            # The job id is the publish's own (PUBLISH_ID_PROPERTY), so the link below finds it.
            Producer(channel).publish(
                json.dumps(message["body"]),
                exchange="",
                routing_key=rerun.queue,
                headers=message["headers"],
                content_type=JSON,
                content_encoding=message["content-encoding"],
                priority=priority,
                # Through a failover, as Celery's own publish: the publish id makes a repeated insert find the first.
                retry=True,
                retry_policy=PUBLISH_RETRY,
                **{**properties, PUBLISH_ID_PROPERTY: {rerun.queue: job_id}},
            )
    except DuplicateJob as exc:
        raise RerunRefused("conflict", f"not sent: {exc}") from None
    except (PublishRefused, MalformedTaskMessage, UniqueOptionError) as exc:
        raise RerunRefused("bad input", f"not sent: {exc}") from None
    now = operations.now()
    details = {"change": rerun.change}
    coll = operations.coll
    coll.update_one(
        {"_id": job_id},
        {
            "$set": {"replaces": rerun.job_id},
            "$push": action_record(ACTION, by, now, replaces=rerun.job_id, previousTaskId=rerun.task_id, **details),
        },
    )
    # Not its updatedAt: that is a running job's lease, which its worker keeps.
    record = action_record(ACTION, by, now, replacedBy=job_id, taskId=task_id, **details)
    coll.update_one({"_id": rerun.job_id}, {"$push": {"replacedBy": job_id, **record}})
    return operations.find(job_id) or {"_id": job_id, "taskId": task_id}


def _carried_properties(properties: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The original's properties the new message carries (CARRIED_PROPERTIES); each it cannot, said in `notes`."""
    carried = {}
    for name, valid in CARRIED_PROPERTIES.items():
        value = properties.get(name)
        if value is None:
            continue
        if valid(value):
            carried[name] = value
        else:
            notes.append(f"its {name} {reprlib.repr(value)} is not one a message can have: the new job has none")
    return carried


def _body_of(message: dict[str, Any]) -> tuple[list[Any], dict[str, Any], dict[str, Any]] | None:
    """The original's [args, kwargs, embed], from its JSON body (decompressed, bounded, when it came compressed)."""
    body = message["body"]
    method = message["headers"].get("compression")
    if method is not None and not isinstance(method, str):
        return None  # names no compression: the body cannot be read
    raw: bytes | None = body.encode("utf-8") if isinstance(body, str) else bytes(body)
    if method and raw is not None:
        try:
            raw = decompress_bounded(raw, method)  # None: a compression whose output cannot be bounded here
        except MalformedTaskMessage:
            return None
    parts = body_parts(message, raw)
    if "args" not in parts:
        return None
    return parts["args"], parts["kwargs"], parts["options"]


def _rekeyed(
    headers: dict[str, Any],
    kind: str,
    task: Any,
    old: tuple[list[Any], dict[str, Any]],
    new: tuple[list[Any], dict[str, Any]],
) -> list[str]:
    """Each flow-control key of the original made again of the new arguments, in `headers`, where it came from the
    arguments: all of them (`unique=True`), or those the task's options name (`unique_on`, `serial_on`, `rate_on`,
    `fair_on`: the task must be registered here). A key given by name (`unique_key=`, a beat slot's) is kept as it
    is. A key made of the arguments by options this process does not know (the call's own `*_on`) is refused: kept,
    it would be the old arguments' key; dropped, the job would run unlike its task. What changed, as notes."""
    notes = []
    for header, option, longest in KEY_HEADERS:
        original = headers.get(header)
        if not isinstance(original, str):
            continue
        makers: list[Callable[..., str | None]] = [functools.partial(_key_of_options, option, longest, task, kind)]
        if option == "unique":
            makers.append(functools.partial(_key_of_all_arguments, kind))
        try:
            maker = next((maker for maker in makers if maker(*old) == original), None)
            if maker is not None:
                headers[header] = maker(*new)
                if headers[header] != original:
                    notes.append(f"its {option} key is made again of the new arguments: {headers[header]}")
                continue
        except UniqueOptionError as exc:
            if option == "fair":  # a fair key only orders the claims: kept, never a refusal
                continue
            raise RerunRefused("bad input", f"the new arguments make no {option} key: {exc}") from None
        if option == "fair":
            # A `fair_key=` value that is no key (a number, a document, a long text) is digested as one made of the
            # arguments is: kept as it is, as a key given by name.
            continue
        if _DIGEST_KEY.search(original) and original.startswith(f"{kind}:"):
            raise RerunRefused(
                "conflict",
                f"its {option} key {original} was made of its arguments by options this process does not have (the "
                f"call's {option}_on, or a task not registered here): send the task anew from its code",
            )
    return notes


def _key_of_options(
    option: str, longest: int | None, task: Any, kind: str, args: list[Any], kwargs: dict[str, Any]
) -> str | None:
    """The key the task's own options (none for a task not registered here) make of these arguments, as a publish
    would (bb_broker.worker.publish_headers)."""
    run = getattr(task, "run", None)
    if option == "unique":
        options = UniqueOptions.read(task, {})
        return options.headers(kind, args, kwargs, run).get(UNIQUE_KEY_HEADER) if options.wanted else None
    return option_key(option, task, {}, kind, args, kwargs, run, max_length=longest or 0)


def _key_of_all_arguments(kind: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """The unique key of a call's `unique=True` without `unique_on`: every argument (UniqueOptions._key)."""
    return f"{kind}:{digest([list(args), dict(kwargs)], kind)}"


def _passed(expires: Any, now: datetime) -> bool:
    if not isinstance(expires, str) or not expires:
        return False
    try:
        moment = datetime.fromisoformat(expires)
    except ValueError:
        return False
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)) <= now


def _repr(value: Any) -> str:
    shown = reprlib.Repr()  # bounded: the arguments may be megabytes
    shown.maxstring, shown.maxother, shown.maxlist, shown.maxdict, shown.maxlevel = 200, 200, 50, 50, 6
    return shown.repr(value)[:MAX_REPR]


def _shown(value: Any) -> str:
    return reprlib.repr(value)[:80]


def _change(old_args: Any, old_kwargs: Any, new_args: Any, new_kwargs: Any) -> str:
    """The change as one line: each of args and kwargs from what to what (or unchanged), bounded."""
    parts = [
        f"{name} {_repr(before)} -> {_repr(after)}" if before != after else f"{name} unchanged"
        for name, before, after in (("args", old_args, new_args), ("kwargs", old_kwargs, new_kwargs))
    ]
    return "; ".join(parts)[:MAX_CHANGE_SHOWN]
