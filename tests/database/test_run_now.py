"""Run now (ops.operations) on a real server: a waiting job made due, alone or by filter, recorded, fenced."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import JobFilter
from bb_broker.ops.operations import RUN_NOW, ActionRefused, Operations
from tests.support.store import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ops(db: Database, clock: FakeClock) -> Operations:
    store = JobStore(db, Policy(max_attempts=3, stale_after=60.0), clock=clock)
    store.ensure_indexes(retention=0)
    return Operations(store)


def publish(ops: Operations, task_id: str, *, in_seconds: float | None = 3600, queue: str = "celery") -> str:
    due = None if in_seconds is None else ops.now() + timedelta(seconds=in_seconds)
    payload = {"args": [1], "kwargs": {}, "options": {}, "headers": {"id": task_id, "task": "app.add"}}
    return ops.store.publish(queue=queue, kind="app.add", task_id=task_id, payload=payload, priority=0,
                             run_after=due, is_retry=False)  # fmt: skip


def test_a_waiting_job_is_due_now_and_claimable_with_who_made_it_so(ops: Operations, db: Database) -> None:
    job_id = publish(ops, "later")
    assert ops.store.claim("celery", "w") is None  # an hour to go
    assert RUN_NOW in ops.applicable(db.jobs.find_one({"_id": job_id}))

    doc = ops.act(RUN_NOW, "later", by="alice")
    assert doc["_id"] == job_id and doc["status"] == "queued" and doc["runAfter"] == ops.now()
    assert doc["actions"] == [{"action": RUN_NOW, "by": "alice", "at": ops.now()}]
    assert RUN_NOW not in ops.applicable(doc)
    claimed = ops.store.claim("celery", "w")
    assert claimed is not None and claimed.id == job_id and claimed.attempts == 1


def test_run_now_refuses_a_job_that_is_due_or_not_queued(ops: Operations, db: Database, clock: FakeClock) -> None:
    due = publish(ops, "due", in_seconds=None)
    with pytest.raises(ActionRefused, match=f"job {due} is due already: a worker that consumes celery takes it next"):
        ops.act(RUN_NOW, due, by="alice")
    claimed = ops.store.claim("celery", "w")
    assert claimed is not None
    with pytest.raises(ActionRefused, match="is running: run-now needs it queued") as refused:
        ops.act(RUN_NOW, due, by="alice")
    assert refused.value.reason == "conflict"
    with pytest.raises(ActionRefused, match="no job has the id") as missing:
        ops.act(RUN_NOW, "nope", by="alice")
    assert missing.value.reason == "not found"
    # A job whose countdown ran out by itself meanwhile is due: nothing to do.
    soon = publish(ops, "soon", in_seconds=5)
    clock.advance(6)
    with pytest.raises(ActionRefused, match="due already"):
        ops.act(RUN_NOW, soon, by="alice")
    assert "actions" not in db.jobs.find_one({"_id": soon}) and "actions" not in db.jobs.find_one({"_id": due})


def test_run_now_by_filter_takes_only_the_waiting_jobs_of_the_filter(ops: Operations, db: Database) -> None:
    mail = [publish(ops, f"mail-{n}", queue="mail") for n in range(3)]
    due_mail = publish(ops, "mail-due", in_seconds=None, queue="mail")
    other = publish(ops, "other")
    job_filter = JobFilter(queue="mail")
    assert ops.count(job_filter, RUN_NOW) == 3
    assert ops.act_on_filter(RUN_NOW, job_filter, by="bob") == 3
    for job_id in mail:
        doc = db.jobs.find_one({"_id": job_id})
        assert doc["runAfter"] == ops.now() and doc["actions"][-1]["by"] == "bob"
    assert "actions" not in db.jobs.find_one({"_id": due_mail})
    assert "actions" not in db.jobs.find_one({"_id": other})
    assert ops.count(job_filter, RUN_NOW) == 0
    assert ops.act_on_filter(RUN_NOW, JobFilter(status="queued"), by="bob") == 1  # `other`, the one left waiting
