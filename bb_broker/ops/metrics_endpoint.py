"""The `/metrics` and `/statuses` endpoint: the job counters (bb_broker/metrics.py) and status gauges counted in the
collection at scrape."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from pymongo.errors import PyMongoError

from bb_broker import metrics
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING
from bb_broker.threads import start_supervised

logger = logging.getLogger(__name__)

#: The gauges, read from the jobs collection at each scrape.
GAUGES = {
    QUEUED: "Jobs queued now (due or waiting for their time).",
    RUNNING: "Jobs held by a worker now.",
    FAILED: "Failed jobs kept in the collection (until retried or purged).",
}

#: Prometheus's classic text format (see make_app for why not OpenMetrics).
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class StatusSource(Protocol):
    """What the gauges read: a JobStore (store.py records the counters in bb_broker/metrics.py, so this module never
    imports it)."""

    def statuses(self) -> dict[str, int]: ...


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
        for counter in [*metrics.COUNTERS.values(), metrics.HELD_BACK, metrics.THREAD_RESTARTS, metrics.SERVER_ERRORS]:
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
    server = make_metrics_server(store, host, port)
    start_supervised("bb-broker-metrics", server.serve_forever)
    return server
