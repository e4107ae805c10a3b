"""The Celery app the benchmark's workers run: one trivial task that stamps when it started and finished."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, signals
from pymongo import monitoring

import bb_broker  # noqa: F401 (registers bbmongo://)

#: Celery's default queue for the backlog, and a second one the idle and under-load probes go to.
QUEUE = "bench"
PROBE_QUEUE = "probe"
TASK = "bench.stamp"
#: A task that keeps its pool process busy while a flag file exists (the saturated worker's ping figure).
HOLD_TASK = "bench.hold"

app = Celery("bench")
app.conf.update(
    broker_url=os.environ.get("BB_BROKER_URL", "bbmongo://127.0.0.1:27017/bench"),
    # The project's recommended setting (README), the same for every broker so that only the transport differs.
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "1")),
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    # A round's own transport options (the polling round's use_change_streams=False), else bbmongo://'s defaults.
    broker_transport_options=json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS", "{}")),
)
if os.environ.get("BENCH_RESULT_BACKEND"):
    # The "with results" rounds: every task's result stored (bbmongo:// on its job, mongodb:// in celery_taskmeta).
    app.conf.update(result_backend=os.environ["BENCH_RESULT_BACKEND"], task_ignore_result=False)

_started: dict[str, tuple[str, float, float]] = {}


class CommandLog(monitoring.CommandListener):
    """Diagnosis (BENCH_COMMANDS): one line per command a process sends, to see what a task costs the server."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        target = event.command.get("collection" if event.command_name == "getMore" else event.command_name)
        target = target if isinstance(target, str) else "-"
        os.write(self.fd, f"{time.time():.6f} {os.getpid()} {event.command_name} {target}\n".encode())

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


if os.environ.get("BENCH_COMMANDS"):
    # Registered before any client exists, so the worker's clients and its pool's (made after the fork) report.
    monitoring.register(CommandLog(os.environ["BENCH_COMMANDS"]))
_stamps_fd: int | None = None


def _stamps() -> int:
    # One O_APPEND descriptor per pool process: a line per task, written whole, no server involved, so
    # the measurement costs every broker the same and adds nothing to MongoDB's or Redis's counters.
    global _stamps_fd
    if _stamps_fd is None:
        _stamps_fd = os.open(os.environ["BENCH_STAMPS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return _stamps_fd


@app.task(name=TASK, bind=True)
def stamp(self: Any, sent_at: float, tag: str = "d") -> None:
    _started[self.request.id] = (tag, sent_at, time.time())


@signals.task_postrun.connect
def _finished(task_id: str | None = None, **_: Any) -> None:
    # After task_success, where bbmongo:// settles the job: "finished" includes writing `succeeded`.
    stamped = _started.pop(task_id or "", None)
    if stamped is not None:
        tag, sent_at, started = stamped
        os.write(_stamps(), f"{tag} {sent_at:.6f} {started:.6f} {time.time():.6f}\n".encode())


@app.task(name=HOLD_TASK)
def hold(flag: str) -> None:
    """Busy until `flag` is removed; stamped `h` when it starts, so the bench knows when every process is taken."""
    started = time.time()
    os.write(_stamps(), f"h {started:.6f} {started:.6f} {started:.6f}\n".encode())
    while os.path.exists(flag):
        time.sleep(0.02)
