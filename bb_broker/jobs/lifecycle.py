"""The job lifecycle rules: statuses, retry backoff, final attempt and staleness, free of I/O."""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeGuard

QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED)
#: What the counts per status can be broken down by (`bb-broker status --by`).
BREAKDOWNS = ("queue", "kind")

#: lastError is for people to read; a whole traceback belongs in the logs.
MAX_ERROR_LENGTH = 2000

#: The longest backoff between two attempts, and the doublings past which it is always reached (a float's range
#: holds any finite backoff_base times 2**64).
MAX_BACKOFF = timedelta(days=7)
MAX_BACKOFF_DOUBLINGS = 64

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def is_duration(value: str) -> bool:
    return bool(_DURATION.match(str(value).lower()))


#: The words a yes or a no may be given as (from JSON, an environment variable, a URL, a form, the CLI).
YES, NO = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def yes_or_no(value: object) -> bool | None:
    """A bool as an operator or a configuration gives it (a bool, or one of YES and NO), None for anything else."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    return True if word in YES else False if word in NO else None


def whole_number(value: object) -> TypeGuard[int]:
    """An int as a document or a message holds one: BSON's 64-bit ones (a subclass of int) too, never a bool (True is
    no count) nor a double."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_duration(value: str) -> timedelta:
    """30s, 30m, 2h, 7d, 1w, or a number of seconds (never nan, inf or negative); ValueError says why not."""
    match = _DURATION.match(str(value).lower())
    if not match:
        raise ValueError(f"{value!r} is not a duration: use e.g. 30m, 2h or 7d")
    try:
        return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    except OverflowError:  # beyond timedelta's 999999999 days, or digits that make an infinite float
        raise ValueError(f"{reprlib.repr(value)} is too long a duration") from None


@dataclass(frozen=True)
class Policy:
    """The tunables of the lifecycle; the defaults are the seed's."""

    max_attempts: int = 3
    backoff_base: float = 5.0
    stale_after: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts!r}")
        if not math.isfinite(self.backoff_base) or self.backoff_base < 0:
            raise ValueError(f"backoff_base must be a number of seconds, not negative, got {self.backoff_base!r}")
        if not math.isfinite(self.stale_after) or self.stale_after <= 0:
            raise ValueError(f"stale_after must be a positive number of seconds, got {self.stale_after!r}")

    def backoff(self, attempts: int) -> timedelta:
        """Delay before the next attempt after `attempts` failed ones: 10 s, then 20 s, doubling up to MAX_BACKOFF
        (2**attempts soon outgrows what a date can hold, under a policy of many attempts)."""
        doublings = min(max(attempts, 0), MAX_BACKOFF_DOUBLINGS)
        return timedelta(seconds=min(self.backoff_base * 2.0**doublings, MAX_BACKOFF.total_seconds()))

    def is_final_attempt(self, attempts: int) -> bool:
        return attempts >= self.max_attempts

    @property
    def heartbeat_interval(self) -> float:
        """How often a worker refreshes the leases of its live jobs: well inside stale_after."""
        return self.stale_after / 5

    @property
    def sweep_interval(self) -> float:
        """How often each worker looks for stale jobs, so a lost job waits at most ~1.5 x stale_after."""
        return self.stale_after / 2


@dataclass(frozen=True)
class Outcome:
    """Where a failed attempt leaves its job."""

    status: str
    last_error: str
    run_after: datetime | None = None


def after_failure(
    policy: Policy, attempts: int, error: str, now: datetime, *, retryable: bool = True, backoff: bool = True
) -> Outcome:
    """A failed attempt goes back to the queue (with backoff unless told otherwise) until the attempts are used up."""
    error = error[:MAX_ERROR_LENGTH]
    countdown = retry_countdown(policy, attempts, retryable=retryable)
    if countdown is None:
        return Outcome(FAILED, error)
    return Outcome(QUEUED, error, now + timedelta(seconds=countdown) if backoff else now)


def retry_countdown(policy: Policy, attempts: int, *, retryable: bool = True) -> float | None:
    """Seconds until the next attempt when the broker runs a failed attempt again, None when the failure is final."""
    if retryable and not policy.is_final_attempt(attempts):
        return policy.backoff(attempts).total_seconds()
    return None


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
