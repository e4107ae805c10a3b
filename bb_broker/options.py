"""The broker's options (broker_transport_options) read once, their defaults written once, and the one store factory."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from bb_broker.jobs.lifecycle import NO, YES, Policy, yes_or_no

if TYPE_CHECKING:
    from pymongo.database import Database

    from bb_broker.connection import BrokerTarget
    from bb_broker.jobs.store import JobStore

#: The transport options that make the lifecycle's Policy.
POLICY_OPTIONS = ("max_attempts", "backoff_base", "stale_after")


#: The longest time an option may give in seconds: a year. Longer ones overflow the dates they are added to.
LONGEST = 365 * 24 * 3600.0


def _flag(value: Any) -> bool:
    flag = yes_or_no(value)
    if flag is None:
        raise ValueError(f"it must be one of {', '.join(YES)} or {', '.join(NO)}")
    return flag


def _number(value: Any) -> float:
    if isinstance(value, bool):  # float(True) is 1.0: a flag given where a number goes is a mistake
        raise ValueError("it is a flag, not a number")
    return float(value)


def _seconds(lowest: float, *, at_least: bool = True) -> Callable[[Any], float]:
    """A reader of seconds from `lowest` (or above it) to LONGEST."""

    def read(value: Any) -> float:
        seconds = _number(value)
        if not math.isfinite(seconds) or seconds < lowest or (not at_least and seconds == lowest) or seconds > LONGEST:
            bound = f"{lowest:g} or more" if at_least else f"more than {lowest:g}"
            raise ValueError(f"it must be a number of seconds, {bound}, and at most a year ({LONGEST:.0f})")
        return seconds

    return read


def _count(lowest: int, highest: int) -> Callable[[Any], int]:
    """A reader of a whole number from `lowest` to `highest`."""

    def read(value: Any) -> int:
        number = _number(value)
        if not (number.is_integer() and lowest <= number <= highest):
            raise ValueError(f"it must be a whole number from {lowest} to {highest}")
        return int(number)

    return read


def _seconds_or_none(value: Any) -> float | None:
    # expireAfterSeconds is a 32-bit int on the server
    return None if value is None else float(_count(0, 2**31 - 1)(value))


def _wait(value: Any) -> float:
    """Seconds something may wait: a finite number, 0 or more (a NaN or a negative wait would be no wait at all), and
    at most a day."""
    seconds = _number(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError("it must be a number of seconds, 0 or more")
    if seconds > 24 * 3600:
        raise ValueError("it must be at most a day (86400 seconds)")
    return seconds


def _collection_name(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 120:
        raise ValueError("it must be a collection's name, text of 1 to 120 characters")
    if "$" in value or "\x00" in value or value.startswith(("system.", ".")) or value.endswith("."):
        raise ValueError("a collection's name holds no '$' or NUL, and does not start with 'system.' or a dot")
    return value


class OptionError(ValueError):
    """A transport option that cannot be read: the message names it and its value."""


def _read(name: str, read: Callable[[Any], Any], value: Any) -> Any:
    try:
        return read(value)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"transport option {name}={value!r} cannot be read: {exc}") from None


@dataclass(frozen=True)
class BrokerOptions:
    """What broker_transport_options set (as a Celery app, the Kombu channel and the operator's tools read them);
    a name not here is Kombu's or Celery's own (polling_interval, say), and left to them."""

    #: max_attempts, backoff_base and stale_after: the attempts, retry backoff and lease of every job.
    policy: Policy = field(default_factory=Policy)
    #: Seconds a plain message (an event, a reply, a control message) waits for its consumer.
    message_ttl: float = 300.0
    #: The collection the jobs are kept in.
    jobs_collection: str = "jobs"
    #: The most jobs one claim takes, however many the consumer could start.
    max_claim_batch: int = 16
    #: Seconds succeeded jobs are kept (0 keeps them); unset leaves the collection's expiry as it is.
    retention: float | None = None
    #: Seconds between polls of a queue that the change stream says nothing about: a safety net.
    safety_poll_interval: float = 10.0
    #: Wake consumers with a change stream where the deployment has one; polling only when False.
    use_change_streams: bool = True
    #: Seconds a message to a topic exchange (Celery's task events), published on an event loop's thread, may wait
    #: in the outbox for others to be stored with it; 0 stores each at once.
    events_linger: float = 0.02
    #: Seconds at most a task's settle, in a prefork worker whose settles come closer together than this (a backlog),
    #: waits for the next ones to be written with it (settles.SettleRelay); 0 writes each at once.
    settle_linger: float = 0.01

    @classmethod
    def parse(cls, given: Mapping[str, Any] | None) -> BrokerOptions:
        """The options `given` sets (broker_transport_options, or a channel's attributes), each read as its type;
        OptionError names one that cannot be read (the Policy's own ValueError, one it refuses)."""
        given = given or {}
        policy_options = {
            "max_attempts": _read("max_attempts", _count(1, 2**31 - 1), given.get("max_attempts", Policy.max_attempts)),
            "backoff_base": _read("backoff_base", _seconds(0.0), given.get("backoff_base", Policy.backoff_base)),
            "stale_after": _read(
                "stale_after", _seconds(0.0, at_least=False), given.get("stale_after", Policy.stale_after)
            ),
        }
        try:
            policy = Policy(**policy_options)
        except ValueError as exc:
            raise OptionError(f"transport options {policy_options}: {exc}") from None
        read: dict[str, Callable[[Any], Any]] = {
            "message_ttl": _seconds(0.0, at_least=False),
            "jobs_collection": _collection_name,
            "max_claim_batch": _count(1, 10_000),
            "retention": _seconds_or_none,
            "safety_poll_interval": _seconds(0.05),
            "use_change_streams": _flag,
            "events_linger": _wait,
            "settle_linger": _wait,
        }
        return cls(policy, **{name: _read(name, read[name], given[name]) for name in read if name in given})


#: The name of every transport option BrokerOptions reads, as broker_transport_options spells it.
TRANSPORT_OPTIONS = POLICY_OPTIONS + tuple(option.name for option in fields(BrokerOptions) if option.name != "policy")
DEFAULTS = BrokerOptions()

#: The transport options Kombu itself reads from a connection's (its retries of a connection, its polling, the
#: virtual channel's body encoding and dead letters): bbmongo:// leaves them to it.
KOMBU_OPTIONS = (
    "max_retries", "interval_start", "interval_step", "interval_max", "connect_retries_timeout", "polling_interval",
    "body_encoding", "deadletter_queue",
)  # fmt: skip


def unread_options(given: Mapping[str, Any] | None) -> list[str]:
    """The names among `given` (broker_transport_options) that neither bbmongo:// nor Kombu reads: a misspelt option,
    or another transport's (Redis's `visibility_timeout`), which would otherwise be ignored without a word."""
    return sorted(str(name) for name in (given or {}) if name not in TRANSPORT_OPTIONS and name not in KOMBU_OPTIONS)


def open_store(
    where: BrokerTarget | Database,
    options: BrokerOptions = DEFAULTS,
    *,
    quick: bool = False,
    secrets: Iterable[str] = (),
    **client_options: Any,
) -> JobStore:
    """The job store the broker's `options` describe, on `where`: a broker URL's target (this process's client for
    it, with `client_options`; with `quick`, the operator's timeouts, connection.quick_timeouts) or a database
    (with the `secrets` to mask in what it says). Ages, due times and leases are on the server's clock, as the
    workers measure them."""
    # Imported on use: `bb-broker --help` reads the defaults here without importing pymongo.
    from bb_broker import connection
    from bb_broker.clock import ServerClock
    from bb_broker.jobs.store import JobStore

    if isinstance(where, connection.BrokerTarget):
        timeouts = connection.quick_timeouts(where) if quick else {}
        db = connection.get_database(where, **{**timeouts, **client_options})
        secrets = where.secrets
    else:
        db = where
    return JobStore(
        db, options.policy, clock=ServerClock.of(db), collection=options.jobs_collection, secrets=tuple(secrets)
    )
