"""The charts' summaries of closed intervals: one document per quarter hour, queue and kind of what finished in it,
kept in SUMMARIES_COLLECTION beside the jobs, so that a day's or a week's chart reads a few hundred small documents
instead of every job of its window (bb_broker.ops.stats builds them; this module reads and keeps them).

A quarter hour is summarized once it is SUMMARY_LAG old, by the first chart that needs it or ahead of the charts
(bb_broker.ops.stats.SummarizingAhead: by one process of the fleet at a time, a worker's or Flower's, whichever holds
the turn, Summaries.take_turn): a group document per queue and kind (`group: True`)
with its counts and its jobs' wait and run times in milliseconds, then the interval's marker (`group: False`),
written last so that a marked interval has all its groups. What is summarized stays as it was: a job deleted since
(retention) or retried by an operator since is still counted where it finished then. Each write deletes the
summaries older than SUMMARY_KEPT, markers before groups, so that no interval is ever marked without its groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from pymongo import ASCENDING, IndexModel, ReplaceOne
from pymongo.collection import Collection
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from bb_broker.clock import aware
from bb_broker.jobs.document import MAX_KIND_LENGTH
from bb_broker.server import capabilities, is_not_implemented, is_unauthorized, unique_refusals

logger = logging.getLogger(__name__)

SUMMARIES_COLLECTION = "bb_stats"
#: The length of a summarized interval: the day's chart's step, a quarter of the week's.
SUMMARY_STEP = timedelta(minutes=15)
#: How old an interval must be to be summarized: far longer than a settle takes to land after the finish time it
#: carries (a worker's writes keep trying through an outage for `settle_patience`, 60 s by default), so that nothing
#: that finished in it arrives after its summary.
SUMMARY_LAG = timedelta(minutes=5)
#: How long a process's turn to summarize ahead lasts unless its next pass renews it: shorter than a quarter hour, so
#: that at most one quarter hour closes while a pass is seen under way (see bb_broker.ops.stats.SUMMARIZED_BY_A_CHART).
TURN = SUMMARY_STEP * 2 / 3
#: How long a summary is kept: a day beyond the longest window a chart draws (31 days).
SUMMARY_KEPT = timedelta(days=32)
INDEX = IndexModel([("jobs", ASCENDING), ("group", ASCENDING), ("at", ASCENDING)], name="bb_stats_at")
#: The group of the jobs whose queue or kind is no name a summary keeps (see group_name).
NOT_A_NAME = "(not a name)"


def group_name(value: Any) -> Any:
    """A job's queue or kind as the charts group it: as it is (None: the job has none), or NOT_A_NAME for one that is
    not a string or is longer than a publish writes (MAX_KIND_LENGTH; a queue name is far shorter). A summary holds
    its names twice, in its _id and its fields: a hand-edited kind of 8 MB made its write pass the server's 16 MB
    and stopped every chart while the job was kept. Such jobs are still counted, together, under NOT_A_NAME."""
    if value is None or (isinstance(value, str) and len(value) <= MAX_KIND_LENGTH):
        return value
    return NOT_A_NAME


class Summaries:
    """The summaries of one jobs collection's charts."""

    def __init__(self, jobs: Collection, clock: Callable[[], datetime], *, keep: bool = True) -> None:
        self.coll = jobs.database[SUMMARIES_COLLECTION]
        self.jobs = jobs.name
        self.now = clock
        #: Whether new summaries are written (a read-only Flower reads those there are and writes none).
        self.keep = keep

    def summarized(self, start: datetime, end: datetime) -> set[datetime]:
        """The starts of the intervals of [start, end) that have a summary."""
        found = self.coll.find(self._in(start, end, group=False), {"at": 1})
        return {aware(doc["at"]) for doc in found if isinstance(doc.get("at"), datetime)}

    def groups(
        self, start: datetime, end: datetime, *, queue: str | None = None, kind: str | None = None
    ) -> Iterable[dict[str, Any]]:
        """The group documents of [start, end), of `queue` and `kind` when given (values, compared whole)."""
        query = self._in(start, end, group=True)
        if queue is not None:
            query["queue"] = queue
        if kind is not None:
            query["kind"] = kind
        return self.coll.find(query, {"_id": 0, "jobs": 0, "group": 0})

    def write(self, groups: list[dict[str, Any]], intervals: list[datetime]) -> bool:
        """Keep `groups` (each with `at`, `queue`, `kind` and its numbers) and mark `intervals` summarized, the
        markers after the groups; False when they were not kept (not allowed, or a server that cannot): the caller
        has the numbers either way, and a later chart builds the intervals again."""
        if not self.keep or not intervals:
            return self.keep
        old = {"$lt": self.now() - SUMMARY_KEPT}
        try:
            self._ensure_index()
            # An old interval's marker goes before its groups; a new one's comes after them.
            self.coll.delete_many({"jobs": self.jobs, "group": False, "at": old})
            self.coll.delete_many({"jobs": self.jobs, "group": True, "at": old})
            if groups:
                self._keep_groups(groups)
            # Markers are inserted, not upserted (an upsert each is far slower on some servers): one that is there
            # already was written by a chart that summarized the same interval at once, from the same jobs.
            markers = [{"_id": {"jobs": self.jobs, "at": at}, "jobs": self.jobs, "at": at, "group": False}
                       for at in intervals]  # fmt: skip
            self.coll.insert_many(markers, ordered=False)
        except BulkWriteError as exc:
            if not capabilities(self.coll.database).only_unique_refusals(exc.details.get("writeErrors", [])):
                raise
            # A chart summarizing the same intervals at once: its writes went first, with the same numbers.
        except OperationFailure as exc:
            if not (is_unauthorized(exc) or is_not_implemented(exc)):  # summaries are a cache: the charts read the jobs
                raise
            logger.info("chart summaries not kept (code %s): the charts read the jobs", exc.code)
            return False
        return True

    def _keep_groups(self, groups: list[dict[str, Any]]) -> None:
        """Upsert `groups`. Two upserts of one group at once (a chart and a pass summarizing the same quarter hour)
        can collide on its _id: the other's write, with the same numbers, went first, and the markers still follow."""
        try:
            self.coll.bulk_write([self._replacing(group) for group in groups], ordered=False)
        except BulkWriteError as exc:
            if not capabilities(self.coll.database).only_unique_refusals(exc.details.get("writeErrors", [])):
                raise

    def take_turn(self, owner: str, length: timedelta) -> bool:
        """Whether `owner` (a process) summarizes ahead of the charts now, for `length`: one process of the fleet at a
        time does, the one whose turn has not run out (renewed at each of its passes), so that the workers and
        Flowers of a deployment do not each summarize the same quarter hours. A turn that ran out (its process died)
        is the next one's to take. False for a user who may not write: such a process summarizes nothing. A turn taken
        is a pass under way (summarizing_now) until end_pass."""
        now = self.now()
        try:
            # Taken where it ran out (or holds no date: a hand edit) or is ours; a turn another holds does not match,
            # and the upsert's _id collides.
            ran_out = [{"until": {"$lte": now}}, {"until": {"$not": {"$type": "date"}}}, {"by": owner}]
            with unique_refusals(self.coll.database):
                self.coll.update_one(
                    {"_id": self._turn, "$or": ran_out},
                    {"$set": {"by": owner, "until": now + length, "jobs": self.jobs, "passing": owner}},
                    upsert=True,
                )
        except DuplicateKeyError:
            return False
        except OperationFailure as exc:
            if not (is_unauthorized(exc) or is_not_implemented(exc)):  # summaries are a cache: the charts read the jobs
                raise
            return False
        return True

    def summarizing_now(self) -> str | None:
        """The process summarizing ahead at this moment (as it named itself): its pass under way, and its turn not
        run out (a process that died in its pass holds it no longer than that). None when no pass is under way."""
        now = self.now()
        # A turn runs out no later than a turn's length from now (a hand edit's far future is no pass under way).
        turn = self.coll.find_one(
            {"_id": self._turn, "until": {"$gt": now, "$lte": now + TURN}}, {"by": 1, "passing": 1}
        )
        holder = None if turn is None else turn.get("by")
        # `passing` names the holder whose pass it is: a turn taken over by a process that does not write it (an older
        # version, mid-upgrade) is no pass under way.
        if not isinstance(holder, str) or turn is None or turn.get("passing") != holder:
            return None
        return holder

    def end_pass(self, owner: str) -> None:
        """`owner`'s pass is over; its turn goes on until its next pass renews it."""
        self.coll.update_one({"_id": self._turn, "by": owner}, {"$set": {"passing": None}})

    def give_up_turn(self, owner: str) -> None:
        """`owner`'s pass failed: its turn is the next process's to take at once, rather than once it runs out."""
        self.coll.update_one({"_id": self._turn, "by": owner}, {"$set": {"until": self.now(), "passing": None}})

    @property
    def _turn(self) -> dict[str, str]:
        return {"jobs": self.jobs, "turn": "summarizing ahead"}

    def _replacing(self, group: dict[str, Any]) -> ReplaceOne[Any]:
        key = {"jobs": self.jobs, "at": group["at"], "queue": group.get("queue"), "kind": group.get("kind")}
        return ReplaceOne({"_id": key}, {**group, "jobs": self.jobs, "group": True}, upsert=True)

    def _ensure_index(self) -> None:
        try:
            self.coll.create_indexes([INDEX])
        except OperationFailure as exc:
            if not is_not_implemented(exc):
                raise
            # A server without createIndexes: the summaries are few, read without an index.

    def _in(self, start: datetime, end: datetime, *, group: bool) -> dict[str, Any]:
        return {"jobs": self.jobs, "group": group, "at": {"$gte": start, "$lt": end}}
