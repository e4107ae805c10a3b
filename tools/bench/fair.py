"""`python -m tools.bench.fair`: a fair queue against the same queue unfair, one key's backlog beside small keys.

Each round publishes, before any worker starts, BENCH_FAIR_BIG jobs (default 10,000) of one fair key, then
BENCH_FAIR_SMALL jobs (default 10) of each of nine more keys, to a fresh database, once with the queue made fair
(`Operations.set_limits(fair=True)`, what `bb-broker limit bench --fair` does) and once not; two `-c 2` prefork
workers then drain it. Figures: the position, among the jobs' `startedAt` (their claim's moment, from the
documents), of each small key's first job (the latest of the nine is reported), and the drain (the tasks over the
time from the first task's start to the last's finish, from the tasks' own stamps). BENCH_REPEAT rounds (default 3),
the two orders alternated; the drain ratio is within a round, reported as the median (lowest–highest). On the server
tools.bench.servers picks (the Rust stand-in when `secantusd-rs` is on PATH).

BENCH_FAIR_CLAIMS=N ends each run once N tasks have finished, the rest of the backlog left queued: the figures are then
those of the first N claims (the tasks per second over the first N to finish, the same backlog behind them), for a
backlog too slow to drain whole on the stand-in (see docs/explanation/performance.md, "Fair queues"). A small key
whose first job did not start in the run is reported as None.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.workers import Worker
from tools.bench.app import PROBE_QUEUE, QUEUE
from tools.bench.runner import Broker, MongoOps, Stamps, mongo_broker, producer, send, stop_worker
from tools.bench.servers import mongo_server

SMALL_KEYS = [f"small-{n}" for n in range(9)]
WORKERS = 2


def one_drain(
    broker: Broker, ops: MongoOps, rep: int, fair: bool, big: int, small: int, claims: int, workdir: Path
) -> dict:
    """One drain of the backlog, fair or not (of its first `claims` tasks when given, else of all of it): the latest
    first start of a small key (None if one did not start) and the tasks per second."""
    database = rep * 2 + int(fair)
    broker.reset(database)
    db = ops.client[f"bench_{broker.name}_{database}"]
    if fair:
        Operations(JobStore(db)).set_limits(QUEUE, fair=True, by="bench")
    name = f"{'fair' if fair else 'unfair'}-{rep}"
    stamps = Stamps(workdir / f"{name}.stamps")
    app = producer(broker.producer_url(database))
    total = big + small * len(SMALL_KEYS)
    try:
        for _ in range(big):
            send(app, "d", QUEUE, {"fair_key": "big"})
        for key in SMALL_KEYS:
            for _ in range(small):
                send(app, "d", QUEUE, {"fair_key": key})
    finally:
        app.close()
    workers = [
        Worker(
            broker.worker_url(database),
            log_dir=workdir,
            name=f"{name}-w{n}",
            app="tools.bench.app",
            extra_args=("-Q", f"{QUEUE},{PROBE_QUEUE}"),
            env={"BENCH_STAMPS": str(stamps.path)},
        )
        for n in range(WORKERS)
    ]
    try:
        for worker in workers:
            worker.start()
        wanted = min(claims, total) if claims else total
        rows = stamps.wait("d", wanted, timeout=300 + wanted / 5, stall=120)
    finally:
        for worker in workers:
            stop_worker(worker)
    started = {"queue": QUEUE, "startedAt": {"$exists": True}}
    starts = [doc["fairKey"] for doc in db.jobs.find(started, {"fairKey": 1}, sort=[("startedAt", 1), ("_id", 1)])]
    firsts = [starts.index(key) + 1 if key in starts else None for key in SMALL_KEYS]
    latest_first = None if None in firsts else max(first for first in firsts if first is not None)
    first_done = sorted(rows, key=lambda row: row[3])[:wanted]  # the first `wanted` to finish
    tps = wanted / (first_done[-1][3] - min(row[2] for row in first_done))
    return {"latest_small_first_start": latest_first, "tps": tps, "tasks": wanted}


def main() -> int:
    big = int(os.environ.get("BENCH_FAIR_BIG", "10000"))
    small = int(os.environ.get("BENCH_FAIR_SMALL", "10"))
    repeat = int(os.environ.get("BENCH_REPEAT", "3"))
    claims = int(os.environ.get("BENCH_FAIR_CLAIMS", "0"))
    workdir = Path(tempfile.mkdtemp(prefix="bb-fair-"))
    server = mongo_server(workdir)
    server.start()
    ops = MongoOps(server.url)
    broker = mongo_broker("fairness", "bbmongo", server.url, server, ops)
    scope = f"the first {claims} tasks of each run" if claims else "whole drains"
    print(f"fair: {big} + 9x{small} jobs, {scope}, {repeat} rounds, {server.label}, logs in {workdir}", file=sys.stderr)
    figures: dict[str, list[dict[str, Any]]] = {"fair": [], "unfair": []}
    started = time.monotonic()
    try:
        for rep in range(repeat):
            for fair in (True, False) if rep % 2 == 0 else (False, True):
                figure = one_drain(broker, ops, rep, fair, big, small, claims, workdir)
                figures["fair" if fair else "unfair"].append(figure)
                print(f"round {rep + 1} {'fair' if fair else 'unfair'}: {figure}", file=sys.stderr)
    finally:
        ops.close()
        server.stop()
    ratios = [f["tps"] / u["tps"] for f, u in zip(figures["fair"], figures["unfair"], strict=True)]
    print(f"\nOne key of {big:,} jobs and nine of {small}, {scope}, two `-c 2` workers, {server.label}, ", end="")
    print(f"{repeat} rounds:\n")
    print("| queue | latest first start of a small key (claims) | drain (tasks/s), median (lowest–highest) |")
    print("| --- | ---: | ---: |")
    for name, rows in figures.items():
        firsts = [row["latest_small_first_start"] for row in rows]
        tps = [row["tps"] for row in rows]
        drain = f"{statistics.median(tps):.1f} ({min(tps):.1f}–{max(tps):.1f})"
        latest = "not all started" if None in firsts else max(first for first in firsts if first is not None)
        print(f"| {name} | {latest} (rounds: {firsts}) | {drain} |")
    spread = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
    print(f"\nfair / unfair drain, within each round: {spread}")
    print(f"{time.monotonic() - started:.0f}s; logs in {workdir}")
    print(json.dumps({"bench": "fair", "server": server.label, "big": big, "small": small, "claims": claims,
                      "figures": figures, "ratios": ratios}, sort_keys=True))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
