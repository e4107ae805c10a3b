"""`python -m tools.bench` (`make bench`): start the servers, run the rounds, print the table and one JSON line."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.servers import with_database
from tools.bench import report, startup
from tools.bench.runner import Broker, MongoOps, RedisOps, Settings, mongo_broker, redis_broker, run_rounds
from tools.bench.servers import RedisServer, Server, mongo_server

HOW_OPS_ARE_COUNTED = (
    "MongoDB: serverStatus opcounters (all six summed) read before and after each window by the bench's own "
    "client, which has no background monitoring; each reading's own serverStatus (calibrated: 1) is subtracted. "
    "The workers' and the producer's operations, their pymongo monitoring included, are all counted. Tasks "
    "record their timestamps in a local file, never on a server. Redis: INFO total_commands_processed, alike."
)


#: The flow-control round's concurrency limit: far above a `-c 2` worker's, so it is never reached.
UNREACHED_LIMIT = 1_000


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _command() -> str:
    overrides = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("BENCH_")]
    return " ".join([*overrides, "make bench"])


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop servers and workers


def main() -> int:
    settings = Settings.from_env()
    signal.signal(signal.SIGTERM, _terminate)
    workdir = Path(tempfile.mkdtemp(prefix="bb-bench-"))
    _log(f"bench: {settings}, logs in {workdir}")
    mongo: Server = mongo_server(workdir)
    redis_server = RedisServer(workdir)
    counters: list[MongoOps | RedisOps] = []
    started = time.monotonic()
    try:
        mongo.start()
        redis_server.start()
        # Before the rounds, on a quiet machine: what an operator waits for each time.
        startup_repeat = int(os.environ.get("BENCH_STARTUP_REPEAT", "5"))
        cli_startup = startup.measure(with_database(mongo.url, "bb_bench_startup"), startup_repeat)
        ops = MongoOps(mongo.url)
        rops = RedisOps(redis_server.url)
        counters += [ops, rops]
        brokers: list[Broker] = [
            mongo_broker("bbmongo", "bbmongo", mongo.url, mongo, ops),
            mongo_broker("mongodb", "mongodb", mongo.url, mongo, ops),
            redis_broker(redis_server, rops),
            # Results on: bbmongo:// on the job documents, against mongodb:// with Celery's MongoDB backend.
            mongo_broker("bbmongo_results", "bbmongo", mongo.url, mongo, ops, results=True),
            mongo_broker("mongodb_results", "mongodb", mongo.url, mongo, ops, results=True),
            # Flow control (docs/guides/unique-jobs.md, flow-control.md): every task unique on its own arguments,
            # or the task queue limited to more running jobs than the worker can ever run: what each costs.
            mongo_broker("bbmongo_unique", "bbmongo", mongo.url, mongo, ops, send_options={"unique": True}),
            mongo_broker("bbmongo_limited", "bbmongo", mongo.url, mongo, ops, concurrency_limit=UNREACHED_LIMIT),
            # A server without change streams (a standalone mongod, FerretDB 2), as the workers meet it: they poll.
            mongo_broker(
                "bbmongo_polling", "bbmongo", mongo.url, mongo, ops, transport_options={"use_change_streams": False}
            ),
        ]
        wanted = os.environ.get("BENCH_BROKERS")
        if wanted:
            brokers = [b for b in brokers if b.name in wanted.split(",")]
        rounds = run_rounds(brokers, settings, workdir, _log)
    finally:
        for counter in counters:
            counter.close()
        redis_server.stop()
        mongo.stop()

    servers = {b.name: b.server for b in brokers}
    med = {name: report.medians(rs) for name, rs in rounds.items()}
    rat = report.ratios(rounds)
    spread = report.round_ratios(rounds)
    tgt = report.targets(med, rat)
    errors = report.events_errors(rounds)
    print(report.table(med, servers, rat, tgt, spread, errors))
    print(startup.table(cli_startup, startup_repeat))
    events_seconds = sum(r.get("events_seconds", 0.0) for rs in rounds.values() for r in rs)
    print(
        f"\n{settings.repeat} rounds of N={settings.n} in {time.monotonic() - started:.0f}s "
        f"(of which the drains with task events on: {events_seconds:.0f}s); logs in {workdir}"
    )
    line = {
        "bench": "bb_broker",
        "command": _command(),
        "settings": settings.__dict__,
        "servers": servers,
        "ops_counted": HOW_OPS_ARE_COUNTED,
        "median": med,
        "ratios": rat,
        "round_ratios": spread,
        "targets": tgt,
        "events_errors": errors,
        "cli_startup": cli_startup,
        "rounds": rounds,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(line, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
