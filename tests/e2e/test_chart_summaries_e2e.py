"""The Jobs tab's chart summaries kept ahead by the workers themselves: a chart finds its quarter hours summarized
whether or not a Flower that may write runs (a read-only Flower writes none), one worker of the fleet at a time."""

from __future__ import annotations

import socket
from datetime import timedelta

from pymongo.database import Database

from bb_broker.clock import ServerClock
from bb_broker.ops.filters import JobFilter
from bb_broker.ops.operations import Operations
from bb_broker.ops.stats import job_stats
from bb_broker.options import open_store
from tests.support.workers import wait_for


def test_a_worker_summarizes_the_closed_quarter_hours_ahead_and_one_worker_of_several_holds_the_turn(
    db: Database, worker_factory
) -> None:
    an_hour_ago = ServerClock(db)() - timedelta(hours=1)  # a job as its settle left it, in a closed quarter hour
    db.jobs.insert_one({"_id": "done", "queue": "celery", "kind": "app.task", "status": "succeeded", "attempts": 1,
                        "runAfter": an_hour_ago, "startedAt": an_hour_ago, "finishedAt": an_hour_ago,
                        "updatedAt": an_hour_ago, "history": []})  # fmt: skip
    workers = [worker_factory(), worker_factory()]
    wait_for(lambda: db.bb_stats.find_one({"group": True, "succeeded": 1}), 60, "the finished job summarized ahead")
    turn = db.bb_stats.find_one({"_id.turn": {"$exists": True}})
    assert turn["by"] in {f"{worker.name}@{socket.gethostname()}:{worker.process.pid}" for worker in workers}
    # A chart then reads the summaries, writing none: what a read-only Flower's chart does.
    chart = job_stats(Operations(open_store(db)), JobFilter(), timedelta(days=1))
    assert chart["summarizedUntil"] is not None and sum(chart["series"]["all"]["succeeded"]) == 1
    assert db.bb_stats.count_documents({"group": True}) == 1
