"""Retention: succeeded jobs expire through a TTL index on finishedAt, failed ones stay until purged or retried."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from kombu import Connection
from pymongo.database import Database

import bb_broker  # noqa: F401  (registers bbmongo://)
from bb_broker.jobs.indexes import DEFAULT_RETENTION, RETENTION_INDEX
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from tests.support.workers import wait_for


def retention_index(db: Database) -> dict | None:
    return next((dict(ix) for ix in db.jobs.list_indexes() if ix["name"] == RETENTION_INDEX), None)


def test_the_index_follows_the_retention_setting(db: Database) -> None:
    store = JobStore(db)
    store.ensure_indexes()  # unset on a new collection: the default
    index = retention_index(db)
    assert index["expireAfterSeconds"] == DEFAULT_RETENTION == 604800
    assert dict(index["key"]) == {"finishedAt": 1} and index["partialFilterExpression"] == {"status": "succeeded"}

    store.ensure_indexes(retention=3600)
    assert retention_index(db)["expireAfterSeconds"] == 3600
    store.ensure_indexes()  # a process that does not set it (a producer, say) leaves it alone
    assert retention_index(db)["expireAfterSeconds"] == 3600
    store.ensure_indexes(retention=2.5)  # whole seconds, rounded up
    assert retention_index(db)["expireAfterSeconds"] == 3
    store.ensure_indexes(retention=0)  # keep succeeded jobs
    assert retention_index(db) is None
    store.ensure_indexes(retention=0)
    store.ensure_indexes()
    assert retention_index(db)["expireAfterSeconds"] == 604800
    with pytest.raises(ValueError, match="retention must be"):
        store.ensure_indexes(retention=-1)

    # An index of that name in another shape (made by hand, say) is rebuilt as ours.
    db.jobs.drop_index(RETENTION_INDEX)
    db.jobs.create_index("updatedAt", name=RETENTION_INDEX, expireAfterSeconds=60)
    store.ensure_indexes(retention=60)
    index = retention_index(db)
    assert dict(index["key"]) == {"finishedAt": 1} and index["partialFilterExpression"] == {"status": "succeeded"}


def test_the_transport_option_sets_it(db: Database, broker_url: str) -> None:
    with Connection(broker_url, transport_options={"retention": 120}) as conn:
        conn.default_channel  # noqa: B018  (opening a channel creates the indexes)
    assert retention_index(db)["expireAfterSeconds"] == 120


def test_succeeded_jobs_expire_and_failed_ones_stay(db: Database) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes(retention=2)
    ids = {}
    for outcome in ("succeeded", "failed", "queued"):
        ids[outcome] = store.publish(queue="celery", kind="app.task", task_id=outcome, payload={}, priority=0,
                                     run_after=datetime(2000, 1, 1, tzinfo=UTC), is_retry=False)  # fmt: skip
    job = store.claim("celery", "w")
    store.succeed(job.id, job.attempts)
    job = store.claim("celery", "w")
    store.fail(job.id, job.attempts, "boom")
    assert db.jobs.find_one({"_id": ids["failed"]})["finishedAt"]

    # The server's TTL monitor runs every 60 s (mongod's default, and the stand-in's).
    wait_for(lambda: db.jobs.find_one({"_id": ids["succeeded"]}, {"_id": 1}) is None, 90, "the succeeded job to expire")
    assert sorted(d["status"] for d in db.jobs.find()) == ["failed", "queued"]
