"""The `bbmongo://` Celery result backend: a task's state and result live on its own job document.

Where things are kept:

- A task run through `bbmongo://` has a job document; its Celery state and result are fields of it (`state`,
  `result`/`resultFormat`, `traceback`, `dateDone`, `children`, `groupId`, `parentId`; see store.py), written by the
  settling write the worker makes anyway: success and final failure cost no operation more than without results.
  A failure the broker retries stores `state: RETRY` (a caller's `get()` waits for the next attempt) and fires no
  errback, chain failure or chord part: those belong to the failure that ends the job. A task's exception is a
  Celery retry then (celery_hooks.retry_failed_attempts); a failure Celery reports from outside the task (a hard
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
from a `task:<old id>` document the retry writes (operations.py), naming the new id. A job that failed without a
Celery result (a lost worker, an unknown task, an operator's cancel) reads as FAILURE with `JobFailed(lastError)`, or
REVOKED when it was revoked, so `get()` never hangs on it.
With `result_extended`, a read adds Celery's extended fields from the job itself: `name` (kind), `args` and `kwargs`
(its message), `queue`, `retries` (the message's header) and `worker` (the finished attempt's history entry); nothing
more is written.
`forget()` removes the result fields and, on a failed job, records the finish it forgot (`forgotten`): the job
reads PENDING, as in Celery's other backends, until it finishes again.

Chords use a native counter: each header task's part is one `findAndModify` on `chord:<group id>` that adds its
result and `$inc`s the count, guarded by the part's key so a task that runs again (its worker was killed) is
counted once. The part is counted before the task's own settle, so a worker killed in between loses no part: the
job is re-queued and its rerun finds its part counted. The part that completes the count claims the callback
(recording the task id of the callback's first message), sends it, then marks it sent; a worker killed between
the claim and the mark leaves its part's job running, and the rerun of that part (the same key) takes the claim
over: it sends the callback with the claimed id unless a job of that id exists already. No `chord_unlock`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

from bson import Binary
from celery import chord, group, maybe_signature, states
from celery.backends import base as celery_backends
from celery.backends.base import BaseBackend
from celery.canvas import _chain
from celery.exceptions import ChordError, TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import GroupResult, ResultSet, allow_join_result, result_from_tuple
from celery.utils.functional import _regen
from kombu import compression
from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import loads, prepare_accept_content
from kombu.serialization import registry as serializers
from kombu.utils.encoding import ensure_bytes
from kombu.utils.uuid import uuid
from pymongo import ASCENDING, DESCENDING, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import OperationFailure
from pymongo.uri_parser import parse_uri

from bb_broker import connection
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, SUCCEEDED, describe_error
from bb_broker.jobs.payloads import PayloadError, _bson_safe, decompress_bounded, to_message
from bb_broker.jobs.store import MAX_DOCUMENT_BYTES, RESULTS_COLLECTION, JobStore, ResultTooLarge, SettleTooLarge
from bb_broker.transport.wakeups import NO_CHANGE_STREAMS
from bb_broker.worker import hooks as celery_hooks

logger = logging.getLogger(__name__)

#: Room left in a job document for everything that is not the result (payload, history, the rest).
RESULT_LIMIT = MAX_DOCUMENT_BYTES - 64 * 1024
#: The fields a result read needs from a job document.
RESULT_FIELDS = {
    "status": 1,
    "lastError": 1,
    "state": 1,
    "result": 1,
    "resultFormat": 1,
    "traceback": 1,
    "dateDone": 1,
    "children": 1,
    "groupId": 1,
    "parentId": 1,
    "finishedAt": 1,
    "forgotten": 1,
}
#: The fields `result_extended` reads too: the task's name, message, queue and the worker that ran it.
EXTENDED_FIELDS = {"kind": 1, "payload": 1, "queue": 1, "history": {"$slice": -1}}
#: Fields forget() removes from a job.
FORGOTTEN = {field: "" for field in RESULT_FIELDS if field not in ("status", "lastError", "finishedAt", "forgotten")}
#: The longest a waiting get() goes without reading the result, even with a change stream that said nothing.
SAFETY_READ = 10.0


def _servers(target: connection.BrokerTarget) -> frozenset[Any]:
    if target.mongo_uri.startswith("mongodb+srv://"):
        return frozenset([target.mongo_uri.split("://", 1)[1].split("@")[-1].split("/")[0]])
    return frozenset(parse_uri(target.mongo_uri, validate=False, warn=False)["nodelist"])


def _described(encoded: Any) -> str:
    """An exception as encode_result left it (a dict for JSON), described as lastError describes one."""
    if isinstance(encoded, BaseException):
        return describe_error(encoded)
    if isinstance(encoded, dict) and "exc_type" in encoded:
        message = encoded.get("exc_message")
        text = " ".join(map(str, message)) if isinstance(message, list | tuple) else str(message or "")
        return f"{encoded['exc_type']}: {text}" if text else str(encoded["exc_type"])
    return str(encoded)


def _first_message(signature: Any) -> Any:
    """The signature whose message a canvas sends first: a chain's first step, a group's or chord's first task."""
    while isinstance(signature, _chain | group | chord) and signature.tasks:
        tasks = signature.tasks
        signature = maybe_signature(tasks[0] if isinstance(tasks, list | tuple) else next(iter(tasks)))
    return signature


#: Celery stores a compressed result (result_compression) behind this marker, then its method and a NUL
#: (celery.backends.base.compress_payload).
_COMPRESSED_RESULT_MARK: bytes = celery_backends.COMPRESSED_PAYLOAD_MAGIC


def _decompressed_result(payload: bytes) -> bytes:
    """An encoded result as Celery wrote it, decompressed if it was (checked on Celery 5.7.0)."""
    if not payload.startswith(_COMPRESSED_RESULT_MARK):
        return payload
    method, _, body = payload[len(_COMPRESSED_RESULT_MARK) :].partition(b"\x00")
    name = method.decode("utf-8")
    # Bounded as a task message's body is: a job document edited by hand must not take the reader's memory.
    plain = decompress_bounded(body, name)
    return compression.decompress(body, name) if plain is None else plain


class JobFailed(Exception):
    """The task's job failed without a result from Celery (its worker was lost, its task unknown, an operator)."""


class JobResultBackend(BaseBackend):
    """Celery's result backend on the `jobs` collection (`result_backend = "bbmongo://host/db"`)."""

    supports_native_join = True
    supports_autoexpire = True
    #: result_compression: a compressed result is kept as its bytes (see _stored), read back by _decompressed_result.
    supports_result_compression = True
    persistent = True

    def __init__(self, app: Any, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app, url=url, **kwargs)
        url = url or app.conf.result_backend
        if url and url.startswith("srv://"):  # Celery splits "bbmongo+srv://..." at its "+"
            url = f"bbmongo+{url}"
        self.url = url
        self.target = connection.parse_broker_url(url)
        options = {**(app.conf.broker_transport_options or {}), **(app.conf.result_backend_transport_options or {})}
        self.jobs_collection = str(options.get("jobs_collection", "jobs"))
        self._change_streams = True
        self._shares_broker_jobs: bool | None = None
        self._indexed_pid: int | None = None
        #: Task id -> its job's id, learnt by reads: what a waiting get() watches.
        self._job_ids: dict[str, str] = {}

    # --- where things are -------------------------------------------------------

    @property
    def _db(self) -> Any:
        return connection.get_database(self.target)

    @property
    def jobs(self) -> Collection:
        return self._db[self.jobs_collection]

    @property
    def side(self) -> Collection:
        db = self._db
        if self._indexed_pid != os.getpid():
            db[RESULTS_COLLECTION].create_index([("expiresAt", ASCENDING)], name="bb_expiry", expireAfterSeconds=0)
            self._indexed_pid = os.getpid()
        return db[RESULTS_COLLECTION]

    def _store(self) -> JobStore | None:
        """The broker's job store when it shares this backend's database: only then are results kept on jobs."""
        store = celery_hooks.store_for(self.app)
        if store is None:
            return None
        if self._shares_broker_jobs is None:
            # The same servers, database and collection, whatever options either URL carries.
            broker = connection.parse_broker_url(celery_hooks.broker_url(self.app) or "")
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
        """A value as the document keeps it: BSON when it came as JSON, else the encoded bytes; and its format."""
        payload = self.encode(value)
        size = len(ensure_bytes(payload))
        if size > RESULT_LIMIT:
            raise ResultTooLarge(
                f"the task's result is {size} bytes encoded, over the {RESULT_LIMIT} bytes a job document has room"
                " for (MongoDB's document limit is 16 MB): it was not stored"
            )
        if self.serializer == "json" and not getattr(self, "compression", None):  # result_compression: Celery >= 5.7
            readable = json.loads(payload)
            if _bson_safe(readable):
                return readable, "json"
        return Binary(ensure_bytes(payload)), f"encoded:{self.serializer}"

    def _loaded(self, value: Any, fmt: str | None) -> Any:
        if fmt == "json":
            return loads(json.dumps(value), "application/json", "utf-8", accept=self.accept)
        serializer = (fmt or "").partition(":")[2] or self.serializer
        content_type, content_encoding, _ = serializers._encoders[serializer]
        return loads(_decompressed_result(bytes(value)), content_type, content_encoding, accept=self.accept)

    def _result_fields(self, result: Any, state: str, traceback: str | None, request: Any) -> dict[str, Any]:
        """The fields of a result, `result` already prepared by encode_result."""
        meta = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=request, format_date=False
        )
        if state in states.EXCEPTION_STATES:
            result = self._masked(result)  # an error's text, as lastError and the traceback have it
        value, fmt = self._stored(result)
        fields = {
            "state": state,
            "result": value,
            "resultFormat": fmt,
            "traceback": connection.scrub(traceback, self.target.secrets) if traceback else None,
            "dateDone": meta["date_done"],
            "children": meta["children"],
        }
        for ours, celerys in (("groupId", "group_id"), ("parentId", "parent_id")):
            if meta.get(celerys):
                fields[ours] = meta[celerys]
        return fields

    def _masked(self, encoded: Any) -> Any:
        """An encoded exception with the URL's password masked (a copy: Celery goes on using the exception)."""
        if not self.target.secrets:
            return encoded
        if isinstance(encoded, BaseException):
            encoded = copy.copy(encoded)
        return connection.scrub_value(encoded, self.target.secrets)

    # --- writing: where the outcome is known --------------------------------------

    def _held(self, request: Any) -> tuple[JobStore, tuple[str, int]] | None:
        """The store and (job id, attempt) of a job this process runs for `request`, if any."""
        job = celery_hooks.job_of(request) if request is not None else None
        store = self._store() if job is not None else None
        return (store, job) if store is not None and job is not None else None

    def mark_as_done(
        self, task_id: str, result: Any, request: Any = None, store_result: bool = True, state: str = states.SUCCESS
    ) -> None:
        held = self._held(request)
        stored = store_result and not getattr(request, "ignore_result", False)
        if held is None:
            return super().mark_as_done(task_id, result, request=request, store_result=store_result, state=state)
        fields = self._result_fields(self.encode_result(result, state), state, None, request) if stored else None
        if request.chord:
            # Counted before the job settles: a worker killed in between loses no part (a rerun counts once).
            self.on_chord_part_return(request, state, result)
        if fields is None:
            return  # the task_success signal settles the job
        store, job = held
        attempt = celery_hooks.attempt_for(store, request, job[1], "succeeded")
        try:
            store.succeed(*job, attempt=attempt, result=fields)
        except SettleTooLarge as exc:
            raise ResultTooLarge(f"the task's result does not fit in its job document: {exc}") from None
        celery_hooks.settled_by_backend(job)

    def mark_as_failure(
        self,
        task_id: str,
        exc: BaseException,
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
        store, job = held
        retryable = celery_hooks.is_retryable(request, exc)
        final = not retryable or store.policy.is_final_attempt(job[1])
        if store_result:
            error = describe_error(exc)
            attempt = celery_hooks.attempt_for(store, request, job[1], "failed", error, traceback)
            try:
                fields = self._result_fields(self.encode_result(exc, state), state, traceback, request)
                store.fail(*job, error, retryable=retryable, attempt=attempt, result=fields)
            except (ResultTooLarge, SettleTooLarge) as too_large:
                # The exception or its traceback is what does not fit: the job fails on that, for good.
                final = True
                reason = ResultTooLarge(f"the task's failure does not fit in its job document: {too_large}")
                fields = self._result_fields(self.encode_result(reason, state), state, None, request)
                store.fail(*job, describe_error(reason), retryable=False, attempt=attempt, result=fields)
            celery_hooks.settled_by_backend(job)
        if not final:
            return  # the broker runs the task again (a hard time limit): chord part, chain, errbacks wait for the last
        if request.chord:
            self.on_chord_part_return(request, state, exc)
        self._fail_chain(getattr(request, "chain", None), exc, traceback, store_result=store_result, state=state)
        if call_errbacks and request.errbacks:
            self._call_task_errbacks(request, exc, traceback)

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
        celery_hooks.pending_result(held[1], fields)
        if request.chord:
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
            attempt = None
            # A Retry as the exception is Celery cancelling the task as its worker stops (no retry of the task's
            # own): the attempt's entry comes from the release of the worker's jobs.
            # A broker's retry recorded its failed attempt itself (see celery_hooks.retry_failed_attempts).
            cancelled = isinstance(result, dict) and result.get("exc_type") == "Retry"
            if state == states.RETRY and not cancelled and not celery_hooks.retried_by_broker(job):
                error = _described(result)
                attempt = celery_hooks.attempt_for(store, request, job[1], "retry", error, traceback)
                celery_hooks.settled_by_backend(job)  # the task_retry signal must not add this attempt again
            # Fenced on the attempt: a worker whose job was taken over changes nothing.
            if not store.annotate(*job, fields, attempt=attempt) and attempt is not None:
                store.record_retry(*job, attempt)  # the retry's publish let a worker claim the job again first
            return result
        # Not a job this process holds: the job of that task id if there is one (never over its success), else ours.
        job_doc = self.jobs.find_one({"taskId": task_id}, {"state": 1}, sort=[("_id", DESCENDING)])
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
        forgotten = {"$cond": [{"$eq": ["$status", FAILED]}, "$finishedAt", None]}
        self.jobs.update_many({"taskId": task_id}, [{"$set": {"forgotten": forgotten}}, {"$unset": list(FORGOTTEN)}])
        self.side.delete_one({"_id": f"task:{task_id}"})

    # --- reading ----------------------------------------------------------------------

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        return self._metas([task_id])[task_id]

    def _metas(self, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The meta of each task id: two reads at most (the jobs, then bb_results for ids with no job)."""
        ids = [str(task_id) for task_id in task_ids]
        metas: dict[str, dict[str, Any]] = {}
        extended = bool(self.app.conf.find_value_for_key("extended", "result"))
        fields = {**RESULT_FIELDS, **(EXTENDED_FIELDS if extended else {}), "taskId": 1}
        cursor = self.jobs.find({"taskId": {"$in": ids}}, fields, sort=[("_id", ASCENDING)])
        for doc in cursor:  # the newest job of a task id comes last and wins
            meta = self._meta_of_job(doc)
            if extended and meta["status"] != states.PENDING:
                meta.update(self._extended(doc))
            metas[doc["taskId"]] = meta
            self._job_ids[doc["taskId"]] = doc["_id"]
        if len(self._job_ids) > 10_000:  # a long-lived client reads many ids: keep only what waits need
            self._job_ids = {task_id: self._job_ids[task_id] for task_id in ids if task_id in self._job_ids}
        missing = [task_id for task_id in ids if task_id not in metas]
        if missing:
            for doc in self.side.find({"_id": {"$in": [f"task:{task_id}" for task_id in missing]}}):
                task_id = doc["_id"].partition(":")[2]
                if doc.get("state") == states.REVOKED and "resultFormat" not in doc:
                    # A revoked task an operator retried under a new id (operations.py): its old id stays REVOKED.
                    metas[task_id] = self._meta(task_id, states.REVOKED, TaskRevokedError(doc.get("lastError")))
                    continue
                metas[task_id] = self._meta_of(doc, task_id)
        for task_id in ids:
            metas.setdefault(task_id, {"status": states.PENDING, "result": None})
        return metas

    def _meta_of_job(self, doc: dict[str, Any]) -> dict[str, Any]:
        status, state = doc.get("status"), doc.get("state")
        task_id = doc["taskId"]
        finished = doc.get("finishedAt")
        if status == FAILED and state is None and finished is not None and doc.get("forgotten") == finished:
            return {"status": states.PENDING, "result": None, "task_id": task_id}  # forget() forgot this failure
        if status == FAILED and state not in (states.FAILURE, states.REVOKED):
            last_error = str(doc.get("lastError") or "failed")
            if last_error.startswith("revoked"):
                return self._meta(task_id, states.REVOKED, TaskRevokedError(last_error))
            return self._meta(task_id, states.FAILURE, JobFailed(last_error))
        if status == SUCCEEDED and (state is None or state in states.UNREADY_STATES):
            # ignore_result, or forgotten. A state a task set before it raised Ignore (a custom one, or FAILURE as
            # Celery's docs show) stays what it reads, as in Celery's other backends.
            return {"status": states.PENDING, "result": None, "task_id": task_id}
        if status in (QUEUED, RUNNING) and (state is None or state in states.READY_STATES):
            return {"status": states.PENDING, "result": None, "task_id": task_id}  # an outcome from an earlier run
        return self._meta_of(doc, task_id)

    def _meta_of(self, doc: dict[str, Any], task_id: str) -> dict[str, Any]:
        meta = {
            "task_id": task_id,
            "status": doc.get("state") or states.PENDING,
            "result": self._loaded(doc.get("result"), doc.get("resultFormat")) if "resultFormat" in doc else None,
            "traceback": doc.get("traceback"),
            "children": doc.get("children") or [],
            "date_done": doc.get("dateDone"),
        }
        if doc.get("groupId"):
            meta["group_id"] = doc["groupId"]
        if doc.get("parentId"):
            meta["parent_id"] = doc["parentId"]
        return self.meta_from_decoded(meta)

    def _extended(self, doc: dict[str, Any]) -> dict[str, Any]:
        """`result_extended`'s fields, as Celery's backends store them from the request: read off the job."""
        try:
            message = to_message(doc.get("payload"))
            body = loads(
                message["body"],
                message["content-type"],
                message["content-encoding"],
                accept=prepare_accept_content(self.app.conf.accept_content),
            )
            args, kwargs = (body[0], body[1]) if isinstance(body, list | tuple) else (None, None)
        except (PayloadError, ContentDisallowed, DecodeError, TypeError, ValueError, IndexError):
            message, args, kwargs = {"headers": {}}, None, None  # a message the client cannot read: no arguments
        history = doc.get("history") or []
        finished = doc.get("status") in (SUCCEEDED, FAILED) and history and isinstance(history[-1], dict)
        return {
            "name": doc.get("kind"),
            "args": args,
            "kwargs": kwargs,
            "worker": history[-1].get("worker") if finished else None,
            "retries": message["headers"].get("retries"),
            "queue": doc.get("queue"),
        }

    @staticmethod
    def _meta(task_id: str, state: str, exc: BaseException) -> dict[str, Any]:
        return {"task_id": task_id, "status": state, "result": exc, "traceback": None, "children": []}

    def task_result_exists(self, task_id: str) -> bool:
        return self._get_task_meta_for(task_id)["status"] != states.PENDING

    # --- waiting -------------------------------------------------------------------------

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
        READY_STATES: frozenset[str] = states.READY_STATES,  # noqa: N803 (Celery's keyword)
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (task id, meta) as each task is ready: woken by a change stream on their jobs, else polling."""
        self._ensure_not_eager()
        pending = {str(task_id) for task_id in task_ids}
        for task_id in list(pending):
            cached = self._cache.get(task_id)
            if cached is not None and cached["status"] in READY_STATES:
                pending.discard(task_id)
                yield task_id, cached
        deadline = None if timeout is None else time.monotonic() + timeout
        stream, watched = None, None
        iterations = 0
        try:
            while pending:
                metas = self._metas(pending)
                for task_id, meta in metas.items():
                    if meta["status"] in READY_STATES:
                        pending.discard(task_id)
                        if meta["status"] == states.SUCCESS:
                            self._cache[task_id] = meta
                        if on_message is not None:
                            on_message(meta)
                        yield task_id, meta
                if not pending:
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CeleryTimeoutError(f"Operation timed out ({timeout})")
                iterations += 1
                if max_iterations and iterations >= max_iterations:
                    return
                jobs = tuple(sorted(self._job_ids[task_id] for task_id in pending if task_id in self._job_ids))
                unknown = tuple(sorted(task_id for task_id in pending if task_id not in self._job_ids))
                if self._change_streams and (jobs, unknown) != watched:
                    if stream is not None:
                        stream.close()
                    stream, watched = self._watch(jobs, unknown, pending), (jobs, unknown)
                    if stream is not None:
                        continue  # read again at once: a change between the read and the watch is not missed
                self._pause(stream, interval, remaining)
                if on_interval is not None:
                    # After the wait and before the next read, as Redis's consumer does: a parent's error (a
                    # chord's revoked header task) is raised before the failure it caused downstream.
                    on_interval()
        finally:
            if stream is not None:
                stream.close()

    def _watch(self, job_ids: Iterable[str], unknown_task_ids: Iterable[str], task_ids: Iterable[str]) -> Any:
        """A change stream on what can change these results: their jobs, a new job for any of the task ids (a
        replaced task's id comes back on its replacement's job, a task id not seen yet on its first), and
        bb_results documents of tasks without a job. None where the deployment has no change streams."""
        unknown = list(unknown_task_ids)
        jobs = self.jobs_collection
        watched = [
            {"ns.coll": jobs, "documentKey._id": {"$in": list(job_ids)}},
            {"ns.coll": jobs, "operationType": "insert", "fullDocument.taskId": {"$in": list(task_ids)}},
            {"ns.coll": RESULTS_COLLECTION, "documentKey._id": {"$in": [f"task:{task_id}" for task_id in unknown]}},
        ]
        try:
            return self._db.watch(
                [{"$match": {"$or": watched}}, {"$project": {"documentKey": 1}}], max_await_time_ms=1000
            )
        except OperationFailure as exc:
            if exc.code in NO_CHANGE_STREAMS:
                self._change_streams = False  # a standalone server: poll
                return None
            raise

    def _pause(self, stream: Any, interval: float, remaining: float | None) -> None:
        """Until one of the watched jobs changes (or SAFETY_READ passes), or else `interval`."""
        if stream is None:
            time.sleep(interval if remaining is None else min(interval, remaining))
            return
        limit = SAFETY_READ if remaining is None else min(SAFETY_READ, remaining)
        started = time.monotonic()
        while time.monotonic() - started < limit:
            if stream.try_next() is not None:  # one awaiting getMore of up to a second
                return

    # --- groups ----------------------------------------------------------------------------

    def _save_group(self, group_id: str, result: GroupResult) -> GroupResult:
        value, fmt = self._stored({"result": result.as_tuple()})
        self.side.replace_one(
            {"_id": f"group:{group_id}"},
            {"kind": "group", "result": value, "resultFormat": fmt, "dateDone": self.app.now(), **self._expires_at()},
            upsert=True,
        )
        return result

    def _restore_group(self, group_id: str) -> dict[str, Any] | None:
        doc = self.side.find_one({"_id": f"group:{group_id}"})
        if doc is None:
            return None
        meta = self._loaded(doc["result"], doc.get("resultFormat"))
        meta["result"] = result_from_tuple(meta["result"], self.app)
        return meta

    def _delete_group(self, group_id: str) -> None:
        self.side.delete_one({"_id": f"group:{group_id}"})

    # --- chords: a native counter on one document --------------------------------------------

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> None:
        """Before the header is sent: a fresh counter (a frozen chord applied again is a new run)."""
        self.ensure_chords_allowed()
        group_id = header_result_args[0]
        self.side.replace_one(
            {"_id": f"chord:{group_id}"},
            {"kind": "chord", "count": 0, "extra": 0, "members": [], "parts": [], **self._expires_at()},
            upsert=True,
        )
        if not isinstance(header_result_args[1], _regen):
            header = self.app.GroupResult(*header_result_args)
            if any(isinstance(result, GroupResult) for result in header.results):
                header.save(backend=self)  # nested groups: the callback gets their structure from a join

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        self.side.update_one({"_id": f"chord:{group_id}"}, {"$set": {"size": chord_size}}, upsert=True)

    def add_to_chord(self, group_id: str, result: Any) -> None:
        self.side.update_one({"_id": f"chord:{group_id}"}, {"$inc": {"extra": 1}})

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> None:
        task_id, group_id, index = request.id, request.group, request.group_index
        if not task_id or not group_id:
            return
        key = f"{task_id}:{index}"
        value, fmt = self._part_value(result, state)
        part = {"key": key, "i": index, "id": task_id, "state": state, "value": value, "format": fmt}
        counter = self._count_part(group_id, key, part)
        if counter is None:
            logger.error("chord %s has no counter (expired, or never applied): part %s ignored", group_id, key)
            return
        size = counter.get("size")
        if size is None:
            size = (request.chord or {}).get("chord_size")
        if size is None or counter["count"] < size + counter.get("extra", 0) or counter.get("sent"):
            return
        # The count is complete: the part that claims the callback sends it.
        callback = maybe_signature(request.chord, app=self.app)
        first = _first_message(callback)
        if not self._claim_callback(group_id, key, first, counter.get("callback")):
            return
        try:
            values = self._chord_values(
                group_id, self.side.find_one({"_id": f"chord:{group_id}"}, {"parts": 1})["parts"]
            )
        except ChordError as exc:
            logger.error("Chord %r raised: %r", group_id, exc)
            self.chord_error_from_stack(callback, exc)
        except Exception as exc:
            logger.exception("Chord %r raised: %r", group_id, exc)
            self.chord_error_from_stack(callback, ChordError(f"Join error: {exc!r}"))
        else:
            self._send_callback(group_id, callback, values)
        self.side.update_one({"_id": f"chord:{group_id}"}, {"$set": {"sent": self.app.now()}})

    def _part_value(self, result: Any, state: str) -> tuple[Any, str]:
        """A part's value as the counter keeps it. A failure too large to keep is kept as that (as its job records
        it), so the chord still fails; a success too large raises, and the task fails on it (then counted so)."""
        if state not in states.EXCEPTION_STATES:
            return self._stored(self.encode_result(result, state))
        try:
            return self._stored(self._masked(self.encode_result(result, state)))
        except ResultTooLarge as too_large:
            reason = ResultTooLarge(f"the task's failure does not fit in its job document: {too_large}")
            return self._stored(self.encode_result(reason, state))

    def _count_part(self, group_id: str, key: str, part: dict[str, Any]) -> dict[str, Any] | None:
        """Add a part to the chord's counter, once per key; the counter as it stands (None: no such chord)."""
        chord_id = f"chord:{group_id}"
        small = {"parts": 0, "members": 0}
        counted: dict[str, Any] = {"$push": {"members": key, "parts": part}, "$inc": {"count": 1}}
        if self.expires:
            # Renewed by every part, as Redis renews a chord's keys: a header that runs longer than result_expires
            # keeps its counter while its parts keep coming.
            counted["$set"] = self._expires_at()
        counter = self.side.find_one_and_update(
            {"_id": chord_id, "members": {"$ne": key}},
            counted,
            projection=small,
            return_document=ReturnDocument.AFTER,
        )
        # None: this part was counted before (the task ran again after its worker died), or the chord is unknown.
        return counter if counter is not None else self.side.find_one({"_id": chord_id}, small)

    def _claim_callback(self, group_id: str, key: str, first: Any, claim: dict[str, Any] | None) -> bool:
        """Whether this part sends the callback: the first to claim it, or the same part run again after its
        worker died holding the claim, and then only when the callback's first message was not sent already.

        The claim records the task id of the callback's first message, so that a part run again sends it with
        the same id and can look for its job first: the callback is sent once whichever side of the send the
        worker died on.
        """
        chord_id = f"chord:{group_id}"
        if claim is None:
            first_id = first.options.get("task_id") or uuid()
            claim = {"by": key, "firstId": first_id, "at": self.app.now()}
            taken = self.side.update_one(
                {"_id": chord_id, "callback": {"$exists": False}}, {"$set": {"callback": claim}}
            )
            if taken.modified_count:
                first.set(task_id=first_id)
                return True
            claim = (self.side.find_one({"_id": chord_id}, {"callback": 1, "sent": 1}) or {}).get("callback")
        if claim is None or claim.get("by") != key:
            return False  # another part sends it
        # This part claimed it before and ran again: its worker died between the claim and the end of the send.
        first.set(task_id=claim["firstId"])
        sent = self.jobs.find_one({"taskId": claim["firstId"]}, {"_id": 1}) is not None
        if sent or self._side_state(claim["firstId"]) is not None:  # a job, or the chord's error stored
            logger.warning("chord %s: the callback was sent before its sender died; not sent again", group_id)
            self.side.update_one({"_id": chord_id}, {"$set": {"sent": self.app.now()}})
            return False
        logger.warning("chord %s: its callback's sender died before sending it; sending it now", group_id)
        return True

    def _send_callback(self, group_id: str, callback: Any, values: list[Any]) -> None:
        try:
            callback.delay(values)
        except Exception as exc:
            logger.exception("Chord callback for %r raised: %r", group_id, exc)
            self.chord_error_from_stack(callback, ChordError(f"Callback error: {exc!r}"))

    def _chord_values(self, group_id: str, parts: list[dict[str, Any]]) -> list[Any]:
        """The header's results in header order; a failed member fails the chord, as in Celery's Redis backend."""
        ordered = sorted(parts, key=lambda part: (part["i"] is None, part["i"] or 0))
        for part in ordered:
            if part["state"] in states.PROPAGATE_STATES:
                exc = self.exception_to_python(self._loaded(part["value"], part["format"]))
                error = ChordError(f"Dependency {part['id']} raised {exc!r}")
                error.__cause__ = exc
                raise error
        header = GroupResult.restore(group_id, backend=self)
        if header is not None:
            # Nested groups in the header: the callback gets their structure, each task's value from its part. Not a
            # join: the part completing the count is counted before its own result is stored, so joining a header
            # that holds it would wait on itself for ever.
            by_task = {part["id"]: part for part in parts}
            return [self._nested_value(result, by_task) for result in header.results]
        return [self._loaded(part["value"], part["format"]) for part in ordered]

    def _nested_value(self, result: Any, parts: dict[str, dict[str, Any]]) -> Any:
        """A header member's value as a join gives it: a list for a group, nested as the groups are."""
        if isinstance(result, ResultSet):
            return [self._nested_value(child, parts) for child in result.results]
        part = parts.get(result.id)
        if part is None:  # not one of the chord's parts: its result, as a join reads it
            with allow_join_result():
                return result.get(timeout=self.app.conf.result_chord_join_timeout, propagate=True)
        return self._loaded(part["value"], part["format"])

    # --- the rest of Celery's backend interface ----------------------------------------------

    def as_uri(self, include_password: bool = False) -> str:
        return self.url if include_password else connection.redact_url(self.url)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return super().__reduce__(args, {**(kwargs or {}), "url": self.url})
