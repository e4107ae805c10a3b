"""Outlasting the server: a write on a held job retried through a failover or a restart, and answers the code does not
recognise backed off per queue (which errors pass with time is server.py's to say)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pymongo.errors import BulkWriteError, ConnectionFailure, OperationFailure

from bb_broker import metrics
from bb_broker.connection import out_of_patience
from bb_broker.server import is_transient, is_unrecognised, passes_with_time, server_words

logger = logging.getLogger(__name__)

__all__ = ["Refusals", "is_transient", "passes_with_time", "through_outages", "through_refusals"]


def through_outages(write: Callable[[], Any], *, patience: float) -> Any:
    """Retry a write on a held job through a failover or a restart, for `patience` seconds: losing a settle would
    run the task again."""
    deadline = time.monotonic() + patience
    delay = 0.1
    while True:
        try:
            return write()
        except (ConnectionFailure, OperationFailure) as exc:
            # Inside a stopping worker's patience (connection.shutdown_patience), once it ran out, the stale
            # sweep takes over: a held job's release tried for a minute held the worker's stop as long, each.
            if not is_transient(exc) or time.monotonic() > deadline or out_of_patience():
                raise
            logger.warning("a write on a held job failed (%s), retrying in %.1fs", type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


#: The first pause after a server answer the code does not recognise, and the longest once it keeps coming.
REFUSAL_BACKOFF = 1.0
REFUSAL_BACKOFF_MAX = 30.0


class Refusals:
    """Server answers the code does not recognise, met on one path (`path`, a metric's label) per key (a queue): each
    is logged once per key and code with the server's own words, counted, and backs its key off as an outage does,
    the pause doubling up to REFUSAL_BACKOFF_MAX while it keeps coming; the key's first success ends it. A worker is
    never ended by what the server answers: its other keys (queues) go on meanwhile.

    Used from the consuming thread and ClaimsAhead's: under a lock."""

    def __init__(self, path: str, secrets: tuple[str, ...] = ()) -> None:
        self._path = path
        self._secrets = secrets
        self._lock = threading.Lock()
        self._until: dict[str, tuple[float, float]] = {}  # key: (monotonic end of its pause, that pause)
        self._said: set[tuple[str, int | None]] = set()

    def wait(self, key: str) -> float:
        """Seconds `key` is still backed off for (0: try it)."""
        with self._lock:
            until = self._until.get(key)
        return 0.0 if until is None else max(until[0] - time.monotonic(), 0.0)

    def met(self, key: str, exc: OperationFailure) -> float:
        """`exc` was the server's answer for `key`: the pause before the next try."""
        with self._lock:
            previous = self._until.get(key)
            pause = REFUSAL_BACKOFF if previous is None else min(previous[1] * 2, REFUSAL_BACKOFF_MAX)
            self._until[key] = (time.monotonic() + pause, pause)
            first = (key, exc.code) not in self._said
            self._said.add((key, exc.code))
        metrics.record_server_error(self._path)
        if first:
            logger.error(
                "the server answered a %s of %r with an error bb_broker does not expect: %s; trying again in %.0f s "
                "and backing off while it lasts (counted in bb_broker_server_errors_total)",
                self._path,
                key,
                server_words(exc, self._secrets),
                pause,
            )
        return pause

    def cleared(self, key: str) -> None:
        """`key`'s last try went through: its backoff ends, and a new refusal is said again."""
        with self._lock:
            if self._until.pop(key, None) is not None:
                self._said = {said for said in self._said if said[0] != key}


def through_refusals(write: Callable[[], Any], *, patience: float, refusals: Refusals, key: str) -> Any:
    """Retry a settling write through outages (through_outages) and through server answers the code does not
    recognise (said and backed off by `refusals`, under `key`), for `patience` seconds in all: a settle given up
    leaves its job to the stale sweep, which runs the task again. The answers the callers act on (a document too
    large, a field of the wrong type) raise at once, as does the last refusal once patience ran out."""
    deadline = time.monotonic() + patience
    while True:
        try:
            done = through_outages(write, patience=max(deadline - time.monotonic(), 0.0))
        except OperationFailure as exc:
            # A bulk's own errors are its statements', which the caller reads one by one.
            unrecognised = is_unrecognised(exc) and not isinstance(exc, BulkWriteError)
            if not unrecognised or time.monotonic() >= deadline or out_of_patience():
                raise
            pause = refusals.met(key, exc)
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            continue
        refusals.cleared(key)
        return done
