"""Fair queues: in a queue made fair (`bb-broker limit mail --fair`), the claims rotate across the fair keys that have
due jobs (the mail of each customer, say), so that one key's backlog delays another key's job by about one job per
active key, not by the whole backlog.

A task message whose header FAIR_KEY_HEADER holds a key becomes a job with that key in `fairKey`; the task options
`fair_key` (the key) and `fair_on` (the arguments the key is made of), on the task or on `apply_async`, set it, as
rate_keys.py's options set a rate key. Unlike those, a fair key is only a scheduling hint: one that is not a bounded
string is made one (fair_key_of) or dropped with a warning, and the task is published all the same. The jobs without
a key (and the hand-edited keys that are not strings) are one more group of their own, served in its turn.

The rotation (FairRotation): one cursor document per fair queue in FAIR_COLLECTION holds `last`, the key served
last. A claim takes, in one findAndModify through FAIR_INDEX, the first due job whose key comes after it in key
order, wrapping around through the jobs without a key, then moves the cursor to the key it took. Each claim of one
job is as atomic as a plain one (one findAndModify), so no job is taken twice; the cursor only moves forward in key
order, so no key with due jobs is passed over for more than one turn of the rotation (two workers that read the
same cursor at once may both serve the key after it, which is all the concurrency costs). An unfair queue's claim
reads no cursor and writes none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pymongo import ASCENDING, IndexModel
from pymongo.collection import Collection as MongoCollection
from pymongo.errors import OperationFailure

from bb_broker.jobs.document import Claimed
from bb_broker.jobs.indexes import CLAIM_ORDER, Hint, ensure_plain_indexes
from bb_broker.jobs.lifecycle import QUEUED
from bb_broker.jobs.unique import UniqueOptionError, digest, option_key, shown
from bb_broker.server import is_missing_hinted_index

logger = logging.getLogger(__name__)

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

#: The jobs of the "no key" group: no key, or a hand-edited one that is not a string.
NO_KEY: dict[str, Any] = {"$not": {"$type": "string"}}


def is_fair_key(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_FAIR_KEY_LENGTH


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
        return option_key("fair", task, call, task_name, args, kwargs, run, max_length=MAX_FAIR_KEY_LENGTH)
    except (UniqueOptionError, RecursionError) as exc:
        logger.warning("%s: %s: the job is published without a fair key", task_name, exc)
        return None


def stored_fair_key(header: Any) -> str | None:
    """The `fairKey` of a job from its message's header: a key, else none (a hand-made message's bad header is a
    scheduling hint lost, never a task refused)."""
    return header if is_fair_key(header) else None


def _turns(last: Any) -> Iterator[dict[str, Any]]:
    """The `fairKey` conditions a claim tries in turn after the key `last` was served: the keys after it, then the
    jobs without a key, then the keys from the first (the rotation wrapped around)."""
    if isinstance(last, str):
        yield {"$gt": last}
        yield NO_KEY
        yield {"$type": "string", "$lte": last}
    else:  # the jobs without a key were served last, or none yet
        yield {"$type": "string"}
        yield NO_KEY


class FairRotation:
    """The rotation cursors of the fair queues of one `jobs` collection (FAIR_COLLECTION, in the same database)."""

    def __init__(self, jobs: MongoCollection, hint: Hint) -> None:
        self.jobs = jobs
        self.cursors: MongoCollection = jobs.database[FAIR_COLLECTION]
        self._hint = hint

    def claim(
        self,
        queue: str,
        due: dict[str, Any],
        claim_one: Callable[[dict[str, Any], dict[str, Any]], Claimed | None],
    ) -> Claimed | None:
        """The next due job of `queue` in its rotation: `claim_one(filter, find_options)` takes the first job of a
        filter (one findAndModify); the cursor then moves to its key."""
        cursor = self.cursors.find_one({"_id": queue}, {"last": 1}) or {}
        last = cursor.get("last")
        options = {"sort": FAIR_ORDER, **self._hint(FAIR_INDEX_NAME, "findAndModify")}
        for turn in _turns(last):
            try:
                taken = claim_one({**due, "fairKey": turn}, options)
            except OperationFailure as exc:
                if not is_missing_hinted_index(exc):
                    raise
                # Made fair by a hand edit, or the index dropped: made here, once, and the claim made again.
                logger.warning("the fair claims' index of %s is missing; creating it", self.jobs.full_name)
                ensure_plain_indexes(self.jobs, [FAIR_INDEX])
                taken = claim_one({**due, "fairKey": turn}, options)
            if taken is not None:
                if taken.fair_key != last or not cursor:
                    self.cursors.update_one({"_id": queue}, {"$set": {"last": taken.fair_key}}, upsert=True)
                return taken
        return None
