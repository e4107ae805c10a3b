"""`python -m tools.bench.settle_window`: how long a finished task waits for its settle, the crash window of group
commit (bb_broker/jobs/settles.py), measured from outside the worker.

A backlog of BENCH_N trivial tasks drains through a `-c 2` prefork worker, at prefetch 1 and at Celery's 4, while
this process watches the jobs collection's change stream. For each settle it sees, the window is from the task's
body's return (the task does nothing else: its start, stamped) to the event's arrival here: Celery's tracer and our
signal receivers, the wait in the writer, the write itself, and the change stream's delivery, so an upper bound. The
same tool on the code before group commit measures the same span. Then 20 lone tasks, one at a time, on the idle
worker: there the window is what `get()` waits after the task's last line. BENCH_REPEAT rounds; prints the
percentiles of each and one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pymongo import MongoClient

from tests.support.servers import with_database
from tests.support.workers import Worker, wait_for
from tools.bench.runner import DEFAULT_PREFETCH, Stamps, percentile, producer, send, stop_worker
from tools.bench.servers import mongo_server


class SettleWatcher:
    """A change stream on `jobs`, noting when each settle to `succeeded` arrives, by the task's send time (its first
    argument, which its stamp carries too)."""

    def __init__(self, client: MongoClient, database: str) -> None:
        self.arrivals: dict[float, float] = {}
        self._stream = client[database]["jobs"].watch(
            [{"$match": {"operationType": "update", "updateDescription.updatedFields.status": "succeeded"}}],
            full_document="updateLookup",  # a read per event, on the server: this tool measures only the window
        )
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for event in self._stream:
            arrived = time.time()
            args = ((event.get("fullDocument") or {}).get("payload") or {}).get("args") or [None]
            if isinstance(args[0], float):
                self.arrivals[round(args[0], 6)] = arrived

    def windows(self, stamps: list[tuple[str, float, float, float]]) -> list[float]:
        """For each stamped task whose settle arrived: ms from its body's return to the arrival."""
        return [
            (self.arrivals[round(sent, 6)] - started) * 1000  # the body returns microseconds after it started
            for _, sent, started, _ in stamps
            if round(sent, 6) in self.arrivals
        ]

    def close(self) -> None:
        self._stream.close()


#: Lone tasks sent to the idle worker after each drain, one at a time.
LONE_TASKS = 20


def drain(
    url: str, client: MongoClient, database: str, workdir: Path, n: int, prefetch: int
) -> tuple[list[float], list[float]]:
    """The windows of a backlog's settles, then of lone tasks' settles on the idle worker."""
    stamps = Stamps(workdir / f"{database}.stamps")
    app = producer(with_database(url, database, "bbmongo"))
    send(app, "w", queue="warmup")  # declare and index before the watch
    watcher = SettleWatcher(client, database)
    for _ in range(n):
        send(app, "d")
    worker = Worker(
        with_database(url, database, "bbmongo"),
        log_dir=workdir,
        name=database,
        app="tools.bench.app",
        extra_args=("-Q", "bench"),
        env={"BENCH_STAMPS": str(stamps.path), "BENCH_PREFETCH": str(prefetch)},
    )
    try:
        worker.start()
        stamps.wait("d", n, timeout=120 + n / 2)
        wait_for(lambda: len(watcher.arrivals) >= n, 30, "every settle of the backlog seen")
        backlog = watcher.windows(stamps.of("d"))
        for k in range(LONE_TASKS):
            time.sleep(0.2)
            send(app, "i")
            wait_for(lambda k=k: len(watcher.arrivals) >= n + k + 1, 30, "the lone task's settle seen")
        lone = watcher.windows(stamps.of("i"))
    finally:
        stop_worker(worker)
        watcher.close()
        app.close()
    return backlog, lone


def summary(windows: list[float]) -> dict[str, float]:
    return {
        "settles": len(windows),
        "p50_ms": percentile(windows, 50),
        "p95_ms": percentile(windows, 95),
        "p99_ms": percentile(windows, 99),
        "max_ms": max(windows),
    }


def main() -> int:
    n, repeat = int(os.environ.get("BENCH_N", "1000")), int(os.environ.get("BENCH_REPEAT", "3"))
    workdir = Path(tempfile.mkdtemp(prefix="bb-settle-window-"))
    server = mongo_server(workdir)
    results: dict[str, Any] = {"server": None, "n": n, "rounds": []}
    try:
        server.start()
        results["server"] = server.label
        client: MongoClient = MongoClient(server.url, tz_aware=True)
        for rep in range(repeat):
            for prefetch in (1, DEFAULT_PREFETCH):
                database = f"settle_window_{rep}_{prefetch}"
                backlog, lone = drain(server.url, client, database, workdir, n, prefetch)
                for phase, windows in (("backlog", backlog), ("idle", lone)):
                    figures = summary(windows)
                    results["rounds"].append({"round": rep, "prefetch": prefetch, "phase": phase, **figures})
                    print(f"round {rep + 1}, prefetch {prefetch}, {phase}: " + ", ".join(
                        f"{k} {v:.1f}" for k, v in figures.items()), file=sys.stderr, flush=True)  # fmt: skip
                client.drop_database(database)
    finally:
        server.stop()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
