"""Whether Flower's broker answers, and what Flower's pages say when it does not.

Flower itself reports a broker it cannot use (a wrong password, a server that is down) only in its log, while its
pages say "No workers are available" under a green "Updated". So the plugin gives Flower a base template with a
banner naming the broker's error (bb_broker.contrib.flower.templates), kept current by a ping every few seconds
(`BrokerHealth`), and makes the Workers table's refresh fail while the error lasts, so that its dot turns red.
"""

from __future__ import annotations

import threading

from flower.views import BaseHandler
from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError, ServerSelectionTimeoutError
from pymongo.uri_parser import parse_uri

from bb_broker.connection import BrokerTarget, get_database, parse_broker_url, quick_timeouts, redact_url, scrub
from bb_broker.server import is_authentication_failure
from bb_broker.threads import start_supervised
from bb_broker.upstream import flower as upstream_flower

SCHEMES = frozenset({"bbmongo", "bbmongo+srv"})


def describe(exc: PyMongoError, target: BrokerTarget) -> str:
    """The error in words an operator acts on, with no password and none of the server's raw reply."""
    if is_authentication_failure(exc):
        parsed = parse_uri(target.mongo_uri, validate=False)
        source = parsed["options"].get("authSource") or target.database
        return f"authentication failed for user {parsed['username']!r} on database {source!r}"
    if isinstance(exc, ServerSelectionTimeoutError):
        return "no server answered: " + scrub(str(exc).split(", Timeout:")[0], target.secrets)
    if isinstance(exc, OperationFailure):
        return scrub(str((exc.details or {}).get("errmsg") or exc), target.secrets)
    return scrub(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", target.secrets)


def _refusal_behind(exc: PyMongoError, client: MongoClient) -> PyMongoError:
    """`exc`, or the login refusal behind it where it is a server selection that timed out: pymongo marks a server
    whose handshake refused the login unknown, with that refusal as its error, and on a loaded machine the next
    selection can time out on it before a connection raises the refusal itself."""
    if isinstance(exc, ServerSelectionTimeoutError):
        for server in client.topology_description.server_descriptions().values():
            if server.error is not None and is_authentication_failure(server.error):
                return server.error
    return exc


class BrokerHealth:
    """Whether Flower's broker answers: a ping every `interval` seconds, in a thread of its own, one per broker URL."""

    interval = 5.0
    _monitors: dict[str, BrokerHealth] = {}
    _lock = threading.Lock()

    def __init__(self, broker_url: str) -> None:
        self.shown_url = redact_url(broker_url)  # as the user wrote it, the password masked
        self.target = parse_broker_url(broker_url)
        self._options = quick_timeouts(self.target)  # a check answers within seconds when the server is down
        self.problem: str | None = None
        self.checked = threading.Event()
        self._wake = threading.Event()

    @classmethod
    def of(cls, broker_url: str) -> BrokerHealth:
        """The monitor of this broker, started on first use."""
        with cls._lock:
            monitor = cls._monitors.get(broker_url)
            if monitor is None:
                monitor = cls._monitors[broker_url] = cls(broker_url)
                start_supervised("bb-broker-health", monitor._run)
            return monitor

    def check(self) -> str | None:
        """Ping the broker's database now (authenticating, as every connection does); its problem, or None."""
        database = get_database(self.target, **self._options)
        try:
            database.command("ping")
            self.problem = None
        except PyMongoError as exc:
            self.problem = describe(_refusal_behind(exc, database.client), self.target)
        self.checked.set()
        return self.problem

    def report(self, problem: str) -> None:
        """A query of Flower's found the broker failing: its pages say so now, and a check soon confirms or clears it
        (a server back in the meantime)."""
        self.problem = problem
        self.checked.set()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self.check()
            self._wake.wait(self.interval)
            self._wake.clear()

    def banner(self) -> str | None:
        """What Flower's pages say while the broker fails; None while it answers."""
        problem = self.problem
        if problem is None:
            return None
        return (
            f"Flower cannot use the broker {self.shown_url}: {problem}. "
            "Workers, tasks and queues shown here may be missing or out of date."
        )


def is_ours(broker_url: str | None) -> bool:
    """Whether Flower's broker URL is one of ours (bbmongo://, bbmongo+srv://)."""
    return bool(broker_url and broker_url.partition("://")[0].lower() in SCHEMES)


def broker_banner(handler: BaseHandler) -> str | None:
    """The banner for the broker of the Flower app serving `handler` (the base template calls this)."""
    broker_url = upstream_flower.broker_url_with_password(handler.application)
    if not is_ours(broker_url):
        return None
    monitor = BrokerHealth.of(broker_url)
    monitor.checked.wait(1.0)  # the first page after start waits for the first verdict, briefly
    return monitor.banner()


def fail_workers_refresh_while_broker_fails(handler: BaseHandler) -> None:
    """The Workers table's refresh fails while the broker does: its dot turns red instead of saying "Updated".
    `handler` is Flower's (its get_argument takes a `type`, Tornado's does not)."""
    if handler.get_argument("json", default=False, type=bool) and (banner := broker_banner(handler)):
        # Answered here, not raised: Flower before 2.2 writes an HTTPError's message unformatted ("%s").
        handler.set_status(503)
        handler.set_header("Content-Type", "text/plain")
        handler.finish(banner)
