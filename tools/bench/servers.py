"""The servers a benchmark run starts and stops: SecantusDB (the Rust daemon when installed) and redis-server."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pymongo import MongoClient
from pymongo.errors import PyMongoError

from tests.support.servers import EmbeddedServer, free_port

#: The fast stand-in: `cargo install secantus-mdb --version <pre-release>` puts it in ~/.cargo/bin.
RUST_DAEMON = "secantusd-rs"


class Server(Protocol):
    url: str
    label: str

    @property
    def pid(self) -> int: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _wait_until(
    ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}; see {log}")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer within {timeout}s; see {log}")


def _mongo_answers(url: str) -> bool:
    try:
        with MongoClient(url, serverSelectionTimeoutMS=500) as client:
            client.admin.command("ping")
        return True
    except PyMongoError:
        return False


class _Daemon:
    """A server binary started in its own session, logging to a file, stopped with SIGTERM (then SIGKILL)."""

    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def _launch(self, argv: list[str], ready: Callable[[], bool], timeout: float) -> None:
        log = open(self.log, "ab")  # noqa: SIM115 (the daemon writes to it for its whole life)
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_until(ready, self.process, Path(argv[0]).name, self.log, timeout)

    def stop(self) -> None:
        _stop(self.process)
        self.process = None


class PythonSecantus:
    """SecantusDB's Python daemon, exactly as the test suite runs it."""

    def __init__(self, workdir: Path) -> None:
        self._server = EmbeddedServer(workdir / "secantus-data", log_dir=workdir)
        self.url = self._server.url
        from importlib.metadata import version

        self.label = f"SecantusDB (Python) {version('SecantusDB')}"

    @property
    def pid(self) -> int:
        assert self._server.process is not None
        return self._server.process.pid

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()


class RustSecantus(_Daemon):
    """SecantusDB's Rust daemon, `secantusd-rs`: the stand-in whose authors put it within a few times of mongod."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"mongodb://127.0.0.1:{self.port}"
        self.data = workdir / "secantus-rs-data"
        self.log = workdir / f"secantusd-rs-{self.port}.log"
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        first = ((out.stdout or out.stderr).strip().splitlines() or [binary])[0]
        self.label = f"SecantusDB (Rust) {first.removeprefix('secantusd-rs ')}"

    def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        argv = [
            self.binary, "--host", "127.0.0.1", "--port", str(self.port), "--storage-path", str(self.data),
            "--log-level", "WARNING", "--cache-size", "512M",
        ]  # fmt: skip
        self._launch(argv, lambda: _mongo_answers(self.url), 60.0)


def mongo_server(workdir: Path) -> Server:
    """The Rust stand-in when it is on PATH (BENCH_SERVER=python forces the Python one)."""
    import os

    binary = shutil.which(RUST_DAEMON)
    if binary and os.environ.get("BENCH_SERVER", "").lower() != "python":
        return RustSecantus(binary, workdir)
    return PythonSecantus(workdir)


class RedisServer(_Daemon):
    """A throwaway redis-server on a free loopback port: no persistence, no config file."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.log = workdir / f"redis-{self.port}.log"
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        version = next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("v=")), "?")
        self.label = f"redis-server {version}"

    def start(self) -> None:
        argv = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "yes",
        ]  # fmt: skip
        self._launch(argv, self._answers, 30.0)

    def _answers(self) -> bool:
        import redis

        with contextlib.suppress(redis.RedisError):
            return bool(redis.Redis.from_url(self.url, socket_timeout=1).ping())
        return False
