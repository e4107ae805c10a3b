"""`python -m celery_app.produce`, the demo producer of the compose project, and what any producer is refused, against
a real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pymongo.database import Database

import bb_broker
from celery_app.produce import build_parser
from tests.support.workers import ROOT, producer, wait_for

EVERY_KIND = {
    "celery_app.tasks.add",
    "celery_app.tasks.flaky",
    "celery_app.tasks.long_running",
    "celery_app.tasks.always_fails",
}


def produce(broker_url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery_app.produce", *args],
        env={**os.environ, "BB_BROKER_URL": broker_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_one_round_inserts_one_queued_job_of_every_example_task(broker_url: str, db: Database) -> None:
    result = produce(broker_url, "--count", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["produce: round 0: add, flaky, long_running, always_fails"]
    jobs = list(db.jobs.find())
    assert {job["kind"] for job in jobs} == EVERY_KIND
    assert len(jobs) == len(EVERY_KIND)
    assert {job["status"] for job in jobs} == {"queued"}
    assert {job["queue"] for job in jobs} == {"celery"}
    add = next(job for job in jobs if job["kind"] == "celery_app.tasks.add")
    assert add["payload"]["args"] == [0, 1]


def test_rounds_repeat_and_touch_the_heartbeat(broker_url: str, db: Database, tmp_path: Path) -> None:
    heartbeat = tmp_path / "alive"
    result = produce(broker_url, "--count", "3", "--every", "0.05", "--heartbeat", str(heartbeat))
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 3
    assert heartbeat.exists()
    # always_fails only in round 0: most of the demo's jobs end well.
    kinds = [job["kind"] for job in db.jobs.find()]
    assert len(kinds) == 4 + 3 + 3
    assert kinds.count("celery_app.tasks.always_fails") == 1
    assert sorted(job["payload"]["args"][0] for job in db.jobs.find({"kind": "celery_app.tasks.add"})) == [0, 1, 2]


def test_sigterm_between_rounds_ends_it_cleanly(broker_url: str, db: Database, tmp_path: Path) -> None:
    heartbeat = tmp_path / "alive"
    process = subprocess.Popen(
        [sys.executable, "-m", "celery_app.produce", "--every", "60", "--heartbeat", str(heartbeat)],
        env={**os.environ, "BB_BROKER_URL": broker_url},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: process.poll() is not None or heartbeat.exists(), 60, "the first round")
        process.send_signal(signal.SIGTERM)  # what `docker stop` sends
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert db.jobs.count_documents({}) == len(EVERY_KIND)


@pytest.mark.parametrize("args", [["--every", "-1"], ["--count", "-2"], ["--count", "many"]])
def test_bad_options_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(args)
    assert exited.value.code == 2
    assert args[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"args": (os.fsdecode(b"caf\xe9.txt"),)}, "the body's args[0]"),  # a file name that is not UTF-8
        ({"kwargs": {"name": "caf\udce9"}}, "the body's kwargs['name']"),
        ({"kwargs": {"caf\udce9": 1}}, "the body's kwargs (a key)"),
        ({"args": (1,), "queue": "caf\udce9"}, "the queue name"),
        ({"args": (1,), "headers": {"tags": ["a", "caf\udce9"]}}, "the headers['tags'][1]"),
        ({"args": (1,), "correlation_id": "caf\udce9"}, "the properties['correlation_id']"),
    ],
    ids=["args", "kwargs", "kwargs key", "queue", "header", "property"],
)
def test_a_text_utf8_cannot_encode_is_refused_at_the_producer(broker_url: str, db: Database, options, field) -> None:
    with pytest.raises(bb_broker.MalformedTaskMessage) as refused:
        producer(broker_url).send_task("tests.support.e2e_app.add", **options)
    assert str(refused.value).startswith(f"malformed message: {field} must be text UTF-8 can encode"), refused.value
    assert db.jobs.count_documents({}) == 0 and db.bb_messages.count_documents({}) == 0


@pytest.mark.parametrize("ca_file", ["/etc/passwd", "/no/such/ca.pem"])
def test_a_tls_file_that_cannot_be_used_is_a_broker_url_error_at_the_producer(mongo_url: str, ca_file: str) -> None:
    host = mongo_url.split("://")[1].rstrip("/")
    url = f"bbmongo://admin:hunter2secret@{host}/db?tls=true&tlsCAFile={ca_file}"
    with pytest.raises(bb_broker.BrokerURLError) as refused:
        producer(url).send_task("tests.support.e2e_app.add", args=(1, 2))
    said = str(refused.value)
    assert f"its tlsCAFile '{ca_file}' " in said and "hunter2secret" not in said and "admin:**@" in said
