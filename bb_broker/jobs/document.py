"""The job document: what it holds, how an attempt entry is built, its size limits and the claim's filter.

The job document's record of its attempts and its Celery result (designed once, for the Jobs view and for the
`bbmongo://` result backend in results.py), written inside writes that exist anyway, never in a round trip of its own:

- `startedAt`: set by the claim (the claim is when an attempt starts holding the job).
- `history`: the last HISTORY_LIMIT attempts, oldest first, each `{n, worker, startedAt, finishedAt, outcome, error,
  traceback}`; `outcome` is `succeeded`, `failed` (the broker's retries included), `retry` (the task's own Celery
  retry), `ignored` (the task raised Celery's `Ignore`, as `Task.replace` does: the job ends `succeeded`), `revoked`
  or `lost` (the worker vanished: the stale sweep or its shutdown settled it). Pushed with
  `$push`/`$slice` by the settling write (a failed attempt the broker retries: just before its retry's publish).
- The result, set by the settling write when the backend is `bbmongo://` (see results.py): `state` (Celery's state),
  `result` (the value as BSON when it came as JSON, else the encoded bytes; `resultFormat` says which), `traceback`,
  `dateDone`, `children`, `groupId`, `parentId`; `readyInAttempt`, the attempt that stored a ready state before the
  settle that ends it (a revoked chord part's REVOKED, stored before the part is counted: results/states.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bson import DatetimeMS, ObjectId
from bson.errors import InvalidBSON, InvalidDocument, InvalidStringData
from kombu.exceptions import EncodeError
from pymongo import UpdateMany
from pymongo.collection import Collection
from pymongo.errors import DocumentTooLarge
from ulid import ULID

from bb_broker.clock import aware
from bb_broker.connection import strict_text
from bb_broker.jobs import lifecycle
from bb_broker.jobs.lifecycle import QUEUED, RUNNING
from bb_broker.jobs.refusals import PublishRefused
from bb_broker.jobs.serial import MAX_SERIAL_KEY_LENGTH, is_serial_key
from bb_broker.jobs.unique import RELEASED_BY_CLAIM
from bb_broker.server import is_too_large

#: Celery's state for a task that failed and will run again (celery.states.RETRY), without importing Celery here.
RETRY_STATE = "RETRY"

#: What a worker needs of a job it claims, and what the claim checks (see malformed): its `queue`, and of its
#: `history` only its type; the history itself and the result fields stay on the server.
CLAIMED_FIELDS = {
    "_id": 1, "attempts": 1, "taskId": 1, "payload": 1, "runAfter": 1, "queue": 1, "serialKey": 1, "fairKey": 1,
    "renamedFrom": 1, "historyType": {"$type": "$history"},
}  # fmt: skip
#: The longest task id a signature's waiter is told of, or a job's first id kept (a Celery id is 36 characters): a
#: longer one is a hand edit.
MAX_TASK_ID_LENGTH = 255

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024

#: Attempts from here on are a hand edit no claim counts on (a 64-bit $inc overflows near 2**63); a claim counts
#: them from 0, so one below 0 is a hand edit too (and would make a backoff of nothing: 5 s * 2**-1000000).
UNCOUNTABLE_ATTEMPTS = 2**31

#: The longest task name a job's `kind` holds (a publish refuses a longer `task` header): the charts' summaries keep
#: it twice, in a document of at most MAX_DOCUMENT_BYTES (see bb_broker.ops.summaries.group_name).
MAX_KIND_LENGTH = 1024

#: Attempts kept in a job's `history`, the newest last.
HISTORY_LIMIT = 10
#: A traceback in `history` is cut to its last this many characters (where the exception is).
MAX_HISTORY_TRACEBACK = 4000
#: The most operator actions a job keeps a record of (the oldest go first).
ACTIONS_KEPT = 20

#: What a settle too large for its document says, after what it settles ("the task's result does not fit ...").
DOES_NOT_FIT = f"does not fit in its job document ({MAX_DOCUMENT_BYTES} bytes at most)"
#: What pymongo raises for a document BSON cannot encode, before sending it: a value of no BSON type, a document
#: over the limit (DocumentTooLarge is one), a str holding a lone surrogate (the C encoder's UnicodeEncodeError).
UNENCODABLE = (InvalidDocument, InvalidStringData, UnicodeEncodeError)


def unwritable_cause(exc: BaseException) -> str | None:
    """Why a write met `exc` and will meet it whatever a retry does, said after what it writes ("the task's result
    ..."): its document over MongoDB's limit, or a value BSON cannot encode. None for any other error."""
    if isinstance(exc, DocumentTooLarge) or is_too_large(exc):
        return DOES_NOT_FIT
    if isinstance(exc, UNENCODABLE):
        return f"cannot be stored: BSON cannot encode it ({storable_text(str(exc))})"
    return None


#: The result backend's collection (same database) of what has no job: see results/backend.py.
RESULTS_COLLECTION = "bb_results"
#: The job field naming the attempt that stored a ready state on its job ahead of the settle that ends it (a revoked
#: chord part: JobResultBackend.mark_as_revoked): while the job still runs that attempt, the state is the task's. An
#: operator's retry, which counts the attempts from 0 again, removes it.
READY_IN_ATTEMPT = "readyInAttempt"
#: The field of a revoked canvas step's `task:<old id>` document there naming the task id an operator's retry gave it
#: (bb_broker.ops.operations): the old id reads as the new one.
RENAMED_TO = "renamedTo"
#: The field of every such `task:<old id>` document naming the new task id, canvas step or not: where an operator's
#: look-up by the old id (bb-broker show, the Jobs tab, the API) finds the job (ops.queries.Queries.find).
RETRIED_AS = "retriedAs"
#: How many times over a read follows a revoked task's old id to the id its retry runs under (a step revoked and
#: retried again, and again).
MAX_RENAMES = 10
#: The field of a failure stored in `bb_results` for a canvas step that has no job (a chain's later step, a failed
#: chord's body) listing the failed jobs an operator retried to continue it (bb_broker.ops.operations), written before
#: the retry's own write: while one of them is queued or running, the failure reads PENDING (results/backend.py).
RETRIED_BY = "retriedBy"
#: The field of a chord counter that completed in error naming the task id its ChordError was stored under (the
#: body's, as Celery's chord_error_from_stack stores it): what a retry of a header step answers.
FAILED_AS = "failedAs"


def due_query(queue: Any, now: datetime) -> dict[str, Any]:
    """The filter of the jobs of `queue` (a name, or a query on it: a safety poll's `$in`) due `now`."""
    return {"status": QUEUED, "queue": queue, "runAfter": {"$lte": now}}


def waiting_query(queue: Any, now: datetime) -> dict[str, Any]:
    """The filter of the jobs of `queue` (a name, or a query on it) that wait for their runAfter (a countdown, an
    ETA, a retry's backoff)."""
    return {"status": QUEUED, "queue": queue, "runAfter": {"$gt": now}}


def claim_query(queue: str, owner: str, now: datetime) -> tuple[dict[str, Any], dict[str, Any]]:
    """The claim: the filter of `queue`'s due jobs (taken in CLAIM_ORDER) and the update that makes one `owner`'s."""
    due = due_query(queue, now)
    take = {
        "$set": {"status": RUNNING, "updatedAt": now, "startedAt": now, "leaseOwner": owner},
        "$inc": {"attempts": 1},
        "$unset": RELEASED_BY_CLAIM,  # a `queued` unique key is free once a worker holds its job
    }
    return due, take


def in_slot(take: dict[str, Any], slot: int, limit: int) -> dict[str, Any]:
    """The claim's update `take` for a queue limited to `limit` running jobs: the job holds `slot` (see
    ConcurrencySlots.claim_in_a_slot) and keeps the limit in `claimLimits`, beside a rate the claim already put
    there."""
    limits = {**take["$set"].get("claimLimits", {}), "concurrency": limit}
    return {**take, "$set": {**take["$set"], "limitSlot": slot, "claimLimits": limits}}


def in_slots(take: dict[str, Any], slots: dict[Any, int], limit: int) -> list[dict[str, Any]]:
    """The claim's update `take` for several jobs of a queue limited to `limit` running jobs, each job (by `_id`) in
    its own slot of `slots`: as in_slot, but as an update pipeline, so that one updateMany takes them all (one write
    the server counts as one operation, as an unlimited queue's batch claim is). The values and the ids are
    `$literal`: in a pipeline a string starting with `$` (a worker's name or a job's id can) would otherwise be read
    as a field path."""
    limited = in_slot(take, 0, limit)
    fields: dict[str, Any] = {name: {"$literal": value} for name, value in limited["$set"].items()}
    fields.update({name: {"$add": [f"${name}", step]} for name, step in limited["$inc"].items()})
    fields["limitSlot"] = {
        "$switch": {
            "branches": [
                {"case": {"$eq": ["$_id", {"$literal": job_id}]}, "then": slot} for job_id, slot in slots.items()
            ]
        }
    }
    return [{"$set": fields}, {"$unset": sorted(limited["$unset"])}]


#: What a job holds only while it is `running`, unset by every write that ends its attempt (a settle, a retry's
#: reschedule, a release, the stale sweep, an operator's requeue), in the write that exists anyway: its lease, and
#: the slot of its queue's concurrency limit (bb_limit_slot) it holds, the flag that claims wait for a slot of that
#: limit (ConcurrencySlots._wait_for_slot), and the flag that others wait for its serial key (see serial.py).
RUNNING_ONLY_FIELDS = ("leaseOwner", "limitSlot", "slotWaiters", "serialWaiters")
HOLDS_RELEASED = dict.fromkeys(RUNNING_ONLY_FIELDS, "")


class JobTooLarge(PublishRefused, ValueError):
    """The task message does not fit in one MongoDB document."""


class SettleUnwritable(ValueError):
    """A settling write can never land, whatever a retry does; `cause` says why (unwritable_cause)."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class ResultNotStored(EncodeError):
    """A task's result or failure cannot be kept in its job document: the job fails with this as its error, never
    retried.

    An EncodeError, so that Celery's tracer records it as the task's failure, as it does a result it cannot encode.
    """


class ResultTooLarge(ResultNotStored):
    """A task's result does not fit in its job document (MongoDB's 16 MB): a ResultNotStored."""


def attempt_entry(
    n: int,
    *,
    worker: str | None,
    started_at: datetime | None,
    finished_at: datetime,
    outcome: str,
    error: str | None = None,
    traceback: str | None = None,
) -> dict[str, Any]:
    """One element of a job's `history`; the traceback is bounded to its end."""
    entry: dict[str, Any] = {"n": n, "worker": worker, "startedAt": started_at, "finishedAt": finished_at}
    entry["outcome"] = outcome
    if error:
        entry["error"] = error[: lifecycle.MAX_ERROR_LENGTH]
    if traceback:
        entry["traceback"] = traceback[-MAX_HISTORY_TRACEBACK:]
    return entry


def pushed(entry: dict[str, Any] | None) -> dict[str, Any]:
    return {} if entry is None else {"$push": {"history": {"$each": [entry], "$slice": -HISTORY_LIMIT}}}


def history_entry_of(update: dict[str, Any]) -> dict[str, Any] | None:
    """The history entry an update pushes (pushed's), or None."""
    each = update.get("$push", {}).get("history", {}).get("$each")
    entry = each[0] if isinstance(each, list) and each else None
    return entry if isinstance(entry, dict) else None


def action_record(action: str, by: str, at: datetime, **details: Any) -> dict[str, Any]:
    """The $push that records an operator's action on a job, keeping the last ACTIONS_KEPT."""
    entry = {"action": action, "by": by, "at": at, **{k: v for k, v in details.items() if v is not None}}
    return {"actions": {"$each": [entry], "$slice": -ACTIONS_KEPT}}


#: The jobs whose `actions` an action_record can be pushed to: none yet, or an array. MongoDB refuses a $push to
#: anything else, and in an update_many that refusal stops the write at that job, the jobs before it changed.
ACTIONS_PUSHABLE: dict[str, Any] = {"$or": [{"actions": {"$exists": False}}, {"actions": {"$type": "array"}}]}
#: The others: an `actions` written by hand (or by another client) that is not an array.
ACTIONS_NOT_PUSHABLE: dict[str, Any] = {"actions": {"$exists": True, "$not": {"$type": "array"}}}


def update_recorded(coll: Collection, query: dict[str, Any], update: dict[str, Any], *, hint: Any = None) -> int:
    """update_many with an action_record in `update`'s $push: the jobs of `query` whose `actions` takes it get the
    whole update, the others (a hand-written `actions` that is not an array, kept as it is) the update without its
    record, in the same command; how many it changed. The record in one update of them all would stop it at the
    first of those, half the jobs done and the answer an error, and a job left out would escape a cancel or a
    revoke."""
    writes = [UpdateMany({"$and": [query, ACTIONS_PUSHABLE]}, update, hint=hint)]
    unrecorded = {operator: fields for operator, fields in update.items() if operator != "$push"}
    if unrecorded:
        writes.append(UpdateMany({"$and": [query, ACTIONS_NOT_PUSHABLE]}, unrecorded, hint=hint))
    return coll.bulk_write(writes, ordered=False).modified_count


@dataclass(frozen=True)
class Claimed:
    """A job a worker now holds: `attempts` is its fencing token for every later write."""

    id: str
    attempts: int
    task_id: str | None
    payload: Any
    #: When the job was due, on the server's clock (None in a hand-edited document without it).
    run_after: datetime | None = None
    #: Its fair key (fair_keys.py), None for none (or a hand-edited one that is not a string).
    fair_key: str | None = None
    #: The task id it first ran under, when an operator's retry of it revoked gave it a new one (`renamedFrom`).
    renamed_from: str | None = None


def of_task(task_ids: str | list[str]) -> dict[str, Any]:
    """The `taskId` condition of the jobs of a task id (or of any of a list of them). A job whose `taskId` is an array
    (written by hand, or by another client) is no task's: a query on an array field matches each of its elements, and
    one such job holding a task id would be read, changed and counted as that task's."""
    matched = {"$eq": task_ids} if isinstance(task_ids, str) else {"$in": list(task_ids)}
    return {**matched, "$not": {"$type": "array"}}


def task_id_of(value: Any) -> str | None:
    """`value` when it can be a Celery task id: a string of 1 to MAX_TASK_ID_LENGTH characters BSON can hold."""
    if isinstance(value, str) and 0 < len(value) <= MAX_TASK_ID_LENGTH and utf8_encodable(value):
        return value
    return None


def claimed(doc: dict[str, Any], attempts: int) -> Claimed:
    run_after = doc.get("runAfter")
    if not isinstance(run_after, datetime):
        run_after = None
    elif run_after.tzinfo is None:
        run_after = run_after.replace(tzinfo=UTC)
    fair_key = doc.get("fairKey") if isinstance(doc.get("fairKey"), str) else None
    renamed_from = task_id_of(doc.get("renamedFrom"))  # a hand edit that is not one: the job runs as its own id
    return Claimed(doc["_id"], attempts, doc.get("taskId"), doc.get("payload"), run_after, fair_key, renamed_from)


def malformed(doc: dict[str, Any]) -> str | None:
    """What makes a claimed job document one no worker can work through to its end, naming the field; None when it
    can. A job's id travels to the worker as a string and every later write finds the job by it; its attempts are
    its fencing token (a whole number in a header) and what its backoff doubles with; its queue is what claims,
    counts and wake-ups go by; its history (read as its type, `historyType`) takes a $push at each settle; its serial
    key, when it has one, is what a claim skips while another job of the key runs (serial.py)."""
    job_id = doc.get("_id")
    if not isinstance(job_id, str):
        return f"_id must be a string, not {bson_kind(job_id)} {job_id!r}"[: lifecycle.MAX_ERROR_LENGTH]
    attempts = doc.get("attempts")
    if not isinstance(attempts, int) or isinstance(attempts, bool):
        return f"attempts must be a whole number, not {bson_kind(attempts)} {attempts!r}"
    if not 0 < attempts <= UNCOUNTABLE_ATTEMPTS:  # as claimed: one more than the document held
        return f"attempts must be a whole number from 0 to {UNCOUNTABLE_ATTEMPTS - 1}, not {attempts - 1}"
    if not isinstance(doc.get("queue"), str):
        return f"queue must be a string, not {bson_kind(doc.get('queue'))}"
    if doc.get("historyType", "missing") not in ("missing", "array"):
        return f"history must be an array, not {doc['historyType']}"
    if "serialKey" in doc and not is_serial_key(doc["serialKey"]):
        return bad_serial_key(doc["serialKey"])
    return None


def not_utf8_fields(doc: dict[str, Any]) -> list[str]:
    """The fields of a document read with LENIENT_DECODING (bb_broker.connection) that hold U+FFFD, where its text
    was not UTF-8 (or held U+FFFD as written: said of a document pymongo's strict decoding refused)."""

    def replaced(value: Any) -> bool:
        if isinstance(value, str):
            return "\ufffd" in value
        if isinstance(value, dict):
            return any(replaced(key) or replaced(item) for key, item in value.items())
        return isinstance(value, list) and any(replaced(item) for item in value)

    return [name for name, value in doc.items() if replaced(name) or replaced(value)]


def stored_not_utf8(coll: Collection, doc: dict[str, Any], fields: Iterable[str] | None = None) -> list[str]:
    """The fields of `doc` (or of those `fields` it has), read from `coll` with LENIENT_DECODING, whose text is not
    UTF-8 where it is stored: read with U+FFFD in place of its bad bytes, written back it would be altered. Only a
    field that holds U+FFFD is read again, strictly; none where that read finds the same (U+FFFD as written)."""
    shown = doc if fields is None else {name: doc[name] for name in fields if name in doc}
    suspects = not_utf8_fields(shown)
    if not suspects:
        return []
    try:  # by the _id read: an _id read altered finds no job, as an altered field raises
        found = strict_text(coll).find_one({"_id": doc.get("_id")}, dict.fromkeys(suspects, 1))
    except InvalidBSON:
        return suspects
    return suspects if found is None else []


def bad_serial_key(value: Any) -> str:
    """Why `value` is no serial key (see serial.py): a key that is not a string is not what SERIAL_INDEX's claims can
    skip, and a key longer than a publish writes is a hand edit."""
    found = f"a string of {len(value)}" if isinstance(value, str) else bson_kind(value)
    return f"serialKey must be a string of 1 to {MAX_SERIAL_KEY_LENGTH} characters, not {found}"


def utf8_encodable(text: str) -> bool:
    """Whether BSON, whose strings are UTF-8, can hold `text`: not when it holds a lone surrogate (what os.fsdecode
    makes of a file name whose bytes are not UTF-8, what JSON's "\\udce9" reads as)."""
    if text.isascii():  # a flag of the str: no scan
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable_text(text: str) -> str:
    """Text a person reads (an error, a traceback) as a document can hold it: a lone surrogate written out as its
    escape (`\\udce9`), the rest as it is."""
    return text if utf8_encodable(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bson_kind(value: Any) -> str:
    """The name MongoDB gives a value's type ($type), for errors a person reads."""
    kinds: tuple[tuple[type, str], ...] = (
        (bool, "bool"),  # before int: a bool is an int too
        (int, "int"),
        (float, "double"),
        (str, "string"),
        (dict, "object"),
        (list, "array"),
        (datetime, "date"),
        (bytes, "binData"),
        (ObjectId, "objectId"),
        (type(None), "null"),
    )
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def new_job_id() -> str:
    """A job's id: a ULID, so that ids sort by creation time (the operator's lists page by it)."""
    return str(ULID())


#: Aggregation expressions: a job's `history` as an array (none when it is missing, or is not one); whether it is not.
HISTORY_NOT_ARRAY = {"$not": [{"$isArray": "$history"}]}
HISTORY_ARRAY = {"$cond": [HISTORY_NOT_ARRAY, [], "$history"]}


def attempt_recorded_expression() -> dict[str, Any]:
    """An aggregation expression: the job's current attempt has its entry in the history already (the last one, with
    the attempt's number, finished since the attempt's claim: not an entry from before `bb-broker retry`)."""
    last = {"$arrayElemAt": [HISTORY_ARRAY, -1]}
    current = {"$and": [{"$eq": ["$$last.n", "$attempts"]}, {"$gte": ["$$last.finishedAt", "$startedAt"]}]}
    return {"$let": {"vars": {"last": last}, "in": current}}


def has_entry_of_current_attempt(doc: dict[str, Any]) -> bool:
    """What attempt_recorded_expression says, of a job read with its `attempts`, `startedAt` and last history entry."""
    last = (doc.get("history") or [None])[-1]
    if not isinstance(last, dict) or last.get("n") != doc.get("attempts"):
        return False
    finished, started = last.get("finishedAt"), doc.get("startedAt")
    return started is None or (finished is not None and _millis(finished) >= _millis(started))


def _millis(moment: datetime | DatetimeMS) -> int:
    """A date's milliseconds, also of one outside Python's range (read as DatetimeMS: EXACT_DECODING)."""
    return int(moment) if isinstance(moment, DatetimeMS) else int(aware(moment).timestamp() * 1000)


def attempts_fence(docs: list[dict[str, Any]], *, shift: int = 0) -> dict[str, Any]:
    """The filter that holds each doc to its own attempts (plus `shift`): `{attempts: n}` when they all share one
    value, as the head of a queue nearly always does, else one `$in` of ids per value under an `$or`. A server may
    answer an `$or` by scanning the collection (the Rust stand-in does), where the plain form is a lookup by id."""
    by_attempts: dict[int, list[Any]] = {}
    for doc in docs:
        by_attempts.setdefault(doc["attempts"] + shift, []).append(doc["_id"])
    if len(by_attempts) == 1:
        return {"attempts": next(iter(by_attempts))}
    return {"$or": [{"_id": {"$in": ids}, "attempts": n} for n, ids in by_attempts.items()]}
