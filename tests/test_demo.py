"""The README's first command: `make demo` (here against the suite's server) and `bb-broker serve`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from pymongo import MongoClient

from tests.servers import free_port
from tests.workers import ROOT


def test_the_demo_runs_the_sample_jobs_to_the_end(broker_url, db) -> None:
    env = {**os.environ, "BB_BROKER_URL": broker_url, "BB_DEMO_ONCE": "1", "PYTHONPATH": str(ROOT)}
    demo = subprocess.run([sys.executable, "-m", "celery_app.demo"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    final = json.loads(demo.stdout.strip().splitlines()[-1])
    assert final == {"queued": 0, "running": 0, "succeeded": 3, "failed": 1}
    doomed = db.jobs.find_one({"kind": "celery_app.tasks.always_fails"})
    assert doomed["attempts"] == 3 and "permanent failure" in doomed["lastError"]
    assert db.jobs.find_one({"kind": "celery_app.tasks.flaky"})["attempts"] == 2


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


def _pings(client: MongoClient) -> bool:
    try:
        return client.admin.command("ping")["ok"] == 1
    except Exception:
        return False
