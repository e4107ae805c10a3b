"""A real Flower subprocess for end-to-end tests and its HTTP API."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tests.support.servers import free_port
from tests.support.workers import FAST_OPTIONS, ROOT, kill_group, wait_for

#: Flower's API refuses requests without authentication unless this is set.
FLOWER_ENV = {"FLOWER_UNAUTHENTICATED_API": "true"}
#: The basic-auth users of the Jobs tab's tests: an admin (--jobs_admins) who may act, and a viewer who may only look.
ADMIN = "admin:s3cret"
VIEWER = "viewer:peek"
USERS = f"{ADMIN},{VIEWER}"
AUTH_ARGS = ("--jobs_admins=admin",)
#: The installed Flower's minor. Its --read_only is new in 2.1: on 2.0 bb_broker's plugin says, as Flower starts,
#: that it is ignored.
FLOWER = tuple(int(part) for part in version("flower").split(".")[:2])
HAS_READ_ONLY = FLOWER >= (2, 1)
NO_READ_ONLY = "this Flower has no --read_only (Flower 2.1 and later have): it is ignored, users may act"


class FlowerProcess:
    """`celery -A tests.support.e2e_app flower` (or `bb-broker flower -A ...`) on a free port, stopped by `stop()`.

    With `basic_auth` ("user:password") Flower asks for those credentials and every request here sends them;
    without it, `bb-broker flower` gets `--no-auth` and Flower's API is opened by FLOWER_UNAUTHENTICATED_API.
    """

    def __init__(
        self,
        broker_url: str,
        *,
        log_dir: Path,
        name: str = "flower",
        app: str = "tests.support.e2e_app",
        launcher: str = "celery",
        extra_args: tuple[str, ...] = (),
        inspect_timeout_ms: int = 10_000,
        cwd: Path = ROOT,
        basic_auth: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        address: str | None = "127.0.0.1",
        bin_dir: Path | None = None,
    ) -> None:
        """`bin_dir`: a venv's bin/ whose `celery` or `bb-broker` command runs Flower (a user's install), else the
        suite's Python runs it."""
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        # A directed inspect returns at its one reply; the long timeout only matters on a loaded machine.
        flower_args = [f"--port={self.port}", f"--inspect_timeout={inspect_timeout_ms}"]
        if address is not None:  # None: the launcher's default
            flower_args.insert(0, f"--address={address}")
        flower_args += extra_args
        self.address = address
        self.basic_auth = basic_auth
        # The "name:password" requests send by default: the first of basic_auth's users unless told.
        self.user = user or (basic_auth.split(",")[0] if basic_auth else None)
        if basic_auth:
            flower_args.append(f"--basic-auth={basic_auth}")
        if launcher == "celery":
            celery = [str(bin_dir / "celery")] if bin_dir else [sys.executable, "-m", "celery"]
            self.argv = [*celery, "-A", app, "flower", *flower_args]
        elif launcher == "bb-broker":
            no_auth = [] if basic_auth else ["--no-auth"]
            bb_broker = [str(bin_dir / "bb-broker")] if bin_dir else [sys.executable, "-m", "bb_broker.cli"]
            self.argv = [*bb_broker, "flower", "-A", app, *no_auth, *flower_args]
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
        self.cwd = cwd
        self.env = {
            **{name: value for name, value in os.environ.items() if not name.startswith("FLOWER_")},
            **({} if basic_auth else FLOWER_ENV),
            "BB_BROKER_URL": broker_url,
            "BB_TRANSPORT_OPTIONS": json.dumps(FAST_OPTIONS),
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where requests go: the address Flower was told (a name of this machine), else 127.0.0.1."""
        host = self.address if self.address not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self, timeout: float = 90.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (Flower writes to it for its whole life)
        self.process = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for(lambda: self.process.poll() is not None or self._healthy(), timeout, "Flower answering")
        if self.process.poll() is not None:
            raise AssertionError(f"Flower exited with {self.process.returncode}:\n{self.log()[-3000:]}")

    def _healthy(self) -> bool:
        try:
            return self.request("GET", "/healthcheck")[0] == 200
        except OSError:
            return False

    def request(
        self,
        method: str,
        path: str,
        form: dict[str, Any] | None = None,
        *,
        credentials: bool = True,
        user: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, str]:
        """The status and body of one request, as `user` ("name:password", else this process's own) or without
        credentials if told, with `headers`; an HTTP error status is returned, not raised, and no answer within
        `timeout` seconds raises TimeoutError."""
        data = urllib.parse.urlencode(form or {}).encode() if method == "POST" else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        who = user or self.user
        if who and credentials:
            req.add_header("Authorization", "Basic " + base64.b64encode(who.encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path}: {status} {body[:500]}"
        return json.loads(body)

    def post(self, path: str, **form: Any) -> Any:
        status, body = self.request("POST", path, form)
        assert status == 200, f"POST {path}: {status} {body[:500]}"
        return json.loads(body)

    def page(self, path: str) -> str:
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path}: {status} {body[:500]}"
        return body

    def worker(self, name: str) -> dict[str, Any]:
        """What Flower learns by inspecting one worker now: stats, registered, active, reserved, scheduled, conf…"""
        asked = time.time()
        info = self.get(f"/api/workers?refresh=1&workername={urllib.parse.quote(name)}")[name]
        # Flower keeps its last answers when an inspect goes unanswered: only fresh ones count.
        assert info.get("timestamp", 0) >= asked and "active" in info, f"{name} did not answer Flower's inspect"
        return info

    def task(self, task_id: str) -> dict[str, Any]:
        """Flower's record of a task, built from the events it received ({} while it has none)."""
        status, body = self.request("GET", f"/api/task/info/{task_id}")
        return json.loads(body) if status == 200 else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGKILL Flower and its children, once a test is done with it: on SIGTERM Flower's exit waits for the
        inspect broadcasts under way, each up to inspect_timeout, and nothing a test checks comes after."""
        kill_group(self.process, 15)
        self.process = None


def broker_rows(page: str) -> dict[str, list[str]]:
    """The Broker page's table: queue name to its cells as text."""
    rows = {}
    for row_id, cells in re.findall(r'<tr id="([^"]+)">(.*?)</tr>', page, re.S):
        texts = [
            html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)
        ]
        rows[row_id] = texts
    return rows


#: Flower's handlers that act (checked in Flower 2.0.1, 2.1.0, 2.2.0): a new one fails this list until it is
#: looked at (it is refused to read-only users meanwhile, unless it is added to READING_POSTS).
FLOWERS_ACTIONS = {
    "WorkerShutDown", "WorkerPoolRestart", "WorkerPoolGrow", "WorkerPoolShrink", "WorkerPoolAutoscale",
    "WorkerQueueAddConsumer", "WorkerQueueCancelConsumer", "TaskApply", "TaskAsyncApply", "TaskSend", "TaskAbort",
    "TaskTimout", "TaskRateLimit", "TaskRevoke",
}  # fmt: skip
