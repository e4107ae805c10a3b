"""The broker's options (broker_transport_options) read once, their defaults written once, and the one store factory."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from bb_broker.jobs.lifecycle import Policy

if TYPE_CHECKING:
    from pymongo.database import Database

    from bb_broker.connection import BrokerTarget
    from bb_broker.jobs.store import JobStore

#: The transport options that make the lifecycle's Policy.
POLICY_OPTIONS = ("max_attempts", "backoff_base", "stale_after")


def _flag(value: Any) -> bool:
    # A transport option may come from JSON, an environment variable or a URL: "false", "0" and "no" say no.
    return str(value).strip().lower() not in ("false", "0", "no")


def _seconds_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _wait(value: Any) -> float:
    """Seconds something may wait: a finite number, 0 or more (a NaN or a negative wait would be no wait at all)."""
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError("it must be a number of seconds, 0 or more")
    return seconds


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
        policy = Policy(
            _read("max_attempts", int, given.get("max_attempts", Policy.max_attempts)),
            _read("backoff_base", float, given.get("backoff_base", Policy.backoff_base)),
            _read("stale_after", float, given.get("stale_after", Policy.stale_after)),
        )
        read: dict[str, Callable[[Any], Any]] = {
            "message_ttl": float,
            "jobs_collection": str,
            "max_claim_batch": int,
            "retention": _seconds_or_none,
            "safety_poll_interval": float,
            "use_change_streams": _flag,
            "events_linger": _wait,
            "settle_linger": _wait,
        }
        return cls(policy, **{name: _read(name, read[name], given[name]) for name in read if name in given})


#: The name of every transport option BrokerOptions reads, as broker_transport_options spells it.
TRANSPORT_OPTIONS = POLICY_OPTIONS + tuple(option.name for option in fields(BrokerOptions) if option.name != "policy")
DEFAULTS = BrokerOptions()


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
