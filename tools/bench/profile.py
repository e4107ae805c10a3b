"""`python -m tools.bench.profile`: where a worker's processes spend their samples during a backlog drain.

BENCH_N trivial tasks (default 4,000) are published before a `-c 2` prefork worker starts, at BENCH_PREFETCH
(default Celery's 4), on the server tools.bench.servers picks (the Rust stand-in when it is on PATH). `py-spy
record` samples the worker's main process and both pool processes for the whole drain; the report gives, for the
pool processes and for the main process, the share of samples each bb_broker function (and Celery's tracer) is on
the stack for. py-spy counts a thread waiting for the GIL as active, so a share is time, not CPU alone; with
BENCH_PROFILE_GIL=1 it samples only the thread holding the GIL (`--gil`), and a share is the Python CPU. The raw
profiles stay in the printed directory (py-spy's collapsed format, for a flame graph). BENCH_PROFILE_BROKER=redis
profiles the same drain through Kombu's `redis://` on a throwaway redis-server, for scale.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from pymongo import MongoClient

from tests.support.servers import with_database
from tests.support.workers import Worker
from tools.bench.runner import DEFAULT_PREFETCH, Stamps, producer, send, stop_worker
from tools.bench.servers import RedisServer, Server, mongo_server

#: Frames whose share is reported: ours, and Celery's tracer for scale.
REPORTED = ("bb_broker/", "celery/app/trace.py")
TOP = 25


def shares(profiles: list[Path]) -> tuple[int, Counter[str]]:
    """Samples in all, and per function the samples it is on the stack for (once per stack)."""
    total, on_stack = 0, Counter[str]()
    for path in profiles:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            samples = int(count)
            total += samples
            names = set()
            for frame in stack.split(";"):
                function, _, where = frame.partition(" (")
                if any(part in where for part in REPORTED):
                    names.add(f"{function} ({where.split(':')[0]})")
            for name in names:
                on_stack[name] += samples
    return total, on_stack


def main() -> int:
    py_spy = Path(sys.executable).parent / "py-spy"
    if not py_spy.exists():
        print(f"py-spy is not installed in this venv: {sys.executable} -m pip install py-spy", file=sys.stderr)
        return 2
    n, prefetch = int(os.environ.get("BENCH_N", "4000")), int(os.environ.get("BENCH_PREFETCH", DEFAULT_PREFETCH))
    gil = os.environ.get("BENCH_PROFILE_GIL") == "1"
    workdir = Path(tempfile.mkdtemp(prefix="bb-profile-"))
    redis = os.environ.get("BENCH_PROFILE_BROKER", "bbmongo") == "redis"
    server: Server = RedisServer(workdir) if redis else mongo_server(workdir)
    server.start()
    try:
        url = server.url if redis else with_database(server.url, "profile", "bbmongo")
        stamps = Stamps(workdir / "stamps")
        app = producer(url)
        for _ in range(n):
            send(app, "d")
        worker = Worker(url, log_dir=workdir, name="profile", app="tools.bench.app", extra_args=("-Q", "bench"),
                        env={"BENCH_STAMPS": str(stamps.path), "BENCH_PREFETCH": str(prefetch)})  # fmt: skip
        worker.start()
        assert worker.process is not None
        pool = subprocess.run(["pgrep", "-P", str(worker.process.pid)], capture_output=True, text=True).stdout.split()
        processes = {"main": [worker.process.pid], "pool": [int(pid) for pid in pool]}
        spies = {
            pid: subprocess.Popen(
                [
                    str(py_spy),
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "--nonblocking",
                    *(["--gil"] if gil else []),
                    "-o",
                    str(workdir / f"{pid}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pids in processes.values()
            for pid in pids
        }
        began = time.monotonic()
        stamps.wait("d", n, timeout=120 + n / 2)
        drained = time.monotonic() - began
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        for spy in spies.values():
            spy.wait(30)
        stop_worker(worker)
        app.close()
        if not redis:
            MongoClient(server.url).drop_database("profile")
    finally:
        server.stop()
    sampled = "the threads holding the GIL" if gil else "every active thread"
    print(
        f"{n} tasks at prefetch {prefetch} on {server.label} in {drained:.1f} s ({sampled} sampled);",
        f"profiles in {workdir}",
    )
    for role, pids in processes.items():
        total, on_stack = shares([workdir / f"{pid}.txt" for pid in pids])
        print(f"\n{role} process{'es' if len(pids) > 1 else ''}: {total} samples")
        for name, samples in on_stack.most_common(TOP):
            print(f"  {100 * samples / max(total, 1):5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
