"""What happened over time, from the job documents: attempts finished per interval by outcome, and the wait and run
times of the jobs that finished, p50 and p95, per queue or kind (the Jobs tab's charts, `bb-broker stats`).

Two aggregations per answer, run at once, bounded by its window through the `bb_status_updated` index: every write
to a job sets its `updatedAt`, so a job with an attempt that finished in the window was last written in it or after. The
server groups the finished jobs by interval and sends each group's count and wait and run times (never a payload or
result), and counts the retried attempts of each interval from the history; the percentiles are computed here.

A day's or a week's chart reads the jobs of its last minutes only: the quarter hours before are read from their
summaries (bb_broker.ops.summaries), which one process of the fleet keeps written ahead of the charts
(SummarizingAhead: a worker's or Flower's thread), or else the first chart that needs one writes, with the same two
aggregations. While such a thread's pass is under way (the first after an upgrade summarizes a week), the Jobs tab's
charts summarize at most one quarter hour themselves and draw the rest as gaps until the pass has written them: a
request reads the jobs of its last minutes and of one quarter hour, not the week's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from bson.int64 import Int64
from pymongo.errors import ExecutionTimeout, PyMongoError

from bb_broker.clock import aware
from bb_broker.forks import reset_in_child
from bb_broker.jobs.indexes import hint_if_indexed
from bb_broker.jobs.lifecycle import BREAKDOWNS, FAILED, STATUSES, SUCCEEDED
from bb_broker.ops.filters import FilterError, JobFilter
from bb_broker.ops.operations import Operations
from bb_broker.ops.summaries import SUMMARY_LAG, SUMMARY_STEP, TURN, Summaries, group_name
from bb_broker.threads import start_supervised

logger = logging.getLogger(__name__)

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
#: The types a time in milliseconds comes as ($dateDiff gives a 64-bit integer); a bool, an int subclass, is none.
TIME_TYPES = frozenset({int, Int64, float})
#: The group name when the numbers are not grouped.
ALL = "all"
#: How far back the Jobs tab summarizes ahead of its charts: the longest window its buttons show.
SUMMARIZED_AHEAD = timedelta(weeks=1)
#: The most quarter hours without a summary that one of the Jobs tab's charts summarizes itself while a pass
#: summarizing ahead is under way, the newest: the one that may have closed since the pass began, which that pass
#: leaves to the next. The older ones it leaves to the pass, so that the first charts after an upgrade, or after a week
#: without workers, read no week of jobs. (Any number is safe: between passes a chart summarizes what it finds.)
SUMMARIZED_BY_A_CHART = 1


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
        return cls(_floor(until, step) - step * (count - 1), step, count)

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
    operations: Operations,
    job_filter: JobFilter,
    length: timedelta,
    by: str | None = None,
    *,
    keep_summaries: bool = True,
    leave_to_holder: bool = False,
    max_ms: int | None = None,
) -> dict[str, Any]:
    """The numbers of the charts for the window of `length` ending now, of the jobs of `job_filter`, per queue or
    kind with `by`: per interval, attempts succeeded, jobs failed for good, attempts retried (failed, lost or
    retried by the task, with another attempt after them), and of the jobs that finished there the wait (runAfter
    to start of their last attempt) and run time (its start to finish), p50 and p95 in seconds (None: no job).

    A window in steps of a quarter hour or more, of every job or of one queue or kind, draws its quarter hours
    older than SUMMARY_LAG from their summaries (bb_broker.ops.summaries), summarizing those that have none yet
    unless `keep_summaries` is False (a read-only Flower), and reads the jobs for the rest only. With
    `leave_to_holder` (the Jobs tab), a chart summarizes at most SUMMARIZED_BY_A_CHART of those itself while a
    process's pass summarizing ahead is under way: the older ones are `pending`, their intervals without numbers
    (None) until that pass has summarized them, and `summarizing` names the process. With `max_ms` (a page's
    request), the jobs' aggregations stop there, and FilterError asks for a narrower filter or window."""
    if by is not None and by not in BREAKDOWNS:
        raise FilterError(f"by must be one of {', '.join(BREAKDOWNS)}, not {by!r}")
    now = operations.now()
    window = Window.ending(now, length)
    tally = Tally(window, by)
    live_from = window.start
    holder = None
    if window.step >= SUMMARY_STEP and job_filter.only_queue_and_kind():
        live_from = max(window.start, min(window.end, _floor(now - SUMMARY_LAG, SUMMARY_STEP)))
        summaries = Summaries(operations.coll, operations.now, keep=keep_summaries)
        groups, pending, holder = _summarized(
            operations, summaries, window.start, live_from, job_filter, leave_to_holder=leave_to_holder
        )
        for group in groups:
            tally.add_summary(group)
        for at in pending:
            tally.leave_out(at)
    query = operations.bounded(job_filter).query()
    if not isinstance(query.get("status"), str):
        query["status"] = {"$in": list(STATUSES)}  # the index's first field, so the window below is a range of it
    if live_from < window.end:
        grouped_by = None if by is None else f"${by}"
        try:
            buckets, retried = _aggregate(operations, query, live_from, window.end, window.step, grouped_by, max_ms)
        except ExecutionTimeout:
            if max_ms is None:  # not ours: a server's or the client's own limit
                raise
            raise FilterError(
                f"reading the jobs of the chart took over {max_ms} ms: narrow the filter (status, queue, kind) or the"
                " window"
            ) from None
        for bucket in buckets:
            tally.add_finished(bucket["_id"], bucket)
        for bucket in retried:
            tally.add_retried(bucket["_id"], bucket["attempts"])
    return {
        "from": window.start.isoformat(),
        "until": window.end.isoformat(),
        "step": window.step.total_seconds(),
        "by": by,
        "filter": job_filter.as_dict(),
        "intervals": [(window.start + window.step * n).isoformat() for n in range(window.count)],
        "series": tally.series(),
        # Up to where the numbers came from summaries of closed quarter hours (None: none did).
        "summarizedUntil": live_from.isoformat() if live_from > window.start else None,
        # The intervals whose numbers wait for the process summarizing ahead (named in `summarizing`).
        "pending": [(window.start + window.step * n).isoformat() for n in sorted(tally.left_out)],
        "summarizing": holder if tally.left_out else None,
    }


class Tally:
    """A chart's numbers as they are gathered, per group (ALL when not grouped) and interval. Owned by the thread
    that calls job_stats."""

    def __init__(self, window: Window, by: str | None) -> None:
        self.window = window
        self.by = by
        self.groups: dict[str, dict[str, list[Any]]] = {}
        #: The intervals with no numbers yet: a quarter hour of theirs is still to be summarized.
        self.left_out: set[int] = set()

    def add_finished(self, key: dict[str, Any], bucket: dict[str, Any]) -> None:
        """A bucket of the finished jobs' aggregation: `key` has the interval, the status and the group."""
        at = self.window.index(key.get("at"))
        status = key.get("status")
        if at is None or status not in (SUCCEEDED, FAILED):
            return
        group = self._group(key.get("group"))
        group[status][at] += _count(bucket.get("jobs"))
        group["waits"][at] += _milliseconds_of(bucket.get("waits"))
        group["runs"][at] += _milliseconds_of(bucket.get("runs"))

    def add_retried(self, key: dict[str, Any], attempts: Any) -> None:
        at = self.window.index(key.get("at"))
        if at is not None and _count(attempts):
            self._group(key.get("group"))["retried"][at] += _count(attempts)

    def add_summary(self, summary: dict[str, Any]) -> None:
        """A summary's group: one queue and kind's numbers of one quarter hour."""
        at = self.window.index(summary.get("at"))
        if at is None:
            return
        group = self._group(summary.get(self.by) if self.by else None)
        for name in ("succeeded", "failed", "retried"):
            group[name][at] += _count(summary.get(name))
        group["waits"][at] += _milliseconds_of(summary.get("waits"))
        group["runs"][at] += _milliseconds_of(summary.get("runs"))

    def leave_out(self, moment: datetime) -> None:
        """The interval holding `moment` has no numbers (None in every series): part of it is not summarized yet."""
        at = self.window.index(moment)
        if at is not None:
            self.left_out.add(at)

    def series(self) -> dict[str, dict[str, list[Any]]]:
        return {
            name: {key: [None if n in self.left_out else value for n, value in enumerate(values)]
                   for key, values in _series(group).items()}
            for name, group in sorted(self.groups.items())
        }  # fmt: skip

    def _group(self, value: Any) -> dict[str, list[Any]]:
        name = ALL if self.by is None else str(group_name(value) if value is not None else "")
        if name not in self.groups:
            count = self.window.count
            self.groups[name] = {"succeeded": [0] * count, "failed": [0] * count, "retried": [0] * count,
                                 "waits": [[] for _ in range(count)], "runs": [[] for _ in range(count)]}  # fmt: skip
        return self.groups[name]


def summarize_ahead(operations: Operations, length: timedelta = SUMMARIZED_AHEAD) -> int:
    """Summarize the closed quarter hours of the last `length` that have none yet, so that the charts find them
    written (SummarizingAhead runs this in the background), none while there is no job. How many quarter hours were
    summarized. Those before the oldest job cost no more than the rest: the quarter hours left are summarized in one
    pair of reads per run of them, and every run ends at the newest."""
    if operations.coll.find_one({}, {"_id": 1}, **hint_if_indexed(operations.store, "_id_")) is None:
        return 0
    now = operations.now()
    start, end = Window.ending(now, length).start, _floor(now - SUMMARY_LAG, SUMMARY_STEP)
    summaries = Summaries(operations.coll, operations.now)
    missing = _missing(start, end, summaries.summarized(start, end))
    _summarize(operations, summaries, missing)
    return len(missing)


class SummarizingAhead:
    """Keeps the charts' summaries written ahead of them (summarize_ahead), so that a day's or a week's chart finds
    its quarter hours summarized instead of summarizing them in its request, even in a read-only Flower: a thread
    `bb-chart-summaries` in each worker's main process and each Flower that may write, one per jobs collection and
    process, passing every third of a quarter hour. Only the process that holds the turn (Summaries.take_turn)
    summarizes, so the fleet summarizes each quarter hour once; its turn lasts two passes, and a process that died
    leaves it to the next. The thread owns its Operations (pymongo's clients are shared between threads)."""

    turn = TURN
    interval = TURN.total_seconds() / 2
    _running: set[Hashable] = set()
    _lock = threading.Lock()

    @classmethod
    def start(cls, operations: Operations, owner: str) -> None:
        """Start the thread for `operations`' jobs collection, once per process; `owner` names the process."""
        with cls._lock:
            if operations.store.key in cls._running:
                return
            cls._running.add(operations.store.key)
        start_supervised("bb-chart-summaries", cls(operations, owner)._run)

    def __init__(self, operations: Operations, owner: str) -> None:
        self.operations = operations
        self.owner = owner

    def _run(self) -> None:
        while True:
            try:
                self.pass_once()
            except PyMongoError as exc:  # the server is down or refuses: the charts summarize what they need
                logger.info("chart summaries: %s; trying again in %.0f s", type(exc).__name__, self.interval)
            time.sleep(self.interval)

    def pass_once(self) -> int | None:
        """One pass: the quarter hours summarized, None when another process holds the turn. A pass that fails gives
        the turn up, so that a process that cannot summarize does not keep the others from it."""
        summaries = Summaries(self.operations.coll, self.operations.now)
        if not summaries.take_turn(self.owner, self.turn):
            return None
        try:
            summarized = summarize_ahead(self.operations)
        except BaseException:
            with contextlib.suppress(PyMongoError):
                summaries.give_up_turn(self.owner)
            raise
        summaries.end_pass(self.owner)
        return summarized


@reset_in_child
def _forget_parents_summarizers() -> None:
    # A pool process has none of its parent's threads, and its lock may have been held at the fork.
    SummarizingAhead._lock = threading.Lock()
    SummarizingAhead._running = set()


def _summarized(
    operations: Operations,
    summaries: Summaries,
    start: datetime,
    end: datetime,
    job_filter: JobFilter,
    *,
    leave_to_holder: bool,
) -> tuple[list[dict[str, Any]], list[datetime], str | None]:
    """The summaries' groups of the quarter hours of [start, end) of `job_filter`'s queue and kind: those kept, and
    those of the quarter hours that had none, summarized now from the jobs (and kept, if the summaries may be); with
    `leave_to_holder`, the newest SUMMARIZED_BY_A_CHART of those only while a process's pass summarizing ahead is
    under way. Then the quarter hours left to that pass, and its process's name."""
    if start >= end:
        return [], [], None
    done = summaries.summarized(start, end)
    kept = [group for group in summaries.groups(start, end, queue=job_filter.queue, kind=job_filter.kind)
            if isinstance(group.get("at"), datetime) and aware(group["at"]) in done] if done else []  # fmt: skip
    missing = _missing(start, end, done)
    pending: list[datetime] = []
    holder = None
    if leave_to_holder and len(missing) > SUMMARIZED_BY_A_CHART:
        holder = summaries.summarizing_now()
        if holder is not None:
            # Only what the pass summarizes (the last week) is left to it; a longer window's older quarter hours not.
            reach = Window.ending(operations.now(), SUMMARIZED_AHEAD).start
            older, newest = missing[:-SUMMARIZED_BY_A_CHART], missing[-SUMMARIZED_BY_A_CHART:]
            pending = [at for at in older if at >= reach]
            missing = [at for at in older if at < reach] + newest
    built = _summarize(operations, summaries, missing)
    chosen = [group for group in built if job_filter.queue in (None, group.get("queue"))
              and job_filter.kind in (None, group.get("kind"))]  # fmt: skip
    return kept + chosen, pending, holder


def _missing(start: datetime, end: datetime, done: set[datetime]) -> list[datetime]:
    """The quarter hours of [start, end) not in `done` (those with a summary), oldest first."""
    quarters = [start + SUMMARY_STEP * n for n in range(max(math.ceil((end - start) / SUMMARY_STEP), 0))]
    return [at for at in quarters if at not in done]


def _summarize(operations: Operations, summaries: Summaries, missing: list[datetime]) -> list[dict[str, Any]]:
    """The groups of the quarter hours `missing`, summarized from the jobs, and kept if the summaries may be."""
    built: list[dict[str, Any]] = []
    for first, last in _runs(missing):
        built += _summaries_of(operations, first, last + SUMMARY_STEP)
    if missing:
        summaries.write(built, missing)
    return built


def _summaries_of(operations: Operations, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """The summaries' groups of every queue and kind of the quarter hours of [start, end), from the jobs."""
    query = {"status": {"$in": list(STATUSES)}}
    buckets, retried = _aggregate(operations, query, start, end, SUMMARY_STEP, {"queue": "$queue", "kind": "$kind"})
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}

    def group_of(key: dict[str, Any]) -> dict[str, Any] | None:
        at, names = key.get("at"), key.get("group") or {}
        if not isinstance(at, datetime):
            return None
        queue, kind = group_name(names.get("queue")), group_name(names.get("kind"))
        place = (aware(at), queue, kind)
        if place not in groups:
            groups[place] = {"at": aware(at), "queue": queue, "kind": kind, "succeeded": 0, "failed": 0,
                             "retried": 0, "waits": [], "runs": []}  # fmt: skip
        return groups[place]

    for bucket in buckets:
        status, group = bucket["_id"].get("status"), group_of(bucket["_id"])
        if group is not None and status in (SUCCEEDED, FAILED):
            group[status] += _count(bucket.get("jobs"))
            group["waits"] += [ms for ms in bucket.get("waits") or [] if _is_number(ms)]
            group["runs"] += [ms for ms in bucket.get("runs") or [] if _is_number(ms)]
    for bucket in retried:
        group = group_of(bucket["_id"])
        if group is not None:
            group["retried"] += _count(bucket.get("attempts"))
    return list(groups.values())


def _aggregate(
    operations: Operations,
    query: dict[str, Any],
    start: datetime,
    end: datetime,
    step: timedelta,
    group: Any,
    max_ms: int | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The finished jobs' buckets and the retried attempts' of [start, end) in intervals of `step`, per `group`.

    Both are bounded through the `bb_status_updated` index: every write to a job sets its `updatedAt`, so a job with
    an attempt that finished at `start` or later was last written then or after. The retried attempts are counted on
    a thread of their own, so that the server runs both aggregations at once (pymongo's client is shared between
    threads; docs/explanation/performance.md has the figures)."""
    query = {**query, "updatedAt": {**query.get("updatedAt", {}), "$gte": start}}
    hint = hint_if_indexed(operations.store, "bb_status_updated", "aggregate")
    if max_ms is not None:
        hint["maxTimeMS"] = max_ms
    finished = _finished_query(query)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bb-stats") as retried_reader:
        retried = retried_reader.submit(
            lambda: list(operations.coll.aggregate(_retried_pipeline(query, start, end, step, group), **hint))
        )
        buckets = (
            list(operations.coll.aggregate(_finished_pipeline(finished, start, end, step, group), **hint))
            if finished
            else []
        )
        return buckets, retried.result()


def _runs(moments: list[datetime]) -> list[tuple[datetime, datetime]]:
    """Consecutive quarter hours as (first, last) pairs, so that each run is summarized by one pair of reads."""
    runs: list[tuple[datetime, datetime]] = []
    for at in moments:
        if runs and at - runs[-1][1] == SUMMARY_STEP:
            runs[-1] = (runs[-1][0], at)
        else:
            runs.append((at, at))
    return runs


def _floor(moment: datetime, step: timedelta) -> datetime:
    """The start of the interval of `step` that holds `moment`, counted from the epoch."""
    seconds = step.total_seconds()
    return datetime.fromtimestamp(math.floor(moment.timestamp() / seconds) * seconds, UTC)


def _is_number(value: Any) -> bool:
    """A finite number: a summary edited to Infinity (a mongosh literal) or NaN counts nothing, and no time."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> int:
    """A count as the server or a summary gave it; anything else (a hand-edited summary) counts nothing."""
    return int(value) if _is_number(value) and value > 0 else 0


def _interval(moment: str, step: timedelta) -> dict[str, Any]:
    """The start of the interval of `step` a date falls in, on the server. Intervals are whole minutes counted from
    2000-01-01, $dateTrunc's reference, which whole minutes, quarter hours and hours from the epoch are too."""
    minutes = int(step.total_seconds() // 60)
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


def _milliseconds_of(times: Any) -> list[int | float]:
    """The times in milliseconds the server sent (or a summary kept), anything else left out (a hand-edited summary).
    Kept in milliseconds until a percentile is taken (_seconds), as a week's chart gathers a value per job."""
    if not isinstance(times, list):
        return []
    return [ms for ms in times if type(ms) in TIME_TYPES and math.isfinite(ms)]


def _seconds(milliseconds: float | None) -> float | None:
    """A percentile in seconds; none is negative, though a publisher's clock that runs ahead of the server's can write
    a runAfter later than the claim that starts the job. (Both are monotonic: the percentile of the values so made.)"""
    return None if milliseconds is None else max(milliseconds / 1000, 0.0)


def _finished_pipeline(
    query: dict[str, Any], start: datetime, end: datetime, step: timedelta, group: Any
) -> list[dict[str, Any]]:
    """The jobs that finished in [start, end), per interval of `step`, status and `group`: how many, and their wait
    (runAfter to the start of their last attempt) and run time (that start to their finish)."""
    in_window = {"$gte": start, "$lt": end}  # dates only: a finishedAt edited into text is left out
    # A group's document must stay far below the server's 16 MB: the percentiles of a busier interval are those of
    # its first TIMED_PER_GROUP jobs in the index's order (by updatedAt); the counts stay exact.
    return [
        {"$match": query},
        {"$match": {"finishedAt": in_window}},
        {"$group": {
            "_id": {"at": _interval("$finishedAt", step), "status": "$status", "group": group},
            "jobs": {"$sum": 1},
            "waits": {"$firstN": {"n": TIMED_PER_GROUP, "input": _milliseconds("$runAfter", "$startedAt")}},
            "runs": {"$firstN": {"n": TIMED_PER_GROUP, "input": _milliseconds("$startedAt", "$finishedAt")}},
        }},
    ]  # fmt: skip


def _retried_pipeline(
    query: dict[str, Any], start: datetime, end: datetime, step: timedelta, group: Any
) -> list[dict[str, Any]]:
    """The attempts that ended unsuccessfully in [start, end) and were not their failed job's last, per interval of
    `step` and `group`."""
    entry_in_window = {"history.outcome": {"$in": list(UNSUCCESSFUL)},
                       "history.finishedAt": {"$gte": start, "$lt": end}}  # fmt: skip
    last_of_failed_job = {"$and": [{"$eq": ["$status", FAILED]}, {"$eq": ["$history.n", "$attempts"]}]}
    return [
        {"$match": query},
        {"$match": {"history.outcome": {"$in": list(UNSUCCESSFUL)}}},
        {"$unwind": "$history"},
        {"$match": entry_in_window},
        {"$group": {
            "_id": {"at": _interval("$history.finishedAt", step), "group": group},
            "attempts": {"$sum": {"$cond": [last_of_failed_job, 0, 1]}},
        }},
    ]  # fmt: skip


def _series(group: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {
        "succeeded": group["succeeded"],
        "failed": group["failed"],
        "retried": group["retried"],
        "waitP50": [_seconds(percentile(values, 0.5)) for values in group["waits"]],
        "waitP95": [_seconds(percentile(values, 0.95)) for values in group["waits"]],
        "runP50": [_seconds(percentile(values, 0.5)) for values in group["runs"]],
        "runP95": [_seconds(percentile(values, 0.95)) for values in group["runs"]],
    }
