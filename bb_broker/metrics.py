"""Prometheus job counters, counted where each event happens: the bottom room, imported by the store, the settles,
the sweeps and the thread supervisor (the gauges and the `/metrics` endpoint are ops/metrics_endpoint.py's)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Literal

from prometheus_client import Counter

logger = logging.getLogger(__name__)

#: The events JobStore reports, one counter each (exposed as jobs_<event>_total).
Event = Literal["enqueued", "succeeded", "retried", "failed", "refused_duplicate"]

COUNTERS: dict[str, Counter] = {
    "enqueued": Counter("jobs_enqueued", "Jobs inserted as queued by producers."),
    "succeeded": Counter("jobs_succeeded", "Jobs that ended succeeded."),
    "retried": Counter("jobs_retried", "Attempts that failed or were cut short and sent their job back to the queue."),
    "failed": Counter("jobs_failed", "Jobs that ended failed."),
    "refused_duplicate": Counter(
        "jobs_duplicates_refused", "Publishes refused because another job holds their unique key (DuplicateJob)."
    ),
}

#: Restarts of bb_broker's background threads whose loop died (threads.py), per thread name.
THREAD_RESTARTS = Counter(
    "bb_broker_thread_restarts", "Background threads of bb_broker restarted after an unexpected error.", ["thread"]
)

#: Claims a queue's limit refused, per limit ("concurrency"): each left the queue's next job queued, to be claimed when
#: the limit lets it (a held-back claim is retried at a settle, so a job may be held back more than once).
HELD_BACK = Counter("jobs_held_back", "Claims refused by a queue's limit: the job stayed queued.", ["limit"])

#: Server answers bb_broker did not expect, per path ("claim"): each was logged and outlasted as an outage (server.py).
SERVER_ERRORS = Counter(
    "bb_broker_server_errors", "Server answers bb_broker did not expect, backed off and tried again.", ["path"]
)

_warned = False


def record(event: Event, amount: int = 1) -> None:
    """Count an event that has happened in this process; a metrics problem never fails a job's write."""
    if amount > 0:
        _count(lambda: COUNTERS[event].inc(amount))


def record_held_back(limit: str) -> None:
    """Count a claim a queue's `limit` refused; a metrics problem never fails the claim."""
    _count(lambda: HELD_BACK.labels(limit=limit).inc())


def record_server_error(path: str) -> None:
    """Count a server answer met on `path` that the code did not expect; a metrics problem never stops the backoff."""
    _count(lambda: SERVER_ERRORS.labels(path=path).inc())


def record_restart(thread: str) -> None:
    """Count a restart of the background thread named `thread`; a metrics problem never stops the restart."""
    _count(lambda: THREAD_RESTARTS.labels(thread=thread).inc())


#: Held by each increment and across every fork of this process: prometheus_client's own locks (one per value, or
#: one for all in multiprocess mode) are not reset in a child, and a pool process forked while another thread (the
#: settle relay's, the claims') was counting would wait for one forever at its first count.
_counting = threading.Lock()
os.register_at_fork(before=_counting.acquire, after_in_parent=_counting.release, after_in_child=_counting.release)


def _count(increment: Callable[[], None]) -> None:
    """Run one counter's increment; a failure (a full disk or a missing PROMETHEUS_MULTIPROC_DIR, say) is logged
    once per process and goes no further."""
    global _warned
    try:
        with _counting:
            increment()
    except Exception as exc:
        if not _warned:
            _warned = True
            logger.warning("job metrics are not being counted: %s", exc)
