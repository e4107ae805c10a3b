"""bbmongo:// without `import bb_broker`: the `celery` command's plugin registers it, a producer names the class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pymongo.database import Database

from tests.support.workers import Worker, producer, settled, wait_for

#: A Celery app as a user writes it who never heard of `import bb_broker`; its result backend is bbmongo:// too.
PLAIN_APP = """
import os

from celery import Celery

app = Celery("plain_app", broker=os.environ["BB_BROKER_URL"], backend=os.environ["BB_BROKER_URL"])


@app.task(name="plain_app.add")
def add(x, y):
    return x + y
"""

#: Run in a process that never imports bb_broker itself: says whether something else did, and what it found.
NEVER_IMPORTED = "import sys\nassert 'bb_broker' not in sys.modules, 'imported already'\n"


@pytest.fixture
def plain_app(tmp_path: Path) -> Path:
    (tmp_path / "plain_app.py").write_text(PLAIN_APP)
    return tmp_path


def test_celery_worker_runs_an_app_that_never_imports_bb_broker(plain_app: Path, broker_url: str, db: Database):
    worker = Worker(broker_url, log_dir=plain_app, name="plain", app="plain_app", env={"PYTHONPATH": str(plain_app)})
    worker.start()  # before, `No such transport: bbmongo.  Did you mean mongodb?`
    task_id = producer(broker_url).send_task("plain_app.add", args=(2, 3)).id
    job = wait_for(settled(db, task_id, "succeeded"), 120, "the plain app's job to succeed")
    assert job["result"] == 5  # the result backend bbmongo:// resolved too, on the job document
    assert [entry["outcome"] for entry in job["history"]] == ["succeeded"]  # bb_broker's task hooks ran


def run_python(code: str, broker_url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"BB_BROKER_URL": broker_url, "PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", NEVER_IMPORTED + code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_a_result_backend_url_resolves_without_import(plain_app: Path, broker_url: str) -> None:
    code = "from plain_app import app\nprint(type(app.backend).__module__, type(app.backend).__name__)\n"
    result = run_python(code, broker_url, plain_app)
    assert result.stdout == "bb_broker.results.backend JobResultBackend\n", result.stderr


def test_a_producer_names_the_transport_class_instead_of_importing_bb_broker(plain_app, broker_url, db) -> None:
    code = (
        "from plain_app import app, add\n"
        "app.conf.broker_transport = 'bb_broker.transport:Transport'\n"
        "print(add.delay(2, 3).id)\n"
    )
    result = run_python(code, broker_url, plain_app)
    assert result.returncode == 0, result.stderr
    task_id = result.stdout.strip()
    assert db.jobs.find_one({"taskId": task_id})["status"] == "queued"


def test_celery_bb_broker_is_the_bb_broker_command(plain_app: Path, broker_url: str) -> None:
    argv = [str(Path(sys.executable).with_name("celery")), "bb-broker", "status", "--json", "--broker", broker_url]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"queued": 0, "running": 0, "succeeded": 0, "failed": 0}
