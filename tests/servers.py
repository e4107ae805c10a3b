"""The MongoDB the suite runs against: BB_TEST_MONGO_URL, or an embedded SecantusDB daemon it starts itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pymongo import MongoClient
from pymongo.errors import PyMongoError

from bb_broker.embedded import daemon_argv


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_database(mongo_url: str, database: str, scheme: str = "bbmongo") -> str:
    """The URL with `database` as its path and `scheme` in front, options kept."""
    rest = mongo_url.split("://", 1)[1]
    hosts, _, tail = rest.partition("/")
    options = tail.partition("?")[2]
    return f"{scheme}://{hosts}/{database}" + (f"?{options}" if options else "")


class EmbeddedServer:
    """A SecantusDB daemon in its own process, so a test can stop and restart it on the same data."""

    def __init__(
        self, data_dir: Path, *, auth: bool = False, log_dir: Path | None = None, tls: tuple[Path, Path] | None = None
    ) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.auth = auth
        self.tls = tls  # (certificate chain, private key) PEM files
        self.log_path = (log_dir or data_dir.parent) / f"secantus-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        argv = daemon_argv("127.0.0.1", self.port, str(self.data_dir), auth=self.auth, test_commands=True)
        if self.tls:
            argv += ["--tls-cert-file", str(self.tls[0]), "--tls-key-file", str(self.tls[1])]
        log = open(self.log_path, "ab")  # noqa: SIM115 (the daemon writes to it for its whole life)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from secantus.cli import main; sys.exit(main(sys.argv[1:]))", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"embedded server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with MongoClient(self.url, serverSelectionTimeoutMS=500, **self.client_options) as client:
                    client.admin.command("ping")
                return
            except PyMongoError:
                time.sleep(0.2)
        raise RuntimeError(f"embedded server did not answer within {timeout}s; see {self.log_path}")

    @property
    def client_options(self) -> dict[str, object]:
        return {"tls": True, "tlsAllowInvalidCertificates": True} if self.tls else {}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None


def external_url() -> str | None:
    return os.environ.get("BB_TEST_MONGO_URL") or None
