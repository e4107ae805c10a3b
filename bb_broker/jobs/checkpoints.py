"""A task's checkpoint on its own job document, and the progress the Jobs tab shows.

A checkpoint is a small JSON value a task saves as it works (bb_broker.checkpoint) and reads when it runs again
(bb_broker.last_checkpoint): whatever sends the job back to the queue (a Celery retry, the broker's retry, the stale
sweep after a SIGKILL, a warm shutdown's give-back, an operator's retry or run-now) leaves it in place, so the next
attempt resumes from it; only an operator's retry told to start over (`fresh`) clears it (CHECKPOINT_CLEARED). Fields:

- `checkpoint`: the value as JSON text (at most MAX_CHECKPOINT_BYTES encoded). Text, not BSON: every JSON value
  round-trips as it was (an integer past 64 bits, a key with a `$` or a `.`), and a hand edit that is not JSON says so.
- `checkpointAt`: when it was saved, on the worker's clock; `checkpointCounts`: `{done, total}` when the value is an
  object holding both as numbers, the progress it shows.

Each save is one write fenced on the job's id, its current attempt and `running`: an attempt the stale sweep took
over (or one whose job was sent back already) changes nothing, and learns so (the save returns False).

Progress: a job's bar comes from Celery's idiom, `update_state(state="PROGRESS", meta={"done": d, "total": t})` (the
result backend keeps it as `state`/`result`, see results/backend.py), while the job is in that state; else from its
checkpoint's counts. What a document holds there is data: anything but two sound numbers shows no bar, and sound
ones are clamped (shown_progress).
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any

from bson.errors import InvalidBSON
from pymongo.collection import Collection

from bb_broker.connection import strict_text
from bb_broker.jobs.lifecycle import RUNNING, SUCCEEDED
from bb_broker.jobs.outages import through_outages
from bb_broker.jobs.store import JobStore

#: The most bytes a checkpoint's JSON text (UTF-8, compact) may be: a job document stays small for every read of it.
MAX_CHECKPOINT_BYTES = 16 * 1024
#: The deepest nesting a checkpoint may have (arrays and objects): deeper is no cursor but a mistake.
MAX_CHECKPOINT_DEPTH = 32
#: The largest count a bar takes (a double's exact integers): past it a count is no count.
MAX_COUNT = 2**53

CHECKPOINT = "checkpoint"
CHECKPOINT_AT = "checkpointAt"
CHECKPOINT_COUNTS = "checkpointCounts"
#: What an operator's retry that starts the job over (`fresh`) unsets.
CHECKPOINT_CLEARED = dict.fromkeys((CHECKPOINT, CHECKPOINT_AT, CHECKPOINT_COUNTS), "")
#: What such a retry adds to its entry in the job's `actions`.
CLEARED_RECORD = {"checkpoint": "cleared"}
#: Celery's custom state whose meta a bar shows.
PROGRESS_STATE = "PROGRESS"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved (not JSON, too large) or read back (a hand edit that is not JSON)."""


def _check(value: Any, depth: int, where: str) -> None:
    """Raise CheckpointError unless `value` is made of JSON's types only (str keys, finite numbers) and nests
    arrays and objects at most MAX_CHECKPOINT_DEPTH levels deep (`depth`: how many hold it)."""
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_CHECKPOINT_DEPTH:
        raise CheckpointError(f"a checkpoint nests at most {MAX_CHECKPOINT_DEPTH} levels deep; {where} is deeper")
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"a checkpoint holds JSON numbers only; {where} is {value!r}")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check(item, depth + 1, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"a checkpoint's object keys are strings; {where} has the key {key!r}")
            _check(item, depth + 1, f"{where}[{key!r}]")
        return
    raise CheckpointError(
        f"a checkpoint holds JSON types only (dict, list, str, int, float, bool, None); {where} is a "
        f"{type(value).__name__}"
    )


def encoded(value: Any) -> str:
    """The checkpoint's JSON text; CheckpointError saying what is wrong when `value` cannot be one."""
    _check(value, 0, "the value")
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # an integer past Python's digits for a text (sys.set_int_max_str_digits)
        raise CheckpointError(f"a checkpoint cannot be written as JSON: {exc}") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate ('\udce9', an undecodable file name): no UTF-8, no BSON string
        raise CheckpointError("a checkpoint's strings are text: the value holds a lone surrogate") from None
    if size > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(
            f"a checkpoint is at most {MAX_CHECKPOINT_BYTES} bytes as JSON; this one is {size}: keep a cursor "
            "(an offset, the last id done), not the work itself"
        )
    return text


def decoded(text: Any, job_id: str) -> Any:
    """A stored checkpoint's value; CheckpointError when the document holds something else (a hand edit)."""
    if not isinstance(text, str):
        raise CheckpointError(f"job {job_id}'s checkpoint is a {type(text).__name__}, not JSON text (a hand edit?)")
    if len(text) > MAX_CHECKPOINT_BYTES:  # characters: never fewer than its bytes as UTF-8, which a save bounds
        raise CheckpointError(
            f"job {job_id}'s checkpoint is larger than a save writes ({MAX_CHECKPOINT_BYTES} bytes; a hand edit?)"
        )
    try:
        # Its depth is not checked: a release before 2026-12-07 saved 33 levels of empty arrays.
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise CheckpointError(f"job {job_id}'s checkpoint is not JSON a save writes (a hand edit?)") from None
    return value


def _no_constant(name: str) -> Any:
    # Python's json reads NaN and the infinities, which JSON has not and a save refuses.
    raise ValueError(f"{name} is no JSON number")


def _count(value: Any) -> float | int | None:
    """`value` when it is a sound count (a number, not a bool, finite, not negative, at most MAX_COUNT)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if 0 <= value <= MAX_COUNT else None


def counts_of(value: Any) -> dict[str, Any] | None:
    """`{done, total}` of a checkpoint (or a PROGRESS meta) that is an object holding both as sound counts."""
    if not isinstance(value, dict):
        return None
    done, total = _count(value.get("done")), _count(value.get("total"))
    return None if done is None or total is None else {"done": done, "total": total}


def save(store: JobStore, job: tuple[str, int], text: str, counts: dict[str, Any] | None, now: datetime) -> bool:
    """Write a checkpoint's JSON `text` (and its counts, or none) on the job's current attempt while it runs: False
    when the attempt is no longer the job's (taken over, sent back, settled)."""
    job_id, attempts = job
    changes: dict[str, Any] = {CHECKPOINT: text, CHECKPOINT_AT: now}
    update: dict[str, Any] = {"$set": changes}
    if counts is None:
        update["$unset"] = {CHECKPOINT_COUNTS: ""}
    else:
        changes[CHECKPOINT_COUNTS] = counts
    current = {"_id": job_id, "attempts": attempts, "status": RUNNING}
    written = through_outages(lambda: store.coll.update_one(current, update), patience=store.settle_patience)
    return bool(written.matched_count == 1)


def load(store: JobStore, job_id: str) -> Any:
    """The job's checkpoint (None when it has none). CheckpointError when its text is not UTF-8 (another program wrote
    it): read with U+FFFD in place of its bytes, the task would resume from, and save again, an altered checkpoint."""
    try:
        doc = strict_text(store.coll).find_one({"_id": job_id}, {CHECKPOINT: 1})
    except InvalidBSON as exc:
        raise CheckpointError(f"job {job_id}'s checkpoint holds text that is not UTF-8 ({exc})") from None
    if doc is None or doc.get(CHECKPOINT) is None:
        return None
    return decoded(doc[CHECKPOINT], job_id)


# --- progress, as the Jobs tab shows it ----------------------------------------------------------------------------


def shown_progress(counts: Any, status: Any) -> dict[str, Any] | None:
    """The bar of a job in `status` with `counts` (`{done, total}` as a document or a projection holds them, any
    value at all): `{done, total, percent}`, done clamped to [0, total], or None (no bar) for a succeeded job, a
    total of 0, or counts that are not sound numbers."""
    if status == SUCCEEDED or not isinstance(counts, dict):
        return None
    done, total = counts.get("done"), _count(counts.get("total"))
    if isinstance(done, (int, float)) and not isinstance(done, bool) and math.isfinite(done) and done < 0:
        done = 0  # a negative count is nothing done yet
    done = _count(done)
    if done is None or not total:
        return None
    done = min(done, total)
    return {"done": done, "total": total, "percent": min(100, math.floor(100 * done / total))}


def progress_of(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The bar of a whole job document (its job page): its PROGRESS state's meta, else its checkpoint's counts."""
    live = doc.get("result") if doc.get("state") == PROGRESS_STATE else None
    counts = _raw_counts(live) or doc.get(CHECKPOINT_COUNTS)
    return shown_progress(counts, doc.get("status"))


def _raw_counts(value: Any) -> dict[str, Any] | None:
    """done and total of a PROGRESS meta when both are numbers (shown_progress judges them)."""
    if not isinstance(value, dict):
        return None
    done, total = value.get("done"), value.get("total")
    numbers = all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in (done, total))
    return {"done": done, "total": total} if numbers else None


_NUMBER_TYPES = ["int", "long", "double"]


def _is_number(path: str) -> dict[str, Any]:
    return {"$in": [{"$type": path}, _NUMBER_TYPES]}


def _number(path: str) -> dict[str, Any]:
    return {"$cond": [_is_number(path), path, None]}


#: The list's projection of a job's counts, as progress_of chooses them, numbers only: a hand-written 15 MB `result`
#: stays on the server. list_row makes the bar of it (shown_progress).
PROGRESS_PROJECTION: dict[str, Any] = {
    "$cond": [
        {"$and": [{"$eq": ["$state", PROGRESS_STATE]}, _is_number("$result.done"), _is_number("$result.total")]},
        {"done": "$result.done", "total": "$result.total"},
        {"done": _number(f"${CHECKPOINT_COUNTS}.done"), "total": _number(f"${CHECKPOINT_COUNTS}.total")},
    ]
}


def progress_now(coll: Collection, job_id: str) -> dict[str, Any] | None:
    """A job's status and bar as the job page refreshes them, reading nothing else of it; None: no such job."""
    doc = coll.find_one({"_id": job_id}, {"status": 1, "progress": PROGRESS_PROJECTION})
    if doc is None:
        return None
    return {"status": doc.get("status"), "progress": shown_progress(doc.get("progress"), doc.get("status"))}
