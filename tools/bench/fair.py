"""`python -m tools.bench.fair`: a fair queue against the same queue unfair, one key's backlog beside small keys.

Each round publishes, before any worker starts, BENCH_FAIR_BIG jobs (default 10,000) of one fair key, then
BENCH_FAIR_SMALL jobs (default 10) of each of nine more keys, to a fresh database, once with the queue made fair
(`Operations.set_limits(fair=True)`, what `bb-broker limit bench --fair` does) and once not; two `-c 2` prefork
workers then drain it. Figures: the position, among the jobs' `startedAt` (their claim's moment, from the
documents), of each small key's first job (the latest of the nine is reported), and the drain (the tasks over the
time from the first task's start to the last's finish, from the tasks' own stamps). BENCH_REPEAT rounds (default 3),
the two orders alternated; the drain ratio is within a round, reported as the median (lowest–highest). On the server
tools.bench.servers picks (the Rust stand-in when `secantusd-rs` is on PATH).
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


def one_drain(broker: Broker, ops: MongoOps, rep: int, fair: bool, big: int, small: int, workdir: Path) -> dict:
    """One drain of the backlog, fair or not: the latest first start of a small key and the tasks per second."""
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
        rows = stamps.wait("d", total, timeout=300 + total / 5, stall=120)
    finally:
        for worker in workers:
            stop_worker(worker)
    starts = [
        doc["fairKey"] for doc in db.jobs.find({"queue": QUEUE}, {"fairKey": 1}, sort=[("startedAt", 1), ("_id", 1)])
    ]
    latest_first = max(starts.index(key) + 1 for key in SMALL_KEYS)
    tps = total / (max(row[3] for row in rows) - min(row[2] for row in rows))
    return {"latest_small_first_start": latest_first, "tps": tps}


def main() -> int:
    big = int(os.environ.get("BENCH_FAIR_BIG", "10000"))
    small = int(os.environ.get("BENCH_FAIR_SMALL", "10"))
    repeat = int(os.environ.get("BENCH_REPEAT", "3"))
    workdir = Path(tempfile.mkdtemp(prefix="bb-fair-"))
    server = mongo_server(workdir)
    server.start()
    ops = MongoOps(server.url)
    broker = mongo_broker("fairness", "bbmongo", server.url, server, ops)
    print(f"fair: {big} + 9x{small} jobs, {repeat} rounds, {server.label}, logs in {workdir}", file=sys.stderr)
    figures: dict[str, list[dict[str, Any]]] = {"fair": [], "unfair": []}
    started = time.monotonic()
    try:
        for rep in range(repeat):
            for fair in (True, False) if rep % 2 == 0 else (False, True):
                figure = one_drain(broker, ops, rep, fair, big, small, workdir)
                figures["fair" if fair else "unfair"].append(figure)
                print(f"round {rep + 1} {'fair' if fair else 'unfair'}: {figure}", file=sys.stderr)
    finally:
        ops.close()
        server.stop()
    ratios = [f["tps"] / u["tps"] for f, u in zip(figures["fair"], figures["unfair"], strict=True)]
    print(f"\nOne key of {big:,} jobs and nine of {small}, two `-c 2` workers, {server.label}, {repeat} rounds:\n")
    print("| queue | latest first start of a small key (claims) | drain (tasks/s), median (lowest–highest) |")
    print("| --- | ---: | ---: |")
    for name, rows in figures.items():
        firsts = [row["latest_small_first_start"] for row in rows]
        tps = [row["tps"] for row in rows]
        drain = f"{statistics.median(tps):.0f} ({min(tps):.0f}–{max(tps):.0f})"
        print(f"| {name} | {max(firsts)} (rounds: {firsts}) | {drain} |")
    spread = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
    print(f"\nfair / unfair drain, within each round: {spread}")
    print(f"{time.monotonic() - started:.0f}s; logs in {workdir}")
    print(json.dumps({"bench": "fair", "server": server.label, "big": big, "small": small, "figures": figures,
                      "ratios": ratios}, sort_keys=True))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
