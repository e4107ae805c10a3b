"""Per-key serialisation: jobs that share a `serialKey` queue up freely, and at most one of them runs at a time.

A task message whose header SERIAL_KEY_HEADER holds a key becomes a job with that key in `serialKey`; the task options
`serial_key` (the key) and `serial_on` (the arguments the key is made of), on the task or on `apply_async`, set it.
The unique index SERIAL_INDEX covers only the `running` jobs that have a key, so the claim that would make a second
job of a key `running` is refused by the server in the claim's own write: nothing is read first, nothing is locked,
and a job that ends (settled, sent back, or recovered by the stale sweep) leaves the index with its status. Jobs
without a key are not in the index and pay nothing.

A refused claim names the busy key (the error's keyValue); the claimer flags the key's running job
(WAITERS_FIELD, one write, only when a key is contended), excludes the key from its next claims, and looks again when
a flagged job ends: its settling write unsets the flag (HOLDS_RELEASED), which the change stream reports. The key's
next job is then the first of them in claim order, so a key's jobs run in queue order.
"""

from __future__ import annotations

from typing import Any

from pymongo import ASCENDING, IndexModel
from pymongo.errors import DuplicateKeyError

from bb_broker.jobs.lifecycle import RUNNING

#: The header of a task message that carries its job's serialisation key.
SERIAL_KEY_HEADER = "bb_serial_key"
#: The longest key (an index key must stay well below the server's limits).
MAX_SERIAL_KEY_LENGTH = 512
SERIAL_INDEX_NAME = "bb_serial_key_running"

SERIAL_INDEX = IndexModel(
    [("serialKey", ASCENDING)],
    name=SERIAL_INDEX_NAME,
    unique=True,
    partialFilterExpression={"serialKey": {"$exists": True}, "status": RUNNING},
)

#: Set on the running job of a key whose next job a claim found waiting; its removal wakes the waiting consumers.
WAITERS_FIELD = "serialWaiters"


#: The options, as task attributes (`@app.task(serial_on=("account_id",))`) and as `apply_async` keyword arguments;
#: a call's own override the task's.
OPTION_NAMES = ("serial_key", "serial_on")


def is_serial_key(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_SERIAL_KEY_LENGTH


def busy_key(exc: DuplicateKeyError) -> tuple[bool | None, Any]:
    """Whether a claim's DuplicateKeyError is SERIAL_INDEX's (None when the server names no index: FerretDB's
    refusals do not, and the caller tells by a read), and then the key it names (None when the server did not say:
    the caller reads it)."""
    details = exc.details or {}
    pattern = details.get("keyPattern")
    message = str(details.get("errmsg", ""))
    ours: bool | None
    if isinstance(pattern, dict):
        ours = list(pattern) == ["serialKey"]
    elif SERIAL_INDEX_NAME in message or "serialKey" in message:
        ours = True
    elif "limitSlot" in message or "bb_limit_slot" in message:
        ours = False
    else:
        ours = None
    value = details.get("keyValue")
    return ours, value.get("serialKey") if isinstance(value, dict) else None
