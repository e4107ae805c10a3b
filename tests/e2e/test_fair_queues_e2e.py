"""A fair queue under two real workers: one key's backlog published first, small keys behind it, made fair with the
CLI; each small key's first job starts among the first claims (counted from the documents' startedAt). The same
queue unfair starts them after the backlog, as before."""

from __future__ import annotations

import subprocess
import sys

from pymongo.database import Database

from tests.support.workers import ROOT, all_succeeded, send, wait_for

SMALL = [f"small-{n}" for n in range(4)]
BIG = 200
QUEUES = ("-Q", "mail")


def backlog(app) -> list[str]:
    ids = [send(app, "add", n, n, queue="mail", fair_key="big") for n in range(BIG)]
    return ids + [send(app, "add", n, n, queue="mail", fair_key=key) for key in SMALL for n in range(3)]


def first_starts(db: Database) -> dict[str, int]:
    """Each key's first job's position among the starts (1 for the first)."""
    order = [doc.get("fairKey") for doc in db.jobs.find({"queue": "mail"}, sort=[("startedAt", 1), ("_id", 1)])]
    return {key: order.index(key) + 1 for key in SMALL}


def test_a_fair_queue_starts_each_small_key_among_the_first_claims_under_two_workers(
    app, db: Database, broker_url: str, worker_factory
) -> None:
    made_fair = subprocess.run(
        [sys.executable, "-m", "bb_broker.cli", "limit", "mail", "--fair", "--broker", broker_url],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made_fair.returncode == 0 and made_fair.stdout.startswith("queue mail: fair per key ("), made_fair
    ids = backlog(app)
    for _ in range(2):
        worker_factory(concurrency=2, extra_args=QUEUES)
    wait_for(all_succeeded(db, ids), timeout=600, message="every job of the fair queue")
    assert max(first_starts(db).values()) <= 20, first_starts(db)
    assert all(doc["attempts"] == 1 for doc in db.jobs.find({"queue": "mail"}))


def test_an_unfair_queue_still_starts_the_backlog_first(app, db: Database, worker_factory) -> None:
    ids = backlog(app)
    for _ in range(2):
        worker_factory(concurrency=2, extra_args=QUEUES)
    wait_for(all_succeeded(db, ids), timeout=600, message="every job of the unfair queue")
    assert min(first_starts(db).values()) > BIG - 10, first_starts(db)
