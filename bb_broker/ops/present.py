"""A job as a person reads it: its summary lines, its arguments, its attempts and actions, values as text; and as
JSON. Every value a command prints of a stored document goes through as_text or as_json: a document written by hand
may hold any BSON type in any field."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any

from bb_broker.clock import aware
from bb_broker.jobs.lifecycle import QUEUED
from bb_broker.jobs.unique import ACTIVE_MODE, FOREVER_MODE, HOLD_FIELDS, PERIOD_MODE, QUEUED_MODE

#: The fields shown first, in this order; the rest of the document follows.
SUMMARY_FIELDS = (
    "_id", "taskId", "kind", "queue", "status", "attempts", "priority", "createdAt", "startedAt", "updatedAt",
    "runAfter", "finishedAt", "leaseOwner", "lastError",
)  # fmt: skip
#: Fields shown in sections of their own.
SECTION_FIELDS = ("payload", "history", "actions", "claimLimits")
#: The unique key's fields, shown as one line (see unique_of).
UNIQUE_FIELDS = ("unique", *HOLD_FIELDS.values())
#: What each unique mode holds its key through, as a person reads it.
HELD_WHILE = {
    QUEUED_MODE: "while queued",
    ACTIVE_MODE: "while queued or running",
    PERIOD_MODE: "in every status for its period",
    FOREVER_MODE: "for good",
}


def unique_of(doc: dict[str, Any]) -> str | None:
    """The job's unique key, its mode and whether the job holds the key now; None for a job without one."""
    unique = doc.get("unique")
    if isinstance(unique, dict) and isinstance(unique.get("mode"), str) and unique["mode"] in HELD_WHILE:
        key, mode = unique.get("key"), unique["mode"]
    elif "uniqueKey" in doc:  # a job made before the modes: a beat slot's
        key, mode = doc["uniqueKey"], FOREVER_MODE
    else:
        return None
    now = "held now" if HOLD_FIELDS[mode] in doc else "given back"
    return f"{as_text(key)} (mode {mode}: held {HELD_WHILE[mode]}; {now})"


def arguments(doc: dict[str, Any]) -> dict[str, Any]:
    """A job's args and kwargs, readable: as stored when the body is JSON, else Celery's argsrepr/kwargsrepr."""
    payload = doc.get("payload")
    if not isinstance(payload, dict):
        return {}
    if "args" in payload:
        return {"args": payload.get("args"), "kwargs": payload.get("kwargs")}
    headers: dict[str, Any] = payload["headers"] if isinstance(payload.get("headers"), dict) else {}
    if "raw" in payload:
        try:
            message = json.loads(payload["raw"])
        except (ValueError, TypeError, RecursionError):  # a hand edit: not JSON, or nested beyond reason
            message = None
        raw_headers = message.get("headers") if isinstance(message, dict) else None
        headers = raw_headers if isinstance(raw_headers, dict) else {}
    shown = {"args": headers.get("argsrepr"), "kwargs": headers.get("kwargsrepr")}
    return {name: value for name, value in shown.items() if value is not None}


def attempts_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's recorded attempts (its `history`, when the writer keeps one), each with its duration."""
    history = doc.get("history")
    if not isinstance(history, list):
        return []
    rows = []
    for entry in history:
        if not isinstance(entry, dict):
            continue
        # `duration` is ours to work out: a hand-written entry's own (text, say) would be formatted as seconds.
        row = {name: value for name, value in entry.items() if name != "duration"}
        started, finished = entry.get("startedAt"), entry.get("finishedAt")
        if isinstance(started, datetime) and isinstance(finished, datetime):
            row["duration"] = (aware(finished) - aware(started)).total_seconds()
        rows.append(row)
    return rows


def actions_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The operator actions recorded on the job (its `actions`, when it is an array: a hand-edited one may not be)."""
    actions = doc.get("actions")
    return [action for action in actions if isinstance(action, dict)] if isinstance(actions, list) else []


def limits_of(doc: dict[str, Any]) -> str:
    """The limits of its queue the job's last claim was held to (`claimLimits`), as a person reads them; "" for none."""
    limits = doc.get("claimLimits")
    if not isinstance(limits, dict):
        return "" if limits is None else as_text(limits)
    shown = []
    if "concurrency" in limits:
        slot = f", slot {doc['limitSlot']}" if "limitSlot" in doc else ""
        shown.append(f"claimed under its queue's concurrency limit {as_text(limits['concurrency'])}{slot}")
    shown += [f"{name} {as_text(value)}" for name, value in limits.items() if name != "concurrency"]
    return "; ".join(shown)


def describe_job(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) lines for a person: the summary fields, the arguments, each attempt, each action, the rest;
    a line with an empty label continues the one above."""
    lines: list[tuple[str, str]] = []
    for name in SUMMARY_FIELDS:
        if name in doc and doc[name] not in (None, ""):
            lines.append(("id" if name == "_id" else name, as_text(doc[name])))
    if doc.get("status") == QUEUED and doc.get("attempts"):
        lines.append(("next attempt", as_text(doc.get("runAfter"))))
    if (unique := unique_of(doc)) is not None:
        lines.append(("unique key", unique))
    for name, value in arguments(doc).items():
        lines.append((name, as_text(value)))
    for row in attempts_of(doc):
        when = f"{as_text(row.get('startedAt'))} -> {as_text(row.get('finishedAt'))}"
        duration = f" ({row['duration']:.3f} s)" if "duration" in row else ""
        worker = as_text(row.get("worker") or "?")
        done = f"{as_text(row.get('outcome', '?'))} on {worker}, {when}{duration}"
        lines.append((f"attempt {as_text(row.get('n', '?'))}", done))
        if row.get("error"):
            lines.append(("", as_text(row["error"])))
    if limits := limits_of(doc):
        lines.append(("limits", limits))
    for action in actions_of(doc):
        done = f"{as_text(action.get('action'))} by {as_text(action.get('by'))} at {as_text(action.get('at'))}"
        lines.append(("action", done))
        if action.get("note"):
            lines.append(("", as_text(action["note"])))
    for name, value in doc.items():
        if name not in SUMMARY_FIELDS and name not in SECTION_FIELDS and (unique is None or name not in UNIQUE_FIELDS):
            lines.append((name, as_text(value)))
    return lines


def as_text(value: Any) -> str:
    """A stored value as a line shows it: a date in UTC to the millisecond, a document or array as JSON (as_json),
    anything else as its text."""
    if isinstance(value, datetime):
        return aware(value).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"
    if isinstance(value, (dict, list)):
        return json.dumps(as_json(value))
    return str(value)


#: The most characters a table's cell shows of a stored value (a kind, an id): `show` and --json have it whole.
CELL_LENGTH = 120


def cell(value: Any) -> str:
    """A stored value as a table's cell shows it: as_text on one line, cut to CELL_LENGTH characters (a hand-edited
    kind of 1 MB widened every line of a table to 1 MB)."""
    text = " ".join(as_text(value).split())
    return text if len(text) <= CELL_LENGTH else text[: CELL_LENGTH - 3] + "..."


def to_the_second(value: Any) -> str:
    """A stored moment as a table's column shows it, to the second (UTC); a value that is not a date as its text."""
    return as_text(value)[:19] if isinstance(value, datetime) else as_text(value)


#: How deep a page or an answer shows a stored value; a document written by hand (or by another client) nested
#: deeper shows that as text from there.
MAX_SHOWN_DEPTH = 100
DEEPER = f"(nested deeper than {MAX_SHOWN_DEPTH} levels)"


def as_json(value: Any, depth: int = 0, *, binary: Callable[[bytes], Any] = str) -> Any:
    """A stored value as JSON can hold it: documents and arrays through (to MAX_SHOWN_DEPTH), a date in ISO 8601
    (UTC), binary data as `binary` makes it (its repr unless told), and what JSON has no type for (an ObjectId, a
    timestamp, a Decimal128, NaN and the infinities) as its text."""
    if isinstance(value, dict | list | tuple) and depth >= MAX_SHOWN_DEPTH:
        return DEEPER
    if isinstance(value, dict):
        return {str(key): as_json(item, depth + 1, binary=binary) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(item, depth + 1, binary=binary) for item in value]
    if isinstance(value, bytes):
        return binary(value)
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)  # BSON's 64-bit ones come back as a subclass
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, datetime):
        return aware(value).isoformat()
    return str(value)
