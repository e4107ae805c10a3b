"""Heavy reliability runs (`make test-heavy`): repeated crashes, outages and a crowd of workers, with figures."""

from __future__ import annotations

import json
import threading
import time

import pytest
from pymongo import MongoClient

from tests.support.faults import crash_repeatedly, start_worker
from tests.support.servers import with_database
from tests.support.workers import ARTIFACTS, producer, send, wait_for

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1800)]
FIGURES = ARTIFACTS / "reliability.jsonl"


def report(name: str, **figures: object) -> None:
    FIGURES.parent.mkdir(exist_ok=True)
    with FIGURES.open("a") as out:
        out.write(json.dumps({"test": name, **figures}) + "\n")
    print(f"{name}: {figures}")


def starts_per_task(db) -> dict[str, int]:
    rows = db.runs.aggregate([{"$match": {"phase": "start"}}, {"$group": {"_id": "$taskId", "n": {"$sum": 1}}}])
    return {row["_id"]: row["n"] for row in rows}


def test_sigkill_the_whole_worker_eight_times_under_load(broker_url, db, tmp_path) -> None:
    ids, starts, cut_short, kills = crash_repeatedly(
        broker_url, db, tmp_path, jobs=200, task_seconds=0.2, kills=8, starts_per_kill=15, timeout=600
    )
    ran_twice = {task for task, n in starts.items() if n > 1}
    assert set(starts) == set(ids)
    assert db.jobs.count_documents({"status": {"$ne": "succeeded"}}) == 0
    assert ran_twice <= cut_short  # only jobs running when a worker was killed ran again
    report("sigkill under load", kills=kills, jobs=len(ids), running_when_killed=len(cut_short), lost=0,
           ran_twice=len(ran_twice))  # fmt: skip


def test_three_outages_while_producing_and_working(own_server, tmp_path) -> None:
    url = with_database(own_server.url, "outages")
    db = MongoClient(own_server.url, tz_aware=True).outages
    # A claim the server carried out as it stopped can be left running in a worker's name, never delivered (seen
    # in 2 of 17 runs): the stale sweep gives it back after stale_after, which must be well inside this test's wait.
    options = {"stale_after": 30.0}
    start_worker(url, tmp_path, "w0", options=options)
    start_worker(url, tmp_path, "w1", options=options)
    app = producer(url)
    published: list[str] = []
    refused: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            try:
                published.append(send(app, "sleep", 0.05))
            except Exception as exc:  # surfaced to the caller: counted, never silent
                refused.append(type(exc).__name__)
            time.sleep(0.05)

    producer_thread = threading.Thread(target=produce)
    producer_thread.start()
    for _ in range(3):
        wait_for(lambda: db.runs.count_documents({}) > len(published) // 2, timeout=120, message="work flowing")
        own_server.stop()
        deadline = time.monotonic() + 10  # the outage
        while time.monotonic() < deadline:
            time.sleep(0.5)
        own_server.start()
    stop.set()
    producer_thread.join(120)
    wait_for(lambda: db.jobs.count_documents({"status": "succeeded"}) >= len(published), timeout=300,
             message="every published job succeeded")  # fmt: skip
    starts = starts_per_task(db)
    assert set(published) <= set(starts)
    task_ids = [doc["taskId"] for doc in db.jobs.find({}, {"taskId": 1})]
    assert len(task_ids) == len(set(task_ids))  # no task written twice (a publish retried after its write landed)
    # A publish whose every try failed was reported to its caller; its write may still have landed, and it runs.
    assert len(set(task_ids) - set(published)) <= len(refused)
    report("three 10 s outages", outages=3, published=len(published), publish_errors_raised=len(refused),
           lost=0, ran_twice=sum(1 for n in starts.values() if n > 1))  # fmt: skip


@pytest.mark.parametrize("prefetch", [1, 4])  # at 4, the workers race with batch claims
def test_six_pool_processes_drain_a_thousand_jobs_exactly_once(broker_url, db, tmp_path, prefetch: int) -> None:
    app = producer(broker_url)
    ids = [send(app, "add", i, 1) for i in range(1000)]
    for i in range(3):
        start_worker(broker_url, tmp_path, f"w{i}", env={"BB_PREFETCH_MULTIPLIER": str(prefetch)})
    wait_for(lambda: db.jobs.count_documents({"status": "succeeded"}) == len(ids), timeout=900,
             message="all jobs drained")  # fmt: skip
    per_task = list(db.runs.aggregate([{"$group": {"_id": "$taskId", "n": {"$sum": 1}}}]))
    assert len(per_task) == len(ids) and all(row["n"] == 1 for row in per_task)
    report(f"three workers, six pool processes, prefetch {prefetch}", jobs=len(ids),
           executions=sum(r["n"] for r in per_task), double_claims=0,
           pool_processes=len({r["pid"] for r in db.runs.find()}))  # fmt: skip
