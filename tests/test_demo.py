"""The README's first command: `make demo` (here against the suite's server) and `bb-broker serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pymongo import MongoClient

from tests.servers import free_port
from tests.workers import ROOT, wait_for


def test_the_demo_runs_the_sample_jobs_to_the_end(broker_url, db) -> None:
    env = {**os.environ, "BB_BROKER_URL": broker_url, "BB_DEMO_ONCE": "1", "PYTHONPATH": str(ROOT)}
    demo = subprocess.run([sys.executable, "-m", "celery_app.demo"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "demo: add.delay(2, 3).get() = 5" in demo.stdout
    final = json.loads(demo.stdout.strip().splitlines()[-1])
    assert final == {"queued": 0, "running": 0, "succeeded": 3, "failed": 1}
    doomed = db.jobs.find_one({"kind": "celery_app.tasks.always_fails"})
    assert doomed["attempts"] == 3 and "permanent failure" in doomed["lastError"]
    assert db.jobs.find_one({"kind": "celery_app.tasks.flaky"})["attempts"] == 2


def test_bb_broker_serve_runs_the_embedded_server(tmp_path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "bb_broker.cli", "serve", "--port", str(port), "--data", str(tmp_path / "data")]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = MongoClient(f"mongodb://127.0.0.1:{port}", serverSelectionTimeoutMS=1000)
        wait_for(lambda: _pings(client), timeout=60, message="the embedded server answers")
        client.served.jobs.insert_one({"_id": 1})
        assert client.served.jobs.count_documents({}) == 1
    finally:
        server.terminate()
        server.wait(30)


def _pings(client: MongoClient) -> bool:
    try:
        return client.admin.command("ping")["ok"] == 1
    except Exception:
        return False
