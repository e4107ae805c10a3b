"""`make demo`: embedded server, a worker, Flower and sample jobs, with the statuses printed as they change.

Environment: BB_BROKER_URL uses that server instead of starting one (its data is left alone); BB_DEMO_KEEP_DATA=1
keeps the embedded server's data of the last run (by default each run starts empty); BB_DEMO_DATA is where the
data and logs go (./bb-data); BB_DEMO_SERVER_PORT and BB_DEMO_FLOWER_PORT are the ports wanted (27017, 5555),
a taken one is replaced by a free one; BB_DEMO_ONCE=1 stops once the sample jobs are settled.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from pymongo import MongoClient
from pymongo.errors import PyMongoError

import bb_broker
from bb_broker.connection import new_client, parse_broker_url, redact_url
from bb_broker.server import describe_failure

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
#: How long each child gets to stop on SIGTERM before it is killed: a warm worker shutdown finishes its task.
STOP_TIMEOUT = 10.0


class DemoFailed(Exception):
    """Something the demo started did not come up or died: the message says what and where its log is."""


class Stopped(Exception):
    """Ctrl-C, SIGTERM or SIGHUP came: stop everything the demo started."""


class StopRequest:
    """Notes Ctrl-C, SIGTERM and SIGHUP; the main thread asks `check()` between its steps.

    The handlers only take note. An exception raised from a signal handler lands wherever the main thread happens
    to be, a garbage collector's weakref callback included, where Python prints it and drops it: pymongo's monitor
    clean-up swallowed a KeyboardInterrupt there, and the demo ran on (3 Ctrl-Cs in 45 under load)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        # Installed even where the demo was started with SIGINT ignored (a shell's background job, a test runner's
        # process): Ctrl-C must work all the same.
        for signum in (signal.SIGINT, *STOP_SIGNALS):
            signal.signal(signum, self._note)

    def _note(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Stopped


class Child:
    """A process the demo started, in a session of its own (Ctrl-C reaches the demo only, which stops it)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        say(f"started {name} (pid {self.process.pid}; log {_shown(log)})")

    def check(self) -> None:
        code = self.process.poll()
        if code is not None:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            raise DemoFailed(f"the {self.name} {how}; its log {_shown(self.log)} ends:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"    {line}" for line in text) or "    (empty)"

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait_or_kill(self, deadline: float) -> None:
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"the {self.name} did not stop in time: killing it")
        # Whatever is left of its session (a worker's pool processes) goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def flower_command(address: str, port: int) -> list[str]:
    """`bb-broker flower` for the demo's app, with the Broker tab; its credentials come in FLOWER_BASIC_AUTH."""
    return [sys.executable, "-m", "bb_broker.cli", "flower", "-A", "celery_app", f"--address={address}",
            f"--port={port}"]  # fmt: skip


def say(message: str) -> None:
    try:
        print(f"demo: {message}", flush=True)
    except (BrokenPipeError, ValueError):  # nobody reads any more (`make demo | tee log`, tee stopped by Ctrl-C)
        _stop_writing()


def _stop_writing() -> None:
    """Send what is left of the demo's output nowhere: the shutdown must go on whoever stopped reading, and
    Python's own flush at exit must not fail on the broken pipe either."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _port(wanted: int, what: str) -> int:
    """`wanted` when it is free, else a free one, said out loud."""
    for port in (wanted, 0):
        try:
            with socket.create_server((HOST, port)) as sock:
                chosen = sock.getsockname()[1]
        except OSError:
            continue
        if chosen != wanted:
            say(f"port {wanted} is taken: the {what} listens on {HOST}:{chosen} instead")
        return chosen
    raise DemoFailed(f"no free port for the {what}")


def _wait_until(ready: Any, child: Child | None, what: str, stop: StopRequest, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        stop.check()
        if child is not None:
            child.check()
        if time.monotonic() > deadline:
            raise DemoFailed(f"{what} did not come up within {timeout:.0f} s")
        time.sleep(0.2)


def _pings(client: MongoClient) -> bool:
    try:
        return client.admin.command("ping").get("ok") == 1
    except PyMongoError:
        return False


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


#: Signals that stop the demo like Ctrl-C does: SIGTERM, and SIGHUP (its terminal closed).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: How long the demo waits for add's result.
RESULT_TIMEOUT = 300.0


def main() -> int:
    stop = StopRequest()
    once = os.environ.get("BB_DEMO_ONCE") == "1"
    data_root = Path(os.environ.get("BB_DEMO_DATA", ROOT / "bb-data")).resolve()
    logs = data_root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    code = 0
    try:
        url = os.environ.get("BB_BROKER_URL")
        if url is None:
            url = _start_server(data_root / "db", children, logs, stop)
        else:
            say(f"using the server of BB_BROKER_URL={redact_url(url)}: the counts are of every job there")
        target = parse_broker_url(url)
        with new_client(target.mongo_uri, serverSelectionTimeoutMS=5000) as client:
            _check_server(client, url, children)
        os.environ["BB_BROKER_URL"] = url  # the children's broker

        celery = [sys.executable, "-m", "celery", "-A", "celery_app"]
        children.append(
            Child("worker", [*celery, "worker", "-c", "2", "-E", "--loglevel", "INFO"], logs / "worker.log")
        )
        flower_port = _port(int(os.environ.get("BB_DEMO_FLOWER_PORT", "5555")), "Flower")
        password = secrets.token_urlsafe(9)
        # The password travels in Flower's own variable, out of the process list.
        flower_env = {**os.environ, "FLOWER_BASIC_AUTH": f"demo:{password}"}
        children.append(Child("flower", flower_command(HOST, flower_port), logs / "flower.log", flower_env))
        _wait_until(lambda: _accepts(flower_port), children[-1], "Flower", stop)
        say(f"Flower on http://{HOST}:{flower_port} (user demo, password {password})")

        from celery_app import app
        from celery_app.tasks import add, always_fails, flaky, long_running

        # `python -m celery_app.demo` imported the app before the URL was known
        app.conf.update(broker_url=url, result_backend=url)
        sample = []
        for task, args in ((add, (2, 3)), (flaky, ("flaky",)), (always_fails, ("doomed",)), (long_running, (3,))):
            stop.check()
            sample.append(task.delay(*args))
        ids = [result.id for result in sample]
        with new_client(target.mongo_uri, serverSelectionTimeoutMS=5000, tz_aware=True) as client:
            db = client[target.database]
            last = None
            say("Ctrl-C stops everything the demo started")
            # The result backend is the jobs collection too: .get() reads the result off add's job document.
            say(f"add.delay(2, 3).get() = {_result(sample[0], stop)!r}")
            while True:
                stop.check()
                for child in children:
                    child.check()
                _check_server(client, url, children)
                # Settled first, then the counts: read the other way round, a job settling in between showed as
                # still running in the last line BB_DEMO_ONCE prints.
                settled = db.jobs.count_documents({"taskId": {"$in": ids}, "status": {"$in": ["succeeded", "failed"]}})
                counts = bb_broker.statuses(db)
                if counts != last:
                    say(json.dumps(counts))
                    last = counts
                if once and settled == len(ids):
                    with contextlib.suppress(BrokenPipeError):
                        print(json.dumps(counts), flush=True)
                    return 0
                time.sleep(1)
    except Stopped:
        return 0
    except BrokenPipeError:  # the reader of our output is gone: stop what was started, quietly
        _stop_writing()
        return 0
    except DemoFailed as exc:
        say(str(exc))
        code = 1
    finally:
        _stop(children)
    return code


def _check_server(client: MongoClient, url: str, children: list[Child]) -> None:
    """The server answers; if not, say why in words (and which child died, if one did)."""
    try:
        client.admin.command("ping")
    except PyMongoError as exc:
        for child in children:
            child.check()
        raise DemoFailed(describe_failure(exc, url)) from None


def _result(result: AsyncResult, stop: StopRequest) -> Any:
    """`result.get()`, in short waits: a stop comes between two of them."""
    deadline = time.monotonic() + RESULT_TIMEOUT
    while True:
        stop.check()
        try:
            return result.get(timeout=0.5)
        except CeleryTimeoutError:
            if time.monotonic() > deadline:
                raise DemoFailed(f"the result of task {result.id} did not come within {RESULT_TIMEOUT:.0f} s") from None


def _start_server(data: Path, children: list[Child], logs: Path, stop: StopRequest) -> str:
    if os.environ.get("BB_DEMO_KEEP_DATA") == "1":
        say(f"data in {data}, kept from the last run (BB_DEMO_KEEP_DATA=1)")
    else:
        shutil.rmtree(data, ignore_errors=True)
        say(f"data in {data}, emptied first (BB_DEMO_KEEP_DATA=1 keeps it)")
    port = _port(int(os.environ.get("BB_DEMO_SERVER_PORT", "27017")), "server")
    server = Child("server", [sys.executable, "-m", "bb_broker.cli", "serve", "--host", HOST, "--port", str(port),
                              "--data", str(data)], logs / "server.log")  # fmt: skip
    children.append(server)
    url = f"bbmongo://{HOST}:{port}/bountyboard"
    with new_client(f"mongodb://{HOST}:{port}", serverSelectionTimeoutMS=500) as client:
        _wait_until(lambda: _pings(client), server, "the server", stop)
    say(f"server ready: {url}")
    return url


def _stop(children: list[Child]) -> None:
    """Everything the demo started, the server last (the worker releases its jobs there), within seconds, whoever
    still reads the demo's output (say() never fails) and whatever signal comes next (ignored)."""
    if not children:
        return
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not leave processes behind
    started = time.monotonic()
    say("stopping " + ", ".join(child.name for child in reversed(children)))
    server = [child for child in children if child.name == "server"]
    for group in ([child for child in children if child not in server], server):
        for child in group:
            child.stop()
        deadline = time.monotonic() + STOP_TIMEOUT
        for child in group:
            child.wait_or_kill(deadline)
    say(f"stopped in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
