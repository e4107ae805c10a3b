"""What happened over time, from the job documents: attempts finished per interval by outcome, and the wait and run
times of the jobs that finished, p50 and p95, per queue or kind (the Jobs tab's charts, `bb-broker stats`).

Two aggregations per answer, run at once, bounded by its window through the `bb_status_updated` index: every write
to a job sets its `updatedAt`, so a job with an attempt that finished in the window was last written in it or after. The
server groups the finished jobs by interval and sends each group's count and wait and run times (never a payload or
result), and counts the retried attempts of each interval from the history; the percentiles are computed here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from bb_broker.clock import aware
from bb_broker.jobs.lifecycle import BREAKDOWNS, FAILED, STATUSES, SUCCEEDED
from bb_broker.ops.operations import FilterError, JobFilter, Operations

#: The longest window charted; and the step of the intervals for a window up to each length.
LONGEST_WINDOW = timedelta(days=31)
STEPS = ((timedelta(hours=1), timedelta(minutes=1)), (timedelta(days=1), timedelta(minutes=15)))
LONG_STEP = timedelta(hours=1)
#: An attempt that ended in the history with one of these outcomes and was not its job's last: a retried attempt.
UNSUCCESSFUL = ("failed", "retry", "lost")
#: What the series of each group hold, one value per interval.
SERIES = ("succeeded", "failed", "retried", "waitP50", "waitP95", "runP50", "runP95")
#: The most jobs of one interval, status and group whose timings the server sends (about 100 bytes each).
TIMED_PER_GROUP = 5_000
#: The group name when the numbers are not grouped.
ALL = "all"


@dataclass(frozen=True)
class Window:
    """The intervals of a chart: `count` steps of `step`, the last one holding `until`."""

    start: datetime
    step: timedelta
    count: int

    @classmethod
    def ending(cls, until: datetime, length: timedelta) -> Window:
        if not timedelta(minutes=1) <= length <= LONGEST_WINDOW:
            raise FilterError(f"a chart's window must be from 1 minute to {LONGEST_WINDOW.days} days")
        step = next((step for longest, step in STEPS if length <= longest), LONG_STEP)
        count = math.ceil(length / step)
        seconds = step.total_seconds()
        last = datetime.fromtimestamp(math.floor(until.timestamp() / seconds) * seconds, UTC)
        return cls(last - step * (count - 1), step, count)

    @property
    def end(self) -> datetime:
        return self.start + self.step * self.count

    def index(self, moment: Any) -> int | None:
        """The interval `moment` falls in, or None outside the window (or not a date)."""
        if not isinstance(moment, datetime):
            return None
        offset = (aware(moment) - self.start) / self.step
        return int(offset) if 0 <= offset < self.count else None


def percentile(values: list[float], fraction: float) -> float | None:
    """The nearest-rank percentile: the smallest value with at least `fraction` of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


def job_stats(
    operations: Operations, job_filter: JobFilter, length: timedelta, by: str | None = None
) -> dict[str, Any]:
    """The numbers of the charts for the window of `length` ending now, of the jobs of `job_filter`, per queue or
    kind with `by`: per interval, attempts succeeded, jobs failed for good, attempts retried (failed, lost or
    retried by the task, with another attempt after them), and of the jobs that finished there the wait (runAfter
    to start of their last attempt) and run time (its start to finish), p50 and p95 in seconds (None: no job)."""
    if by is not None and by not in BREAKDOWNS:
        raise FilterError(f"by must be one of {', '.join(BREAKDOWNS)}, not {by!r}")
    window = Window.ending(operations.now(), length)
    query = operations.bounded(job_filter).query()
    if not isinstance(query.get("status"), str):
        query["status"] = {"$in": list(STATUSES)}  # the index's first field, so the window below is a range of it
    query["updatedAt"] = {**query.get("updatedAt", {}), "$gte": window.start}
    hint = operations._hint_if_indexed("bb_status_updated")
    groups: dict[str, dict[str, list[Any]]] = {}

    def group_of(value: Any) -> dict[str, list[Any]]:
        name = ALL if by is None else str(value if value is not None else "")
        if name not in groups:
            groups[name] = {"succeeded": [0] * window.count, "failed": [0] * window.count,
                            "retried": [0] * window.count, "waits": [[] for _ in range(window.count)],
                            "runs": [[] for _ in range(window.count)]}  # fmt: skip
        return groups[name]

    # The server groups the jobs by interval (and queue or kind) and sends one document per group, with each job's
    # wait and run time worked out there in milliseconds: no document per job, no date decoded here. The retried
    # attempts are counted meanwhile, on a thread of their own, so that the server runs both aggregations at once
    # (pymongo's client is shared between threads; docs/explanation/performance.md has the figures). Only this
    # thread writes `groups`.
    finished = _finished_query(query)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bb-stats") as retried_reader:
        retried = retried_reader.submit(lambda: list(operations.coll.aggregate(_retried_pipeline(query, window, by),
                                                                               **hint)))  # fmt: skip
        buckets: Iterable[dict[str, Any]] = (
            operations.coll.aggregate(_finished_pipeline(finished, window, by), **hint) if finished else []
        )
        for bucket in buckets:
            at = window.index(bucket["_id"].get("at"))
            status = bucket["_id"].get("status")
            if at is None or status not in (SUCCEEDED, FAILED):
                continue
            group = group_of(bucket["_id"].get("group"))
            group[status][at] += bucket["jobs"]
            group["waits"][at] += _seconds(bucket["waits"])
            group["runs"][at] += _seconds(bucket["runs"])
        for bucket in retried.result():
            at = window.index(bucket["_id"].get("at"))
            if at is not None and bucket["attempts"]:
                group_of(bucket["_id"].get("group"))["retried"][at] += bucket["attempts"]
    series = {name: _series(group) for name, group in sorted(groups.items())}
    return {
        "from": window.start.isoformat(),
        "until": window.end.isoformat(),
        "step": window.step.total_seconds(),
        "by": by,
        "filter": job_filter.as_dict(),
        "intervals": [(window.start + window.step * n).isoformat() for n in range(window.count)],
        "series": series,
    }


def _interval(moment: str, window: Window) -> dict[str, Any]:
    """The start of the interval of `window` a date falls in, on the server. Intervals are whole minutes counted from
    2000-01-01, $dateTrunc's reference, which whole minutes, quarter hours and hours from the epoch are too."""
    minutes = int(window.step.total_seconds() // 60)
    return {"$dateTrunc": {"date": moment, "unit": "minute", "binSize": minutes}}


def _finished_query(query: dict[str, Any]) -> dict[str, Any] | None:
    """`query` narrowed to the jobs that have finished for good, or None when it asks for jobs that have not: the
    index's first field is the status, so a status fewer is a range of the index the server does not read."""
    status = query.get("status")
    if isinstance(status, str):
        return query if status in (SUCCEEDED, FAILED) else None
    return {**query, "status": {"$in": [SUCCEEDED, FAILED]}}


def _milliseconds(start: str, end: str) -> dict[str, Any]:
    """From one date field of the job to another, in milliseconds, on the server; None (not an error that would fail
    the whole chart) when either is missing or is not a date, as in a hand-edited document."""
    both_dates = {"$and": [{"$eq": [{"$type": start}, "date"]}, {"$eq": [{"$type": end}, "date"]}]}
    return {"$cond": [both_dates, {"$dateDiff": {"startDate": start, "endDate": end, "unit": "millisecond"}}, None]}


def _seconds(milliseconds: list[Any]) -> list[float]:
    """The times the server sent, in seconds, a missing one left out: none is negative, though a publisher's clock
    that runs ahead of the server's can write a runAfter later than the claim that starts the job."""
    return [max(ms / 1000, 0.0) for ms in milliseconds if isinstance(ms, int | float) and not isinstance(ms, bool)]


def _finished_pipeline(query: dict[str, Any], window: Window, by: str | None) -> list[dict[str, Any]]:
    """The jobs that finished in `window`, per interval, status and group: how many, and their wait (runAfter to
    the start of their last attempt) and run time (that start to their finish)."""
    in_window = {"$gte": window.start, "$lt": window.end}  # dates only: a finishedAt edited into text is left out
    # A group's document must stay far below the server's 16 MB: the percentiles of a busier interval are those of
    # its first TIMED_PER_GROUP jobs in the index's order (by updatedAt); the counts stay exact.
    return [
        {"$match": query},
        {"$match": {"finishedAt": in_window}},
        {"$group": {
            "_id": {"at": _interval("$finishedAt", window), "status": "$status",
                    "group": None if by is None else f"${by}"},
            "jobs": {"$sum": 1},
            "waits": {"$firstN": {"n": TIMED_PER_GROUP, "input": _milliseconds("$runAfter", "$startedAt")}},
            "runs": {"$firstN": {"n": TIMED_PER_GROUP, "input": _milliseconds("$startedAt", "$finishedAt")}},
        }},
    ]  # fmt: skip


def _retried_pipeline(query: dict[str, Any], window: Window, by: str | None) -> list[dict[str, Any]]:
    """The attempts that ended unsuccessfully in `window` and were not their failed job's last, per interval and
    group."""
    entry_in_window = {"history.outcome": {"$in": list(UNSUCCESSFUL)},
                       "history.finishedAt": {"$gte": window.start, "$lt": window.end}}  # fmt: skip
    last_of_failed_job = {"$and": [{"$eq": ["$status", FAILED]}, {"$eq": ["$history.n", "$attempts"]}]}
    return [
        {"$match": query},
        {"$match": {"history.outcome": {"$in": list(UNSUCCESSFUL)}}},
        {"$unwind": "$history"},
        {"$match": entry_in_window},
        {"$group": {
            "_id": {"at": _interval("$history.finishedAt", window), "group": None if by is None else f"${by}"},
            "attempts": {"$sum": {"$cond": [last_of_failed_job, 0, 1]}},
        }},
    ]  # fmt: skip


def _series(group: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {
        "succeeded": group["succeeded"],
        "failed": group["failed"],
        "retried": group["retried"],
        "waitP50": [percentile(values, 0.5) for values in group["waits"]],
        "waitP95": [percentile(values, 0.95) for values in group["waits"]],
        "runP50": [percentile(values, 0.5) for values in group["runs"]],
        "runP95": [percentile(values, 0.95) for values in group["runs"]],
    }
