"""`python -m tools.bench.paced`: the worker's CPU per task at an equal pace, and per second idle, alone.

`make bench`'s `worker_cpu_ms_per_task_paced` comes after the drains, the probes and the loaded windows of a round:
a run of 3 rounds takes many minutes. This measures only that window, in about a minute a round, to compare two
versions of the code: per round and per broker (`bbmongo://` on the stand-in tools.bench.servers picks, then
`redis://`, the order turned every other round), a fresh prefork worker (`-c 2`, prefetch 1) runs 50 warm-up tasks,
sits idle for BENCH_IDLE seconds (its CPU per second idle), then takes BENCH_N tasks (default 500) sent one by one
at tools.bench.runner.PACE a second (its CPU per task, main process and pool processes apart, as paced_cpu counts
them). Prints each round's figures with the load average, and the ratios to Redis's within each round: median
(lowest-highest) over BENCH_REPEAT rounds (default 3). A round whose pace fell under 90% of PACE is said so: a
worker that could not keep up spends more per task, and the ratio is not at an equal pace.

BENCH_PACED_COMMANDS=1 also counts the commands the bbmongo:// worker's processes send in the paced window, per task.
BENCH_PACED_SYSCALLS=1 counts, with `strace -c -f`, the system calls of each worker's main process (all its threads)
in the paced window, per task: a wake-up handed from one thread to another shows as `futex` calls. strace slows
the process it traces: the CPU figures of such a run are not the bench's.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from tests.support.servers import with_database
from tests.support.workers import Worker
from tools.bench.runner import PACE, Stamps, producer, send, stop_worker, worker_cpu_seconds
from tools.bench.servers import RedisServer, Server, mongo_server

WARM_UP = 50
BROKERS = ("bbmongo", "redis")


def _load() -> str:
    return "/".join(f"{value:.1f}" for value in os.getloadavg())


def _commands_per_task(log: Path, began: float, ended: float, main_pid: int, tasks: int) -> dict[str, float]:
    """The commands the worker's processes sent between `began` and `ended` (CommandLog's lines), per task."""
    counted: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        at, pid, name, target = line.split()
        if began <= float(at) <= ended:
            counted[f"{'main' if int(pid) == main_pid else 'pool'} {name} {target}"] += 1
    return {key: count / tasks for key, count in sorted(counted.items())}


def _syscalls_per_task(summary: Path, tasks: int) -> dict[str, float]:
    """strace -c's table (`% time, seconds, usecs/call, calls, [errors,] syscall`), the calls per task."""
    calls: dict[str, float] = {}
    for line in summary.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0].replace(".", "").isdigit() and fields[-1] != "total":
            calls[fields[-1]] = int(fields[3]) / tasks
    return dict(sorted(calls.items(), key=lambda item: -item[1]))


def one_worker(
    url: str, name: str, workdir: Path, n: int, idle: float, commands: bool, syscalls: bool = False
) -> dict[str, Any]:
    """A fresh worker's CPU: per second idle after its warm-up, then per task over `n` tasks at PACE a second."""
    stamps = Stamps(workdir / f"{name}.stamps")
    log = workdir / f"{name}.commands"
    app = producer(url)
    worker = Worker(
        url,
        log_dir=workdir,
        name=name,
        app="tools.bench.app",
        extra_args=("-Q", "bench"),
        env={
            "BENCH_STAMPS": str(stamps.path),
            "BENCH_PREFETCH": "1",
            **({"BENCH_COMMANDS": str(log)} if commands else {}),
        },
    )
    try:
        worker.start()
        assert worker.process is not None
        pid = worker.process.pid
        for _ in range(WARM_UP):
            send(app, "w")
            time.sleep(1 / PACE)
        stamps.wait("w", WARM_UP, timeout=120)
        time.sleep(1.0)
        (main, pool), began = worker_cpu_seconds(pid), time.monotonic()
        time.sleep(idle)
        (main_idle, pool_idle), idled = worker_cpu_seconds(pid), time.monotonic() - began
        tracer, traced = None, workdir / f"{name}.strace"
        if syscalls:
            strace = shutil.which("strace")
            if strace is None:
                raise RuntimeError("BENCH_PACED_SYSCALLS=1 needs strace: apt-get install -y strace")
            argv = [strace, "-c", "-f", "-o", str(traced), "-p", str(pid)]
            tracer = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached to every thread
        began, began_at = time.monotonic(), time.time()
        for k in range(n):
            send(app, "q")
            time.sleep(max(0.0, began + (k + 1) / PACE - time.monotonic()))
        stamps.wait("q", n, timeout=120 + n)
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)  # detaches, and writes its table
            tracer.wait(60)
        main_end, pool_end = worker_cpu_seconds(pid)
        figures: dict[str, Any] = {
            "main_ms_per_task": (main_end - main_idle) * 1000 / n,
            "pool_ms_per_task": (pool_end - pool_idle) * 1000 / n,
            "idle_main_ms_per_s": (main_idle - main) * 1000 / idled,
            "idle_pool_ms_per_s": (pool_idle - pool) * 1000 / idled,
            "tps": n / (time.monotonic() - began),
            "load": _load(),
        }
        figures["ms_per_task"] = figures["main_ms_per_task"] + figures["pool_ms_per_task"]
        if commands and log.exists():
            figures["commands_per_task"] = _commands_per_task(log, began_at, time.time(), pid, n)
        if tracer is not None:
            figures["syscalls_per_task"] = _syscalls_per_task(traced, n)
        return figures
    finally:
        stop_worker(worker)
        app.close()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def main() -> int:
    n, repeat = int(os.environ.get("BENCH_N", "500")), int(os.environ.get("BENCH_REPEAT", "3"))
    idle, commands = float(os.environ.get("BENCH_IDLE", "10")), os.environ.get("BENCH_PACED_COMMANDS") == "1"
    syscalls = os.environ.get("BENCH_PACED_SYSCALLS") == "1"
    workdir = Path(tempfile.mkdtemp(prefix="bb-paced-"))
    mongo: Server = mongo_server(workdir)
    redis_server = RedisServer(workdir)
    rounds: dict[str, list[dict[str, Any]]] = {broker: [] for broker in BROKERS}
    print(f"paced: {n} tasks at {PACE:.0f}/s, {idle:.0f} s idle, {repeat} rounds, load {_load()}; logs in {workdir}")
    mongo.start()
    redis_server.start()
    try:
        for rep in range(repeat):
            for broker in BROKERS if rep % 2 == 0 else BROKERS[::-1]:
                if broker == "redis":
                    redis.Redis.from_url(redis_server.url).flushdb()
                    url = redis_server.url
                else:
                    url = with_database(mongo.url, f"bench_paced_{rep}")
                figures = one_worker(
                    url, f"{broker}-{rep}", workdir, n, idle, commands and broker == "bbmongo", syscalls
                )
                rounds[broker].append(figures)
                slow = "  (under 90% of the pace)" if figures["tps"] < 0.9 * PACE else ""
                print(
                    f"round {rep + 1} {broker:8} {figures['ms_per_task']:.2f} ms per task (main "
                    f"{figures['main_ms_per_task']:.2f}, pool {figures['pool_ms_per_task']:.2f}), idle main "
                    f"{figures['idle_main_ms_per_s']:.1f} pool {figures['idle_pool_ms_per_s']:.1f} ms/s, "
                    f"{figures['tps']:.0f} tasks/s, load {figures['load']}{slow}",
                    flush=True,
                )
                for command, per_task in figures.get("commands_per_task", {}).items():
                    print(f"    {command}: {per_task:.3f} per task")
                if "syscalls_per_task" in figures:
                    calls = figures["syscalls_per_task"]
                    listed = ", ".join(f"{call} {per_task:.1f}" for call, per_task in calls.items() if per_task >= 0.5)
                    print(f"    main process system calls per task: {sum(calls.values()):.1f} ({listed})")
    finally:
        redis_server.stop()
        mongo.stop()
    ours, theirs = rounds["bbmongo"], rounds["redis"]
    for label, key in (("worker", "ms_per_task"), ("main process", "main_ms_per_task"), ("pool", "pool_ms_per_task")):
        ratios = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True) if b[key] > 0]
        medians = f"{statistics.median(r[key] for r in ours):.2f} / {statistics.median(r[key] for r in theirs):.2f}"
        print(f"{label:13} bbmongo/redis {_spread(ratios)}, ms per task (medians) {medians}")
    print(f"load at the end {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
