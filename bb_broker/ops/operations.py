"""The operator's actions on `jobs`: retry/cancel/requeue/delete/run-now, revoke, purge, pauses and limits (beside
the reads of Queries)."""

from __future__ import annotations

import json
import logging
import reprlib
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from bson.errors import InvalidBSON
from pymongo import UpdateOne
from pymongo.errors import BulkWriteError, ExecutionTimeout

from bb_broker.clock import aware
from bb_broker.connection import strict_text
from bb_broker.jobs.checkpoints import CHECKPOINT_CLEARED, CLEARED_RECORD
from bb_broker.jobs.document import (
    FAILED_AS,
    HOLDS_RELEASED,
    READY_IN_ATTEMPT,
    RENAMED_TO,
    RESULTS_COLLECTION,
    RETRIED_AS,
    RETRIED_BY,
    action_record,
    bson_kind,
    of_task,
    stored_not_utf8,
    task_id_of,
    update_recorded,
)
from bb_broker.jobs.fair_keys import FAIR_INDEX
from bb_broker.jobs.indexes import DEFAULT_RETENTION, ensure_plain_indexes, hint_if_indexed
from bb_broker.jobs.lifecycle import FAILED, MAX_ERROR_LENGTH, QUEUED, RUNNING, STATUSES, SUCCEEDED
from bb_broker.jobs.queues import LimitError, QueueLimits, parse_concurrency, parse_fair, parse_rate
from bb_broker.jobs.revokes import revoke_queued
from bb_broker.jobs.unique import FOREVER_MODE, HOLD_FIELDS, MODES, RELEASED_BY_CANCEL
from bb_broker.ops.filters import FilterError, JobFilter, queue_name
from bb_broker.ops.queries import SEARCH_MAX_MS, Queries, no_job_has
from bb_broker.server import capabilities

logger = logging.getLogger(__name__)

#: What a retry reads of each job it sends back.
RETRY_FIELDS = {
    "_id": 1, "taskId": 1, "lastError": 1, "revokedAt": 1, "renamedFrom": 1, "groupId": 1, "parentId": 1,
    "payload.headers.eta": 1, "unique": 1, "actions": 1,
    "payload.options.chain.options.task_id": 1,
    **dict.fromkeys(HOLD_FIELDS.values(), 1),
}  # fmt: skip
#: What a retry copies of what it read into its writes (the task id into its records, the unique key held again).
COPIED_BY_RETRY = ("_id", "taskId", "unique")
#: Each action: the statuses it applies to.
ACTIONS: dict[str, tuple[str, ...]] = {
    "retry": (FAILED,),
    "cancel": (QUEUED,),
    "requeue": (RUNNING,),
    "delete": (SUCCEEDED, FAILED),
    "run-now": (QUEUED,),  # only a queued job whose runAfter is still to come (a countdown, an ETA, a backoff)
}
#: What the retry of a header step of a chord that completed in error means (bb_broker.results.chords), on its record.
CHORD_FAILED_NOTE = (
    "its chord had failed (its body's errbacks ran, and are not undone): once every failed step of the chord has "
    "succeeded, the body is sent, once, with the header's results in order, as if none had failed"
)
#: The action that makes a waiting job due now.
RUN_NOW = "run-now"


class ActionRefused(Exception):
    """An action that does not apply: `reason` is "not found" or "conflict" (the job is not in a fitting status)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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


class Operations(Queries):
    """An operator's actions on one jobs collection and its queue controls, beside its reads (Queries)."""

    # --- counts of what an action would touch -----------------------------------

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
        options = hint_if_indexed(self.store, job_filter.hint, "aggregate")
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

    # --- actions ---------------------------------------------------------------

    def act(self, action: str, identifier: str, *, by: str, fresh: bool = False) -> dict[str, Any]:
        """Apply one action to one job (by job id or Celery task id): the job afterwards. `fresh`: a retry clears
        the job's checkpoint (bb_broker.checkpoint), which it otherwise keeps for the next attempt to resume from.

        Raises ActionRefused when there is no such job, or it is not in a status the action applies to."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        doc = self.find(identifier)
        if doc is None:
            raise ActionRefused("not found", no_job_has(identifier))
        job_filter = {"_id": doc["_id"]}
        if not isinstance(doc["_id"], str):
            # Written by hand: no worker can run a job under it (a claim fails it as malformed), nor act on it by id.
            raise ActionRefused("conflict", f"job {reprlib.repr(doc['_id'])} has an _id that is not a string")
        if stored_not_utf8(self.coll, doc, ["_id"]):
            # Read with U+FFFD in place of its bytes (found by its task id): a write by that id finds no job.
            raise ActionRefused("conflict", f"job {doc['_id']} has an _id that holds text that is not UTF-8")
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
        done = self._apply(action, job_filter, by=by, held=held, fresh=fresh)
        if doc["_id"] in held:
            raise ActionRefused("conflict", held[doc["_id"]])
        if not done:
            raise ActionRefused("conflict", f"job {doc['_id']} changed meanwhile: look again")
        return self.find(doc["_id"]) or {"_id": doc["_id"], "deleted": True}

    def act_on_filter(
        self,
        action: str,
        job_filter: JobFilter,
        *,
        by: str,
        unchanged_since: datetime | None = None,
        held: dict[str, str] | None = None,
    ) -> int:
        """Apply an action to every job of the filter it applies to; how many it changed. With `unchanged_since`
        (when the operator counted them), only to jobs that have not changed since: not to a job published, or
        one that came into the action's status, after the operator saw the count. A retry puts in `held` the failed
        jobs it left failed, each with why (as retry() does)."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        query = self.bounded(job_filter).query()
        return self._apply(action, query, by=by, hint=job_filter.hint, unchanged_since=unchanged_since, held=held)

    def retry(
        self,
        identifiers: Iterable[str] | None = None,
        *,
        kind: str | None = None,
        by: str = "operator",
        fresh: bool = False,
    ) -> Retried:
        """Failed jobs back to queued, due now, with all their attempts again: those with these job ids or Celery
        task ids, of this kind, or (no selector) every one. `unmatched` lists the identifiers of no failed job.
        Each keeps its checkpoint, to resume from; `fresh` clears it, to start over."""
        selector: dict[str, Any] = {"status": FAILED}
        if kind is not None:
            selector["kind"] = str(kind)
        wanted = None if identifiers is None else [str(i) for i in identifiers]
        if wanted is None:
            docs = list(self.coll.find(selector, RETRY_FIELDS))
        else:
            # By job id, then by task id: two indexed reads (an $or of both is not one everywhere).
            by_id = {"_id": {"$in": wanted}, **selector}
            by_task = {"taskId": of_task(wanted), **selector}
            docs = list(self.coll.find(by_id, RETRY_FIELDS, **hint_if_indexed(self.store, "_id_")))
            seen = [doc["_id"] for doc in docs]  # compared, not hashed: a hand-written _id may be a document
            more = self.coll.find(by_task, RETRY_FIELDS, **hint_if_indexed(self.store, "bb_task_id"))
            docs += [doc for doc in more if doc["_id"] not in seen]
        held: dict[str, str] = {}
        job_ids = self._retry_docs(docs, by=by, held=held, fresh=fresh)
        unmatched = []
        if wanted is not None:
            found = [doc["_id"] for doc in docs] + [doc.get("taskId") for doc in docs]
            unmatched = [identifier for identifier in wanted if identifier not in found]
        return Retried(job_ids, unmatched, held)

    def cancel_queued(self, job_ids: Iterable[str], *, by: str) -> int:
        """Cancel those of these jobs (by job id) that are still queued, in one write: how many it cancelled."""
        query = {"_id": {"$in": list(job_ids)}, "status": QUEUED}
        return update_recorded(self.coll, query, _cancelled(by, self.now()))

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
        return self.coll.delete_many(query, **hint_if_indexed(self.store, "bb_status_updated")).deleted_count

    def revoke(self, task_ids: Iterable[str], *, by: str, terminate: bool = False) -> int:
        """A revoke an operator asked for (Flower's revoke button or API), recorded with their name: the queued jobs
        of these tasks end failed at once (revoke_queued), and a running one gets the record while its worker obeys
        the broadcast. How many queued jobs ended failed."""
        ids = [str(task_id) for task_id in task_ids]
        revoked = revoke_queued(self.store, ids, by=by)
        if ids:
            # Only the record: updatedAt is its lease, which the job's worker keeps.
            record = action_record("revoke", by, self.now(), terminate=terminate or None)
            running = {"taskId": of_task(ids), "status": RUNNING}
            update_recorded(self.coll, running, {"$push": record}, **hint_if_indexed(self.store, "bb_task_id"))
        return revoked

    # --- queue controls --------------------------------------------------------

    def pause(self, queue: str, *, by: str) -> bool:
        return self.controls.pause(queue_name(queue), by=by, now=self.now())

    def resume(self, queue: str, *, by: str) -> bool:
        return self.controls.resume(queue_name(queue), by=by, now=self.now())

    def set_limits(
        self,
        queue: str,
        *,
        concurrency: object = None,
        rate: object = None,
        fair: object = None,
        clear: bool = False,
        by: str,
    ) -> QueueLimits:
        """Set `queue`'s limits for every worker: `concurrency` (N running at once) and `rate` ("10/m"), each left as
        it is when None and removed when "none", and `fair` (true or false: whether its claims rotate across its jobs'
        fair keys), left as it is when None; `clear` removes them all. A value that cannot be a limit is refused with
        LimitError, and nothing changes. The limits the queue has now."""
        name = queue_name(queue)
        if clear and (concurrency is not None or rate is not None or fair is not None):
            raise LimitError("clear removes every limit: give it alone")
        if not clear and concurrency is None and rate is None and fair is None:
            raise LimitError("give a concurrency limit, a rate, fair, or clear")
        wanted: dict[str, Any] = {}
        if clear or fair is not None:
            wanted["fair"] = False if clear else parse_fair(fair)
            if wanted["fair"]:
                # Made before the queue is fair, so that its first fair claim finds it (one createIndexes: the same
                # index again is no change).
                ensure_plain_indexes(self.coll, [FAIR_INDEX])
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
        fresh: bool = False,
    ) -> int:
        now = self.now()
        selected = _unchanged(self._action_query(query, action), unchanged_since)
        options = hint_if_indexed(self.store, hint, "update") if hint else {}
        if action == "retry":
            docs = self.coll.find(selected, RETRY_FIELDS, **(hint_if_indexed(self.store, hint) if hint else {}))
            return len(self._retry_docs(docs, by=by, held={} if held is None else held, fresh=fresh))
        if action == "cancel":
            return update_recorded(self.coll, selected, _cancelled(by, now), **options)
        if action == RUN_NOW:
            # Due now, behind the jobs due before it: the change stream's update of runAfter wakes the workers.
            update = {"$set": {"runAfter": now, "updatedAt": now}, "$push": action_record(RUN_NOW, by, now)}
            return update_recorded(self.coll, selected, update, **options)
        if action == "requeue":
            reason = f"requeued by {by}: its lease had expired"[:MAX_ERROR_LENGTH]
            update = {
                "$set": {"status": QUEUED, "runAfter": now, "updatedAt": now, "lastError": reason},
                "$unset": HOLDS_RELEASED,
                "$push": action_record("requeue", by, now),
            }
            return update_recorded(self.coll, selected, update, **options)
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

    def _retry_docs(
        self, docs: Iterable[dict[str, Any]], *, by: str, held: dict[str, str], fresh: bool = False
    ) -> list[str]:
        """Each failed job back to queued, fenced on its status. A revoked job gets a new Celery task id: every
        worker that saw the revoke keeps the old id in memory and would discard it unrun. It keeps the id it first
        ran under (`renamedFrom`), delivered with it, under which a chord counts its part. A job whose unique key
        was given back takes it again in the same write; where another job holds it now, the unique index refuses
        the write and the job stays failed, the reason in `held`."""
        now = self.now()
        retried: list[str] = []
        batch: list[tuple[str, UpdateOne, str | None]] = []  # job id, its write, the new task id it gives it
        renamed: dict[str, tuple[str, str, bool]] = {}  # job id -> (its revoked task id, its new one, in a canvas)
        answered: dict[str, list[str]] = {}  # job id -> the task ids whose stored failure its retry answers
        cleared_record = CLEARED_RECORD if fresh else {}
        failed_chords: dict[str, list[str] | None] = {}  # group id -> what its chord's failure was stored under
        for doc in docs:
            if not isinstance(doc["_id"], str):
                # A hand-written _id no worker can run a job under (a claim fails it as malformed): it stays failed.
                held[str(doc.get("taskId") or doc["_id"])] = f"job {doc['_id']} stays failed: {_not_a_string_id(doc)}"
                continue
            if altered := stored_not_utf8(self.coll, doc, COPIED_BY_RETRY):
                # Read with U+FFFD in place of its bytes: the retry would write that into its key and records.
                held[doc["_id"]] = f"job {doc['_id']} stays failed: {', '.join(altered)} holds text that is not UTF-8"
                continue
            changes: dict[str, Any] = {"status": QUEUED, "attempts": 0, "runAfter": now, "updatedAt": now}
            failed_chord = self._failed_chord(doc, failed_chords)
            note = None if failed_chord is None else CHORD_FAILED_NOTE
            record = action_record("retry", by, now, note=note, **cleared_record)
            headers = (doc.get("payload") or {}).get("headers") if isinstance(doc.get("payload"), dict) else None
            if isinstance(headers, dict) and headers.get("eta"):
                changes["payload.headers.eta"] = None  # due now: a worker would otherwise hold it until the old ETA
            new_id = None
            if doc.get("revokedAt") or str(doc.get("lastError", "")).startswith("revoked"):
                new_id = str(uuid.uuid4())
                changes |= self._renamed(doc["_id"], new_id)
                if first_id := task_id_of(doc.get("renamedFrom")) or task_id_of(doc.get("taskId")):
                    # The id it first ran under, delivered with it (payloads.RENAMED_FROM_HEADER): a chord counts the
                    # part of a header task under it, so the retry's result takes the revoked one's place.
                    changes["renamedFrom"] = first_id
                record = action_record(
                    "retry", by, now, previousTaskId=doc.get("taskId"), taskId=new_id, note=note, **cleared_record
                )
            chained = _chained_task_ids(doc)
            answered[doc["_id"]] = chained + (failed_chord or [])
            if new_id is not None and doc.get("taskId"):
                in_canvas = bool(doc.get("groupId") or doc.get("parentId") or chained)
                renamed[doc["_id"]] = (doc["taskId"], new_id, in_canvas)
            changes |= _key_taken_again(doc)
            # lastError stays: it says why the job needed a retry until its next attempt settles.
            # readyInAttempt: the revoked attempt's, which the retry's attempts, counted from 0 again, would meet.
            cleared = {"finishedAt": "", "revokedAt": "", READY_IN_ATTEMPT: "", **(CHECKPOINT_CLEARED if fresh else {})}
            update = {"$set": changes, "$unset": cleared, "$push": record}
            if not isinstance(doc.get("actions", []), list):
                del update["$push"]  # written by hand, kept as it is: the retry goes unrecorded there (update_recorded)
            batch.append((doc["_id"], UpdateOne({"_id": doc["_id"], "status": FAILED}, update), new_id))
            if len(batch) >= 500:
                retried += self._write_retries(batch, answered, held)
                batch = []
        if batch:
            retried += self._write_retries(batch, answered, held)
        self._keep_revoked([renamed[job_id] for job_id in retried if job_id in renamed], by=by, now=now)
        return retried

    def _write_retries(
        self, batch: list[tuple[str, UpdateOne, str | None]], answered: dict[str, list[str]], held: dict[str, str]
    ) -> list[str]:
        """The batch's retries written, each named first on the failures its step's failure stored for the rest of
        its canvas (_answer_failures)."""
        self._answer_failures({job_id: answered[job_id] for job_id, _, _ in batch if answered.get(job_id)})
        return self._write_batch(batch, held)

    def _answer_failures(self, answered: dict[str, list[str]]) -> None:
        """The failures Celery stored for the rest of a failed step's canvas (each later step of its chain; the body
        of the chord it failed), none of which has a job yet (so in `bb_results`), name the step's job as retried
        (RETRIED_BY): while that job is queued or running, they read PENDING (JobResultBackend), so that a caller's
        get() waits for the retry instead of raising the failure it answers; once it has failed again they read
        FAILURE again (a chain's later steps rewritten by that failure, a chord's body as its error stood).

        Written before the retry's own write and read against the job's status as it is, so nothing is moved or
        removed: a retry whose write does not land (another got there first, a crash in between) leaves them reading
        FAILURE while the job is failed, and no outcome a newer run writes is undone."""
        writes = [
            UpdateOne({"_id": f"task:{task_id}", "state": "FAILURE"}, {"$addToSet": {RETRIED_BY: job_id}})
            for job_id, task_ids in answered.items()
            for task_id in task_ids
        ]
        if not writes:
            return
        try:
            self.coll.database[RESULTS_COLLECTION].bulk_write(writes, ordered=False)
        except BulkWriteError as exc:  # a hand edit made a RETRIED_BY that is no array: that one reads FAILURE
            errors = exc.details.get("writeErrors", [])
            logger.warning("%d stored failure(s) not named as retried: %s", len(errors), errors[:1])

    def _failed_chord(self, doc: dict[str, Any], failed_chords: dict[str, list[str] | None]) -> list[str] | None:
        """For a header step of a chord that completed in error before (as Celery fails a chord: its body never sent,
        its errbacks run): the task ids its ChordError was stored under (an older counter's: its callback's). None
        for any other step."""
        group_id = doc.get("groupId")
        if not isinstance(group_id, str):
            return None
        if group_id not in failed_chords:
            failed = {"_id": f"chord:{group_id}", "failed": True}
            counter = self.coll.database[RESULTS_COLLECTION].find_one(failed, {FAILED_AS: 1, "callback.firstId": 1})
            if counter is None:
                failed_chords[group_id] = None
            else:
                stored_as = counter.get(FAILED_AS)
                if not isinstance(stored_as, list):
                    callback = counter.get("callback")
                    stored_as = [callback.get("firstId")] if isinstance(callback, dict) else []
                failed_chords[group_id] = [task_id for task_id in stored_as if isinstance(task_id, str)]
        return failed_chords[group_id]

    def _keep_revoked(self, renamed: list[tuple[str, str, bool]], *, by: str, now: datetime) -> None:
        """A revoked task retried under a new id: its old id keeps reading REVOKED for the result backend (Celery's
        states are final), saying which id runs now. With no job of that id left, a caller's get() would wait for
        ever. Kept as the result backend keeps results of tasks without a job, for DEFAULT_RETENTION.

        A step of a canvas (in a group or a chord's header, after a parent, or with a chain after it) is the
        exception: the handles of the later steps hold its old id among their parents (a chord's header, a chain's
        steps), whose get() checks them while it waits. Its old id reads as its new one (`renamedTo`), so that the
        canvas's get() waits for the retry as it does for a failed step's, and reads its outcome; REVOKED again
        when no job of the new id is left."""
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
                        RETRIED_AS: new_id,
                        **({RENAMED_TO: new_id} if in_canvas else {}),
                    },
                    "$unset": {
                        "result": "",
                        "resultFormat": "",
                        "traceback": "",
                        **({} if in_canvas else {RENAMED_TO: ""}),
                    },
                },
                upsert=True,
            )
            for old_id, new_id, in_canvas in renamed
        ]
        self.coll.database[RESULTS_COLLECTION].bulk_write(writes, ordered=False)

    def _write_batch(self, batch: list[tuple[str, UpdateOne, str | None]], held: dict[str, str]) -> list[str]:
        ids = [job_id for job_id, _, _ in batch]
        try:
            modified = self.coll.bulk_write([op for _, op, _ in batch], ordered=False).modified_count
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
        # Some changed meanwhile: the ones that are now queued by this write are ours. A renamed one is ours only under
        # the task id this write gave it: another retry at the same moment may have queued it under its own.
        new_ids = {job_id: new_id for job_id, _, new_id in batch}
        queued = self.coll.find({"_id": {"$in": ids}, "status": QUEUED}, {"taskId": 1})
        return [doc["_id"] for doc in queued if new_ids[doc["_id"]] in (None, doc.get("taskId"))]

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
        changes: dict[str, Any] = {"taskId": task_id}
        try:  # read as it is: a message read with U+FFFD in place of its bytes would be written back altered
            payload = (strict_text(self.coll).find_one({"_id": job_id}, {"payload": 1}) or {}).get("payload")
        except InvalidBSON:
            return changes  # its message is not UTF-8 and stays as it is: a claim fails the job, naming it
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


def _cancelled(by: str, now: datetime) -> dict[str, Any]:
    """The update that cancels a queued job: failed, saying who cancelled it."""
    return {
        "$set": {
            "status": FAILED,
            "lastError": f"cancelled by {by}"[:MAX_ERROR_LENGTH],
            "updatedAt": now,
            "finishedAt": now,
        },
        "$unset": RELEASED_BY_CANCEL,  # a cancelled job gives back its unique key (not a beat slot's)
        "$push": action_record("cancel", by, now),
    }


def _not_a_string_id(doc: dict[str, Any]) -> str:
    """Why a job whose _id was written by hand, not a string, is not retried: no worker can run a job under it (a
    claim fails it as malformed)."""
    return f"its _id is {bson_kind(doc['_id'])}, not a string: no worker can run it"


def _chained_task_ids(doc: dict[str, Any]) -> list[str]:
    """The task ids of the steps chained after a job's task, as its stored message names them (none when the message
    is not stored as JSON, or a hand edit made it something else)."""
    options = (doc.get("payload") or {}).get("options") if isinstance(doc.get("payload"), dict) else None
    chain = options.get("chain") if isinstance(options, dict) else None
    steps = [step.get("options") for step in chain if isinstance(step, dict)] if isinstance(chain, list) else []
    return [step["task_id"] for step in steps if isinstance(step, dict) and isinstance(step.get("task_id"), str)]


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


def _unchanged(query: dict[str, Any], since: datetime | None) -> dict[str, Any]:
    """The query narrowed to jobs last changed at or before `since` (every write to a job sets its updatedAt)."""
    if since is None:
        return query
    return {**query, "updatedAt": {**query.get("updatedAt", {}), "$lte": since}}


def _is_none(value: object) -> bool:
    """Whether a limit given as text says to remove it."""
    return isinstance(value, str) and value.strip().lower() == "none"
