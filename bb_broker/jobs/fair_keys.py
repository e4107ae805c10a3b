"""Fair queues: in a queue made fair (`bb-broker limit mail --fair`), the claims rotate across the fair keys that have
due jobs (the mail of each customer, say), so that one key's backlog delays another key's job by about one job per
active key, not by the whole backlog.

A task message whose header FAIR_KEY_HEADER holds a key becomes a job with that key in `fairKey`; the task options
`fair_key` (the key) and `fair_on` (the arguments the key is made of), on the task or on `apply_async`, set it, as
rate_keys.py's options set a rate key. Unlike those, a fair key is only a scheduling hint: one that is not a bounded
string is made one (fair_key_of) or dropped with a warning, and the task is published all the same. The jobs without
a key (and the hand-edited keys that are not strings) are one more group of their own, served in its turn.

The rotation (FairRotation): one cursor document per fair queue in FAIR_COLLECTION holds `last`, the key served
last. A claim takes, in one findAndModify through FAIR_INDEX, the first due job of the next turn after it in key
order (a key with due jobs, or the jobs without a key, after the last key), wrapping around, then moves the cursor
to the key it took. Which turns have due jobs a worker knows from its view of the queue, read again every
LOOK_EVERY_JOBS jobs or LOOK_EVERY (a key whose first job comes meanwhile waits for that, then its turn). A view
holds at most FairRotation.view_keys keys: past that many, it is a window of the keys after the cursor, and the
next look reads the window after it (an answer as large as the keys would pass the server's 16 MB cap). Each claim
of one job is as atomic as a plain one, so no job is taken twice; no key with due jobs in the view is passed over
for more than one turn (two workers that read the same cursor at once may both serve the key after it). A batch
(Claims.claim_many) reads the jobs of as many turns as it wants, one read per turn among them, and takes them with
one write, as an unfair batch does; while one key alone has due jobs there is nothing to rotate, and the claims are
an unfair queue's (bb_claim, the claim order), no cursor read or written. An unfair queue's claim reads no cursor,
no view, and writes none.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pymongo import ASCENDING, IndexModel
from pymongo.collection import Collection as MongoCollection
from pymongo.errors import OperationFailure

from bb_broker.jobs.document import CLAIMED_FIELDS, Claimed, utf8_encodable
from bb_broker.jobs.indexes import CLAIM_ORDER, Hint, ensure_plain_indexes, hinted
from bb_broker.jobs.lifecycle import QUEUED
from bb_broker.jobs.unique import UniqueOptionError, digest, option_key, shown
from bb_broker.server import is_missing_hinted_index

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The header of a task message that carries its job's fair key.
FAIR_KEY_HEADER = "bb_fair_key"
#: The longest key kept as it is; a longer one (or one that is not a string) is kept as a digest of itself.
MAX_FAIR_KEY_LENGTH = 512
#: The options, as task attributes (`@app.task(fair_on=("customer_id",))`) and as `apply_async` keyword arguments;
#: a call's own override the task's.
OPTION_NAMES = ("fair_key", "fair_on")

#: The rotation cursors of the fair queues: one document per queue, `_id` its name, `last` the key served last.
FAIR_COLLECTION = "bb_fair"
#: The order a fair claim walks a queue in: by key, then in each key as a plain claim does.
FAIR_ORDER = [("fairKey", ASCENDING), *CLAIM_ORDER]
#: Created when a queue is first made fair (Operations.set_limits, or the first fair claim), never before: a
#: deployment without fair queues pays nothing for it. Partial on the queued jobs: a job leaves it when claimed.
FAIR_INDEX_NAME = "bb_fair"
FAIR_INDEX = IndexModel(
    [("queue", ASCENDING), ("status", ASCENDING), *FAIR_ORDER],
    name=FAIR_INDEX_NAME,
    partialFilterExpression={"status": QUEUED},
)

#: The jobs of the "no key" group: no key, or a hand-edited one that is not a string, an array among them (whose
#: string element `$type: "string"` would match, as the keys' own reads leave arrays out).
NO_KEY: dict[str, Any] = {"$or": [{"fairKey": {"$not": {"$type": "string"}}}, {"fairKey": {"$type": "array"}}]}


def is_fair_key(value: Any) -> bool:
    # UTF-8 text only: a lone surrogate ("\ud800") makes a header no message can carry, and the publish was refused.
    return isinstance(value, str) and 0 < len(value) <= MAX_FAIR_KEY_LENGTH and utf8_encodable(value)


def fair_key_of(value: Any, task_name: str) -> str | None:
    """The fair key a `fair_key` option's value gives: a non-empty string of at most MAX_FAIR_KEY_LENGTH characters
    as it is; any other JSON value (a number, a longer string, a document) as the task name and a SHA-256 of it, so
    that equal values still share a key; None (no key), with a warning, for an empty string or what is not JSON."""
    if is_fair_key(value):
        return str(value)
    if not (isinstance(value, str) and not value):
        try:
            return f"{task_name}:{digest(value, task_name, option='fair')}"
        except (UniqueOptionError, RecursionError):  # not JSON, or nested past what JSON encodes
            pass
    logger.warning("%s: fair_key %s is not a key: the job is published without one", task_name, shown(value))
    return None


def publish_fair_key(
    task: Any,
    call: Mapping[str, Any],
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    run: Callable[..., Any] | None,
) -> str | None:
    """The fair key of a publish from its options (the call's over the task's), None for none. Never raises: options
    that make no key (fair_on naming an argument the task does not have, both options at once, arguments that are not
    JSON) are logged and the task is published without one."""
    given = call.get("fair_key")
    if given is None and call.get("fair_on") is None and task is not None:
        given = getattr(task, "fair_key", None)
    try:
        if given is not None and call.get("fair_on") is None:
            return fair_key_of(given, task_name)
        key = option_key("fair", task, call, task_name, args, kwargs, run, max_length=MAX_FAIR_KEY_LENGTH)
        return key if key is None or is_fair_key(key) else fair_key_of(key, task_name)
    except (UniqueOptionError, RecursionError) as exc:
        logger.warning("%s: %s: the job is published without a fair key", task_name, exc)
        return None


def stored_fair_key(header: Any) -> str | None:
    """The `fairKey` of a job from its message's header: a key, else none (a hand-made message's bad header is a
    scheduling hint lost, never a task refused)."""
    return header if is_fair_key(header) else None


#: A turn of the rotation: a fair key, or None for the jobs without one.
Turn = str | None
#: How long a worker's view of the turns with due jobs serves before it is read again: this many of its claimed jobs,
#: or this long, whichever comes first. A key whose first job comes meanwhile waits for the next look, then its turn.
LOOK_EVERY_JOBS = 32
LOOK_EVERY = timedelta(seconds=1)


def _rotation(turns: tuple[Turn, ...], last: Turn) -> list[Turn]:
    """`turns` (the keys in key order, then None if jobs without a key are due) in the order a claim tries them after
    `last` was served: the keys after it, then the jobs without a key, then the keys from the first (the rotation
    wrapped around). After the jobs without a key, or before any claim, the keys from the first."""
    keys = [turn for turn in turns if turn is not None]
    unkeyed: list[Turn] = [None] if None in turns else []
    if last is None:
        return [*keys, *unkeyed]
    return [key for key in keys if key > last] + unkeyed + [key for key in keys if key <= last]


def _of_turn(due: dict[str, Any], turn: Turn) -> dict[str, Any]:
    """The filter of a turn's due jobs."""
    if turn is not None:
        return {**due, "fairKey": turn}
    return {**due, **NO_KEY} if "$or" not in due else {"$and": [due, NO_KEY]}


@dataclass(frozen=True)
class _View:
    """What a worker last read of a fair queue's turns: those with due jobs, as they were at `read_at`."""

    turns: tuple[Turn, ...]
    read_at: datetime
    #: Jobs this view may still hand out before it is read again.
    jobs_left: int
    #: Whether the view is a window of the keys (there were more than FairRotation.view_keys): `turns` are then
    #: the rotation's next turns after `start` (the cursor's `last` when it was read): the keys after it in key
    #: order, and if they reach the last key, the jobs without a key and the first keys, up to view_keys keys. A
    #: claim takes the window's turns after the cursor's place in it, never wrapping around inside it: past its end
    #: (or with the cursor moved out of it by another worker), the next look reads the window after.
    window: bool = False
    start: Turn = None


class FairRotation:
    """The rotation of the fair queues of one `jobs` collection: the cursors (FAIR_COLLECTION, in the same
    database), and this process's view of each queue's turns.

    The view (its turns with due jobs: one aggregation of the keys, one read for the jobs without a key) is looked
    at again after LOOK_EVERY_JOBS jobs or LOOK_EVERY (one read: is a due job outside it?), and read again when one
    is or every turn it has was found empty; a turn found empty leaves it until then. While it holds one turn alone
    (one key's backlog), there is nothing to rotate: the claims are an unfair queue's, no cursor read or written.
    With more, a claim reads the cursor, claims the next turn after it, and moves it there. With more keys than
    `view_keys`, the view is a window of them (_View.window), read again at each look.

    Owned by one JobStore; its claims run on the transport's claim threads (transport/claims.py)."""

    #: The most keys a view holds, and a look reads: a window of the keys beyond it. Bounds a look's answer (the keys
    #: of 1,000 jobs of MAX_FAIR_KEY_LENGTH characters are half a megabyte), its `$nin` and a claim's rotation.
    view_keys = 1000

    def __init__(self, jobs: MongoCollection, hint: Hint, now: Callable[[], datetime]) -> None:
        self.jobs = jobs
        self.cursors: MongoCollection = jobs.database[FAIR_COLLECTION]
        self._hint = hint
        self._now = now
        # Replaced whole, never changed in place: the claims of one process run on two threads (transport/claims.py),
        # and a view read by one while the other replaces it is only a turn out of date.
        self._views: dict[str, _View] = {}
        #: The cursor's `last` as this process last read or wrote it (absent: never).
        self._cursor_seen: dict[str, Turn] = {}

    def claim(
        self,
        queue: str,
        due: dict[str, Any],
        claim_one: Callable[[dict[str, Any], dict[str, Any]], Claimed | None],
    ) -> Claimed | None:
        """The next due job of `queue` in its rotation: `claim_one(filter, find_options)` takes the first job of a
        filter (one findAndModify), tried for each turn in the rotation's order until one has a job."""
        options = {"sort": FAIR_ORDER, **self._hint(FAIR_INDEX_NAME, "findAndModify")}
        view, looked = self._view(queue, due)
        while True:
            order = self._order(queue, view)
            rotating = view.window or len(order) > 1
            for turn in order:
                if not rotating:  # one turn alone, nothing to rotate: the plain claim, its index and order
                    taken = claim_one(due, {"sort": CLAIM_ORDER, **self._hint("bb_claim", "findAndModify")})
                else:
                    taken = self._indexed(claim_one, _of_turn(due, turn), options)
                if taken is not None:
                    self._served(queue, turn if rotating else taken.fair_key, 1)
                    return taken
                view = self._found_empty(queue, turn)
            if looked:
                return None
            view, looked = self._look(queue, due), True

    def heads(self, queue: str, due: dict[str, Any], wanted: int) -> list[dict[str, Any]]:
        """The `wanted` jobs (CLAIMED_FIELDS) that as many claims of one job would take next, read and not taken
        (Claims.claim_many takes them with one write): a turn each, one read per turn among them."""
        view, looked = self._view(queue, due)
        while True:
            order = self._order(queue, view)
            if len(order) == 1 and not view.window:  # one turn alone, nothing to rotate: the plain read, its order
                plain = self._plain_first(due, wanted)
                if plain:
                    key = plain[-1].get("fairKey")
                    self._served(queue, key if isinstance(key, str) else None, len(plain))
                    return plain
                order, view = [], self._found_empty(queue, order[0])
            # A whole view's turns round again for a batch larger than they are; a window's never do: past its end,
            # the next look reads the window after.
            plan = order[:wanted] if view.window else [order[n % len(order)] for n in range(wanted)] if order else []
            found = {turn: self._indexed(self._first, due, turn, count) for turn, count in Counter(plan).items()}
            for turn, count in Counter(plan).items():
                if len(found[turn]) < count:
                    view = self._found_empty(queue, turn)
            waiting = {turn: deque(jobs) for turn, jobs in found.items()}
            heads: list[dict[str, Any]] = []
            last: Turn = None
            for turn in plan:
                if waiting[turn]:
                    heads.append(waiting[turn].popleft())
                    last = turn
            if heads:
                self._served(queue, last, len(heads))
                return heads
            if looked:
                return []
            view, looked = self._look(queue, due), True

    def _plain_first(self, due: dict[str, Any], count: int) -> list[dict[str, Any]]:
        coll, hint = self.jobs, self._hint("bb_claim", "find")
        return hinted(coll, lambda: list(coll.find(due, CLAIMED_FIELDS, sort=CLAIM_ORDER, limit=count, **hint)))

    def _first(self, due: dict[str, Any], turn: Turn, count: int) -> list[dict[str, Any]]:
        return list(
            self.jobs.find(
                _of_turn(due, turn),
                CLAIMED_FIELDS,
                sort=FAIR_ORDER,
                limit=count,
                **self._hint(FAIR_INDEX_NAME, "find"),
            )
        )

    def _view(self, queue: str, due: dict[str, Any]) -> tuple[_View, bool]:
        """This process's view of `queue`'s turns, read again if it is spent or old; whether it was read now."""
        view = self._views.get(queue)
        if view is None or view.jobs_left <= 0 or not view.read_at <= self._now() < view.read_at + LOOK_EVERY:
            return self._look(queue, due), True
        return view, False

    def _look(self, queue: str, due: dict[str, Any]) -> _View:
        """Read which turns of `queue` have due jobs. A whole view with turns left is kept if no due job is outside
        them (one read through the index); else the first keys are read (one aggregation, view_keys + 1 of them at
        most), and whether jobs without a key are due (one read). Past view_keys keys, a window is read instead."""
        view = self._views.get(queue)
        if view is not None and view.turns and not view.window and self._indexed(self._none_outside, due, view.turns):
            view = replace(view, read_at=self._now(), jobs_left=LOOK_EVERY_JOBS)
        else:
            keys = self._indexed(self._keys_after, due, None)
            if len(keys) <= self.view_keys:
                unkeyed = not self._indexed(self._none_outside, due, tuple(keys))
                view = _View((*keys, *([None] if unkeyed else [])), self._now(), LOOK_EVERY_JOBS)
            else:
                view = self._window(queue, due, keys)
        self._views[queue] = view
        return view

    def _window(self, queue: str, due: dict[str, Any], first_keys: list[str]) -> _View:
        """A view of the rotation's next view_keys keys after the cursor: the keys after it (`first_keys`, the first
        keys of all, when it is at the start), and if they reach the last key, the jobs without a key (when due)
        and the first keys again."""
        start = self._cursor_last(queue)
        keys = first_keys if start is None else self._indexed(self._keys_after, due, start)
        turns: list[Turn] = list(keys[: self.view_keys])
        if start is not None and len(keys) <= self.view_keys:  # the rotation's end: it wraps around
            if self._indexed(self._any_unkeyed, due):
                turns.append(None)
            turns += [key for key in first_keys if key <= start][: self.view_keys - len(keys)]
        return _View(tuple(turns), self._now(), LOOK_EVERY_JOBS, window=True, start=start)

    def _keys_after(self, due: dict[str, Any], after: str | None) -> list[str]:
        """The first view_keys + 1 keys of the due jobs after `after` (from the first when None), in BSON's order
        of strings (code point order, as Python's). One aggregation: a `distinct` answers every key at once, past
        16 MB refused."""
        # Strings only: `$type` and `$gt` match an array holding one (a hand edit), which $group would make a key.
        keys: dict[str, Any] = {"$type": "string"} if after is None else {"$gt": after}
        keys["$not"] = {"$type": "array"}
        pipeline: list[dict[str, Any]] = [
            {"$match": {**due, "fairKey": keys}},
            {"$group": {"_id": "$fairKey"}},
            {"$sort": {"_id": ASCENDING}},
            {"$limit": self.view_keys + 1},
        ]
        found = self.jobs.aggregate(pipeline, **self._hint(FAIR_INDEX_NAME, "aggregate"))
        return sorted(document["_id"] for document in found)

    def _any_unkeyed(self, due: dict[str, Any]) -> bool:
        unkeyed = _of_turn(due, None)
        return self.jobs.find_one(unkeyed, {"_id": 1}, **self._hint(FAIR_INDEX_NAME, "find")) is not None

    def _none_outside(self, due: dict[str, Any], turns: tuple[Turn, ...]) -> bool:
        """Whether no due job is outside `turns` (a hand-edited key that is neither a string nor null always is)."""
        outside = {**due, "fairKey": {"$nin": list(turns)}}
        return self.jobs.find_one(outside, {"_id": 1}, **self._hint(FAIR_INDEX_NAME, "find")) is None

    def _order(self, queue: str, view: _View) -> list[Turn]:
        """The view's turns in the order a claim tries them: from the cursor's, read here, when there are two or
        more to rotate. A window's are those after the cursor, none once it is past the window's end (or wrapped
        around through the jobs without a key): the next look reads the window after it."""
        if len(view.turns) <= 1 and not view.window:
            return list(view.turns)
        last = self._cursor_last(queue)
        if not view.window:
            return _rotation(view.turns, last)
        if last == view.start:
            return list(view.turns)
        return list(view.turns[view.turns.index(last) + 1 :]) if last in view.turns else []

    def _cursor_last(self, queue: str) -> Turn:
        """The cursor's `last` (None before any claim, or after the jobs without a key), as read now."""
        cursor = self.cursors.find_one({"_id": queue}, {"last": 1}) or {}
        last = cursor.get("last") if isinstance(cursor.get("last"), str) else None
        self._cursor_seen[queue] = last
        return last

    def _served(self, queue: str, turn: Turn, jobs: int) -> None:
        """`jobs` claimed, the last of them in `turn`: the cursor moves there (unless it is there already, as far as
        this process saw), and the view has that many fewer jobs to hand out."""
        view = self._views.get(queue)
        if view is not None:
            self._views[queue] = replace(view, jobs_left=view.jobs_left - jobs)
        if queue not in self._cursor_seen or self._cursor_seen[queue] != turn:
            self.cursors.update_one({"_id": queue}, {"$set": {"last": turn}}, upsert=True)
            self._cursor_seen[queue] = turn

    def _found_empty(self, queue: str, turn: Turn) -> _View:
        """`turn` had no due job: it leaves the view until the next look."""
        view = self._views[queue]
        view = replace(view, turns=tuple(other for other in view.turns if other != turn))
        self._views[queue] = view
        return view

    def _indexed(self, query: Callable[..., T], *args: Any) -> T:
        """`query(*args)`, through FAIR_INDEX: made here, once, if it is missing (a queue made fair by a hand edit,
        or the index dropped), and the query made again."""
        try:
            return query(*args)
        except OperationFailure as exc:
            if not is_missing_hinted_index(exc):
                raise
        logger.warning("the fair claims' index of %s is missing; creating it", self.jobs.full_name)
        ensure_plain_indexes(self.jobs, [FAIR_INDEX])
        return query(*args)
