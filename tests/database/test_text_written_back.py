"""Operator actions and settles on jobs whose text is not UTF-8, or whose dates are before year 1 (another program
wrote them, a mongod keeps them; the proxy answers as one: wire.keeping_what_the_stand_in_refuses). Every client of
ours reads such text with U+FFFD in place of its bytes, such a date as 0001-01-01 (LENIENT_DECODING): a write of what
it read would store that, the value lost. Each leaves the value as its bytes are or is refused with one line naming
the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from celery import Celery
from pymongo.database import Database

from bb_broker.connection import new_client
from bb_broker.jobs import checkpoints
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import ActionRefused, Operations
from bb_broker.ops.rerun import RerunRefused, plan
from tests.support import wire
from tests.support.workers import wait_for

pytestmark = pytest.mark.stand_in

#: Stored by the stand-in in place of text whose bytes are not UTF-8 (b"caf\xe9.txt"), which the proxy answers.
NOT_UTF8 = wire.NOT_UTF8_MARKER


@pytest.fixture
def ops(store: JobStore) -> Operations:
    """The operations of a client made as the product makes them (new_client), through a mongod that holds text that
    is not UTF-8."""
    return Operations(store)


def failed_job(db: Database, job_id: str, **fields) -> None:
    now = datetime.now(UTC)
    doc = {"_id": job_id, "taskId": f"task-{job_id}", "status": "failed", "attempts": 1, "queue": "celery",
           "kind": "tests.echo", "lastError": "ValueError: boom", "updatedAt": now, "finishedAt": now}  # fmt: skip
    db.jobs.insert_one(doc | fields)


def test_a_retry_with_changed_arguments_of_a_job_holding_such_text_is_refused_naming_it(
    app: Celery, ops: Operations, db: Database
) -> None:
    app.send_task("tests.echo", args=[1], kwargs={"name": NOT_UTF8})
    store = JobStore(db, Policy(max_attempts=1))
    # Due by the publisher's reading of the server's clock, by the store's a moment later maybe (a loaded machine).
    job = wait_for(lambda: store.claim("celery", "worker-1"), timeout=30, message="the job claimed")
    assert store.fail(job.id, job.attempts, "ValueError: boom")
    before = list(db.jobs.find())
    # Its kwargs, kept by a retry that changes only the args, would be sent as "caf\ufffd.txt".
    refused = pytest.raises(RerunRefused, plan, ops, job.id, [2], None)
    assert refused.value.reason == "conflict"
    assert str(refused.value) == f"job {job.id} holds text that is not UTF-8 in payload: it cannot be sent again"
    assert list(db.jobs.find()) == before


def test_a_retry_keeps_a_revoked_jobs_message_it_cannot_read_as_it_is(ops: Operations, db: Database) -> None:
    raw = json.dumps({"headers": {"id": "task-r", "note": NOT_UTF8}, "properties": {"correlation_id": "task-r"}})
    failed_job(db, "r", revokedAt=datetime.now(UTC), payload={"raw": raw, "body": ""})
    assert ops.retry(["r"], by="alice").job_ids == ["r"]
    doc = db.jobs.find_one({"_id": "r"})
    # Under a new task id (a revoked one's), its message as its bytes are: rewritten, it held "caf\ufffd.txt".
    assert doc["status"] == "queued" and doc["taskId"] != "task-r"
    assert doc["payload"]["raw"] == raw


def test_a_retry_of_a_job_whose_unique_key_holds_such_text_leaves_it_failed_naming_it(
    ops: Operations, db: Database
) -> None:
    failed_job(db, "k", unique={"key": f"key-{NOT_UTF8}", "mode": "active"})
    failed_job(db, "plain")
    retried = ops.retry(["k", "plain"], by="alice")
    # Retried, it would hold its key again under "key-caf\ufffd.txt", a key no publish of the task makes.
    assert retried.job_ids == ["plain"]
    assert retried.held == {"k": "job k stays failed: unique holds text that is not UTF-8"}
    doc = db.jobs.find_one({"_id": "k"})
    assert doc["status"] == "failed" and "uniqueActive" not in doc and "actions" not in doc


@pytest.fixture
def store(mongo_url: str, db: Database) -> Iterator[JobStore]:
    """A store of a client made as the product makes them (new_client), through a mongod that holds what the
    stand-in refuses: text that is not UTF-8, dates before year 1."""
    proxy = wire.WireProxy(mongo_url, wire.mongod_keeping_what_the_stand_in_refuses())
    client = new_client(f"mongodb://{proxy.address}", tz_aware=True)
    try:
        store = JobStore(client[db.name], Policy(max_attempts=1))
        store.ensure_indexes()
        yield store
    finally:
        client.close()
        proxy.close()


def running_job(db: Database, job_id: str, **fields) -> None:
    now = datetime.now(UTC)
    doc = {"_id": job_id, "taskId": f"task-{job_id}", "status": "running", "attempts": 2, "queue": "celery",
           "kind": "tests.echo", "leaseOwner": "w", "updatedAt": now, "startedAt": now}  # fmt: skip
    db.jobs.insert_one(doc | fields)


def test_a_settle_copies_a_start_before_year_1_as_it_is(store: JobStore, db: Database) -> None:
    # Read as 0001-01-01 (the nearest date Python holds) and written back so: the failure's history entry, and the
    # start a job given back unstarted takes again from its previous attempt's entry.
    before_1 = wire.BEFORE_YEAR_1_MARKER
    running_job(db, "failing", startedAt=before_1)
    assert store.fail_running_task("task-failing", "w", "WorkerLostError: gone", retryable=False) is not None
    [entry] = db.jobs.find_one({"_id": "failing"})["history"]
    assert (entry["n"], entry["outcome"], entry["startedAt"]) == (2, "failed", before_1)
    previous = {"n": 1, "worker": "w", "startedAt": before_1, "finishedAt": before_1, "outcome": "failed"}
    running_job(db, "released", history=[previous])
    assert store.release("released", 2, owner="w")
    doc = db.jobs.find_one({"_id": "released"})
    assert (doc["status"], doc["attempts"], doc["startedAt"]) == ("queued", 1, before_1)


def test_a_checkpoint_holding_such_text_is_refused_to_the_task_naming_it(store: JobStore, db: Database) -> None:
    # Read with U+FFFD, the task resumed from an altered checkpoint, and saved it so with its next one.
    running_job(db, "resumes", checkpoint=json.dumps({"file": NOT_UTF8}))
    refused = pytest.raises(checkpoints.CheckpointError, checkpoints.load, store, "resumes")
    assert str(refused.value).startswith("job resumes's checkpoint holds text that is not UTF-8 (")
    running_job(db, "plain", checkpoint=json.dumps({"file": "plain.txt"}))
    assert checkpoints.load(store, "plain") == {"file": "plain.txt"}


#: Each action, and a job of the task id `task-x` it applies to, but for its _id.
APPLICABLE = {
    "retry": {"status": "failed"},
    "delete": {"status": "failed"},
    "cancel": {"status": "queued", "runAfter": datetime(2100, 1, 1, tzinfo=UTC)},
    "run-now": {"status": "queued", "runAfter": datetime(2100, 1, 1, tzinfo=UTC)},
    "requeue": {"status": "running", "leaseOwner": "w", "updatedAt": datetime(2000, 1, 1, tzinfo=UTC)},
}


@pytest.mark.parametrize("action", APPLICABLE)
def test_an_action_on_a_job_whose_id_is_not_utf8_is_refused_naming_it(
    ops: Operations, db: Database, action: str
) -> None:
    # Found by its task id, its _id read "caf\ufffd.txt": the action's write by that id found no job, and the operator
    # was told the job "changed meanwhile".
    failed_job(db, NOT_UTF8, taskId="task-x", **APPLICABLE[action])
    before = list(db.jobs.find())
    refused = pytest.raises(ActionRefused, ops.act, action, "task-x", by="alice")
    assert refused.value.reason == "conflict"
    assert str(refused.value) == "job caf\ufffd.txt has an _id that holds text that is not UTF-8"
    if action == "retry":
        retried = ops.retry(["task-x"], by="alice")
        assert (retried.job_ids, retried.unmatched) == ([], [])
        assert retried.held == {"caf\ufffd.txt": "job caf\ufffd.txt stays failed: _id holds text that is not UTF-8"}
        refused = pytest.raises(RerunRefused, plan, ops, "task-x", [2], None)
        assert str(refused.value) == "job caf\ufffd.txt holds text that is not UTF-8 in _id: it cannot be sent again"
    assert list(db.jobs.find()) == before
