"""The MongoDB the suite runs against: BB_TEST_MONGO_URL, or an embedded SecantusDB daemon it starts itself."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pymongo import MongoClient
from pymongo.errors import PyMongoError

from bb_broker.embedded import daemon_argv

#: The password of the user `auth_server` (tests/conftest.py) creates.
AUTH_PASSWORD = "s3cret-pw"


#: Where free_port hands out ports: a block per test process, below Linux's ephemeral range (32768 and up).
FIRST_PORT = 20_000
PORTS_PER_WORKER = 250
BLOCKS = (32_768 - FIRST_PORT) // PORTS_PER_WORKER
_handed_out = itertools.count()
#: The socket that holds this process's block (bound to its first port) for as long as the process lives.
_block_claim: socket.socket | None = None


def free_port() -> int:
    """A port nothing listens on, which no other test process on this machine is handed: each takes from a block of
    its own, below the ephemeral range, where neither another process's free_port nor an outgoing connection can
    take it between this call and its server's bind. (A port the kernel picked at random once went to two workers'
    Flowers: a request reached the other one, whose users differ, and had a 401. A block per xdist worker number
    alone was shared by two pytest sessions on one machine: a Flower that could not bind its port left the test
    talking to the other session's Flower, and a server's port went to the other session's server.)"""
    block = _own_block()
    for _ in range(PORTS_PER_WORKER - 1):
        port = block + 1 + next(_handed_out) % (PORTS_PER_WORKER - 1)  # the first port is the block's claim
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # still in use, or its last connection not yet closed
            return port
    raise RuntimeError(f"no free port in {block}-{block + PORTS_PER_WORKER - 1}")


def _own_block() -> int:
    """The first port of this process's block, claimed on first use by listening on it until the process ends: a
    process of another pytest session finds the claim and takes the next free block. An xdist worker starts looking
    at its own number's block, so one session's workers do not contend."""
    global _block_claim
    if _block_claim is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        first = int(worker) if worker.isdigit() else 0
        for n in range(BLOCKS):
            claim = socket.socket()
            try:
                claim.bind(("127.0.0.1", FIRST_PORT + (first + n) % BLOCKS * PORTS_PER_WORKER))
                claim.listen(1)
            except OSError:
                claim.close()
                continue
            _block_claim = claim
            break
        else:
            raise RuntimeError(f"every block of {PORTS_PER_WORKER} ports from {FIRST_PORT} is claimed")
    return _block_claim.getsockname()[1]


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


class AnswerDroppingProxy:
    """A TCP proxy in front of a server that, once armed, lets commands matching `needle` through to the server
    and drops the client's connection instead of passing the server's answer back: a write that landed unseen,
    as when the network fails between a server and its client."""

    def __init__(self, upstream_url: str) -> None:
        host, _, port = upstream_url.removeprefix("mongodb://").rstrip("/").partition(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"mongodb://127.0.0.1:{self.listener.getsockname()[1]}"
        self._needle = b""
        self._drops_left = 0
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_the_answers_to(self, needle: bytes, times: int) -> None:
        self._needle, self._drops_left = needle, times

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the server is gone (its test is over, or stopped it): the client sees its connection end
                client.close()
                continue
            watched: set[int] = set()  # request ids whose answer is to be dropped
            threading.Thread(target=self._requests, args=(client, server, watched), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, watched), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, watched: set[int]) -> None:
        with contextlib.suppress(OSError):
            while message := _read_message(client):
                if self._drops_left and self._needle in message:
                    self._drops_left -= 1
                    watched.add(int.from_bytes(message[4:8], "little"))
                server.sendall(message)

    def _answers(self, server: socket.socket, client: socket.socket, watched: set[int]) -> None:
        with contextlib.suppress(OSError):
            while message := _read_message(server):
                if int.from_bytes(message[8:12], "little") in watched:
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    self.dropped += 1
                    return
                client.sendall(message)


def _read_message(sock: socket.socket) -> bytes:
    """One MongoDB wire message (its header's first field is its length), or b"" when the peer closed."""
    header = read_exactly(sock, 4)
    if not header:
        return b""
    return header + read_exactly(sock, int.from_bytes(header, "little") - 4)


def read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = b""
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return b""
        chunks += chunk
    return chunks
