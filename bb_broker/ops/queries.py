"""The operator's reads of `jobs`: counts, queue depths, lists (argument searches, orphans), look-ups, holders."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from bson import ObjectId
from pymongo import DESCENDING
from pymongo.errors import ExecutionTimeout

from bb_broker.clock import aware, reading
from bb_broker.jobs.checkpoints import PROGRESS_PROJECTION, shown_progress
from bb_broker.jobs.document import (
    MAX_KIND_LENGTH,
    MAX_RENAMES,
    RESULTS_COLLECTION,
    RETRIED_AS,
    of_task,
    task_id_of,
)
from bb_broker.jobs.indexes import hint_if_indexed
from bb_broker.jobs.lifecycle import BREAKDOWNS, FAILED, QUEUED, RUNNING, STATUSES
from bb_broker.jobs.queues import QueueControls, QueueLimits
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import ARGUMENT_SEARCH_WINDOW, FilterError, JobFilter, ago
from bb_broker.ops.summaries import NOT_A_NAME, group_name

#: The most rows one page of a list holds.
MAX_PAGE = 200
#: How long a search in lastError may scan before it answers with what it found.
SEARCH_MAX_MS = 2000
#: The job ids each holder (a worker's lease owner) lists; its count says how many it holds in all.
HOLDER_JOBS_SHOWN = 10
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
    projection["progress"] = PROGRESS_PROJECTION  # its counts, numbers only: list_row makes the bar
    return projection


LIST_PROJECTION = _list_projection()


def _bounded_name(field: str) -> dict[str, Any]:
    """A job's queue or kind as a breakdown groups it, bounded on the server (a hand-edited kind of 1 MB was sent and
    printed whole, a number printed as a name): a text cut one past MAX_KIND_LENGTH, which group_name then folds into
    NOT_A_NAME as the charts do; none for none; NOT_A_NAME for any other type."""
    value, kind = f"${field}", {"$type": f"${field}"}
    branches = [
        {"case": {"$eq": [kind, "string"]}, "then": {"$substrCP": [value, 0, MAX_KIND_LENGTH + 1]}},
        {"case": {"$in": [kind, ["missing", "null"]]}, "then": None},
    ]
    return {"$switch": {"branches": branches, "default": NOT_A_NAME}}


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
    if (bar := shown_progress(row.pop("progress", None), row.get("status"))) is not None:
        row["progress"] = bar
    return row


@dataclass
class Page:
    """One page of a list, newest first: `next` is the key of the following page (None on the last)."""

    jobs: list[dict[str, Any]]
    next: str | None
    stopped_early: bool = False


class Queries:
    """An operator's reads of one jobs collection and its queue controls."""

    #: How many of the newest jobs an argument search looks among (see bounded).
    search_window = ARGUMENT_SEARCH_WINDOW

    def __init__(self, store: JobStore, controls: QueueControls | None = None) -> None:
        self.store = store
        self.coll = store.coll
        self.controls = controls or QueueControls(store.coll.database)

    def now(self) -> datetime:
        """The server's time, as the store reads it; a server that cannot be reached raises here (ServerClock.reading)
        rather than a second time, after a second wait, at the query that follows."""
        return reading(self.store.now)

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
                {"$group": {"_id": {"name": _bounded_name(by), "status": "$status"}, "n": {"$sum": 1}}},
            ],
            **hint_if_indexed(self.store, "bb_status_updated", "aggregate"),
        ):
            name = group_name(row["_id"].get("name"))
            counts = rows.setdefault("" if name is None else name, dict.fromkeys(STATUSES, 0))
            counts[row["_id"]["status"]] += row["n"]
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
            **hint_if_indexed(self.store, "bb_claim", "aggregate"),
        ):
            queue = row["_id"].get("queue")
            if isinstance(queue, str):
                depths.setdefault(queue, dict.fromkeys(shown, 0))[row["_id"]["status"]] = row["n"]
        return depths

    def queues(self, consumed: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
        """Every queue holding queued, running or failed jobs, every queue named in `consumed` (what workers
        consume) and every paused or limited queue: its depths, whether it is paused and its limits (`concurrency`,
        beside the `running` it counts, `rate`, as "10/m", and `fair` when it is), sorted by name."""
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
                if limits.fair:
                    rows[name]["fair"] = True
        return rows

    # --- argument searches ----------------------------------------------------

    def bounded(self, job_filter: JobFilter) -> JobFilter:
        """An argument search bounded to the newest `search_window` jobs of the rest of its filter: its
        `search_from` is the oldest of them (read through the filter's index), or None when there are no more than
        that (nothing is left out). A filter without argument searches is returned as it is, and one already bounded
        (a `searchFrom` a list or a count answered, sent back) while its window holds no more than twice
        `search_window` jobs: one from further back (a client's own) would have the search, which no index serves,
        read as far back as it says."""
        if not job_filter.arguments:
            return job_filter
        if job_filter.search_from is not None:
            reach = 2 * self.search_window
            within = {"$and": [job_filter.unindexed, {"_id": {"$gte": job_filter.search_from}}]}
            hint = hint_if_indexed(self.store, job_filter.hint)
            if self.coll.count_documents(within, limit=reach + 1, **hint) <= reach:
                return job_filter
            job_filter = replace(job_filter, search_from=None)
        oldest = list(
            self.coll.find(
                job_filter.unindexed,
                {"_id": 1},
                sort=[("_id", DESCENDING)],
                skip=self.search_window - 1,
                limit=1,
                **hint_if_indexed(self.store, job_filter.hint),
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
        return self.coll.count_documents(query, **hint_if_indexed(self.store, "bb_status_updated", "aggregate"))

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
            **hint_if_indexed(self.store, "bb_status_updated", "aggregate"),
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
            newest = {"sort": [("_id", DESCENDING)], **hint_if_indexed(self.store, "bb_task_id")}
            doc = self.coll.find_one({"taskId": of_task(identifier)}, **newest)
        for other in _other_id_forms(identifier) if doc is None else ():
            doc = self.coll.find_one({"_id": other})  # a hand-written job's id, as the lists show it
            if doc is not None:
                break
        return doc if doc is not None else self._retried_as(identifier)

    def _retried_as(self, task_id: str) -> dict[str, Any] | None:
        """The job of a revoked task an operator retried under a new task id, by an id it had before (its
        `task:<old id>` in bb_results names the new one, RETRIED_AS; again for a step revoked and retried again)."""
        newest = {"sort": [("_id", DESCENDING)], **hint_if_indexed(self.store, "bb_task_id")}
        for _ in range(MAX_RENAMES):
            kept = self.coll.database[RESULTS_COLLECTION].find_one({"_id": f"task:{task_id}"}, {RETRIED_AS: 1})
            new_id = task_id_of((kept or {}).get(RETRIED_AS))
            if new_id is None or new_id == task_id:
                return None
            if (doc := self.coll.find_one({"taskId": of_task(new_id)}, **newest)) is not None:
                return doc
            task_id = new_id
        return None

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
        options |= hint_if_indexed(self.store, job_filter.hint)
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
            **hint_if_indexed(self.store, "bb_status_updated"),
        )
        return list(cursor)

    # --- queue controls and waits ---------------------------------------------------

    def paused(self) -> dict[str, dict[str, Any]]:
        return self.controls.paused()

    def waiting(self, doc: dict[str, Any]) -> bool:
        """Whether a job is queued and not due yet (its runAfter is still to come): what run-now applies to."""
        run_after = doc.get("runAfter")
        return doc.get("status") == QUEUED and isinstance(run_after, datetime) and aware(run_after) > self.now()

    def _age(self, older_than: timedelta | None, newer_than: timedelta | None) -> dict[str, Any]:
        # Ages are measured on the store's clock (the server's in a worker or the CLI), like due times and leases.
        now = self.now()
        window: dict[str, datetime] = {}
        if older_than is not None:
            window["$lt"] = ago(now, older_than)
        if newer_than is not None:
            window["$gte"] = ago(now, newer_than)
        return {"updatedAt": window} if window else {}


def no_job_has(identifier: str) -> str:
    """What an operator is told of an `identifier` no job has (by find). The lists show an _id whose bytes are not
    UTF-8 with U+FFFD in their place: no filter holds those bytes, so such an id is never found, and that is said."""
    said = f"no job has the id or task id {identifier!r}"
    if "\ufffd" in identifier:
        said += " (an id shown with U+FFFD holds bytes that are not UTF-8, which no look-up can hold: give its task id)"
    return said


def _other_id_forms(identifier: str) -> list[Any]:
    """The _id values other than a string that `identifier` may stand for: a whole number, an ObjectId."""
    forms: list[Any] = []
    if re.fullmatch(r"-?[0-9]{1,18}", identifier):
        forms.append(int(identifier))
    if ObjectId.is_valid(identifier) and len(identifier) == 24:
        forms.append(ObjectId(identifier))
    return forms


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
