"""Canvas at scale: a large group and a chain to a chord with a large header, timed on bbmongo://, mongodb:// and Redis.

Run as Celery's integration suite runs them (`t/integration/test_canvas.py`): Celery's own test worker
(`celery.contrib.testing.worker.start_worker`) in a thread of this process, a prefork pool of one process, the
default prefetch, and a Redis result backend for every broker (a redis-server of its own, so that the server ops
counted are the broker's), so that only the broker differs. Each scenario runs CANVAS_REPEAT times; the table
shows the median.

    .venv/bin/python -m tools.bench.canvas    # CANVAS_N=1000, CANVAS_REPEAT=3, CANVAS_BROKERS=bbmongo,mongodb,redis

CANVAS_COMMANDS=<file> logs every MongoDB command the processes send (one line each: time, pid, command, target).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery, group
from celery.contrib.testing.worker import start_worker
from pymongo import monitoring

import bb_broker  # noqa: F401 (registers bbmongo://)
from tests.support.servers import with_database
from tools.bench.runner import Counter, MongoOps, RedisOps
from tools.bench.servers import RedisServer, mongo_server


def identity(value: Any) -> Any:
    return value


def tsum(values: list[int]) -> int:
    return sum(values)


def make_app(broker_url: str, backend: str) -> Celery:
    """A fresh app per broker, configured as Celery's integration conftest configures its own."""
    app = Celery("canvas_bench", set_as_current=False)
    app.conf.update(broker_url=broker_url, result_backend=backend, result_extended=True)
    app.task(name="canvas_bench.identity")(identity)
    app.task(name="canvas_bench.tsum")(tsum)
    return app


@dataclass
class Figure:
    broker: str
    scenario: str
    seconds: float
    ops: int


def large_group(app: Celery, n: int) -> Callable[[], None]:
    identity = app.tasks["canvas_bench.identity"]

    def run() -> None:
        result = group(identity.s(i) for i in range(n)).delay()
        assert result.get(timeout=600) == list(range(n))

    return run


def chain_to_chord(app: Celery, n: int) -> Callable[[], None]:
    identity, tsum = app.tasks["canvas_bench.identity"], app.tasks["canvas_bench.tsum"]

    def run() -> None:
        result = (identity.si(1) | group(identity.s() for _ in range(n)) | tsum.s()).delay()
        assert result.get(timeout=600) == n

    return run


def measure(broker: str, url: str, backend: str, counter: Counter, n: int, repeat: int) -> list[Figure]:
    app = make_app(url, backend)
    figures = []
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge("celery")  # nothing left from an earlier run
    with start_worker(app, pool="prefork", concurrency=1, perform_ping_check=False, loglevel="ERROR"):
        app.tasks["canvas_bench.identity"].delay(0).get(timeout=60)  # warm: the pool and the connections are up
        scenarios = ((f"group of {n}", large_group(app, n)), (f"chain to a chord of {n}", chain_to_chord(app, n)))
        for scenario, run in scenarios:
            rounds = []
            for _ in range(repeat):
                before = counter.total()
                started = time.monotonic()
                run()
                seconds = time.monotonic() - started
                rounds.append(Figure(broker, scenario, seconds, counter.delta(before, counter.total())))
                print(f"  {broker}: {scenario}: {seconds:.1f} s, {rounds[-1].ops} server ops", flush=True)
            figures.append(sorted(rounds, key=lambda figure: figure.seconds)[len(rounds) // 2])
    app.close()
    return figures


class CommandLog(monitoring.CommandListener):
    """One line per command: when it started, the process, the command, its collection, and its milliseconds."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.targets: dict[int, tuple[float, str]] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        target = event.command.get("collection" if event.command_name == "getMore" else event.command_name)
        self.targets[event.request_id] = (time.time(), target if isinstance(target, str) else "-")

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        began, target = self.targets.pop(event.request_id, (time.time(), "-"))
        line = f"{began:.6f} {os.getpid()} {event.command_name} {target} {event.duration_micros / 1000:.2f}\n"
        os.write(self.fd, line.encode())

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.targets.pop(event.request_id, None)


def main() -> int:
    n = int(os.environ.get("CANVAS_N", "1000"))
    repeat = int(os.environ.get("CANVAS_REPEAT", "3"))
    brokers = [b.strip() for b in os.environ.get("CANVAS_BROKERS", "bbmongo,mongodb,redis").split(",") if b.strip()]
    if os.environ.get("CANVAS_COMMANDS"):
        monitoring.register(CommandLog(os.environ["CANVAS_COMMANDS"]))
    work = Path(tempfile.mkdtemp(prefix="canvas-bench-"))
    mongo, redis, results = mongo_server(work), RedisServer(work), RedisServer(work)
    for server in (mongo, redis, results):
        server.start()
    figures: list[Figure] = []
    try:
        print(f"{mongo.label}, {redis.label}; work in {work}", flush=True)
        redis_ops = RedisOps(redis.url)
        mongo_ops = MongoOps(mongo.url)
        for broker in brokers:
            if broker == "redis":
                url, counter = redis.url, redis_ops
            else:
                url, counter = with_database(mongo.url, f"canvas_{broker}", broker), mongo_ops
            counter.calibrate()
            figures += measure(broker, url, results.url, counter, n, repeat)
    finally:
        for server in (mongo, redis, results):
            server.stop()
    print(f"\n{mongo.label}, {redis.label}; result backend Redis; Celery's test worker (prefork, 1 process);")
    print(f"median of {repeat}; server ops: the broker's server only\n")
    print("| scenario | broker | seconds | server ops |\n|---|---|---|---|")
    for figure in figures:
        print(f"| {figure.scenario} | {figure.broker} | {figure.seconds:.1f} | {figure.ops} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
