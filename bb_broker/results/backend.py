"""The `bbmongo://` Celery result backend: a task's state and result live on its own job document.

Where things are kept:

- A task run through `bbmongo://` has a job document; its Celery state and result are fields of it (`state`,
  `result`/`resultFormat`, `traceback`, `dateDone`, `children`, `groupId`, `parentId`; see jobs/document.py), written by
  the settling write the worker makes anyway: success and final failure cost no operation more than without results.
  A failure the broker retries stores `state: RETRY` (a caller's `get()` waits for the next attempt) and fires no
  errback, chain failure or chord part: those belong to the failure that ends the job. A task's exception is a
  Celery retry then (worker/settle.py's broker_retry); a failure Celery reports from outside the task (a hard
  time limit) comes to mark_as_failure, which keeps it from Celery's failure path the same way.
- `STARTED` (`task_track_started`), custom states (`update_state`) and Celery's own retries are one write each on
  the job's current attempt; `ignore_result` tasks write nothing beyond the settle.
- `bb_results` (same database) holds what has no job: saved groups (`group:<id>`), chord counters (`chord:<id>`),
  and results of tasks that never had a job (`task:<id>`, for example a chain step failed before it was sent).
  Its documents expire `result_expires` after they were last written (a TTL index on `expiresAt`): a chord's counter
  `result_expires` after its latest part, as Redis renews a chord's keys.
- A result lives as long as its job: succeeded jobs expire after the broker's `retention`, failed jobs stay until
  purged. Set `result_expires` to the same number of seconds as `retention` and both kinds of record agree.

Reading: the newest job with that task id (index `bb_task_id`), then `bb_results`; nothing found is PENDING, as in
Celery's other backends. A revoked task an operator retried runs under a new task id: its old id keeps reading REVOKED
from a `task:<old id>` document the retry writes (operations.py), naming the new id; a canvas step's reads as the new
id (`renamedTo`), which the later steps' handles wait on through their parents. A job that failed without a
Celery result (a lost worker, an unknown task, an operator's cancel) reads as FAILURE with `JobFailed(lastError)`, or
REVOKED when it was revoked, so `get()` never hangs on it.
With `result_extended`, a read adds Celery's extended fields from the job itself: `name` (kind), `args` and `kwargs`
(its message), `queue`, `retries` (the message's header) and `worker` (the finished attempt's history entry); nothing
more is written.
`forget()` removes the result fields and, on a failed job, records the finish it forgot (`forgotten`): the job
reads PENDING, as in Celery's other backends, until it finishes again.

The rest lives beside this module: groups and chords (a native counter, no `chord_unlock`) in chords.py, waiting in
consumer.py, what a job document reads as in states.py, how a value is stored in codec.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from celery import states
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.exceptions import ContentDisallowed
from pymongo import ASCENDING, DESCENDING, UpdateOne
from pymongo.collection import Collection
from pymongo.uri_parser import parse_uri

from bb_broker import app_stores, connection
from bb_broker.jobs.document import (
    DOES_NOT_FIT,
    MAX_RENAMES,
    READY_IN_ATTEMPT,
    RENAMED_TO,
    RESULTS_COLLECTION,
    RETRIED_BY,
    ResultNotStored,
    ResultTooLarge,
    SettleUnwritable,
    of_task,
    storable_text,
    task_id_of,
)
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, describe_error, yes_or_no
from bb_broker.jobs.settles import Settle
from bb_broker.jobs.store import JobStore
from bb_broker.results import codec
from bb_broker.results import states as job_states
from bb_broker.results.chords import ChordBackend
from bb_broker.results.consumer import ResultConsumer
from bb_broker.results.states import EXTENDED_FIELDS, FORGOTTEN, RESULT_FIELDS, JobFailed, UnreadableResult
from bb_broker.server import capabilities
from bb_broker.upstream import celery as upstream_celery
from bb_broker.worker import receivers, settle
from bb_broker.worker.settle import RESULT

__all__ = ["JobFailed", "JobResultBackend", "UnreadableResult"]

logger = logging.getLogger(__name__)


def not_stored(subject: str, cause: str) -> ResultNotStored:
    """The error of a job whose result or failure (`subject`) cannot be kept, for `cause`: ResultTooLarge when it does
    not fit, else ResultNotStored (BSON cannot encode it). What get() raises; never retried (an EncodeError)."""
    error = ResultTooLarge if cause.startswith(DOES_NOT_FIT) else ResultNotStored
    return error(f"{subject} {cause}")


def _servers(target: connection.BrokerTarget) -> frozenset[Any]:
    if target.mongo_uri.startswith("mongodb+srv://"):
        return frozenset([target.mongo_uri.split("://", 1)[1].split("@")[-1].split("/")[0]])
    return frozenset(parse_uri(target.mongo_uri, validate=False, warn=False)["nodelist"])


class JobResultBackend(ChordBackend):
    """Celery's result backend on the `jobs` collection (`result_backend = "bbmongo://host/db"`)."""

    supports_native_join = True
    supports_autoexpire = True
    #: result_compression: a compressed result is kept as its bytes (see codec.stored), read back by
    #: codec.decompressed_result.
    supports_result_compression = True
    persistent = True
    # Set by Celery's Backend.__init__, which celery-types does not declare.
    serializer: str
    #: The content types a result may be read in (result_accept_content, else accept_content).
    accept: set[str]

    def __init__(self, app: Any, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app, url=url, **kwargs)
        url = url or app.conf.result_backend
        if url and url.startswith("srv://"):  # Celery splits "bbmongo+srv://..." at its "+"
            url = f"bbmongo+{url}"
        self.url = url
        self.target = connection.parse_broker_url(url)
        options = {**(app.conf.broker_transport_options or {}), **(app.conf.result_backend_transport_options or {})}
        self.jobs_collection = str(options.get("jobs_collection", "jobs"))
        # As the broker's consumers read it (an unreadable value is the worker's to refuse, at its start).
        self.use_change_streams = yes_or_no(options.get("use_change_streams", True)) is not False
        self._shares_broker_jobs: bool | None = None
        self._indexed_pid: int | None = None
        self.result_consumer = ResultConsumer(self, cache=upstream_celery.result_cache(self))
        # This URL's credentials among its options, in the settings a worker on any broker shows (`inspect conf`).
        upstream_celery.install_url_censor(connection.redact_url)

    # --- where things are -------------------------------------------------------

    @property
    def database(self) -> Any:
        return connection.get_database(self.target)

    @property
    def jobs(self) -> Collection:
        return self.database[self.jobs_collection]

    @property
    def side(self) -> Collection:
        db = self.database
        if self._indexed_pid != os.getpid():
            # A server without TTL indexes keeps these documents (a task's without a job, a group's, a chord's
            # counter), as it keeps the rate counters: small, one per such task, read by id.
            if capabilities(db).ttl_indexes:
                db[RESULTS_COLLECTION].create_index([("expiresAt", ASCENDING)], name="bb_expiry", expireAfterSeconds=0)
            self._indexed_pid = os.getpid()
        return db[RESULTS_COLLECTION]

    def _store(self) -> JobStore | None:
        """The broker's job store when it shares this backend's database: only then are results kept on jobs."""
        store = app_stores.store_for(self.app)
        if store is None:
            return None
        if self._shares_broker_jobs is None:
            # The same servers, database and collection, whatever options either URL carries.
            broker = connection.parse_broker_url(app_stores.broker_url(self.app) or "")
            self._shares_broker_jobs = (_servers(broker), broker.database, store.coll.name) == (
                _servers(self.target),
                self.target.database,
                self.jobs_collection,
            )
        return store if self._shares_broker_jobs else None

    def _expires_at(self) -> dict[str, Any]:
        return {"expiresAt": self.app.now() + timedelta(seconds=self.expires)} if self.expires else {}

    # --- encoding -------------------------------------------------------------------

    def _stored(self, value: Any) -> tuple[Any, str]:
        """A value as the document keeps it (see codec.stored)."""
        return self._stored_payload(self.encode(value))

    def _stored_payload(self, payload: str | bytes) -> tuple[Any, str]:
        # result_compression: Celery >= 5.7
        return codec.stored(payload, self.serializer, compressed=bool(getattr(self, "compression", None)))

    def _loaded(self, value: Any, fmt: str | None) -> Any:
        return codec.loaded(value, fmt, serializer=self.serializer, accept=self.accept)

    def _result_fields(self, result: Any, state: str, traceback: str | None, request: Any) -> dict[str, Any]:
        """The fields of a result, `result` already prepared by encode_result."""
        return self._sized_result_fields(result, state, traceback, request)[0]

    def _sized_result_fields(
        self, result: Any, state: str, traceback: str | None, request: Any
    ) -> tuple[dict[str, Any], int]:
        """_result_fields, and about how many bytes they are (the encoded result and the traceback)."""
        meta = upstream_celery.result_meta(self, result, state, traceback, request)
        if state in states.EXCEPTION_STATES:
            result = self._masked(result)  # an error's text, as lastError and the traceback have it
        payload = self.encode(result)
        value, fmt = self._stored_payload(payload)
        fields = {
            "state": state,
            "result": value,
            "resultFormat": fmt,
            "traceback": storable_text(connection.scrub(traceback, self.target.secrets)) if traceback else None,
            "dateDone": meta["date_done"],
            "children": meta["children"],
        }
        for ours, celerys in (("groupId", "group_id"), ("parentId", "parent_id")):
            if meta.get(celerys):
                fields[ours] = meta[celerys]
        return fields, len(payload) + len(traceback or "")

    def _masked(self, encoded: Any) -> Any:
        return codec.masked(encoded, self.target.secrets)

    # --- writing: where the outcome is known --------------------------------------

    def _held(self, request: Any) -> tuple[JobStore, tuple[str, int]] | None:
        """The store and (job id, attempt) of a job this process runs for `request`, if any."""
        job = settle.job_of(request) if request is not None else None
        store = self._store() if job is not None else None
        return (store, job) if store is not None and job is not None else None

    def mark_as_done(
        self, task_id: str, result: Any, request: Any = None, store_result: bool = True, state: str = states.SUCCESS
    ) -> None:
        held = self._held(request)
        stored = store_result and not getattr(request, "ignore_result", False)
        if held is None:
            return super().mark_as_done(task_id, result, request=request, store_result=store_result, state=state)
        fields, size = None, 0
        if stored:
            fields, size = self._sized_result_fields(self.encode_result(result, state), state, None, request)
        if request.chord:
            # Counted before the job settles: a worker killed in between loses no part (a rerun counts once).
            self.on_chord_part_return(request, state, result)
        if fields is None:
            return  # the task_success signal settles the job
        try:
            settle.succeeded(held[0], request, result=(fields, size), unwritable=self.failed_unstored)
        except SettleUnwritable as exc:
            raise not_stored(RESULT, exc.cause) from None  # Celery's tracer records it as the task's failure

    def mark_as_failure(
        self,
        task_id: str,
        exc: Exception,
        traceback: str | None = None,
        request: Any = None,
        store_result: bool = True,
        call_errbacks: bool = True,
        state: str = states.FAILURE,
    ) -> None:
        held = self._held(request)
        if held is None:
            return super().mark_as_failure(
                task_id,
                exc,
                traceback,
                request=request,
                store_result=store_result,
                call_errbacks=call_errbacks,
                state=state,
            )
        store = held[0]
        if store_result:
            final = settle.failed(
                store,
                request,
                exc,
                traceback,
                result=lambda: self._sized_result_fields(self.encode_result(exc, state), state, traceback, request),
                unwritable=self.failed_unstored,
            )
        else:
            final = settle.ends_the_job(store, request, exc)
        if not final:
            return  # the broker runs the task again (a hard time limit): chord part, chain, errbacks wait for the last
        if request.chord:
            self.on_chord_part_return(request, state, exc)
        upstream_celery.fail_chain(self, getattr(request, "chain", None), exc, traceback, store_result, state)
        if call_errbacks and request.errbacks:
            receivers.prepare_errbacks(self, request)
        if call_errbacks and request.errbacks:
            upstream_celery.call_errbacks(self, request, exc, traceback)

    def failed_unstored(
        self,
        store: JobStore,
        job: tuple[str, int],
        attempt: dict[str, Any] | None,
        request: Any,
        subject: str,
        cause: str,
    ) -> Settle:
        """The settle that fails a job for good because its result or failure (`subject`) cannot be kept in its
        document, for `cause` (document.unwritable_cause): get() raises not_stored's error."""
        error = not_stored(subject, cause)
        fields = self._result_fields(self.encode_result(error, states.FAILURE), states.FAILURE, None, request)
        return store.failure(*job, describe_error(error), retryable=False, attempt=attempt, result=fields)

    def mark_as_revoked(
        self,
        task_id: str,
        reason: str = "",
        request: Any = None,
        store_result: bool = True,
        state: str = states.REVOKED,
    ) -> None:
        held = self._held(request)
        if held is None or not store_result:
            return super().mark_as_revoked(task_id, reason, request=request, store_result=store_result, state=state)
        # The task_revoked signal that follows settles the job, with the reason it knows, and these fields.
        fields = self._result_fields(self.encode_result(TaskRevokedError(reason), state), state, None, request)
        settle.revoked(held[0], request, result=fields)
        if request.chord:
            # Celery's backends store REVOKED before they count the chord part (BaseBackend.mark_as_revoked): a
            # get() on the chord's result, which checks the chord's parents as it waits (follow_parents), raises the
            # part's TaskRevokedError, not the ChordError the part causes. The settle waits for task_revoked, after
            # the part is counted (a worker killed in between loses no part): the state goes on the job first, read
            # as the task's while the job runs this attempt.
            store, (job_id, attempts) = held
            store.annotate(job_id, attempts, {**fields, READY_IN_ATTEMPT: attempts})
            self.on_chord_part_return(request, state, TaskRevokedError(reason))

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: str | None = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Every other state (STARTED, RETRY, custom states), and results of tasks this process does not hold."""
        fields = self._result_fields(result, state, traceback, request)
        held = self._held(request)
        if held is not None:
            store, job = held
            if state != states.RETRY:
                # Fenced on the attempt: a worker whose job was taken over changes nothing.
                store.annotate(*job, fields)
                return result
            # A Retry as the exception is Celery cancelling the task as its worker stops (no retry of the task's
            # own): the attempt's entry comes from the release of the worker's jobs.
            cancelled = isinstance(result, dict) and result.get("exc_type") == "Retry"
            settle.retried(store, request, None if cancelled else codec.described(result), traceback, result=fields)
            return result
        # Not a job this process holds: the job of that task id if there is one (never over its success), else ours.
        job_doc = self.jobs.find_one({"taskId": of_task(task_id)}, {"state": 1}, sort=[("_id", DESCENDING)])
        if job_doc is not None:
            if job_doc.get("state") != states.SUCCESS:
                self.jobs.update_one({"_id": job_doc["_id"], "state": {"$ne": states.SUCCESS}}, {"$set": fields})
            return result
        if self._side_state(task_id) != states.SUCCESS:  # a success is never overwritten, as in Celery's backends
            self.side.update_one(
                {"_id": f"task:{task_id}"}, {"$set": {**fields, "kind": "task", **self._expires_at()}}, upsert=True
            )
        return result

    def _side_state(self, task_id: str) -> str | None:
        doc = self.side.find_one({"_id": f"task:{task_id}"}, {"state": 1})
        return None if doc is None else doc.get("state")

    def _forget(self, task_id: str) -> None:
        # A failed job reads FAILURE (or REVOKED) from its status alone: `forgotten` records which finish was
        # forgotten, so the job reads PENDING until it finishes again (an operator's retry runs it again).
        if capabilities(self.database).update_pipelines:
            forgotten = {"$cond": [{"$eq": ["$status", FAILED]}, "$finishedAt", None]}
            pipeline: list[dict[str, Any]] = [{"$set": {"forgotten": forgotten}}, {"$unset": list(FORGOTTEN)}]
            self.jobs.update_many({"taskId": of_task(task_id)}, pipeline)
        else:
            self._forget_by_read(task_id)
        self.side.delete_one({"_id": f"task:{task_id}"})

    def _forget_by_read(self, task_id: str) -> None:
        """Where the server refuses update pipelines (Amazon DocumentDB): the task's jobs read, then one write each in
        one bulk write, fenced on the status and finish read. A job that finished again in between keeps its new
        outcome, as it would had it finished just after the forget."""
        writes = [
            UpdateOne(
                {"_id": doc["_id"], "status": doc.get("status"), "finishedAt": doc.get("finishedAt")},
                {
                    "$set": {"forgotten": doc.get("finishedAt") if doc.get("status") == FAILED else None},
                    "$unset": FORGOTTEN,
                },
            )
            for doc in self.jobs.find({"taskId": of_task(task_id)}, {"status": 1, "finishedAt": 1})
        ]
        if writes:
            self.jobs.bulk_write(writes, ordered=False)

    # --- reading ----------------------------------------------------------------------

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        return self.metas([task_id])[task_id]

    def metas(self, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The meta of each task id: two reads at most (the jobs, then bb_results for ids with no job), two more for
        each retried revoked canvas step's new id it follows."""
        ids = [str(task_id) for task_id in task_ids]
        metas, found = self._found_metas(ids, MAX_RENAMES)
        self.result_consumer.remember_jobs(found, ids)
        for task_id in ids:
            metas.setdefault(task_id, {"status": states.PENDING, "result": None})
        # An exception as Celery encoded it becomes the exception (one the broker made is one already).
        return {task_id: self._decoded(task_id, meta) for task_id, meta in metas.items()}

    def _decoded(self, task_id: str, meta: dict[str, Any]) -> dict[str, Any]:
        """meta_from_decoded, or for an exception stored that Celery cannot make one of again (a hand edit), the
        task's FAILURE saying so."""
        try:
            return self.meta_from_decoded(meta)
        except ContentDisallowed:
            raise  # a refusal of the app's own accept list, as Celery's backends raise it
        except Exception as exc:
            return job_states.unreadable(task_id, "its stored exception", exc)

    def _found_metas(self, ids: list[str], renames: int) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """The metas of those of `ids` something is stored for, and the jobs found (task id -> job id). A revoked
        canvas step an operator retried under a new id (its `task:<old id>` names it: RENAMED_TO) reads as the new
        id, through at most `renames` renames, or as REVOKED when nothing of the new id is left."""
        metas, found = self._job_metas(ids)
        missing = [task_id for task_id in ids if task_id not in metas]
        renamed: dict[str, str] = {}  # old id -> new id
        retried: dict[str, list[str]] = {}  # task id -> the jobs an operator retried to answer its stored failure
        if missing:
            for doc in self.side.find({"_id": {"$in": [f"task:{task_id}" for task_id in missing]}}):
                task_id = doc["_id"].partition(":")[2]
                where = f"{RESULTS_COLLECTION} {doc['_id']}"
                metas[task_id] = meta = self._readable(task_id, where, self._side_meta, doc)
                new_id = task_id_of(doc.get(RENAMED_TO))
                if renames > 0 and new_id is not None and new_id != task_id:
                    renamed[task_id] = new_id
                if meta["status"] == states.FAILURE and isinstance(doc.get(RETRIED_BY), list):
                    retried[task_id] = [job_id for job_id in doc[RETRIED_BY] if isinstance(job_id, str)]
        if retried:
            self._answered_by_retries(retried, metas, found)
        if renamed:
            followed, jobs = self._found_metas(sorted(set(renamed.values())), renames - 1)
            for old_id, new_id in renamed.items():
                if new_id in followed:
                    metas[old_id] = {**followed[new_id], "task_id": old_id}
                if new_id in jobs:
                    found[old_id] = jobs[new_id]  # a wait on the old id watches the new id's job
        return metas, found

    def _job_metas(self, ids: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """The metas of those of `ids` that have a job, and those jobs (task id -> job id): one read."""
        metas: dict[str, dict[str, Any]] = {}
        found: dict[str, str] = {}
        extended = bool(self.app.conf.find_value_for_key("extended", "result"))
        fields = {**RESULT_FIELDS, **(EXTENDED_FIELDS if extended else {}), "taskId": 1}
        newest: dict[str, dict[str, Any]] = {}
        for doc in self.jobs.find({"taskId": of_task(ids)}, fields, sort=[("_id", ASCENDING)]):
            # The newest job of a task id comes last and wins; one whose _id is not a job id (a hand-written job's
            # ObjectId sorts after every string) only over another such.
            current = newest.get(doc["taskId"])
            if current is None or isinstance(doc["_id"], str) or not isinstance(current["_id"], str):
                newest[doc["taskId"]] = doc
        for task_id, doc in newest.items():  # only the winner decoded: an older job's result is not read
            metas[task_id] = self._readable(task_id, f"its job {doc['_id']}", self._job_meta, doc, extended)
            found[task_id] = doc["_id"]
        return metas, found

    def _job_meta(self, doc: dict[str, Any], extended: bool) -> dict[str, Any]:
        meta = job_states.meta_of_job(doc, self._loaded)
        if extended and meta["status"] != states.PENDING:
            # The message decoded as the results are: result_accept_content, never more than the reader accepts.
            meta.update(job_states.extended(doc, self.accept))
        return meta

    def _side_meta(self, doc: dict[str, Any]) -> dict[str, Any]:
        return job_states.meta_of_task_document(doc, self._loaded)[1]

    def _readable(self, task_id: str, where: str, read: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        """`read(*args)`, the meta of one task's stored outcome; for one that cannot be read (a field written by hand
        or by another client), that task's FAILURE saying why: the other tasks of the same read are read all the
        same."""
        try:
            return read(*args)
        except ContentDisallowed:
            raise  # a refusal of the app's own accept list, as Celery's backends raise it
        except Exception as exc:
            logger.warning("task %s: the result stored in %s cannot be read: %r", task_id, where, exc)
            return job_states.unreadable(task_id, where, exc)

    def _answered_by_retries(
        self, retried: dict[str, list[str]], metas: dict[str, dict[str, Any]], found: dict[str, str]
    ) -> None:
        """A failure stored for a canvas step without a job (a chain's later step, a failed chord's body) whose cause
        an operator retried (RETRIED_BY, bb_broker.ops.operations) reads PENDING while that retry is queued or runs:
        a get() waits for the canvas to continue, watching the retried job. One read of those jobs, and where none
        is queued or running, one of the steps' own jobs again."""
        job_ids = sorted({job_id for job_ids in retried.values() for job_id in job_ids})
        live = {"_id": {"$in": job_ids}, "status": {"$in": [QUEUED, RUNNING]}}
        running = {doc["_id"] for doc in self.jobs.find(live, {"_id": 1})}
        ended = []
        for task_id, job_ids in retried.items():
            answering = next((job_id for job_id in job_ids if job_id in running), None)
            if answering is not None:
                metas[task_id] = job_states.pending(task_id)
                found[task_id] = answering  # a wait on it watches the retried job: its next outcome wakes it
            else:
                ended.append(task_id)
        if ended:
            # A retry that succeeded sent the step (the next of its chain, the chord's body) before it settled: after
            # the read that found no job of the step, before the one that found the retry ended. Its job is the step's.
            later, jobs = self._job_metas(ended)
            metas.update(later)
            found.update(jobs)

    def task_result_exists(self, task_id: str) -> bool:
        return self._get_task_meta_for(task_id)["status"] != states.PENDING

    # --- waiting: the result consumer's ----------------------------------------------------

    def wait_for(
        self,
        task_id: str,
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_interval: Any = None,
    ) -> dict[str, Any]:
        for _, meta in self.get_many([task_id], timeout=timeout, interval=interval, on_interval=on_interval):
            return meta
        raise CeleryTimeoutError("The operation timed out.")

    def get_many(
        self,
        task_ids: Iterable[str],
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_message: Any = None,
        on_interval: Any = None,
        max_iterations: int | None = None,
        READY_STATES: frozenset[str] = states.READY_STATES,  # Celery's keyword
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (task id, meta) as each task is ready (see ResultConsumer.get_many)."""
        upstream_celery.refuse_when_eager(self)
        yield from self.result_consumer.get_many(
            task_ids,
            timeout=timeout,
            interval=interval,
            on_message=on_message,
            on_interval=on_interval,
            max_iterations=max_iterations,
            ready_states=READY_STATES,
        )

    # --- the rest of Celery's backend interface ----------------------------------------------

    def as_uri(self, include_password: bool = False) -> str:
        return self.url if include_password else connection.redact_url(self.url)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        # Backend.__reduce__(args, kwargs) pickles the backend as its class and these: celery-types omits it.
        return super().__reduce__(args, {**(kwargs or {}), "url": self.url})  # type: ignore[call-arg]
