"""free_port across test processes: two pytest sessions on one machine (two checkouts' `make test`) share no port."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.servers import FIRST_PORT, PORTS_PER_WORKER
from tests.support.workers import ROOT

#: A test process of its own: prints the port free_port hands it, then holds on to what it has until told to end.
HOLDER = "from tests.support.servers import free_port; print(free_port(), flush=True); input()"


def test_two_sessions_with_the_same_worker_number_take_ports_from_different_blocks() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_XDIST_WORKER": "gw0"}  # both sessions' first worker
    sessions = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER], env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        ports = [int(session.stdout.readline()) for session in sessions]
    finally:
        for session in sessions:
            session.communicate("\n", timeout=60)
    blocks = {(port - FIRST_PORT) // PORTS_PER_WORKER for port in ports}
    assert len(blocks) == 2, f"both sessions were handed ports of one block: {ports}"
