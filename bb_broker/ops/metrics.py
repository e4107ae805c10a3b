"""Prometheus metrics: job counters where each event happens, status gauges counted in the collection at scrape."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any, Literal, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from pymongo.errors import PyMongoError

from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING

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

#: The gauges, read from the jobs collection at each scrape.
GAUGES = {
    QUEUED: "Jobs queued now (due or waiting for their time).",
    RUNNING: "Jobs held by a worker now.",
    FAILED: "Failed jobs kept in the collection (until retried or purged).",
}

#: Prometheus's classic text format (see make_app for why not OpenMetrics).
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"

_warned = False


class StatusSource(Protocol):
    """What the gauges read: a JobStore (store.py records the counters here, so this module never imports it)."""

    def statuses(self) -> dict[str, int]: ...


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


def multiprocess_dir() -> str | None:
    # The variable prometheus_client itself reads (it chooses its storage when it is imported).
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class StatusGauges:
    """jobs_queued, jobs_running and jobs_failed, counted in the collection whenever Prometheus scrapes."""

    def __init__(self, store: StatusSource) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        try:
            counts = self.store.statuses()
        except PyMongoError as exc:
            # The counters are still worth serving; a missing gauge shows the collection could not be read.
            logger.warning("jobs collection unreadable for metrics: %s", type(exc).__name__)
            return
        for status, help_text in GAUGES.items():
            yield GaugeMetricFamily(f"jobs_{status}", help_text, value=counts[status])


def registry_for(store: StatusSource) -> CollectorRegistry:
    """The counters (of every process sharing PROMETHEUS_MULTIPROC_DIR, when it is set) and the gauges."""
    registry = CollectorRegistry()
    directory = multiprocess_dir()
    if directory:
        MultiProcessCollector(registry, path=directory)
    else:
        for counter in [*COUNTERS.values(), HELD_BACK, THREAD_RESTARTS, SERVER_ERRORS]:
            registry.register(counter)
    registry.register(StatusGauges(store))
    return registry


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def make_app(store: StatusSource) -> WSGIApp:
    """`/metrics` in Prometheus text format and `/statuses` as the statuses() JSON."""
    registry = registry_for(store)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            # Always the 0.0.4 text format: in OpenMetrics the gauge jobs_failed and the counter
            # jobs_failed_total would be one family named twice, which Prometheus rejects.
            status, content_type, body = "200 OK", TEXT_FORMAT, generate_latest(registry)
        elif path == "/statuses":
            content_type = "application/json"
            try:
                status, body = "200 OK", json.dumps(store.statuses()).encode()
            except PyMongoError as exc:
                error = f"cannot read the jobs collection: {type(exc).__name__}"
                status, body = "503 Service Unavailable", json.dumps({"error": error}).encode()
        else:
            status, content_type, body = "404 Not Found", "text/plain", b"not found: try /metrics or /statuses\n"
        start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood the log."""


def make_metrics_server(store: StatusSource, host: str, port: int) -> WSGIServer:
    """A bound (not yet serving) HTTP server; port 0 picks a free one, see `server_port`."""
    return make_server(host, port, make_app(store), server_class=_Server, handler_class=_QuietHandler)


def serve_in_background(store: StatusSource, host: str, port: int) -> WSGIServer:
    """Serve from a daemon thread of this process (a worker's main process, say)."""
    from bb_broker.threads import start_supervised  # threads.py counts its restarts here

    server = make_metrics_server(store, host, port)
    start_supervised("bb-broker-metrics", server.serve_forever)
    return server
