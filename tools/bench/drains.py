"""`python -m tools.bench.drains`: how fast a worker drains a backlog, per backlog size, `bbmongo://` against Kombu's
built-in `mongodb://`, at prefetch 1 and at Celery's default (4).

The stand-in reads a queue's head by walking its index, so the drain moves with the backlog: one figure per size,
not one number. For each size in BENCH_BACKLOGS (default 500,1000,2000,5000) and each prefetch, the tasks are
published before a `-c 2` prefork worker starts, and the drain is the tasks over the time from the first task's
start to the last's finish, as in `make bench`. Each drain has a fresh database. BENCH_REPEAT rounds (default 3),
the brokers' order rotated in each; the ratio is within a round, reported as the median (lowest–highest). On the
server tools.bench.servers picks (BENCH_SERVER=python: the Python stand-in, which `make demo` runs).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.support.workers import Worker
from tools.bench.app import PROBE_QUEUE, QUEUE
from tools.bench.runner import DEFAULT_PREFETCH, Broker, MongoOps, Stamps, mongo_broker, producer, send, stop_worker
from tools.bench.servers import mongo_server

PREFETCHES = (1, DEFAULT_PREFETCH)


def drain(broker: Broker, database: int, n: int, prefetch: int, workdir: Path) -> float:
    """Tasks per second a fresh worker drains a backlog of `n` with, in database number `database`."""
    broker.reset(database)
    name = f"{broker.name}-{n}-p{prefetch}-{database}"
    stamps = Stamps(workdir / f"{name}.stamps")
    app = producer(broker.producer_url(database))
    try:
        for _ in range(n):
            send(app, "d", QUEUE, broker.send_options)
        worker = Worker(
            broker.worker_url(database),
            log_dir=workdir,
            name=name,
            app="tools.bench.app",
            extra_args=("-Q", f"{QUEUE},{PROBE_QUEUE}"),  # as `make bench` runs it
            env={"BENCH_STAMPS": str(stamps.path), "BENCH_PREFETCH": str(prefetch)},
        )
        worker.start()
        try:
            rows = stamps.wait("d", n, timeout=120 + n / 2)
        finally:
            stop_worker(worker)
    finally:
        app.close()
    return n / (max(row[3] for row in rows) - min(row[2] for row in rows))


def main() -> int:
    backlogs = [int(size) for size in os.environ.get("BENCH_BACKLOGS", "500,1000,2000,5000").split(",")]
    repeat = int(os.environ.get("BENCH_REPEAT", "3"))
    workdir = Path(tempfile.mkdtemp(prefix="bb-drains-"))
    server = mongo_server(workdir)
    server.start()
    ops = MongoOps(server.url)
    brokers = [mongo_broker(scheme, scheme, server.url, server, ops) for scheme in ("bbmongo", "mongodb")]
    print(f"drains: backlogs {backlogs}, {repeat} rounds, {server.label}, logs in {workdir}", file=sys.stderr)
    tps: dict[str, dict[tuple[int, int], list[float]]] = {b.name: {} for b in brokers}
    started, database = time.monotonic(), 0
    try:
        for rep in range(repeat):
            for n in backlogs:
                for prefetch in PREFETCHES:
                    order = brokers[rep % 2 :] + brokers[: rep % 2]
                    for broker in order:
                        figure = drain(broker, database, n, prefetch, workdir)
                        database += 1
                        tps[broker.name].setdefault((n, prefetch), []).append(figure)
                        print(f"round {rep + 1} {broker.name} n={n} p{prefetch}: {figure:.0f}/s", file=sys.stderr)
    finally:
        ops.close()
        server.stop()
    print(f"\nDrain (tasks/s), {server.label}, -c 2 prefork, medians of {repeat} rounds; ratio within each round:\n")
    print("| backlog | prefetch | `bbmongo://` | `mongodb://` | ratio, median (lowest–highest) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for (size, per_process), ours in tps["bbmongo"].items():
        theirs = tps["mongodb"][(size, per_process)]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        print(
            f"| {size:,} | {per_process} | {statistics.median(ours):.0f} | {statistics.median(theirs):.0f} | "
            f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) |"
        )
    print(f"\n{time.monotonic() - started:.0f}s; logs in {workdir}")
    by_name = {name: {f"{n}/p{p}": figures for (n, p), figures in drains.items()} for name, drains in tps.items()}
    print(json.dumps({"bench": "drains", "server": server.label, "backlogs": backlogs, "tps": by_name}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
