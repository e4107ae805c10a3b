"""Which jobs an operator means: a filter from request or command-line strings (`JobFilter`), checked where it is read,
and the query and index it reads through."""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from ulid import ULID

from bb_broker.jobs import lifecycle
from bb_broker.jobs.lifecycle import RUNNING, STATUSES

#: The longest filter value taken (queue and kind names, search text).
MAX_FILTER_LENGTH = 200

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
    #: The oldest job id an argument search looks at (Queries.bounded sets it): the newest of the rest of the filter.
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


def queue_name(queue: str) -> str:
    """A queue name as an operator gives it, trimmed; FilterError when it is empty or too long."""
    queue = str(queue).strip()
    if not queue or len(queue) > MAX_FILTER_LENGTH:
        raise FilterError(f"a queue name must be 1 to {MAX_FILTER_LENGTH} characters")
    return queue
