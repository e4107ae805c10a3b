"""Real `celery worker` subprocesses for end-to-end tests, and waiting on conditions instead of sleeping."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery
from pymongo import monitoring
from pymongo.database import Database

T = TypeVar("T")
#: The checkout, and where tests leave what a person may want to look at afterwards (screenshots, figures).
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"

#: Small enough that retries and stale sweeps happen within a test, large enough for a loaded machine.
FAST_OPTIONS = {"backoff_base": 0.25, "stale_after": 300.0, "polling_interval": 0.1}


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, message: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last value {value!r}")
        time.sleep(0.05)


#: Every worker a test started; conftest kills them all after each test, whatever the test did.
STARTED: list[Worker] = []


class Worker:
    def __init__(
        self,
        broker_url: str,
        *,
        log_dir: Path,
        name: str,
        concurrency: int = 2,
        options: dict[str, Any] | None = None,
        app: str = "tests.support.e2e_app",
        pool: str = "prefork",
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        bin_dir: Path | None = None,
        cwd: Path = ROOT,
    ) -> None:
        """`bin_dir`: a venv's bin/ whose `celery` command runs the worker (a user's install), else the suite's."""
        self.broker_url = broker_url
        self.log_path = log_dir / f"worker-{name}.log"
        self.name = name
        celery = [str(bin_dir / "celery")] if bin_dir else [sys.executable, "-m", "celery"]
        self.argv = [
            *celery, "-A", app, "worker", "-n", f"{name}@%h", "-c", str(concurrency),
            "-P", pool, "--loglevel", "INFO", "--without-mingle", "--without-gossip", *extra_args,
        ]  # fmt: skip
        self.env = {
            **os.environ,
            "BB_BROKER_URL": broker_url,
            "BB_TRANSPORT_OPTIONS": json.dumps({**FAST_OPTIONS, **(options or {})}),
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> None:
        STARTED.append(self)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the worker writes to it for its whole life)
        self.process = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for(lambda: self.process.poll() is not None or " ready." in self.log(), timeout, f"{self.name} ready")
        if self.process.poll() is not None:
            raise AssertionError(f"worker {self.name} exited with {self.process.returncode}:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the main process and its whole pool, as a crash or an OOM killer would."""
        kill_group(self.process)


def kill_group(process: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
    """SIGKILL a process started in a session of its own (start_new_session=True) with every process of its group
    (a worker's pool, Flower's children), as a crash or an OOM killer would, and reap it; None: nothing started."""
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout)


def producer(broker_url: str) -> Celery:
    """A Celery app that only publishes, as a web process would."""
    app = Celery("producer", broker=broker_url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    return app


def send(app: Celery, name: str, *args: Any, **options: Any) -> str:
    return app.send_task(f"tests.support.e2e_app.{name}", args=args, **options).id


def consumer_loops(app: Celery, workers: int = 1) -> dict[str, dict[str, Any]]:
    """What the workers' Celery consumers say about their loop (tests/support/e2e_app.py's `consumer_loop` command):
    `asynloop` on Celery's event loop, `synloop` on the blocking one. Returns once `workers` answered."""
    replies = app.control.broadcast("consumer_loop", reply=True, timeout=10, limit=workers) or []
    return {name: answer for reply in replies for name, answer in reply.items()}


def job(db: Database, task_id: str) -> dict[str, Any]:
    return db.jobs.find_one({"taskId": task_id}) or {}


def all_succeeded(db: Database, ids: list[str]) -> Callable[[], bool]:
    """Whether every job of these task ids has succeeded: a condition to wait on."""
    return lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == len(ids)


def settled(db: Database, task_id: str, status: str) -> Callable[[], Any]:
    """A wait_for condition: the task's job has `status` (and then it is the document)."""
    return lambda: (doc := job(db, task_id)).get("status") == status and doc


def process_factory(request: Any, build: Callable[..., Any], stop: Callable[[Any], None]) -> Iterator[Callable]:
    """A fixture's body: `make(**kwargs)` builds and starts a process (a worker, Flower); after the test every one
    is stopped, and the end of each log is shown when the test failed."""
    started: list[Any] = []

    def make(**kwargs: Any) -> Any:
        process = build(len(started), **kwargs)
        started.append(process)
        process.start()
        return process

    yield make
    for process in started:
        stop(process)
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for process in started:
            print(f"----- {process.log_path.name} (last lines) -----\n{process.log()[-4000:]}")


def failing_write(changes: Any, timeout: float = 60.0) -> dict[str, Any]:
    """The fields set by the update that failed a job, read from a change stream opened on `jobs` beforehand.

    A job's lastError must be right in that very write: a reader between two writes would see a placeholder.
    """

    def next_failure() -> dict[str, Any] | None:
        while (change := changes.try_next()) is not None:
            fields = (change.get("updateDescription") or {}).get("updatedFields") or {}
            if fields.get("status") == "failed":
                return fields
        return None

    return wait_for(next_failure, timeout, "the write that failed the job")


class ClaimCommands(monitoring.CommandListener):
    """The commands one thread sends to the jobs and bb_messages collections of one database, while it records
    (the consumer's looks and claims: not the watcher's getMores, nor the lease keeper's heartbeats and sweeps).

    Registered with pymongo.monitoring.register, it hears the clients made from then on, which include the
    transport's client for a test's own database (a client per broker URL)."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.recording: int | None = None  # the thread recorded
        self.sent: list[tuple[str, str]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        target = event.command.get(event.command_name)
        if threading.get_ident() != self.recording or event.database_name != self.database:
            return
        if target in ("jobs", "bb_messages"):
            self.sent.append((event.command_name, target))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    @contextlib.contextmanager
    def recorded(self) -> Iterator[list[tuple[str, str]]]:
        self.sent, self.recording = [], threading.get_ident()
        try:
            yield self.sent
        finally:
            self.recording = None
