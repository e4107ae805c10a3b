"""A producer or a worker that cannot use its server says which server and why in one line, as `bb-broker` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from celery import Celery
from kombu.exceptions import OperationalError
from pymongo.database import Database

import bb_broker
from tests.support.servers import free_port
from tests.support.workers import ROOT, producer, send, settled, wait_for

#: Texts the URLs below hold that must never be shown.
SECRETS = ("hunter2secret", "TokSecret")

#: (URL template with {port}, the URL as it must be shown)
UNREACHABLE = [
    ("bbmongo://127.0.0.1:{port}/jobsdb", "bbmongo://127.0.0.1:{port}/jobsdb"),
    ("bbmongo://admin:hunter2secret@127.0.0.1:{port}/jobsdb", "bbmongo://admin:**@127.0.0.1:{port}/jobsdb"),
    (
        "bbmongo://AKIA:hunter2secret@127.0.0.1:{port}/jobsdb?authMechanism=MONGODB-AWS"
        "&authMechanismProperties=AWS_SESSION_TOKEN:TokSecret",
        "bbmongo://AKIA:**@127.0.0.1:{port}/jobsdb?authMechanism=MONGODB-AWS"
        "&authMechanismProperties=AWS_SESSION_TOKEN:**",
    ),
]


def add(x: int, y: int) -> int:
    return x + y


def expected_line(shown: str, port: int) -> str:
    return (
        f"cannot reach the server at {shown}: nothing listens at 127.0.0.1:{port} (connection refused): "
        "is the server running? (gave up after "
    )


@pytest.mark.parametrize(("template", "shown"), UNREACHABLE, ids=["plain", "password", "aws-token"])
def test_delay_on_an_unreachable_server_raises_one_clear_line(template: str, shown: str) -> None:
    port = free_port()
    app = Celery("unreachable_producer", broker=template.format(port=port), set_as_current=False)
    app.conf.broker_connection_timeout = 2
    task = app.task(name="app.add")(add)
    with pytest.raises(OperationalError) as caught:  # Kombu's error, as Celery's retries and callers expect
        task.apply_async((2, 3), retry_policy={"max_retries": 1, "interval_start": 0})
    assert isinstance(caught.value, bb_broker.ServerUnreachable)
    message = str(caught.value)
    assert "\n" not in message and "Topology" not in message
    assert message.startswith(expected_line(shown.format(port=port), port)), message
    assert not any(secret in message for secret in SECRETS)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("bbmongo://bb:hunter2secret@localhost", "bbmongo://bb:**@localhost"),
        ("bbmongo://localhost:27017", "bbmongo://localhost:27017"),
        ("bbmongo://bb:hunter2secret@h1:27017,h2:27018/", "bbmongo://bb:**@h1:27017,h2:27018/"),
        ("BBMONGO://bb:hunter2secret@localhost/?replicaSet=rs0", "BBMONGO://bb:**@localhost/?replicaSet=rs0"),
    ],
)
def test_delay_on_a_url_without_a_database_shows_the_url_as_written(url: str, shown: str) -> None:
    app = Celery("no_database_producer", broker=url, set_as_current=False)
    task = app.task(name="app.add")(add)
    with pytest.raises(bb_broker.BrokerURLError) as caught:
        task.delay(2, 3)
    assert str(caught.value).startswith(f"broker URL {shown!r} must name the database in its path"), caught.value


@pytest.mark.parametrize(("template", "shown"), UNREACHABLE[1:], ids=["password", "aws-token"])
def test_a_worker_that_cannot_reach_its_server_logs_one_clear_line_and_keeps_trying(tmp_path, template, shown) -> None:
    port = free_port()
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "BB_BROKER_URL": template.format(port=port), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "celery", "-A", "tests.support.e2e_app", "worker", "-c", "1", "--loglevel", "INFO",
            "--without-mingle", "--without-gossip"]  # fmt: skip
    with log_path.open("wb") as log:
        worker = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: "Trying again in" in log_path.read_text(errors="replace").split("(1/100)", 1)[-1], 120,
                 "the worker's second try")  # fmt: skip
        assert worker.poll() is None  # Celery's reconnect loop took it as a lost connection: it keeps trying
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(30)
    text = log_path.read_text(errors="replace")
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert (
        errors[0]
        .split("] ", 1)[1]
        .startswith(
            f"consumer: Cannot connect to {shown.format(port=port)}: " + expected_line(shown.format(port=port), port)
        )
    ), errors[0]
    assert "Topology Description" not in text and "Traceback" not in text
    assert not any(secret in text for secret in SECRETS)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("bbmongo://bb:hunter2secret@localhost", "broker URL 'bbmongo://bb:**@localhost' must name the database"),
        ("bbmongo://bb:hunter2@secret?x@localhost/db", "broker URL 'bbmongo://bb:**@localhost/db': its user name or"),
        ("bbmongo://bb:hunter2secret@localhost/bounty.board", "broker URL 'bbmongo://bb:**@localhost/bounty.board': a"),
    ],
    ids=["no-database", "unescaped-password", "dotted-database"],
)
def test_a_worker_given_a_wrong_url_says_so_in_one_line(url: str, said: str) -> None:
    env = {**os.environ, "BB_BROKER_URL": url, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "celery", "-A", "tests.support.e2e_app", "worker", "-c", "1", "--without-mingle"]
    worker = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 1
    assert worker.stdout == "" and worker.stderr.count("\n") == 1, worker.stderr  # no traceback
    assert worker.stderr.startswith(f"bb_broker: {said}")
    assert "hunter2" not in worker.stderr and "secret" not in worker.stderr


@pytest.mark.parametrize(
    ("linger", "said"),
    [
        ("soon", "transport option settle_linger='soon' cannot be read: could not convert string to float: 'soon'"),
        (-1, "transport option settle_linger=-1 cannot be read: it must be a number of seconds, 0 or more"),
    ],
    ids=["not-a-number", "negative-wait"],
)
def test_a_worker_given_a_transport_option_it_cannot_read_says_so_in_one_line(linger: object, said: str) -> None:
    env = {
        **os.environ,
        "BB_BROKER_URL": "bbmongo://localhost:1/db",
        "BB_TRANSPORT_OPTIONS": json.dumps({"settle_linger": linger}),
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, "-m", "celery", "-A", "tests.support.e2e_app", "worker", "-c", "1", "--without-mingle"]
    worker = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 1
    assert worker.stdout == "" and worker.stderr.count("\n") == 1, worker.stderr  # no traceback
    assert worker.stderr == f"bb_broker: {said}\n"


def test_a_transport_option_nothing_reads_is_named_once_in_the_workers_log(
    worker_factory, broker_url: str, db: Database
) -> None:
    # A misspelt option, and another transport's, were ignored without a word: the lease stayed 300 s.
    worker = worker_factory(options={"stale_afer": 30, "visibility_timeout": 3600})
    plain = worker_factory(concurrency=1)  # bb_broker's options and Kombu's own (polling_interval): no word
    app = producer(broker_url)
    try:
        task_id = send(app, "add", 2, 3)
        wait_for(settled(db, task_id, "succeeded"), message="the task ran")
    finally:
        app.close()
    said = [line for line in worker.log().splitlines() if "reads no transport option" in line]
    assert len(said) == 1, said
    assert "'stale_afer', 'visibility_timeout': ignored" in said[0] and "lease is stale_after" in said[0]
    assert "reads no transport option" not in plain.log()
