"""The operator's queries and actions on `jobs`: counts, lists, look-ups, retry/cancel/requeue/delete/run-now, revoke,
pause."""

from __future__ import annotations

import json
import logging
import re
import reprlib
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import ObjectId
from pymongo import DESCENDING, UpdateOne
from pymongo.errors import BulkWriteError, ExecutionTimeout
from ulid import ULID

from bb_broker.clock import ServerClock, aware
from bb_broker.jobs import lifecycle
from bb_broker.jobs.admin import DEFAULT_RETENTION
from bb_broker.jobs.document import HOLDS_RELEASED, RESULTS_COLLECTION, bson_kind
from bb_broker.jobs.lifecycle import BREAKDOWNS, FAILED, MAX_ERROR_LENGTH, QUEUED, RUNNING, STATUSES, SUCCEEDED
from bb_broker.jobs.queues import LimitError, QueueControls, QueueLimits, parse_concurrency, parse_rate
from bb_broker.jobs.store import JobStore
from bb_broker.jobs.unique import FOREVER_MODE, HOLD_FIELDS, MODES, RELEASED_BY_CANCEL
from bb_broker.server import capabilities

logger = logging.getLogger(__name__)

#: The fields an operator reads about a failed job.
FAILED_FIELDS = {"_id": 1, "kind": 1, "queue": 1, "taskId": 1, "attempts": 1, "lastError": 1, "updatedAt": 1}
#: The fields of a row in a list of jobs (the payload and the history stay on the detail page).
LIST_FIELDS = (
    "kind", "queue", "status", "attempts", "taskId", "lastError", "priority",
    "createdAt", "updatedAt", "finishedAt", "runAfter", "leaseOwner", "schedule", "uniqueKey",
)  # fmt: skip
#: The most characters of a text a row of a list carries (the page shows the first line's first 160).
LIST_TEXT_LENGTH = 500
#: What ends a text cut for a list (a value too big to show there, an array or an object, is named by its type).
CUT_MARK = "… [cut: the job's own page has it whole]"
#: The types of values a row carries as they are: small ones (and no value at all).
_SMALL_TYPES = ["missing", "null", "bool", "int", "long", "double", "decimal", "date", "objectId", "timestamp"]


def _list_projection() -> dict[str, Any]:
    """What the server sends of each listed job: every list field a text cut to one character more than a row
    shows (so that a cut is seen), a small value as it is, and for any other (a hand-written 15 MB array) nothing
    but its field's name and type in `bbNotShown`. A 15 MB lastError stays on the server."""
    projection: dict[str, Any] = {}
    not_shown = []
    for name in LIST_FIELDS:
        value, kind = f"${name}", {"$type": f"${name}"}
        projection[name] = {
            "$switch": {
                "branches": [
                    {"case": {"$eq": [kind, "string"]}, "then": {"$substrCP": [value, 0, LIST_TEXT_LENGTH + 1]}},
                    {"case": {"$in": [kind, _SMALL_TYPES]}, "then": value},
                ],
                "default": "$$REMOVE",
            }
        }
        shown = {"$in": [kind, ["string", *_SMALL_TYPES]]}
        not_shown.append({"$cond": [shown, [], [{"$concat": [name, ":", kind]}]]})
    projection["bbNotShown"] = {"$concatArrays": not_shown}
    return projection


LIST_PROJECTION = _list_projection()


def list_row(doc: dict[str, Any]) -> dict[str, Any]:
    """A job as the list projection read it, bounded: a text longer than a row shows cut and marked, a value not
    shown named by its type, and `truncated` naming each field cut (absent when none is)."""
    row = dict(doc)
    cut = []
    for entry in row.pop("bbNotShown", None) or []:
        name, _, kind = str(entry).partition(":")
        row[name] = f"[{kind}: the job's own page has it whole]"
        cut.append(name)
    for name in LIST_FIELDS:
        value = row.get(name)
        if isinstance(value, str) and len(value) > LIST_TEXT_LENGTH:
            row[name] = value[:LIST_TEXT_LENGTH] + CUT_MARK
            cut.append(name)
    if cut:
        row["truncated"] = sorted(cut)
    return row


#: What a retry reads of each job it sends back.
RETRY_FIELDS = {
    "_id": 1, "taskId": 1, "lastError": 1, "revokedAt": 1, "payload.headers.eta": 1, "unique": 1,
    **dict.fromkeys(HOLD_FIELDS.values(), 1),
}  # fmt: skip
#: The most rows one page of a list holds.
MAX_PAGE = 200
#: How long a search in lastError may scan before it answers with what it found.
SEARCH_MAX_MS = 2000
#: The most operator actions a job keeps a record of (the oldest go first).
ACTIONS_KEPT = 20
#: The lastError of a job revoked while it was still queued (as a worker's own revoke says it).
REVOKED = "revoked before it ran"
#: The job ids each holder (a worker's lease owner) lists; its count says how many it holds in all.
HOLDER_JOBS_SHOWN = 10
#: The longest filter value taken (queue and kind names, search text).
MAX_FILTER_LENGTH = 200

#: Each action: the statuses it applies to.
ACTIONS: dict[str, tuple[str, ...]] = {
    "retry": (FAILED,),
    "cancel": (QUEUED,),
    "requeue": (RUNNING,),
    "delete": (SUCCEEDED, FAILED),
    "run-now": (QUEUED,),  # only a queued job whose runAfter is still to come (a countdown, an ETA, a backoff)
}
#: The action that makes a waiting job due now.
RUN_NOW = "run-now"

#: The index each filtered list reads through, by the most selective field it filters on (see JobFilter.hint).
LIST_INDEXES = {
    "root": "bb_canvas_root",
    "schedule": "bb_list_schedule",
    "kind": "bb_list_kind",
    "queue": "bb_list_queue",
    "status": "bb_list_status",
}


class FilterError(ValueError):
    """A filter value that cannot be used: the message says which and why."""


class ActionRefused(Exception):
    """An action that does not apply: `reason` is "not found" or "conflict" (the job is not in a fitting status)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def ago(now: datetime, duration: timedelta) -> datetime:
    """`duration` before `now`; the earliest time there is when that is before year 1 (nothing is older)."""
    try:
        return now - duration
    except OverflowError:
        return datetime.min.replace(tzinfo=UTC)


def parse_moment(value: str, now: datetime) -> datetime:
    """An ISO 8601 time (UTC unless it says otherwise), or a duration meaning that long ago."""
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        if not lifecycle.is_duration(value):
            shown = reprlib.repr(value)
            raise FilterError(f"{shown} is neither an ISO 8601 time nor a duration like 30m or 7d") from None
        try:
            return ago(now, lifecycle.parse_duration(value))
        except ValueError as exc:  # too long a duration
            raise FilterError(str(exc)) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _ulid_bound(moment: datetime, *, upper: bool) -> str:
    """The smallest (or largest) job id created at `moment`: a job id is a ULID, which starts with its time."""
    millis = min(max(int(moment.timestamp() * 1000), 0), 2**48 - 1)
    return str(ULID(millis.to_bytes(6, "big") + (b"\xff" if upper else b"\x00") * 10))


#: The values that ask for a yes/no filter (`orphaned=1`), and those that leave it off.
YES, NO = ("1", "true", "yes"), ("0", "false", "no")
#: The filters by name, as a request or the command line gives them.
FILTER_NAMES = ("status", "queue", "kind", "schedule", "since", "until", "error", "orphaned", "root")
#: Searches inside what a task was called with, `<prefix>.<name>=<value>`: where each prefix's values are in the job
#: document (a JSON body is stored decoded there: payloads.to_document), and what a name after it must be (checked
#: whole, so that no name is ever a path of its own or an operator: no `$`, no `.`).
ARGUMENT_FIELDS = {
    "kwargs": ("payload.kwargs", re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}"), "a keyword argument's name"),
    "args": ("payload.args", re.compile(r"[0-9]{1,3}"), "a position from 0 to 999"),
    "headers": ("payload.headers", re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}"), "a header's name"),
}
#: The most argument searches one filter combines.
MAX_ARGUMENT_FILTERS = 5
#: An argument search reads through no index: it looks among this many of the newest jobs of the rest of the filter
#: (found through its index), and says so when there were more.
ARGUMENT_SEARCH_WINDOW = 10_000
_INTEGER = re.compile(r"-?[0-9]{1,18}")
_DECIMAL = re.compile(r"-?[0-9]{1,18}\.[0-9]{1,18}")


@dataclass(frozen=True)
class JobFilter:
    """Which jobs a list, a count or a bulk action is about; `since`/`until` bound the creation time;
    `lease_expired_before` keeps the running jobs whose lease (their updatedAt, which each heartbeat refreshes) is
    older than that: orphaned, their worker gone or stuck, not yet sent back by the stale sweep."""

    status: str | None = None
    queue: str | None = None
    kind: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    error: str | None = None  # text searched in lastError, case-insensitive
    schedule: str | None = None  # the periodic entry (bb_broker.beat) that sent the jobs: its slots' and run-nows'
    lease_expired_before: datetime | None = None
    #: (`kwargs.invoice_id`, "42") pairs: the task's arguments or headers that must have these values.
    arguments: tuple[tuple[str, str], ...] = ()
    #: The oldest job id an argument search looks at (Operations.bounded sets it): the newest of the rest of the filter.
    search_from: str | None = None
    #: The canvas (its root's task id: bb_broker.jobs.canvas) whose steps are listed.
    root: str | None = None

    @classmethod
    def parse(
        cls, values: dict[str, str | None], now: datetime, *, stale_after: float = lifecycle.Policy.stale_after
    ) -> JobFilter:
        """A filter from request or command-line strings; a bad value raises FilterError saying which. `stale_after`
        (the workers' lease, in seconds) is what makes a running job orphaned. An entry's name (`schedule`) is taken
        as it is, spaces included: it names one entry exactly."""
        searched = {name: value for name, value in values.items() if name.partition(".")[0] in ARGUMENT_FIELDS}
        arguments = parse_arguments(searched)
        stripped = {
            name: (value.strip() if isinstance(value, str) and name != "schedule" else value)
            for name, value in values.items()
            if name not in searched
        }
        clean = {name: value for name, value in stripped.items() if value}
        unknown = set(clean) - set(FILTER_NAMES)
        if unknown:
            raise FilterError(
                f"unknown filter {sorted(unknown)[0]!r}: use {', '.join(FILTER_NAMES)}, "
                "or kwargs.<name>, args.<position>, headers.<name>"
            )
        for name in ("queue", "kind", "error", "schedule", "root"):
            if len(clean.get(name) or "") > MAX_FILTER_LENGTH:
                raise FilterError(f"{name} is longer than {MAX_FILTER_LENGTH} characters")
        status = clean.get("status")
        if status is not None and status not in STATUSES:
            raise FilterError(f"status {reprlib.repr(status)} is not one of {', '.join(STATUSES)}")
        lease_cutoff = None
        orphaned = str(clean.get("orphaned", "")).lower()
        if orphaned in YES:
            if status not in (None, RUNNING):
                raise FilterError(f"orphaned jobs are {RUNNING}: status {status} has none")
            status, lease_cutoff = RUNNING, ago(now, timedelta(seconds=stale_after))
        elif orphaned and orphaned not in NO:
            shown = reprlib.repr(clean["orphaned"])
            raise FilterError(f"orphaned must be 1 (only jobs whose lease ran out) or 0, not {shown}")
        since = parse_moment(clean["since"], now) if "since" in clean else None
        until = parse_moment(clean["until"], now) if "until" in clean else None
        if since and until and since > until:
            raise FilterError("since is after until")
        return cls(
            status,
            clean.get("queue"),
            clean.get("kind"),
            since,
            until,
            clean.get("error"),
            schedule=clean.get("schedule"),
            lease_expired_before=lease_cutoff,
            arguments=arguments,
            root=clean.get("root"),
        )

    def query(self) -> dict[str, Any]:
        """The find filter; without a status, every status is named so that an index on (field, status, _id)
        still gives the jobs in id order (the server merges one scan per status)."""
        query: dict[str, Any] = {}
        if self.root is not None:
            query["rootId"] = self.root
        if self.schedule is not None:
            query["schedule"] = self.schedule  # a value, compared whole: an entry's name may be `a.*` or `$x`
        if self.kind is not None:
            query["kind"] = self.kind
        if self.queue is not None:
            query["queue"] = self.queue
        if self.status is not None:
            query["status"] = self.status
        elif query:
            query["status"] = {"$in": list(STATUSES)}
        ids = {}
        if self.since is not None:
            ids["$gte"] = _ulid_bound(self.since, upper=False)
        if self.until is not None:
            ids["$lte"] = _ulid_bound(self.until, upper=True)
        if self.search_from is not None:
            ids["$gte"] = max(ids.get("$gte", ""), self.search_from)
        if ids:
            query["_id"] = ids
        for name, value in self.arguments:
            prefix, _, rest = name.partition(".")
            query[f"{ARGUMENT_FIELDS[prefix][0]}.{rest}"] = {"$in": argument_values(value)}
        if self.error:
            query["lastError"] = {"$regex": re.escape(self.error), "$options": "i"}
        if self.lease_expired_before is not None:
            query["updatedAt"] = {"$lt": self.lease_expired_before}
        return query

    @property
    def hint(self) -> str:
        for name, index in LIST_INDEXES.items():
            if getattr(self, name) is not None:
                return index
        return "_id_"

    def as_dict(self) -> dict[str, str]:
        values = {"status": self.status, "queue": self.queue, "kind": self.kind, "error": self.error}
        values["schedule"] = self.schedule
        values["root"] = self.root
        values |= {
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "orphaned": "1" if self.lease_expired_before is not None else None,
        }
        shown = {name: value for name, value in values.items() if value}
        return shown | dict(self.arguments)

    def only_queue_and_kind(self) -> bool:
        """Whether the filter names no more than a queue and a kind (what the charts' summaries are kept by)."""
        return replace(self, queue=None, kind=None) == JobFilter()

    @property
    def unindexed(self) -> dict[str, Any]:
        """The filter without its argument searches (which no index serves): what bounds their window."""
        return replace(self, error=None, arguments=(), search_from=None).query()


def parse_arguments(values: dict[str, str | None]) -> tuple[tuple[str, str], ...]:
    """The argument searches of a filter (`kwargs.<name>`, `args.<position>`, `headers.<name>`), each name checked
    whole against its prefix's pattern; the value is taken as it is (no trimming: it is matched exactly), an empty
    one is no search."""
    found = []
    for name, value in sorted(values.items()):
        if value is None or value == "":
            continue
        prefix, _, rest = name.partition(".")
        pattern, expected = ARGUMENT_FIELDS[prefix][1:]
        if not pattern.fullmatch(rest):
            raise FilterError(f"{name[:80]!r}: after {prefix}. comes {expected}")
        if len(value) > MAX_FILTER_LENGTH:
            raise FilterError(f"{name} is longer than {MAX_FILTER_LENGTH} characters")
        found.append((name, value))
    if len(found) > MAX_ARGUMENT_FILTERS:
        raise FilterError(f"at most {MAX_ARGUMENT_FILTERS} argument searches at a time, not {len(found)}")
    return tuple(found)


def argument_values(text: str) -> list[Any]:
    """The stored values a searched text stands for: itself, and the number, boolean or null it spells (a query
    string has only text; a JSON argument may be 42, 4.5 or true). Only ever values, never an operator."""
    values: list[Any] = [text]
    if _INTEGER.fullmatch(text):
        values.append(int(text))
    elif _DECIMAL.fullmatch(text):
        values.append(float(text))
    elif text in ("true", "false"):
        values.append(text == "true")
    # Not null: {field: null} matches the jobs without the field too.
    return values


@dataclass
class Page:
    """One page of a list, newest first: `next` is the key of the following page (None on the last)."""

    jobs: list[dict[str, Any]]
    next: str | None
    stopped_early: bool = False


@dataclass
class Retried:
    """What a retry did: the jobs sent back to the queue, and the identifiers given that matched no failed job."""

    job_ids: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    #: Failed jobs left failed (another job holds their unique key now, or no worker can run them): job id -> why.
    held: dict[str, str] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.job_ids)


class Operations:
    """An operator's view of one jobs collection and its queue controls."""

    #: How many of the newest jobs an argument search looks among (see bounded).
    search_window = ARGUMENT_SEARCH_WINDOW

    def __init__(self, store: JobStore, controls: QueueControls | None = None) -> None:
        self.store = store
        self.coll = store.coll
        self.controls = controls or QueueControls(store.coll.database)

    def now(self) -> datetime:
        """The server's time, as the store reads it; a server that cannot be reached raises here (ServerClock.reading)
        rather than a second time, after a second wait, at the query that follows."""
        clock = self.store.now
        return clock.reading() if isinstance(clock, ServerClock) else clock()

    # --- counts --------------------------------------------------------------

    def statuses(self) -> dict[str, int]:
        return self.store.statuses()

    def breakdown(self, by: str) -> dict[str, dict[str, int]]:
        """Counts per status for each queue (or each kind), all four keys per row, sorted by name."""
        if by not in BREAKDOWNS:
            raise ValueError(f"cannot break the counts down by {by!r}: one of {', '.join(BREAKDOWNS)}")
        rows: dict[str, dict[str, int]] = {}
        for row in self.coll.aggregate(
            [
                {"$match": {"status": {"$in": list(STATUSES)}}},
                {"$group": {"_id": {"name": f"${by}", "status": "$status"}, "n": {"$sum": 1}}},
            ],
            **self._hint_if_indexed("bb_status_updated", "aggregate"),
        ):
            name = row["_id"].get("name")
            counts = rows.setdefault("" if name is None else str(name), dict.fromkeys(STATUSES, 0))
            counts[row["_id"]["status"]] = row["n"]
        return dict(sorted(rows.items()))

    def queue_depths(self, queues: Iterable[str] | None = None) -> dict[str, dict[str, int]]:
        """Queued, running and failed jobs per queue, from one aggregation: of the named queues (zeros for an empty
        one), or of every queue holding such jobs when `queues` is None."""
        shown = (QUEUED, RUNNING, FAILED)
        match: dict[str, Any] = {"status": {"$in": list(shown)}}
        depths: dict[str, dict[str, int]] = {}
        if queues is not None:
            names = list(queues)
            match["queue"] = {"$in": names}
            depths = {name: dict.fromkeys(shown, 0) for name in names}
        for row in self.coll.aggregate(
            [{"$match": match}, {"$group": {"_id": {"queue": "$queue", "status": "$status"}, "n": {"$sum": 1}}}],
            **self._hint_if_indexed("bb_claim", "aggregate"),
        ):
            queue = row["_id"].get("queue")
            if isinstance(queue, str):
                depths.setdefault(queue, dict.fromkeys(shown, 0))[row["_id"]["status"]] = row["n"]
        return depths

    def queues(self, consumed: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
        """Every queue holding queued, running or failed jobs, every queue named in `consumed` (what workers
        consume) and every paused or limited queue: its depths, whether it is paused and its limits (`concurrency`,
        beside the `running` it counts, and `rate`, as "10/m"), sorted by name."""
        depths = self.queue_depths()
        controls = self.controls.controls()
        rows: dict[str, dict[str, Any]] = {}
        for name in sorted({*depths, *consumed, *controls}):
            control = controls.get(name, {})
            paused = control.get("paused") is True
            rows[name] = {**depths.get(name, dict.fromkeys((QUEUED, RUNNING, FAILED), 0)), "paused": paused}
            if paused:
                rows[name]["pausedBy"] = control.get("pausedBy")
                rows[name]["pausedAt"] = control.get("pausedAt")
            limits = QueueLimits.of(control)
            if limits:
                rows[name] |= {"limitedBy": control.get("limitedBy"), "limitedAt": control.get("limitedAt")}
                if limits.concurrency is not None:
                    rows[name]["concurrency"] = limits.concurrency
                if limits.rate is not None:
                    rows[name]["rate"] = str(limits.rate)
        return rows

    # --- argument searches ----------------------------------------------------

    def bounded(self, job_filter: JobFilter) -> JobFilter:
        """An argument search bounded to the newest `search_window` jobs of the rest of its filter: its
        `search_from` is the oldest of them (read through the filter's index), or None when there are no more than
        that (nothing is left out). A filter without argument searches, or already bounded, is returned as it is."""
        if not job_filter.arguments or job_filter.search_from is not None:
            return job_filter
        oldest = list(
            self.coll.find(
                job_filter.unindexed,
                {"_id": 1},
                sort=[("_id", DESCENDING)],
                skip=self.search_window - 1,
                limit=1,
                **self._hint_if_indexed(job_filter.hint),
            )
        )
        return replace(job_filter, search_from=str(oldest[0]["_id"])) if oldest else job_filter

    # --- orphans and holders --------------------------------------------------

    def lease_cutoff(self) -> datetime:
        """A running job last heartbeat before this has lost its lease (the stale sweep's cutoff)."""
        return ago(self.now(), timedelta(seconds=self.store.policy.stale_after))

    def orphaned(self, doc: dict[str, Any], cutoff: datetime | None = None) -> bool:
        """Whether a job is running on a lease that ran out: its worker is gone or stuck, and the stale sweep has not
        sent it back yet."""
        updated = doc.get("updatedAt")
        if doc.get("status") != RUNNING or not isinstance(updated, datetime):
            return False
        return aware(updated) < (cutoff or self.lease_cutoff())

    def orphaned_count(self) -> int:
        """How many running jobs have lost their lease (through the index the stale sweep reads)."""
        query = {"status": RUNNING, "updatedAt": {"$lt": self.lease_cutoff()}}
        return self.coll.count_documents(query, **self._hint_if_indexed("bb_status_updated", "aggregate"))

    def holders(self) -> list[dict[str, Any]]:
        """What each worker holds, from the running jobs' `leaseOwner` (`host:pid:id` as a worker writes it): per
        owner, its running and orphaned jobs, its last heartbeat, since when it holds its oldest, and the first
        HOLDER_JOBS_SHOWN of its job ids. Running jobs are few (workers x prefetch), read through the status index."""
        cutoff = self.lease_cutoff()
        dated = {"$eq": [{"$type": "$updatedAt"}, "date"]}  # as the sweep's query: a job without one is not lost
        rows = self.coll.aggregate(
            [
                {"$match": {"status": RUNNING}},
                {"$sort": {"_id": 1}},
                {
                    "$group": {
                        "_id": "$leaseOwner",
                        "running": {"$sum": 1},
                        "orphaned": {"$sum": {"$cond": [{"$and": [dated, {"$lt": ["$updatedAt", cutoff]}]}, 1, 0]}},
                        "lastHeartbeat": {"$max": "$updatedAt"},
                        "since": {"$min": "$startedAt"},
                        "jobs": {"$push": "$_id"},
                    }
                },
            ],
            **self._hint_if_indexed("bb_status_updated", "aggregate"),
        )
        holders = []
        for row in rows:
            owner = row.pop("_id")
            host, pid = _owner_process(owner)
            jobs = row.pop("jobs")
            holders.append({"owner": owner, "host": host, "pid": pid, **row, "jobs": jobs[:HOLDER_JOBS_SHOWN]})
        return sorted(holders, key=lambda holder: str(holder["owner"]))

    # --- reading jobs ----------------------------------------------------------

    def find(self, identifier: str) -> dict[str, Any] | None:
        """The job with this job id, or else the (newest) job of this Celery task id."""
        identifier = str(identifier)
        doc = self.coll.find_one({"_id": identifier})
        if doc is None:
            # A task id sent twice (apply_async(task_id=...) again) has a job per send: the newest is the one meant.
            newest = {"sort": [("_id", DESCENDING)], **self._hint_if_indexed("bb_task_id")}
            doc = self.coll.find_one({"taskId": identifier}, **newest)
        for other in _other_id_forms(identifier) if doc is None else ():
            doc = self.coll.find_one({"_id": other})  # a hand-written job's id, as the lists show it
            if doc is not None:
                break
        return doc

    def list_jobs(
        self, job_filter: JobFilter, *, after: str | None = None, limit: int = 50, search_ms: int = SEARCH_MAX_MS
    ) -> Page:
        """A page of jobs, newest first, by key: `after` is the previous page's `next`. A search in lastError
        stops after `search_ms` and says so (`stopped_early`), keeping what it found."""
        if not 1 <= limit <= MAX_PAGE:
            raise FilterError(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
        query = self.bounded(job_filter).query()
        if after is not None:
            if not after or len(after) > 64:
                raise FilterError("after must be a job id (the `next` of the previous page)")
            ids = dict(query.get("_id", {}))
            ids["$lt"] = after
            query["_id"] = ids
        options: dict[str, Any] = {"sort": [("_id", DESCENDING)], "limit": limit + 1}
        options |= self._hint_if_indexed(job_filter.hint)
        if job_filter.error:
            options |= {"max_time_ms": search_ms, "batch_size": 10}  # small batches: what is found comes back
        jobs: list[dict[str, Any]] = []
        stopped_early = False
        cutoff = self.lease_cutoff()
        try:
            for doc in self.coll.find(query, LIST_PROJECTION, **options):
                row = list_row(doc)
                if self.orphaned(row, cutoff):
                    row["orphaned"] = True
                jobs.append(row)
        except ExecutionTimeout:
            if not job_filter.error:
                raise
            stopped_early = True
        if stopped_early:
            return Page(jobs, jobs[-1]["_id"] if jobs else after, stopped_early=True)
        more = len(jobs) > limit
        jobs = jobs[:limit]
        return Page(jobs, jobs[-1]["_id"] if more else None)

    def count(
        self,
        job_filter: JobFilter,
        action: str | None = None,
        *,
        unchanged_since: datetime | None = None,
        search_ms: int = 5 * SEARCH_MAX_MS,
    ) -> int:
        """How many jobs the filter holds (those `action` would touch, when it is given; of those, the ones not
        changed after `unchanged_since`). A search in lastError may scan: past `search_ms` it raises FilterError
        rather than keep the server busy."""
        options = self._hint_if_indexed(job_filter.hint, "aggregate")
        if job_filter.error:
            options["maxTimeMS"] = search_ms
        query = _unchanged(self._action_query(self.bounded(job_filter).query(), action), unchanged_since)
        try:
            return self.coll.count_documents(query, **options)
        except ExecutionTimeout:
            raise FilterError(
                f"counting the jobs whose last error contains {job_filter.error!r} took over {search_ms} ms: "
                "narrow the filter (status, queue, kind or time)"
            ) from None

    def failed_jobs(
        self,
        *,
        kind: str | None = None,
        schedule: str | None = None,
        older_than: timedelta | None = None,
        newer_than: timedelta | None = None,
        limit: int = 0,
    ) -> list[dict[str, Any]]:
        """Failed jobs, the most recently failed first (a failed job's updatedAt is when it failed); 0 = no limit.
        `schedule`: only those the periodic entry of that name sent."""
        query: dict[str, Any] = {"status": FAILED, **self._age(older_than, newer_than)}
        if kind is not None:
            query["kind"] = str(kind)
        if schedule is not None:
            query["schedule"] = str(schedule)
        cursor = self.coll.find(
            query,
            FAILED_FIELDS,
            sort=[("updatedAt", DESCENDING)],
            limit=max(limit, 0),
            **self._hint_if_indexed("bb_status_updated"),
        )
        return list(cursor)

    # --- actions ---------------------------------------------------------------

    def act(self, action: str, identifier: str, *, by: str) -> dict[str, Any]:
        """Apply one action to one job (by job id or Celery task id): the job afterwards.

        Raises ActionRefused when there is no such job, or it is not in a status the action applies to."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        doc = self.find(identifier)
        if doc is None:
            raise ActionRefused("not found", f"no job has the id or task id {identifier!r}")
        job_filter = {"_id": doc["_id"]}
        if not isinstance(doc["_id"], str):
            # Written by hand: no worker can run a job under it (a claim fails it as malformed), nor act on it by id.
            raise ActionRefused("conflict", f"job {reprlib.repr(doc['_id'])} has an _id that is not a string")
        if doc.get("status") not in ACTIONS[action]:
            wanted = " or ".join(ACTIONS[action])
            raise ActionRefused("conflict", f"job {doc['_id']} is {doc.get('status')}: {action} needs it {wanted}")
        if not isinstance(doc.get("actions", []), list):
            # Each action is recorded there with a $push, which MongoDB refuses on anything but an array.
            kind = bson_kind(doc["actions"])
            raise ActionRefused("conflict", f"job {doc['_id']} has an actions field that is {kind}, not an array")
        if action == "requeue" and not self._lease_expired(doc):
            raise ActionRefused("conflict", f"job {doc['_id']} is running with a live lease: its worker holds it")
        if action == RUN_NOW and not self.waiting(doc):
            raise ActionRefused(
                "conflict", f"job {doc['_id']} is due already: a worker that consumes {doc.get('queue')} takes it next"
            )
        held: dict[str, str] = {}
        done = self._apply(action, job_filter, by=by, held=held)
        if doc["_id"] in held:
            raise ActionRefused("conflict", held[doc["_id"]])
        if not done:
            raise ActionRefused("conflict", f"job {doc['_id']} changed meanwhile: look again")
        return self.find(doc["_id"]) or {"_id": doc["_id"], "deleted": True}

    def act_on_filter(
        self, action: str, job_filter: JobFilter, *, by: str, unchanged_since: datetime | None = None
    ) -> int:
        """Apply an action to every job of the filter it applies to; how many it changed. With `unchanged_since`
        (when the operator counted them), only to jobs that have not changed since: not to a job published, or
        one that came into the action's status, after the operator saw the count."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        query = self.bounded(job_filter).query()
        return self._apply(action, query, by=by, hint=job_filter.hint, unchanged_since=unchanged_since)

    def retry(
        self, identifiers: Iterable[str] | None = None, *, kind: str | None = None, by: str = "operator"
    ) -> Retried:
        """Failed jobs back to queued, due now, with all their attempts again: those with these job ids or Celery
        task ids, of this kind, or (no selector) every one. `unmatched` lists the identifiers of no failed job."""
        selector: dict[str, Any] = {"status": FAILED}
        if kind is not None:
            selector["kind"] = str(kind)
        wanted = None if identifiers is None else [str(i) for i in identifiers]
        if wanted is None:
            docs = list(self.coll.find(selector, RETRY_FIELDS))
        else:
            # By job id, then by task id: two indexed reads (an $or of both is not one everywhere).
            by_id = {"_id": {"$in": wanted}, **selector}
            by_task = {"taskId": {"$in": wanted}, **selector}
            docs = list(self.coll.find(by_id, RETRY_FIELDS, **self._hint_if_indexed("_id_")))
            seen = [doc["_id"] for doc in docs]  # compared, not hashed: a hand-written _id may be a document
            more = self.coll.find(by_task, RETRY_FIELDS, **self._hint_if_indexed("bb_task_id"))
            docs += [doc for doc in more if doc["_id"] not in seen]
        held: dict[str, str] = {}
        job_ids = self._retry_docs(docs, by=by, held=held)
        unmatched = []
        if wanted is not None:
            found = [doc["_id"] for doc in docs] + [doc.get("taskId") for doc in docs]
            unmatched = [identifier for identifier in wanted if identifier not in found]
        return Retried(job_ids, unmatched, held)

    def why_not_retried(self, identifier: str, kind: str | None = None) -> str:
        """Why a job id or task id given to retry() is in its `unmatched`."""
        doc = self.find(identifier)
        if doc is None:
            return "no such job"
        if doc.get("status") != FAILED:
            return f"it is {doc.get('status')}, not failed"
        if not isinstance(doc["_id"], str):
            return _not_a_string_id(doc)
        if kind is not None and doc.get("kind") != kind:
            return f"its kind is {doc.get('kind')}, not {kind}"
        return "it changed meanwhile: look again"

    def purge(self, statuses: Collection[str], *, older_than: timedelta | None = None) -> int:
        """Delete the jobs in these statuses last changed (for a finished job: finished) over `older_than` ago."""
        if not statuses or not set(statuses) <= set(STATUSES):
            raise ValueError(f"purge needs statuses among {', '.join(STATUSES)}, got {sorted(statuses)!r}")
        query = {"status": {"$in": sorted(statuses)}, **self._age(older_than, None)}
        return self.coll.delete_many(query, **self._hint_if_indexed("bb_status_updated")).deleted_count

    def revoke_queued(self, task_ids: Iterable[str], *, by: str) -> int:
        """The jobs of revoked Celery tasks that are still queued end failed at once, so no worker runs them later
        (a worker's own list of revoked ids lives in its memory). Running jobs are left to the workers."""
        ids = [str(task_id) for task_id in task_ids]
        if not ids:
            return 0
        now = self.now()
        result = self.coll.update_many(
            {"taskId": {"$in": ids}, "status": QUEUED},
            {
                "$set": {"status": FAILED, "lastError": REVOKED, "updatedAt": now, "finishedAt": now, "revokedAt": now},
                "$unset": RELEASED_BY_CANCEL,
                "$push": _record("revoke", by, now),
            },
            **self._hint_if_indexed("bb_task_id"),
        )
        if result.modified_count:
            logger.info("revoked %d queued job(s) of task(s) %s (%s)", result.modified_count, ", ".join(ids), by)
        return result.modified_count

    def revoke(self, task_ids: Iterable[str], *, by: str, terminate: bool = False) -> int:
        """A revoke an operator asked for (Flower's revoke button or API), recorded with their name: the queued jobs
        of these tasks end failed at once (revoke_queued), and a running one gets the record while its worker obeys
        the broadcast. How many queued jobs ended failed."""
        ids = [str(task_id) for task_id in task_ids]
        revoked = self.revoke_queued(ids, by=by)
        if ids:
            # Only the record: updatedAt is its lease, which the job's worker keeps.
            record = _record("revoke", by, self.now(), terminate=terminate or None)
            running = {"taskId": {"$in": ids}, "status": RUNNING}
            self.coll.update_many(running, {"$push": record}, **self._hint_if_indexed("bb_task_id"))
        return revoked

    # --- queue controls --------------------------------------------------------

    def pause(self, queue: str, *, by: str) -> bool:
        return self.controls.pause(_queue_name(queue), by=by, now=self.now())

    def resume(self, queue: str, *, by: str) -> bool:
        return self.controls.resume(_queue_name(queue), by=by, now=self.now())

    def paused(self) -> dict[str, dict[str, Any]]:
        return self.controls.paused()

    def set_limits(
        self, queue: str, *, concurrency: object = None, rate: object = None, clear: bool = False, by: str
    ) -> QueueLimits:
        """Set `queue`'s limits for every worker: `concurrency` (N running at once) and `rate` ("10/m"), each left as
        it is when None and removed when "none"; `clear` removes both. A value that cannot be a limit is refused with
        LimitError, and nothing changes. The limits the queue has now."""
        name = _queue_name(queue)
        if clear and (concurrency is not None or rate is not None):
            raise LimitError("clear removes every limit: give it alone")
        if not clear and concurrency is None and rate is None:
            raise LimitError("give a concurrency limit, a rate, or clear")
        wanted: dict[str, Any] = {}
        if clear or _is_none(concurrency):
            wanted["concurrency"] = None
        elif concurrency is not None:
            wanted["concurrency"] = parse_concurrency(concurrency)
        if clear or _is_none(rate):
            wanted["rate"] = None
        elif rate is not None:
            wanted["rate"] = parse_rate(rate)
        self.controls.set_limits(name, **wanted, by=by, now=self.now())
        return QueueLimits.of(self.controls.coll.find_one({"_id": name}) or {})

    # --- helpers -----------------------------------------------------------------

    def _apply(
        self,
        action: str,
        query: dict[str, Any],
        *,
        by: str,
        hint: str | None = None,
        unchanged_since: datetime | None = None,
        held: dict[str, str] | None = None,
    ) -> int:
        now = self.now()
        selected = _unchanged(self._action_query(query, action), unchanged_since)
        options = self._hint_if_indexed(hint, "update") if hint else {}
        if action == "retry":
            docs = self.coll.find(selected, RETRY_FIELDS, **(self._hint_if_indexed(hint) if hint else {}))
            return len(self._retry_docs(docs, by=by, held={} if held is None else held))
        if action == "cancel":
            update = {
                "$set": {
                    "status": FAILED,
                    "lastError": f"cancelled by {by}"[:MAX_ERROR_LENGTH],
                    "updatedAt": now,
                    "finishedAt": now,
                },
                "$unset": RELEASED_BY_CANCEL,  # a cancelled job gives back its unique key (not a beat slot's)
                "$push": _record("cancel", by, now),
            }
            return self.coll.update_many(selected, update, **options).modified_count
        if action == RUN_NOW:
            # Due now, behind the jobs due before it: the change stream's update of runAfter wakes the workers.
            update = {"$set": {"runAfter": now, "updatedAt": now}, "$push": _record(RUN_NOW, by, now)}
            return self.coll.update_many(selected, update, **options).modified_count
        if action == "requeue":
            reason = f"requeued by {by}: its lease had expired"[:MAX_ERROR_LENGTH]
            update = {
                "$set": {"status": QUEUED, "runAfter": now, "updatedAt": now, "lastError": reason},
                "$unset": HOLDS_RELEASED,
                "$push": _record("requeue", by, now),
            }
            return self.coll.update_many(selected, update, **options).modified_count
        # delete: nothing is left to record it on, so the log says who deleted what
        deleted = self.coll.delete_many(selected, **options).deleted_count
        logger.info("%s deleted %d finished job(s) matching %s", by, deleted, selected)
        return deleted

    def _action_query(self, query: dict[str, Any], action: str | None) -> dict[str, Any]:
        """The query narrowed to the jobs `action` applies to (fenced on their status)."""
        if action is None:
            return query
        statuses = ACTIONS[action]
        wanted = query.get("status")
        if isinstance(wanted, str):
            allowed = [wanted] if wanted in statuses else []
        else:
            allowed = [status for status in statuses if wanted is None or status in wanted.get("$in", statuses)]
        narrowed = {**query, "status": allowed[0] if len(allowed) == 1 else {"$in": allowed}}
        if action == "requeue":
            narrowed["updatedAt"] = {"$lt": self.now() - timedelta(seconds=self.store.policy.stale_after)}
        if action == RUN_NOW:
            narrowed["runAfter"] = {"$gt": self.now()}
        return narrowed

    def _retry_docs(self, docs: Iterable[dict[str, Any]], *, by: str, held: dict[str, str]) -> list[str]:
        """Each failed job back to queued, fenced on its status. A revoked job gets a new Celery task id: every
        worker that saw the revoke keeps the old id in memory and would discard it unrun. A job whose unique key
        was given back takes it again in the same write; where another job holds it now, the unique index refuses
        the write and the job stays failed, the reason in `held`."""
        now = self.now()
        retried: list[str] = []
        batch: list[tuple[str, UpdateOne]] = []
        renamed: dict[str, tuple[str, str]] = {}  # job id -> (its revoked task id, its new one)
        for doc in docs:
            if not isinstance(doc["_id"], str):
                # A hand-written _id no worker can run a job under (a claim fails it as malformed): it stays failed.
                held[str(doc.get("taskId") or doc["_id"])] = f"job {doc['_id']} stays failed: {_not_a_string_id(doc)}"
                continue
            changes: dict[str, Any] = {"status": QUEUED, "attempts": 0, "runAfter": now, "updatedAt": now}
            record = _record("retry", by, now)
            headers = (doc.get("payload") or {}).get("headers") if isinstance(doc.get("payload"), dict) else None
            if isinstance(headers, dict) and headers.get("eta"):
                changes["payload.headers.eta"] = None  # due now: a worker would otherwise hold it until the old ETA
            if doc.get("revokedAt") or str(doc.get("lastError", "")).startswith("revoked"):
                new_id = str(uuid.uuid4())
                changes |= self._renamed(doc["_id"], new_id)
                record = _record("retry", by, now, previousTaskId=doc.get("taskId"), taskId=new_id)
                if doc.get("taskId"):
                    renamed[doc["_id"]] = (doc["taskId"], new_id)
            changes |= _key_taken_again(doc)
            # lastError stays: it says why the job needed a retry until its next attempt settles.
            update = {"$set": changes, "$unset": {"finishedAt": "", "revokedAt": ""}, "$push": record}
            batch.append((doc["_id"], UpdateOne({"_id": doc["_id"], "status": FAILED}, update)))
            if len(batch) >= 500:
                retried += self._write_batch(batch, held)
                batch = []
        if batch:
            retried += self._write_batch(batch, held)
        self._keep_revoked([renamed[job_id] for job_id in retried if job_id in renamed], by=by, now=now)
        return retried

    def _keep_revoked(self, renamed: list[tuple[str, str]], *, by: str, now: datetime) -> None:
        """A revoked task retried under a new id: its old id keeps reading REVOKED for the result backend (Celery's
        states are final), saying which id runs now. With no job of that id left, a caller's get() would wait for
        ever. Kept as the result backend keeps results of tasks without a job, for DEFAULT_RETENTION."""
        if not renamed:
            return
        expires_at = now + timedelta(seconds=DEFAULT_RETENTION)
        writes = [
            UpdateOne(
                {"_id": f"task:{old_id}"},
                {
                    "$set": {
                        "kind": "task",
                        "state": "REVOKED",
                        "lastError": f"revoked; retried by {by} as task {new_id}"[:MAX_ERROR_LENGTH],
                        "dateDone": now,
                        "expiresAt": expires_at,
                    },
                    "$unset": {"result": "", "resultFormat": "", "traceback": ""},
                },
                upsert=True,
            )
            for old_id, new_id in renamed
        ]
        self.coll.database[RESULTS_COLLECTION].bulk_write(writes, ordered=False)

    def _write_batch(self, batch: list[tuple[str, UpdateOne]], held: dict[str, str]) -> list[str]:
        ids = [job_id for job_id, _ in batch]
        try:
            modified = self.coll.bulk_write([op for _, op in batch], ordered=False).modified_count
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if not capabilities(self.coll.database).only_unique_refusals(errors):
                raise
            for error in errors:
                job_id = ids[error["index"]]
                held[job_id] = self._why_held(job_id)
            modified = -1  # which of the others landed: read below
        if modified == len(batch):
            return ids
        # Some changed meanwhile: the ones that are now queued by this write are ours.
        return [doc["_id"] for doc in self.coll.find({"_id": {"$in": ids}, "status": QUEUED}, {"_id": 1})]

    def _why_held(self, job_id: str) -> str:
        """Why a failed job's retry could not take its unique key again: which job holds it now."""
        unique = (self.coll.find_one({"_id": job_id}, {"unique": 1}) or {}).get("unique") or {}
        key, mode = unique.get("key"), unique.get("mode")
        holder = self.coll.find_one({HOLD_FIELDS[mode]: key}, {"taskId": 1, "status": 1}) if mode in MODES else None
        by = (
            "another job"
            if holder is None
            else f"job {holder['_id']} (task {holder.get('taskId')}, {holder.get('status')})"
        )
        return (
            f"job {job_id} stays failed: its unique key {key!r} is held by {by} now; retry it once that job has ended"
        )

    def _renamed(self, job_id: str, task_id: str) -> dict[str, Any]:
        """The fields that give a job's stored message a new Celery task id."""
        payload = (self.coll.find_one({"_id": job_id}, {"payload": 1}) or {}).get("payload")
        changes: dict[str, Any] = {"taskId": task_id}
        if not isinstance(payload, dict):
            return changes
        if "raw" in payload:
            try:
                message = json.loads(payload["raw"])
                message["headers"]["id"] = task_id
                message.setdefault("properties", {})["correlation_id"] = task_id
                changes["payload.raw"] = json.dumps(message)
            except (ValueError, TypeError, KeyError, RecursionError):  # a hand edit: the job keeps its message
                pass
            return changes
        if isinstance(payload.get("headers"), dict):
            changes["payload.headers.id"] = task_id
        if isinstance(payload.get("properties"), dict):
            changes["payload.properties.correlation_id"] = task_id
        return changes

    def waiting(self, doc: dict[str, Any]) -> bool:
        """Whether a job is queued and not due yet (its runAfter is still to come): what run-now applies to."""
        run_after = doc.get("runAfter")
        return doc.get("status") == QUEUED and isinstance(run_after, datetime) and aware(run_after) > self.now()

    def applicable(self, doc: dict[str, Any]) -> list[str]:
        """The actions that apply to a job as it is now (run-now only while it waits for its runAfter)."""
        return [
            name
            for name, statuses in ACTIONS.items()
            if doc.get("status") in statuses and (name != RUN_NOW or self.waiting(doc))
        ]

    def _lease_expired(self, doc: dict[str, Any]) -> bool:
        updated = doc.get("updatedAt")
        cutoff = self.now() - timedelta(seconds=self.store.policy.stale_after)
        return isinstance(updated, datetime) and aware(updated) < cutoff

    def _hint_if_indexed(self, index: str, command: str = "find") -> dict[str, Any]:
        # An operator may look at a database no worker has indexed yet, where a hint would be an error. The _id index
        # is always there (a missing collection ignores the hint), and hinted: a planner may otherwise scan and sort
        # the whole collection for a newest-first read with nothing else in its filter (the Python stand-in does).
        # No hint at all where the server refuses one on `command` (server.py).
        hint = self.store.server.hint(index, command)
        if not hint or index == "_id_":
            return hint
        return hint if any(ix["name"] == index for ix in self.coll.list_indexes()) else {}

    def _age(self, older_than: timedelta | None, newer_than: timedelta | None) -> dict[str, Any]:
        # Ages are measured on the store's clock (the server's in a worker or the CLI), like due times and leases.
        now = self.now()
        window: dict[str, datetime] = {}
        if older_than is not None:
            window["$lt"] = ago(now, older_than)
        if newer_than is not None:
            window["$gte"] = ago(now, newer_than)
        return {"updatedAt": window} if window else {}


def _other_id_forms(identifier: str) -> list[Any]:
    """The _id values other than a string that `identifier` may stand for: a whole number, an ObjectId."""
    forms: list[Any] = []
    if re.fullmatch(r"-?[0-9]{1,18}", identifier):
        forms.append(int(identifier))
    if ObjectId.is_valid(identifier) and len(identifier) == 24:
        forms.append(ObjectId(identifier))
    return forms


def _not_a_string_id(doc: dict[str, Any]) -> str:
    """Why a job whose _id was written by hand, not a string, is not retried: no worker can run a job under it (a
    claim fails it as malformed)."""
    return f"its _id is {bson_kind(doc['_id'])}, not a string: no worker can run it"


def _key_taken_again(doc: dict[str, Any]) -> dict[str, Any]:
    """The `$set` that makes a retried job hold its unique key again, when it gave the key back (a beat slot's is
    never given back; a key written by hand that is not one is left alone)."""
    unique = doc.get("unique")
    if not isinstance(unique, dict) or unique.get("mode") not in MODES or unique["mode"] == FOREVER_MODE:
        return {}
    field_name = HOLD_FIELDS[unique["mode"]]
    if field_name in doc or not isinstance(unique.get("key"), str) or not unique["key"]:
        return {}
    return {field_name: unique["key"]}


def _owner_process(owner: Any) -> tuple[str | None, int | None]:
    """The host and process id of a lease owner as a worker writes it (`host:pid:id`); (None, None) for any other
    value (none, or written by hand)."""
    if not isinstance(owner, str):
        return None, None
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if not host or not (pid.isascii() and pid.isdigit() and len(pid) <= 10):
        return None, None
    return host, int(pid)


def _record(action: str, by: str, at: datetime, **details: Any) -> dict[str, Any]:
    """The $push that records an operator's action on a job, keeping the last ACTIONS_KEPT."""
    entry = {"action": action, "by": by, "at": at, **{k: v for k, v in details.items() if v is not None}}
    return {"actions": {"$each": [entry], "$slice": -ACTIONS_KEPT}}


def _unchanged(query: dict[str, Any], since: datetime | None) -> dict[str, Any]:
    """The query narrowed to jobs last changed at or before `since` (every write to a job sets its updatedAt)."""
    if since is None:
        return query
    return {**query, "updatedAt": {**query.get("updatedAt", {}), "$lte": since}}


def _is_none(value: object) -> bool:
    """Whether a limit given as text says to remove it."""
    return isinstance(value, str) and value.strip().lower() == "none"


def _queue_name(queue: str) -> str:
    queue = str(queue).strip()
    if not queue or len(queue) > MAX_FILTER_LENGTH:
        raise FilterError(f"a queue name must be 1 to {MAX_FILTER_LENGTH} characters")
    return queue


def revoked_task_ids(message: dict[str, Any], body: Any) -> list[str]:
    """The task ids of a Celery `revoke` control broadcast (any other message: none). Only JSON is read."""
    from kombu.exceptions import ContentDisallowed, DecodeError
    from kombu.serialization import loads

    if message.get("content-type") != "application/json" or body is None:
        return []
    try:
        decoded = loads(
            body, "application/json", message.get("content-encoding") or "utf-8", accept={"application/json"}
        )
    except (ContentDisallowed, DecodeError, ValueError, TypeError):
        return []
    if not isinstance(decoded, dict) or decoded.get("method") != "revoke":
        return []
    arguments = decoded.get("arguments")
    task_ids = arguments.get("task_id") if isinstance(arguments, dict) else None
    if isinstance(task_ids, str):
        return [task_ids]
    if isinstance(task_ids, list):
        return [str(task_id) for task_id in task_ids if isinstance(task_id, str)]
    return []
