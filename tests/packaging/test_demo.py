"""The README's first command: `make demo` (against the suite's server, or its own) and `bb-broker serve`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pymongo import MongoClient

from tests.support.servers import EmbeddedServer, free_port
from tests.support.workers import ROOT, wait_for

DEMO = [sys.executable, "-m", "celery_app.demo"]
#: The demo writes its logs to the checkout's bb-data/ unless told, and wants Flower on 5555: one demo at a time.
pytestmark = pytest.mark.xdist_group("demo")


def demo_env(**settings: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("BB_DEMO_", "BB_BROKER_URL"))}
    return {**env, "PYTHONPATH": str(ROOT), **settings}


def final_counts(stdout: str) -> dict[str, int]:
    """The JSON line BB_DEMO_ONCE prints when the sample jobs are settled."""
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_the_demo_runs_the_sample_jobs_to_the_end(broker_url, db) -> None:
    env = demo_env(BB_BROKER_URL=broker_url, BB_DEMO_ONCE="1")
    demo = subprocess.run(DEMO, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "demo: add.delay(2, 3).get() = 5" in demo.stdout
    final = final_counts(demo.stdout)
    assert final == {"queued": 0, "running": 0, "succeeded": 3, "failed": 1}
    doomed = db.jobs.find_one({"kind": "celery_app.tasks.always_fails"})
    assert doomed["attempts"] == 3 and "permanent failure" in doomed["lastError"]
    assert db.jobs.find_one({"kind": "celery_app.tasks.flaky"})["attempts"] == 2


def seed_failed_jobs(data: Path, count: int) -> None:
    """A data directory left by an earlier run: `count` failed jobs in the demo's database."""
    data.mkdir(parents=True)
    server = EmbeddedServer(data, log_dir=data.parent)
    server.start()
    try:
        with MongoClient(server.url) as client:
            now = datetime.now(UTC)
            client.bountyboard.jobs.insert_many(
                [{"_id": f"old-{i}", "status": "failed", "kind": "old", "queue": "celery", "attempts": 3,
                  "updatedAt": now} for i in range(count)]
            )  # fmt: skip
    finally:
        server.stop()


@contextmanager
def taken_port() -> Iterator[int]:
    """A port something else listens on (and never answers)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def test_the_demo_takes_free_ports_says_which_and_starts_from_empty_data(tmp_path) -> None:
    seed_failed_jobs(tmp_path / "demo" / "db", 5)
    with ExitStack() as stack:
        server_port, flower_port = stack.enter_context(taken_port()), stack.enter_context(taken_port())
        env = demo_env(BB_DEMO_DATA=str(tmp_path / "demo"), BB_DEMO_ONCE="1", BB_DEMO_SERVER_PORT=str(server_port),
                       BB_DEMO_FLOWER_PORT=str(flower_port))  # fmt: skip
        demo = subprocess.run(DEMO, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert final_counts(demo.stdout) == {"queued": 0, "running": 0, "succeeded": 3, "failed": 1}  # not the old 5
    said = demo.stdout
    used_server = int(re.search(rf"port {server_port} is taken: the server listens on 127\.0\.0\.1:(\d+)", said)[1])
    assert f"server ready: bbmongo://127.0.0.1:{used_server}/bountyboard" in said
    used_flower = int(re.search(rf"port {flower_port} is taken: the Flower listens on 127\.0\.0\.1:(\d+)", said)[1])
    assert re.search(rf"Flower on http://127\.0\.0\.1:{used_flower} \(user demo, password \S+\)", said)
    assert "emptied first (BB_DEMO_KEEP_DATA=1 keeps it)" in said
    assert "stopped in" in said.splitlines()[-1]


class RunningDemo:
    """`make demo` in the background, its output read as it comes."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(DEMO, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            if self.process.poll() is not None and not any(re.search(pattern, line) for line in self.lines):
                raise AssertionError(f"the demo ended without saying {pattern!r}:\n" + "\n".join(self.lines))
            return next((match for line in self.lines if (match := re.search(pattern, line))), None)

        return wait_for(found, timeout, f"the demo to say {pattern!r}")

    def pids(self) -> dict[str, int]:
        started = (re.search(r"^demo: started (\w+) \(pid (\d+);", line) for line in self.lines)
        return {match[1]: int(match[2]) for match in started if match}

    def end(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def test_sigterm_stops_everything_the_demo_started_and_kept_data_is_kept(tmp_path) -> None:
    seed_failed_jobs(tmp_path / "demo" / "db", 5)
    ports = {"BB_DEMO_SERVER_PORT": str(free_port()), "BB_DEMO_FLOWER_PORT": str(free_port())}
    demo = RunningDemo(demo_env(BB_DEMO_DATA=str(tmp_path / "demo"), BB_DEMO_KEEP_DATA="1", **ports))
    try:
        demo.said(r"kept from the last run \(BB_DEMO_KEEP_DATA=1\)")
        demo.said(r'^demo: \{.*"failed": [5-9]')  # the earlier run's jobs are still there
        demo.said(r"^demo: Flower on http://")
        pids = demo.pids()
        assert set(pids) == {"server", "worker", "flower"}
        demo.process.send_signal(signal.SIGTERM)
        assert demo.end() == 0, "\n".join(demo.lines)
    finally:
        demo.end()
    assert all(gone(pid) for pid in pids.values()), pids  # it waited for each of them before it exited
    assert demo.lines[-2] == "demo: stopping flower, worker, server" and demo.lines[-1].startswith("demo: stopped in")


def test_the_demo_notices_a_child_that_died_and_stops_the_rest(broker_url) -> None:
    demo = RunningDemo(demo_env(BB_BROKER_URL=broker_url, BB_DEMO_FLOWER_PORT=str(free_port())))
    try:
        demo.said(r"^demo: Flower on http://")
        pids = demo.pids()
        os.kill(pids["flower"], signal.SIGKILL)
        assert demo.end() == 1, "\n".join(demo.lines)
    finally:
        demo.end()
    assert "demo: the flower was killed by SIGKILL; its log " in "\n".join(demo.lines)
    assert gone(pids["worker"])


def test_the_demo_says_in_words_why_it_cannot_use_the_server_it_was_given() -> None:
    closed = free_port()
    env = demo_env(BB_BROKER_URL=f"bbmongo://demo:s3cret@127.0.0.1:{closed}/bountyboard")
    demo = subprocess.run(DEMO, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert demo.returncode == 1 and demo.stderr == ""
    assert demo.stdout.splitlines()[-1] == (
        f"demo: cannot reach the server at bbmongo://demo:**@127.0.0.1:{closed}/bountyboard: nothing listens at "
        f"127.0.0.1:{closed} (connection refused): is the server running? (gave up after 5 s)"
    )
    assert "s3cret" not in demo.stdout


def test_bb_broker_serve_says_where_it_listens_and_stores_and_how_to_stop(tmp_path) -> None:
    port = free_port()
    data = tmp_path / "data"
    argv = [sys.executable, "-m", "bb_broker.cli", "serve", "--port", str(port), "--data", str(data)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = [server.stdout.readline() for _ in range(3)]
        assert said == [
            f"bb-broker: listening on 127.0.0.1:{port}; broker URL bbmongo://127.0.0.1:{port}/bountyboard\n",
            f"bb-broker: data in {data}\n",
            "bb-broker: stop it with Ctrl-C (or SIGTERM)\n",
        ]
        client = MongoClient(f"mongodb://127.0.0.1:{port}", serverSelectionTimeoutMS=5000)
        assert _pings(client)  # it said so once it was listening
        client.served.jobs.insert_one({"_id": 1})
        assert client.served.jobs.count_documents({}) == 1
    finally:
        server.terminate()
        server.wait(30)
    assert server.returncode == 0


def test_bb_broker_serve_refuses_a_port_in_use(tmp_path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "bb_broker.cli", "serve", "--port", str(port), "--data", str(tmp_path / "d")]
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == (
        f"bb-broker: cannot listen on 127.0.0.1:{port}: Address already in use (another server there? choose --port)\n"
    )


@pytest.mark.parametrize("kind", ["under a file", "a file", "under /proc"])
def test_bb_broker_serve_refuses_a_data_directory_it_cannot_make_in_one_line(kind: str, tmp_path) -> None:
    (tmp_path / "a-file").write_text("")
    data = {"under a file": tmp_path / "a-file" / "d", "a file": tmp_path / "a-file", "under /proc": "/proc/bb/d"}[kind]
    argv = [sys.executable, "-m", "bb_broker.cli", "serve", "--port", str(free_port()), "--data", str(data)]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith(f"bb-broker: cannot use --data {data}: ") and len(refused.stderr.splitlines()) == 1


def _pings(client: MongoClient) -> bool:
    try:
        return client.admin.command("ping")["ok"] == 1
    except Exception:
        return False


@pytest.mark.parametrize(
    ("stop", "own_server"),
    [("SIGINT to its process group", True), ("SIGTERM", False), ("SIGHUP", False)],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_the_demo_stops_every_child_when_nobody_reads_its_output(broker_url, tmp_path, stop, own_server) -> None:
    # `make demo 2>&1 | tee log`, then Ctrl-C: tee dies with the demo's terminal group and its pipe breaks.
    settings = {"BB_DEMO_DATA": str(tmp_path / "demo"), "BB_DEMO_FLOWER_PORT": str(free_port())}
    settings.update({"BB_DEMO_SERVER_PORT": str(free_port())} if own_server else {"BB_BROKER_URL": broker_url})
    # Started with SIGINT ignored, as a shell starts a background job (and as a test runner's process may be
    # started): the demo's Ctrl-C must work all the same.
    ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if stop.startswith("SIGINT") else None
    demo = subprocess.Popen(DEMO, cwd=ROOT, env=demo_env(**settings), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=ignore_sigint)  # fmt: skip
    pids: dict[str, int] = {}
    try:
        for line in demo.stdout:
            if started := re.search(r"^demo: started (\w+) \(pid (\d+);", line):
                pids[started[1]] = int(started[2])
            if line.startswith("demo: Flower on http://"):
                break
        assert set(pids) == ({"server", "worker", "flower"} if own_server else {"worker", "flower"}), pids
        demo.stdout.close()  # the reader is gone: the demo's next line meets a broken pipe
        if stop.startswith("SIGINT"):
            os.killpg(demo.pid, signal.SIGINT)
        else:
            demo.send_signal(getattr(signal, stop))
        demo.wait(120)
        assert wait_for(lambda: all(gone(pid) for pid in pids.values()), 30, "every child to be gone"), pids
        assert demo.returncode == 0
    finally:
        if demo.poll() is None:
            demo.kill()
        for pid in pids.values():  # what the demo left behind, so that the suite does not inherit it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
