"""Prometheus counters where jobs settle, gauges from the collection, and the /metrics and /statuses endpoints."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from celery import Celery
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from pymongo.database import Database

from bb_broker import statuses
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from tests.support.workers import ROOT, wait_for

COUNTERS = ("jobs_enqueued_total", "jobs_succeeded_total", "jobs_retried_total", "jobs_failed_total")


def counted() -> dict[str, float]:
    """This process's counters."""
    return {name: REGISTRY.get_sample_value(name) or 0.0 for name in COUNTERS}


def since(before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in counted().items()}


def publish(store: JobStore, task_id: str, *, queue: str = "celery", is_retry: bool = False) -> str:
    return store.publish(queue=queue, kind="app.task", task_id=task_id, payload={"args": []}, priority=0,
                         run_after=datetime(2000, 1, 1, tzinfo=UTC), is_retry=is_retry)  # fmt: skip


def test_counters_follow_where_each_job_settles(db: Database) -> None:
    store = JobStore(db, Policy(max_attempts=2, stale_after=60))
    store.ensure_indexes()
    before = counted()
    publish(store, "ok")
    publish(store, "flaky")
    assert since(before) == {**dict.fromkeys(COUNTERS, 0), "jobs_enqueued_total": 2}

    ok = store.claim("celery", "w")
    assert store.succeed(ok.id, ok.attempts)
    assert not store.succeed(ok.id, ok.attempts)  # a second, fenced-out write counts nothing
    flaky = store.claim("celery", "w")
    store.fail(flaky.id, flaky.attempts, "boom")  # attempt 1 of 2: back to the queue
    db.jobs.update_one({"_id": flaky.id}, {"$set": {"runAfter": datetime(2000, 1, 1, tzinfo=UTC)}})
    flaky = store.claim("celery", "w")
    store.fail(flaky.id, flaky.attempts, "boom")  # attempt 2 of 2: failed
    assert since(before) == {
        "jobs_enqueued_total": 2, "jobs_succeeded_total": 1, "jobs_retried_total": 1, "jobs_failed_total": 1,
    }  # fmt: skip

    # A Celery retry reschedules the running job: a retry, not a new job.
    again = publish(store, "self-retry")
    store.claim("celery", "w")
    assert publish(store, "self-retry", is_retry=True) == again
    # The stale sweep's recoveries: one back to the queue, one out of attempts.
    lost = publish(store, "lost", queue="other")
    store.claim("other", "w")
    spent = publish(store, "spent", queue="other")
    db.jobs.update_one({"_id": spent}, {"$set": {"attempts": 1}})
    store.claim("other", "w")
    db.jobs.update_many({"_id": {"$in": [lost, spent]}}, {"$set": {"updatedAt": datetime(2000, 1, 1, tzinfo=UTC)}})
    assert store.requeue_stale() == (1, 1)
    assert since(before) == {
        "jobs_enqueued_total": 5, "jobs_succeeded_total": 1, "jobs_retried_total": 3, "jobs_failed_total": 2,
    }  # fmt: skip


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def get_json(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@contextlib.contextmanager
def serve_metrics(broker_url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`bb-broker serve-metrics` on a free port; yields its base URL."""
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    argv = [sys.executable, "-m", "bb_broker.cli", "serve-metrics", "--broker", broker_url, "--port", "0"]
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, cwd=ROOT, env={**environ, **(env or {})}, stdout=out, stderr=out)
    try:
        found = wait_for(
            lambda: process.poll() is not None or re.search(r"on (http://\S+)", log.read_text()),
            timeout=60,
            message="serve-metrics listening",
        )
        assert process.poll() is None, log.read_text()
        yield found.group(1)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(15)


def test_serve_metrics_gauges_and_statuses_from_the_collection(db: Database, broker_url: str, tmp_path: Path) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    for task_id in ("a", "b", "c", "d", "e"):
        publish(store, task_id)
    for _ in range(3):
        store.claim("celery", "w")  # three running
    job = store.claim("celery", "w")
    store.fail(job.id, job.attempts, "boom")  # one failed, one still queued

    with serve_metrics(broker_url, tmp_path / "serve-metrics.log") as url:
        samples = scrape(url)
        assert {k: samples[k] for k in ("jobs_queued", "jobs_running", "jobs_failed")} == {
            "jobs_queued": 1, "jobs_running": 3, "jobs_failed": 1,
        }  # fmt: skip
        assert all(samples[name] == 0 for name in COUNTERS)  # this process settled nothing
        assert get_json(f"{url}/statuses") == (200, statuses(db))

        store.succeed(job.id, job.attempts)  # fenced out: nothing changes
        running = db.jobs.find_one({"status": "running"})
        store.succeed(running["_id"], running["attempts"])
        assert scrape(url)["jobs_running"] == 2  # counted at each scrape, not remembered
        assert get_json(f"{url}/statuses")[1] == {"queued": 1, "running": 2, "succeeded": 1, "failed": 1}
        assert get_json(f"{url}/nothing-here")[0] == 404


def test_a_worker_serves_the_counters_of_its_pool_processes(
    app: Celery, db: Database, broker_url: str, worker_factory, tmp_path: Path
) -> None:
    shared = tmp_path / "prometheus"
    shared.mkdir()
    worker = worker_factory(env={"BB_METRICS_PORT": "0", "PROMETHEUS_MULTIPROC_DIR": str(shared)})
    found = wait_for(lambda: re.search(r"bb_broker metrics on (http://\S+)/metrics", worker.log()), 30, "endpoint")
    url = found.group(1)

    before = counted()
    ok = app.send_task("tests.support.e2e_app.add", args=(2, 3)).id
    doomed = app.send_task("tests.support.e2e_app.always_fails").id
    assert since(before)["jobs_enqueued_total"] == 2  # counted by the producer, this process
    for task_id, status in ((ok, "succeeded"), (doomed, "failed")):
        wait_for(lambda t=task_id, s=status: (db.jobs.find_one({"taskId": t}) or {}).get("status") == s, 90, status)

    # Settled in prefork pool processes, served by the main process from PROMETHEUS_MULTIPROC_DIR.
    expected = {"jobs_enqueued_total": 0, "jobs_succeeded_total": 1, "jobs_retried_total": 2, "jobs_failed_total": 1}
    samples = wait_for(
        lambda: (s := scrape(url)) and {k: s.get(k) for k in expected} == expected and s,
        30,
        message=f"the worker's counters to reach {expected}",
    )
    assert (samples["jobs_queued"], samples["jobs_running"], samples["jobs_failed"]) == (0, 0, 1)
    assert get_json(f"{url}/statuses") == (200, {"queued": 0, "running": 0, "succeeded": 1, "failed": 1})

    # serve-metrics on the same host, sharing the directory, serves the same counters.
    with serve_metrics(broker_url, tmp_path / "serve-metrics.log", {"PROMETHEUS_MULTIPROC_DIR": str(shared)}) as other:
        assert {k: scrape(other)[k] for k in expected} == expected


def test_a_metrics_port_out_of_range_is_one_line_and_the_worker_works(
    app: Celery, db: Database, worker_factory
) -> None:
    worker = worker_factory(env={"BB_METRICS_PORT": "99999"})
    task_id = app.send_task("tests.support.e2e_app.add", args=(2, 3)).id
    wait_for(lambda: (db.jobs.find_one({"taskId": task_id}) or {}).get("status") == "succeeded", 90, "the task ran")
    log = worker.log()
    assert "bb_broker metrics endpoint not started on 127.0.0.1:99999: bind(): port must be 0-65535" in log
    assert "Traceback" not in log  # was: Signal handler _serve_metrics raised OverflowError, and its traceback
