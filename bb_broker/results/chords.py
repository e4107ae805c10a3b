"""Groups and chords in `bb_results`: saved groups, and a chord's native counter on one document (no chord_unlock).

Each header task's part is one `findAndModify` on `chord:<group id>` that adds its result and `$inc`s the count,
guarded by the part's key so a task that runs again (its worker was killed) is counted once. The part is counted
before the task's own settle, so a worker killed in between loses no part: the job is re-queued and its rerun finds
its part counted. The part that completes the count claims the callback (recording the task id of the callback's
first message), sends it, then marks it sent; a worker killed between the claim and the mark leaves its part's job
running, and the rerun of that part (the same key) takes the claim over: it sends the callback with the claimed id
unless a job of that id exists already.

A header task that failed for good and that an operator retried (bb_broker.ops.operations) reports again under the
same key (a revoked one, retried under a new task id, under the id it first ran under, which its job's delivery
carries: payloads.RENAMED_FROM_HEADER): its success replaces its failed or revoked part (kept in `fixed`, once per
key, the count unchanged). A chord that had completed in error (the callback failed with a ChordError, never sent,
marked `failed`) whose parts have all succeeded now sends its callback after all, once: the part that claims
`resend` sends it under the task id the failed callback had, so the callers' results and the rest of the canvas
follow it; a rerun of that part after its worker died sends it only if no job of that id exists.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, chord, group, maybe_signature, states
from celery.backends.base import BaseBackend
from celery.exceptions import ChordError
from celery.result import GroupResult, ResultSet, allow_join_result, result_from_tuple
from kombu.exceptions import ContentDisallowed
from kombu.utils.uuid import uuid
from pymongo import ReturnDocument
from pymongo.collection import Collection

from bb_broker.jobs.document import FAILED_AS, ResultTooLarge, of_task, task_id_of
from bb_broker.jobs.payloads import RENAMED_FROM_HEADER
from bb_broker.jobs.unique import shown
from bb_broker.results.states import UnreadableResult
from bb_broker.upstream import celery as upstream_celery

logger = logging.getLogger(__name__)

#: A chord counter without its parts (what most reads need), and its parts with their replacements (see _current_parts).
SMALL = {"parts": 0, "members": 0, "fixed": 0, "fixedKeys": 0}
COUNTED = {"parts": 1, "fixed": 1}


def _current_parts(counted: dict[str, Any]) -> list[dict[str, Any]]:
    """A chord's parts as they stand: a failed part an operator's retry since made succeed replaced by that success."""
    fixed = {part["key"]: part for part in counted.get("fixed") or []}
    return [fixed.get(part["key"], part) for part in counted["parts"]]


def _is_count(value: Any) -> bool:
    """Whether a counter's `count`, `size` or `extra` is a count: a whole number, not below 0 (a double from a shell's
    edit as well)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value >= 0 and (isinstance(value, int) or value.is_integer())


def _first_message(signature: Any) -> Any:
    """The signature whose message a canvas sends first: a chain's first step, a group's or chord's first task."""
    while isinstance(signature, upstream_celery.chain_class() | group | chord) and signature.tasks:
        tasks = signature.tasks
        signature = maybe_signature(tasks[0] if isinstance(tasks, list | tuple) else next(iter(tasks)))
    return signature


def _failed_as(callback: Any) -> list[str]:
    """The task ids Celery's chord_error_from_stack stored the chord's error under: the callback's (given one then if
    it had none), each task's of a group callback (Celery >= 5.6)."""
    tasks = [maybe_signature(task) for task in callback.tasks] if isinstance(callback, group) else []
    ids = [callback.id, *(task.id for task in tasks if task is not None)]
    return [task_id for task_id in ids if isinstance(task_id, str)]


class ChordBackend(BaseBackend):
    """Celery's group and chord interface on `bb_results`, for a backend that says where and how it stores values."""

    # Set by Celery's Backend.__init__, which celery-types does not declare.
    app: Celery
    #: result_expires in seconds (None or 0: results do not expire).
    expires: float | None

    @property
    def side(self) -> Collection:
        """The collection of what has no job: groups, chord counters, results of tasks without a job."""
        raise NotImplementedError

    @property
    def jobs(self) -> Collection:
        raise NotImplementedError

    def _stored(self, value: Any) -> tuple[Any, str]:
        raise NotImplementedError

    def _loaded(self, value: Any, fmt: str | None) -> Any:
        raise NotImplementedError

    def _masked(self, encoded: Any) -> Any:
        raise NotImplementedError

    def _expires_at(self) -> dict[str, Any]:
        raise NotImplementedError

    def _side_state(self, task_id: str) -> str | None:
        raise NotImplementedError

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
        try:
            meta = self._loaded(doc["result"], doc.get("resultFormat"))
            meta["result"] = result_from_tuple(meta["result"], self.app)
        except ContentDisallowed:
            raise  # a refusal of the app's own accept list, as Celery's backends raise it
        except Exception as exc:  # written by hand or by another client
            raise UnreadableResult(f"group {group_id}: its saved result cannot be read ({exc!r:.300})") from exc
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
        if not upstream_celery.is_lazy_result_list(header_result_args[1]):
            header = self.app.GroupResult(*header_result_args)
            if any(isinstance(result, GroupResult) for result in header.results or []):
                header.save(backend=self)  # nested groups: the callback gets their structure from a join

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        self.side.update_one({"_id": f"chord:{group_id}"}, {"$set": {"size": chord_size}}, upsert=True)

    def add_to_chord(self, group_id: str, result: Any) -> None:
        self.side.update_one({"_id": f"chord:{group_id}"}, {"$inc": {"extra": 1}})

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> None:
        task_id, group_id, index = request.id, request.group, request.group_index
        if not task_id or not group_id:
            return
        # A revoked header task an operator retried runs under a new id: its part is the one of the id it first ran
        # under, so the retry's result takes the revoked one's place.
        first_id = task_id_of(getattr(request, RENAMED_FROM_HEADER, None))
        key = f"{first_id or task_id}:{index}"
        value, fmt = self._part_value(result, state)
        part = {"key": key, "i": index, "id": task_id, "state": state, "value": value, "format": fmt}
        if first_id is not None:
            part["firstId"] = first_id
        counter = self._count_part(group_id, key, part)
        if counter is None:
            logger.error("chord %s has no counter (expired, or never applied): part %s ignored", group_id, key)
            return
        size = counter.get("size")
        if size is None:
            size = (request.chord or {}).get("chord_size")
        if size is None:
            return
        count, extra = counter.get("count"), counter.get("extra", 0)
        if not (_is_count(size) and size > 0 and _is_count(count) and _is_count(extra)):
            # Edited by hand: a size of 0 would send the callback with some of the header's results.
            shape = f"count {shown(count)}, size {shown(size)}, extra {shown(extra)}"
            logger.error("chord %s: its counter holds no counts (%s): the callback is not sent", group_id, shape)
            return
        if count < size + extra:
            return
        callback = maybe_signature(request.chord, app=self.app)
        if counter.get("sent"):
            self._send_again_if_fixed(group_id, key, callback, counter)
            return
        # The count is complete: the part that claims the callback sends it.
        first = _first_message(callback)
        if not self._claim_callback(group_id, key, first, counter.get("callback")):
            return
        sent: dict[str, Any] = {"sent": self.app.now()}
        try:
            counted = self.side.find_one({"_id": f"chord:{group_id}"}, COUNTED)
            # Read back by _count_part just now, its expiry renewed by this very part: it is there.
            assert counted is not None, f"chord {group_id}: its counter vanished before its callback was sent"
            values = self._chord_values(group_id, _current_parts(counted))
        except ChordError as exc:
            logger.error("Chord %r raised: %r", group_id, exc)
            self.chord_error_from_stack(callback, exc)
            sent |= {"failed": True, FAILED_AS: _failed_as(callback)}
        except Exception as exc:
            logger.exception("Chord %r raised: %r", group_id, exc)
            self.chord_error_from_stack(callback, ChordError(f"Join error: {exc!r}"))
            sent |= {"failed": True, FAILED_AS: _failed_as(callback)}
        else:
            self._send_callback(group_id, callback, values)
        marked = self.side.find_one_and_update(
            {"_id": f"chord:{group_id}"}, {"$set": sent}, SMALL, return_document=ReturnDocument.AFTER
        )
        if sent.get("failed") and marked is not None:
            # A failed part retried and fixed while this part read the parts: the fix found the chord not yet failed.
            self._send_again_if_fixed(group_id, key, callback, marked)

    def _send_again_if_fixed(self, group_id: str, key: str, callback: Any, counter: dict[str, Any]) -> None:
        """A chord that completed in error, each of its failed parts since retried and succeeded: its callback sent
        now, once (the part that claims `resend` sends it)."""
        if not counter.get("failed") or counter.get("resent"):
            return
        counted = self.side.find_one({"_id": f"chord:{group_id}"}, COUNTED)
        if counted is None or any(part["state"] in states.PROPAGATE_STATES for part in _current_parts(counted)):
            return  # a part still failed: the chord stays failed until that one is retried too
        first = _first_message(callback)
        if not self._claim_resend(group_id, key, first, counter):
            return
        try:
            values = self._chord_values(group_id, _current_parts(counted))
        except Exception as exc:
            logger.exception("Chord %r raised again: %r", group_id, exc)
            self.chord_error_from_stack(callback, ChordError(f"Join error: {exc!r}"))
        else:
            logger.warning("chord %s: every failed part succeeded on its retry; its callback is sent now", group_id)
            self._send_callback(group_id, callback, values)
        self.side.update_one({"_id": f"chord:{group_id}"}, {"$set": {"resent": self.app.now()}})

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
        counted: dict[str, Any] = {"$push": {"members": key, "parts": part}, "$inc": {"count": 1}}
        # Renewed by every part, as Redis renews a chord's keys: a header that runs longer than result_expires keeps
        # its counter while its parts keep coming.
        renewed = {"$set": self._expires_at()} if self.expires else {}
        counter = self.side.find_one_and_update(
            {"_id": chord_id, "members": {"$ne": key}},
            counted | renewed,
            projection=SMALL,
            return_document=ReturnDocument.AFTER,
        )
        if counter is None and part["state"] == states.SUCCESS:
            # Counted before: a part that failed for good and was retried by an operator replaces its failure with
            # its success, once (a retried part run again after its worker died finds it replaced).
            failed = {"key": key, "state": {"$in": sorted(states.PROPAGATE_STATES)}}
            counter = self.side.find_one_and_update(
                {"_id": chord_id, "parts": {"$elemMatch": failed}, "fixedKeys": {"$ne": key}},
                {"$push": {"fixed": part, "fixedKeys": key}} | renewed,
                projection=SMALL,
                return_document=ReturnDocument.AFTER,
            )
            if counter is not None:
                logger.warning("chord %s: part %s failed before and succeeded on its retry", group_id, key)
        # None: this part was counted before (the task ran again after its worker died), or the chord is unknown.
        return counter if counter is not None else self.side.find_one({"_id": chord_id}, SMALL)

    def _claim_callback(self, group_id: str, key: str, first: Any, claim: dict[str, Any] | None) -> bool:
        """Whether this part sends the callback: the first to claim it, or the same part run again after its
        worker died holding the claim, and then only when the callback's first message was not sent already.

        The claim records the task id of the callback's first message, so that a part run again sends it with
        the same id and can look for its job first: the callback is sent once whichever side of the send the
        worker died on.
        """
        first_id = first.options.get("task_id") or uuid()
        return self._claim(group_id, key, first, "callback", claim, first_id, {})

    def _claim_resend(self, group_id: str, key: str, first: Any, counter: dict[str, Any]) -> bool:
        """Whether this part sends again the callback of a chord that completed in error (`failed`): as
        _claim_callback, under the task id the failed callback had (a job of that id: sent already)."""
        first_id = (counter.get("callback") or {}).get("firstId") or first.options.get("task_id") or uuid()
        return self._claim(group_id, key, first, "resend", counter.get("resend"), first_id, {"failed": True})

    def _claim(
        self,
        group_id: str,
        key: str,
        first: Any,
        name: str,
        claim: dict[str, Any] | None,
        first_id: str,
        guard: dict[str, Any],
    ) -> bool:
        """Take the claim `name` on the counter (`guard`: what the counter must also hold), or find it this part's own
        from before its worker died: then whether the message is still to send (no job of its id; for the first
        send, no error of the chord stored either)."""
        chord_id = f"chord:{group_id}"
        if claim is None:
            claim = {"by": key, "firstId": first_id, "at": self.app.now()}
            taken = self.side.update_one({"_id": chord_id, name: {"$exists": False}, **guard}, {"$set": {name: claim}})
            if taken.modified_count:
                first.set(task_id=first_id)
                return True
            claim = (self.side.find_one({"_id": chord_id}, {name: 1}) or {}).get(name)
        if claim is None:
            return False
        if not (isinstance(claim, dict) and task_id_of(claim.get("firstId")) and isinstance(claim.get("by"), str)):
            # Written by hand or by another client: whose claim it is, and under which id it sends, nobody can tell.
            logger.error(
                "chord %s: its %s claim is not one (%s): the callback is not sent", group_id, name, shown(claim)
            )
            return False
        if claim["by"] != key:
            return False  # another part sends it
        # This part claimed it before and ran again: its worker died between the claim and the end of the send.
        first.set(task_id=claim["firstId"])
        done = "sent" if name == "callback" else "resent"
        sent = self.jobs.find_one({"taskId": of_task(claim["firstId"])}, {"_id": 1}) is not None
        # The first send's error is stored as the callback's result; a resend's is there already from before.
        failed = not sent and name == "callback" and self._side_state(claim["firstId"]) is not None
        if sent or failed:
            logger.warning("chord %s: the callback was sent before its sender died; not sent again", group_id)
            marks = {done: self.app.now(), **({"failed": True} if failed else {})}
            self.side.update_one({"_id": chord_id}, {"$set": marks})
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
            # A header task retried under a new id is in the saved header under the id it first ran under.
            by_task = {part.get("firstId", part["id"]): part for part in parts}
            return [self._nested_value(result, by_task) for result in header.results or []]
        return [self._loaded(part["value"], part["format"]) for part in ordered]

    def _nested_value(self, result: Any, parts: dict[str, dict[str, Any]]) -> Any:
        """A header member's value as a join gives it: a list for a group, nested as the groups are."""
        if isinstance(result, ResultSet):
            return [self._nested_value(child, parts) for child in result.results or []]
        part = parts.get(result.id)
        if part is None:  # not one of the chord's parts: its result, as a join reads it
            with allow_join_result():
                return result.get(timeout=self.app.conf.result_chord_join_timeout, propagate=True)
        return self._loaded(part["value"], part["format"])
