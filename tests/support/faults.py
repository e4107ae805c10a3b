"""Fault injection shared by the fault tests: workers started by hand, server fail points, repeated crashes."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from pymongo import MongoClient

from tests.support.workers import Worker, producer, send, wait_for


def start_worker(url: str, tmp_path: Path, name: str, **kwargs) -> Worker:
    worker = Worker(url, log_dir=tmp_path, name=name, **kwargs)
    worker.start()
    return worker


def fail_point(client: MongoClient, times: int, **data) -> None:
    client.admin.command("configureFailPoint", "failCommand", mode={"times": times}, data=data)


def crash_repeatedly(broker_url, db, tmp_path, *, jobs: int, task_seconds: float, kills: int, starts_per_kill: int,
                     timeout: float) -> tuple[list[str], dict[str, int], set[str], int]:  # fmt: skip
    """Publish `jobs` sleeps, SIGKILL a fresh whole worker up to `kills` times once `starts_per_kill` more tasks
    started, then let a survivor finish. Returns the ids, task starts per job, the jobs the collection still had
    `running` at each kill, and the kills done."""
    options = {"stale_after": 2.0, "max_attempts": 20}  # a job may be cut short by more than one kill
    app = producer(broker_url)
    ids = [send(app, "sleep", task_seconds) for _ in range(jobs)]
    done = 0
    cut_short: set[str] = set()
    while done < kills and db.jobs.count_documents({"status": "succeeded"}) < len(ids):
        worker = start_worker(broker_url, tmp_path, f"victim{done}", options=options)
        target = db.runs.count_documents({"phase": "start"}) + starts_per_kill
        wait_for(lambda target=target: db.runs.count_documents({"phase": "start"}) >= target or
                 db.jobs.count_documents({"status": "succeeded"}) == len(ids), timeout=120,
                 message="work under way")  # fmt: skip
        worker.kill()
        done += 1
        cut_short |= {doc["taskId"] for doc in db.jobs.find({"status": "running"}, {"taskId": 1})}
    start_worker(broker_url, tmp_path, "survivor", options=options)
    wait_for(lambda: db.jobs.count_documents({"status": "succeeded"}) == len(ids), timeout=timeout,
             message="every job succeeded after the crashes")  # fmt: skip
    rows = db.runs.aggregate([{"$match": {"phase": "start"}}, {"$group": {"_id": "$taskId", "n": {"$sum": 1}}}])
    return ids, {row["_id"]: row["n"] for row in rows}, cut_short, done


def fail_point_on(client: MongoClient, **data) -> None:
    """Arm failCommand until fail_point_off: every matching command meets it."""
    client.admin.command("configureFailPoint", "failCommand", mode="alwaysOn", data=data)


def fail_point_off(client: MongoClient) -> None:
    client.admin.command("configureFailPoint", "failCommand", mode="off")


def server_errors(metrics_url: str) -> dict[str, float]:
    """bb_broker_server_errors_total per path, as a worker's /metrics serves it (BB_METRICS_PORT)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["path"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "bb_broker_server_errors_total"
    }
