"""A publish on `bbmongo://`: a Celery task message becomes a job, anything else a plain message (the channel's
`_put` hands each here, with what Kombu decoded)."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bson import ObjectId

from bb_broker.jobs.canvas import canvas_fields
from bb_broker.jobs.document import new_job_id
from bb_broker.jobs.fair_keys import FAIR_KEY_HEADER, stored_fair_key
from bb_broker.jobs.payloads import (
    ATTEMPTS_HEADER,
    JOB_ID_HEADER,
    PUBLISH_ID_PROPERTY,
    SCHEDULE_HEADER,
    body_parts,
    check_body,
    check_encodable,
    check_envelope,
    check_publish_ids,
    to_document,
)
from bb_broker.jobs.rate_keys import RATE_KEY_HEADER
from bb_broker.jobs.serial import SERIAL_KEY_HEADER
from bb_broker.jobs.unique import UNIQUE_REFUSED_HEADER, UniqueOptionError, hold_of

if TYPE_CHECKING:
    from bb_broker.clock import ServerClock
    from bb_broker.transport.plumbing import MessageStore


def put_plain(
    plumbing: MessageStore, queue: str, message: dict[str, Any], priority: int, *, soon: bool, linger: float
) -> None:
    """Store a message that is not a task message for `queue` (`soon`, `linger`: as MessageStore.put's)."""
    if names_a_task(message):
        check_envelope(message)  # a task without an id: Celery's consumer cannot take it
    check_encodable(
        {
            "the queue name": queue,
            "the headers": message.get("headers"),
            "the properties": message.get("properties"),
        }
    )
    message, message_id = plain_publish(message, queue)
    plumbing.put(queue, message, priority, ttl=expiration(message), soon=soon, linger=linger, message_id=message_id)


def put_job(
    publish_job: Callable[..., str],
    clock: ServerClock,
    queue: str,
    message: dict[str, Any],
    body: bytes | str,
    priority: int,
) -> None:
    """Store a task message for `queue` as a job; `body`: the message's, as Kombu decoded it. `publish_job` takes
    the job (JobStore.publish's keywords): the store's publish, or a bulk enqueue's batch (Channel.publish_job)."""
    properties = message["properties"]
    if isinstance(body, str):
        body = body.encode(message.get("content-encoding") or "utf-8")
    headers = message["headers"]
    if UNIQUE_REFUSED_HEADER in headers:
        # The publisher's unique options could not make a key: its before_task_publish receiver cannot raise.
        raise UniqueOptionError(str(headers[UNIQUE_REFUSED_HEADER]))
    check_envelope(message)  # refused here, with nothing written, rather than failed at its claim
    # Kombu retries a publish whose answer was lost (the server went away with the insert in flight) with the
    # same properties: the job ids kept there, one per queue the message goes to, let the retry find the
    # inserts that landed instead of writing twins.
    job_id = properties.setdefault(PUBLISH_ID_PROPERTY, {}).setdefault(queue, new_job_id())
    eta = moment(headers, "eta")
    expires = moment(headers, "expires", strict=False)
    if expires is not None and expires.tzinfo is not None:
        # Stored on the server's clock, as every time here, and given to each worker on its own (see Channel._claim).
        headers = {**headers, "expires": clock.from_local(expires).isoformat()}
    payload = to_document({**message, "headers": headers}, body)
    check_body({**message, "body": body}, payload, whole_canvas=True)
    # The body's own parts first, so that an error names the argument: as the job keeps them readable, or parsed
    # here only where it keeps the body whole (a text BSON cannot hold is one reason it does).
    readable = "args" in payload or payload.get("bodyFormat") == "json"
    parts = payload if readable else body_parts(message, body)
    named = {f"the body's {part}": parts[part] for part in ("args", "kwargs", "options") if part in parts}
    if parts.get("bodyFormat") == "json":
        named["the body"] = parts["body"]
    check_encodable({"the queue name": queue, **named, "the headers": headers, "the properties": properties})
    publish_job(
        queue=queue,
        kind=headers["task"],
        task_id=str(headers["id"]),
        payload=payload,
        priority=priority,
        # Celery's ETA is its countdown added to this process's clock: due by the server's, as every due time.
        run_after=None if eta is None else clock.from_local(eta if eta.tzinfo else eta.replace(tzinfo=UTC)),
        is_retry=bool(headers.get("retries")),
        job_id=job_id,
        retry_of=retry_of(headers),
        unique=hold_of(headers, clock),
        schedule=headers.get(SCHEDULE_HEADER),
        serial_key=headers.get(SERIAL_KEY_HEADER),
        rate_key=headers.get(RATE_KEY_HEADER),
        fair_key=stored_fair_key(headers.get(FAIR_KEY_HEADER)),
        canvas=canvas_fields(headers),
    )


def expiration(message: dict[str, Any]) -> float | None:
    """Seconds a message may wait for a consumer: Kombu's `expiration` property (milliseconds, as in AMQP)."""
    value = (message.get("properties") or {}).get("expiration")
    if value is None:
        return None
    try:
        milliseconds = float(value)
    except (TypeError, ValueError, OverflowError):
        milliseconds = math.nan
    if not math.isfinite(milliseconds):
        raise ValueError(f"message has an unreadable expiration property {reprlib.repr(value)}")
    return max(milliseconds / 1000.0, 0.0)


def plain_publish(message: dict[str, Any], queue: str) -> tuple[dict[str, Any], ObjectId]:
    """The plain message to store for `queue`, and the _id this publish chose for it there.

    Kombu retries a publish whose answer was lost (the server went away with the insert in flight) with the same
    properties dict: the _id kept there, one per queue, lets the retry find the insert that landed instead of
    storing a twin. It is never stored in the message."""
    properties = message.get("properties") or {}
    check_publish_ids(properties)
    chosen = properties.setdefault(PUBLISH_ID_PROPERTY, {}).setdefault(queue, str(ObjectId()))
    stored = {k: v for k, v in properties.items() if k != PUBLISH_ID_PROPERTY}
    return {**message, "properties": stored}, ObjectId(chosen)


def names_a_task(message: dict[str, Any]) -> bool:
    """Whether a message that is not a task message (is_task_message) still has the `task` header Celery's consumer
    reads first: a task message missing its id, or whose task is not a name."""
    headers = message.get("headers")
    return isinstance(headers, dict) and "task" in headers


def retry_of(headers: dict[str, Any]) -> tuple[str, int] | None:
    """The (job id, attempt) a Celery retry comes from: its request's delivery headers, which Celery's retry message
    carries on (and the broker's own retries set)."""
    job_id, attempts = headers.get(JOB_ID_HEADER), headers.get(ATTEMPTS_HEADER)
    if not headers.get("retries") or job_id is None or attempts is None:
        return None
    return str(job_id), int(attempts)


def moment(headers: dict[str, Any], name: str, *, strict: bool = True) -> datetime | None:
    """A task message's `eta` or `expires` header as Celery writes it (ISO 8601); naive ones are left naive (Celery
    reads them in the worker's timezone). `strict`: an unreadable one is an error, else None (left to Celery)."""
    value = headers.get(name)
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        if strict:
            raise ValueError(f"task message has an unreadable {name} header {value!r}") from None
        return None
