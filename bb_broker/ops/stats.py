"""What happened over time, from the job documents: attempts finished per interval by outcome, and the wait and run
times of the jobs that finished, p50 and p95, per queue or kind (the Jobs tab's charts, `bb-broker stats`).

One aggregation per answer, bounded by its window through the `bb_status_updated` index: every write to a job sets
its `updatedAt`, so a job with an attempt that finished in the window was last written in it or after. The server
sends each such job's timings (never its payload or result); the intervals and percentiles are counted here.
"""

from __future__ import annotations

import math
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
    projection = {
        "queue": 1, "kind": 1, "status": 1, "attempts": 1, "runAfter": 1, "startedAt": 1, "finishedAt": 1,
        "history.n": 1, "history.outcome": 1, "history.finishedAt": 1,
    }  # fmt: skip
    cursor = operations.coll.aggregate(
        [{"$match": query}, {"$project": projection}], **operations._hint_if_indexed("bb_status_updated")
    )
    groups: dict[str, dict[str, list[Any]]] = {}
    for doc in cursor:
        name = ALL if by is None else str(doc.get(by) if doc.get(by) is not None else "")
        group = groups.get(name)
        if group is None:
            group = groups[name] = {"succeeded": [0] * window.count, "failed": [0] * window.count,
                                    "retried": [0] * window.count, "waits": [[] for _ in range(window.count)],
                                    "runs": [[] for _ in range(window.count)]}  # fmt: skip
        _count_attempts(doc, window, group)
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


def _count_attempts(doc: dict[str, Any], window: Window, group: dict[str, list[Any]]) -> None:
    status, attempts = doc.get("status"), doc.get("attempts")
    history = doc.get("history")
    for entry in history if isinstance(history, list) else []:
        if not isinstance(entry, dict) or entry.get("outcome") not in UNSUCCESSFUL:
            continue
        last_of_failed_job = status == FAILED and entry.get("n") == attempts
        at = window.index(entry.get("finishedAt"))
        if at is not None and not last_of_failed_job:
            group["retried"][at] += 1
    at = window.index(doc.get("finishedAt"))
    if at is None or status not in (SUCCEEDED, FAILED):
        return
    group[status][at] += 1
    started, due, finished = doc.get("startedAt"), doc.get("runAfter"), doc["finishedAt"]
    if isinstance(started, datetime):
        if isinstance(due, datetime):
            group["waits"][at].append(max((aware(started) - aware(due)).total_seconds(), 0.0))
        group["runs"][at].append(max((aware(finished) - aware(started)).total_seconds(), 0.0))


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
