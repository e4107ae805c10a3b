"""The README's quick start, run as written: its app, its worker, its task, its counts, its job document."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from pymongo.database import Database

import bb_broker
from tests.support.readme import README_URL, block, commands
from tests.support.workers import ROOT, Worker


def test_the_quick_start_runs_as_written(tmp_path: Path, broker_url: str, db: Database) -> None:
    app_source = block("**2. An app**", "python")
    assert README_URL in app_source
    (tmp_path / "myapp.py").write_text(app_source.replace(README_URL, broker_url))
    worker_command, task_command, status_command = commands("**3. A worker, a task, the counts**")
    assert worker_command[:4] == ["celery", "-A", "myapp", "worker"]
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    worker_options = tuple(worker_command[4:])  # -E --loglevel INFO
    Worker(broker_url, log_dir=tmp_path, name="quick", app="myapp", extra_args=worker_options, env=env).start()

    assert task_command[:2] == ["python", "-c"]
    task = subprocess.run(
        [sys.executable, "-c", task_command[2]], cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert (task.returncode, task.stdout.strip()) == (0, "5"), task.stderr

    assert status_command[:2] == ["bb-broker", "status"] and status_command[-1] == README_URL
    bb_broker_command = Path(sys.executable).with_name("bb-broker")
    status = subprocess.run(
        [str(bb_broker_command), *status_command[1:-1], broker_url], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    assert re.search(r"^succeeded +1$", status.stdout, re.M), status.stdout

    # The abridged job document and the statuses() the README shows are what the run left behind.
    document = db.jobs.find_one()
    shown = set(re.findall(r'"(\w+)": ', block("What the task left behind", "python")))
    in_payload, in_history = {"args", "kwargs"}, {"n", "worker", "outcome"}
    assert shown - in_payload - in_history <= set(document)
    assert in_payload <= set(document["payload"]) and in_history <= set(document["history"][0])
    assert (document["kind"], document["status"], document["result"]) == ("myapp.add", "succeeded", 5)
    assert document["payload"]["args"] == [2, 3] and document["history"][0]["outcome"] == "succeeded"
    counts = ast.literal_eval(re.search(r"# (\{.*\})", block("And from code", "python"))[1])
    assert bb_broker.statuses(broker_url) == counts
