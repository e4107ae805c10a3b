"""Unique jobs: at most one job per key, refused by a unique index at the insert, released by the job's own writes.

A task message's headers say its key and how long the key is held (its mode):

- UNIQUE_KEY_HEADER: the key (a non-empty string of at most MAX_UNIQUE_KEY_LENGTH characters);
- UNIQUE_MODE_HEADER: `queued` (held until a worker claims the job), `active` (until it ends: queued or running),
  `period` (in every status, for UNIQUE_PERIOD_HEADER seconds: the period's time bucket, on the server's clock, is
  folded into the stored key), or `forever` (never given back but by deleting the job), the mode of a key without
  this header: `celery beat` on bb_broker.beat keys each slot's job `beat:<entry>:<slot>` so.

Each mode keeps its key in a field of its own (HOLD_FIELDS), under a partial unique index over the documents that
have it, so that the writes that end a hold need no read and no condition: a claim unsets `uniqueQueued`, the write
that settles a job unsets `uniqueActive`, a cancel or revoke unsets all three of the modes that give keys back. The
job also keeps `unique: {key, mode}`, not indexed, for the people who look at it. A key is unique among the jobs of
its mode: the same string in two modes is two keys (a key derived from the arguments names the task anyway).

The Celery side (`@app.task(unique=True)`, `apply_async(unique_key=...)`) is UniqueOptions: the options read from
the task and the call, turned into those headers by a `before_task_publish` receiver (bb_broker.worker.publish_headers).
Celery's signals swallow what a receiver raises, so a bad option travels as UNIQUE_REFUSED_HEADER and the transport
raises UniqueOptionError before it writes anything.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pymongo import ASCENDING, IndexModel

from bb_broker.jobs.refusals import PublishRefused

#: The header of a task message that carries its job's unique key.
UNIQUE_KEY_HEADER = "bb_unique_key"
#: How long the key is held (MODES); a key without it is held forever.
UNIQUE_MODE_HEADER = "bb_unique_mode"
#: The period of the `period` mode, in seconds.
UNIQUE_PERIOD_HEADER = "bb_unique_period"
#: Why the publisher's unique options are refused: the transport raises UniqueOptionError with it, writing nothing.
UNIQUE_REFUSED_HEADER = "bb_unique_refused"
#: The longest key a header may carry (an index key must stay well below the server's limits).
MAX_UNIQUE_KEY_LENGTH = 512

QUEUED_MODE, ACTIVE_MODE, PERIOD_MODE, FOREVER_MODE = "queued", "active", "period", "forever"
MODES = (QUEUED_MODE, ACTIVE_MODE, PERIOD_MODE, FOREVER_MODE)
#: The modes a caller chooses with `unique_while` (the period mode is chosen by giving `unique_period`).
WHILE_MODES = (QUEUED_MODE, ACTIVE_MODE)

#: The field that holds a key in each mode; `uniqueKey` (forever) is the beat's, as it was before the modes.
HOLD_FIELDS = {
    FOREVER_MODE: "uniqueKey",
    QUEUED_MODE: "uniqueQueued",
    ACTIVE_MODE: "uniqueActive",
    PERIOD_MODE: "uniquePeriod",
}
#: The `$unset` of the claim: a `queued` key is free once a worker holds the job.
RELEASED_BY_CLAIM = {HOLD_FIELDS[QUEUED_MODE]: ""}
#: The `$unset` of a job's end, succeeded or failed for good (an `active` key; a `queued` one is gone already unless
#: the job never ran).
RELEASED_AT_END = {HOLD_FIELDS[QUEUED_MODE]: "", HOLD_FIELDS[ACTIVE_MODE]: ""}
#: The `$unset` of a cancel or revoke: every key but the beat's.
RELEASED_BY_CANCEL = {HOLD_FIELDS[mode]: "" for mode in (QUEUED_MODE, ACTIVE_MODE, PERIOD_MODE)}


def _index(mode: str, name: str) -> IndexModel:
    field = HOLD_FIELDS[mode]
    return IndexModel([(field, ASCENDING)], name=name, unique=True, partialFilterExpression={field: {"$exists": True}})


UNIQUE_INDEX = _index(FOREVER_MODE, "bb_unique_key")
UNIQUE_INDEXES = [
    UNIQUE_INDEX,
    _index(QUEUED_MODE, "bb_unique_queued"),
    _index(ACTIVE_MODE, "bb_unique_active"),
    _index(PERIOD_MODE, "bb_unique_period"),
]


class DuplicateJob(Exception):
    """A job with this unique key exists already: the publish wrote nothing.

    `task_id` and `job_id` are the existing job's, read once after the index refused the insert (None when that job
    was deleted in between). With the `bbmongo://` result backend, `AsyncResult(exc.task_id).get()` waits for the
    existing job's outcome."""

    def __init__(self, unique_key: str, task_id: str | None, job_id: str | None) -> None:
        # The fields as its args: pickle, and Celery's serialized exceptions, rebuild it as cls(*args).
        super().__init__(unique_key, task_id, job_id)
        self.unique_key = unique_key
        self.task_id = task_id
        self.job_id = job_id

    def __str__(self) -> str:
        return f"a job with unique key {self.unique_key!r} exists already (task id {self.task_id})"


class UniqueOptionError(PublishRefused, ValueError, TypeError):
    """A unique or serial option that cannot make a key (a key that is not a bounded string, an unknown mode, a
    period that is not a positive number, `unique_on` or `serial_on` naming an argument the task does not have):
    nothing was published.

    Both a ValueError and a TypeError, as the option was a wrong value or of a wrong type."""


@dataclass(frozen=True)
class Hold:
    """The key a job is stored with and the mode that holds it (the stored key has the period's bucket in it)."""

    key: str
    mode: str

    @property
    def field(self) -> str:
        return HOLD_FIELDS[self.mode]

    def fields(self) -> dict[str, Any]:
        """What a new job document gets: the holding field, and `unique` for display."""
        return {self.field: self.key, "unique": {"key": self.key, "mode": self.mode}}


def hold_of(headers: Mapping[str, Any], now: Callable[[], datetime]) -> Hold | None:
    """The hold a task message's (already validated) headers ask for, the period's bucket taken at `now()`."""
    key = headers.get(UNIQUE_KEY_HEADER)
    if key is None:
        return None
    mode = headers.get(UNIQUE_MODE_HEADER) or FOREVER_MODE
    if mode == PERIOD_MODE:
        key = f"{key}@{period_bucket(float(headers[UNIQUE_PERIOD_HEADER]), now())}"
    return Hold(str(key), str(mode))


def period_bucket(period: float, now: datetime) -> str:
    """The start of the period `now` falls in, counted from the Unix epoch: the same in every publisher."""
    seconds = math.floor(now.timestamp() / period) * period
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


def header_problem(headers: Mapping[str, Any]) -> tuple[str, str, Any] | None:
    """What is wrong with a message's unique headers, as (header, expected, value); None when nothing is."""
    key_expected = f"a non-empty string of at most {MAX_UNIQUE_KEY_LENGTH} characters"
    if UNIQUE_KEY_HEADER in headers and not valid_key(headers[UNIQUE_KEY_HEADER]):
        return UNIQUE_KEY_HEADER, key_expected, headers[UNIQUE_KEY_HEADER]
    mode = headers.get(UNIQUE_MODE_HEADER, FOREVER_MODE)
    if mode not in MODES:
        return UNIQUE_MODE_HEADER, f"one of {', '.join(MODES)}", mode
    if (UNIQUE_MODE_HEADER in headers or UNIQUE_PERIOD_HEADER in headers) and UNIQUE_KEY_HEADER not in headers:
        return UNIQUE_KEY_HEADER, f"present with {UNIQUE_MODE_HEADER} or {UNIQUE_PERIOD_HEADER}", None
    period = headers.get(UNIQUE_PERIOD_HEADER)
    if mode == PERIOD_MODE and not valid_period(period):
        return UNIQUE_PERIOD_HEADER, f"{PERIOD_EXPECTED} with the period mode", period
    if mode != PERIOD_MODE and UNIQUE_PERIOD_HEADER in headers:
        return UNIQUE_PERIOD_HEADER, f"absent unless {UNIQUE_MODE_HEADER} is {PERIOD_MODE}", period
    return None


def valid_key(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_UNIQUE_KEY_LENGTH


#: The shortest period, in seconds: its bucket is written to the millisecond.
MIN_PERIOD = 0.001

#: What a period must be, as errors say it.
PERIOD_EXPECTED = f"a number of seconds, at least {MIN_PERIOD}"


def valid_period(value: Any) -> bool:
    # Compared, not given to math.isfinite: a JSON header holds an int of any size, and one no float holds raises
    # there (NaN and infinity fail the comparisons).
    return isinstance(value, (int, float)) and not isinstance(value, bool) and MIN_PERIOD <= value <= sys.float_info.max


# --- the Celery options ------------------------------------------------------

#: The options, as task attributes (`@app.task(unique=True, unique_on=("account_id",))`) and as `apply_async`
#: keyword arguments; a call's own override the task's.
OPTION_NAMES = ("unique", "unique_key", "unique_on", "unique_while", "unique_period")


@dataclass(frozen=True)
class UniqueOptions:
    """The unique options of one publish: the task's, then the call's over them.

    `unique`: True makes the job unique (implied by any other option), False (a call's) turns off the task's.
    `unique_key`: the key itself; else the task name and a SHA-256 of the arguments as canonical JSON, all of them
    or those `unique_on` names (parameter names, or positions of the positional arguments).
    `unique_while`: `active` (held while queued or running, the default) or `queued` (until a worker claims it).
    `unique_period`: seconds: held in every status within the period (its time bucket is part of the key)."""

    unique: Any = None
    unique_key: Any = None
    unique_on: Any = None
    unique_while: Any = None
    unique_period: Any = None

    @classmethod
    def read(cls, task: Any, call: Mapping[str, Any]) -> UniqueOptions:
        """The task's attributes, then the call's options over them; a call's `unique=False` turns them all off."""
        if call.get("unique") is False:
            return cls(unique=False)
        values = {name: getattr(task, name, None) for name in OPTION_NAMES} if task is not None else {}
        values.update({name: call[name] for name in OPTION_NAMES if call.get(name) is not None})
        return cls(**values)

    @property
    def wanted(self) -> bool:
        if self.unique is False:
            return False
        return self.unique is not None or any(getattr(self, name) is not None for name in OPTION_NAMES[1:])

    def headers(
        self, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any], run: Callable[..., Any] | None
    ) -> dict[str, Any]:
        """The headers of a publish with these options; UniqueOptionError says why they cannot be made.

        `run`: the task's function, whose signature maps `unique_on`'s names to positional arguments (None for a
        task this process does not have: then only keyword arguments are found by name)."""
        if not self.wanted:
            return {}
        if self.unique not in (None, True):
            raise UniqueOptionError(f"unique must be True or False, not {self.unique!r}")
        mode = self._mode()
        headers: dict[str, Any] = {UNIQUE_KEY_HEADER: self._key(task_name, args, kwargs, run), UNIQUE_MODE_HEADER: mode}
        if mode == PERIOD_MODE:
            headers[UNIQUE_PERIOD_HEADER] = self.unique_period
        return headers

    def _mode(self) -> str:
        if self.unique_period is not None:
            if not valid_period(self.unique_period):
                raise UniqueOptionError(f"unique_period must be {PERIOD_EXPECTED}, not {self.unique_period!r}")
            if self.unique_while is not None:
                raise UniqueOptionError(
                    "unique_period and unique_while do not go together: a period holds the key in every status"
                )
            return PERIOD_MODE
        mode = ACTIVE_MODE if self.unique_while is None else self.unique_while
        if mode not in WHILE_MODES:
            raise UniqueOptionError(f"unique_while must be one of {', '.join(WHILE_MODES)}, not {mode!r}")
        return str(mode)

    def _key(
        self, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any], run: Callable[..., Any] | None
    ) -> str:
        if self.unique_key is not None:
            if self.unique_on is not None:
                raise UniqueOptionError("unique_key and unique_on do not go together: the key is given")
            if not valid_key(self.unique_key):
                raise UniqueOptionError(
                    f"unique_key must be a non-empty string of at most {MAX_UNIQUE_KEY_LENGTH} characters, "
                    f"not {shown(self.unique_key)}"
                )
            return str(self.unique_key)
        if self.unique_on is None:
            hashed: Any = [list(args), dict(kwargs)]
        else:
            hashed = chosen_arguments(self.unique_on, task_name, args, kwargs, run)
        return f"{task_name}:{digest(hashed, task_name)}"


def chosen_arguments(
    names: Any,
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    run: Callable[..., Any] | None,
    option: str = "unique_on",
) -> dict[str, Any]:
    """The arguments `names` (the value of `option`) name, by name (str) or position (int), with the task's defaults
    filled in."""
    if isinstance(names, (str, int)):
        names = (names,)
    if not isinstance(names, (list, tuple)) or not names:
        raise UniqueOptionError(f"{option} must be argument names or positions, not {shown(names)}")
    bound: dict[str, Any] = dict(kwargs)
    parameters: list[str] = []
    if run is not None:
        try:
            signature = inspect.signature(run)
            call = signature.bind_partial(*args, **kwargs)
            call.apply_defaults()
            bound = dict(call.arguments)
            parameters = list(signature.parameters)
        except (TypeError, ValueError):  # a builtin without a signature, arguments that do not fit it
            pass
    chosen: dict[str, Any] = {}
    for name in names:
        if isinstance(name, int) and not isinstance(name, bool):
            if not -len(args) <= name < len(args):
                raise UniqueOptionError(f"{option} position {name} is not among the {len(args)} positional arguments")
            chosen[f"#{name % len(args)}"] = args[name]
        elif isinstance(name, str):
            if name not in bound:
                known = ", ".join(parameters or sorted(bound)) or "none"
                raise UniqueOptionError(
                    f"{option} names {name!r}, not an argument of {task_name} (its arguments: {known})"
                )
            chosen[name] = bound[name]
        else:
            raise UniqueOptionError(f"{option} must be argument names or positions, not {shown(name)}")
    return chosen


def option_key(
    option: str,
    task: Any,
    call: Mapping[str, Any],
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    run: Callable[..., Any] | None,
    *,
    max_length: int,
) -> str | None:
    """The key a publish's options `<option>_key` (the key itself) and `<option>_on` (the arguments it is made of)
    give, the call's over the task's; None: neither is set. `<option>_on` names arguments as `unique_on` does: the key
    is the task name and a SHA-256 of their values (the jobs of one account, say). UniqueOptionError says why the
    options make no key."""
    names = (f"{option}_key", f"{option}_on")
    given = {name: call[name] for name in names if call.get(name) is not None}
    if not given and task is not None:
        given = {name: getattr(task, name) for name in names if getattr(task, name, None) is not None}
    if not given:
        return None
    if len(given) == len(names):
        raise UniqueOptionError(f"{names[0]} and {names[1]} do not go together: the key is given")
    if names[0] in given:
        key = given[names[0]]
        if not (isinstance(key, str) and 0 < len(key) <= max_length):
            raise UniqueOptionError(
                f"{names[0]} must be a non-empty string of at most {max_length} characters, not {shown(key)}"
            )
        return key
    chosen = chosen_arguments(given[names[1]], task_name, args, kwargs, run, option=names[1])
    return f"{task_name}:{digest(chosen, task_name, option=option)}"


def digest(value: Any, task_name: str, option: str = "unique") -> str:
    """SHA-256 of `value` as canonical JSON (sorted keys, no spaces; Kombu's JSON for dates, UUIDs, decimals)."""
    from kombu.exceptions import EncodeError
    from kombu.utils import json as kombu_json

    try:
        text = kombu_json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, EncodeError) as exc:
        raise UniqueOptionError(
            f"the arguments of {task_name} are not JSON, so no key can be made of them ({exc}): give {option}_key, "
            f"or {option}_on naming JSON arguments"
        ) from None
    return hashlib.sha256(text.encode()).hexdigest()


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
