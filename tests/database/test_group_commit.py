"""Settles group-committed (bb_broker/jobs/settles.py): what one write carries, fencing inside it, an outage in the
middle of it, and a settle in it that does not fit in its document."""

from __future__ import annotations

import pytest
from pymongo import MongoClient

from bb_broker import metrics
from bb_broker.jobs import settles
from bb_broker.jobs.store import TOO_LARGE_TO_SETTLE, JobStore
from tests.support.faults import fail_point
from tests.support.store import CommandLog, held_jobs, settles_sent
from tests.support.workers import wait_for


@pytest.fixture
def store(client: MongoClient) -> JobStore:
    store = JobStore(client.grouped)
    store.ensure_indexes()
    return store


def first_settle_held_on_the_server(client: MongoClient, store: JobStore, log: CommandLog, job_id: str) -> None:
    """Settle `job_id` in a write the server holds for a second: what is settled meanwhile waits for the next."""
    log.commands.clear()
    fail_point(client, 1, failCommands=["update"], blockConnection=True, blockTimeMS=1000)
    store.settle_soon(store.success(job_id, 1))
    wait_for(lambda: settles_sent(log), message="the first settle sent")


def statuses(store: JobStore, ids: list[str]) -> list[str]:
    docs = {doc["_id"]: doc["status"] for doc in store.coll.find({"_id": {"$in": ids}})}
    return [docs[job_id] for job_id in ids]


def test_settles_made_while_one_is_in_flight_go_in_one_write_and_a_stale_one_changes_nothing(
    client: MongoClient, store: JobStore, log: CommandLog
) -> None:
    ids = held_jobs(store, 5)
    store.coll.update_one({"_id": ids[4]}, {"$set": {"attempts": 2}})  # another worker took it over meanwhile
    succeeded = metrics.COUNTERS["succeeded"]._value.get()
    first_settle_held_on_the_server(client, store, log, ids[0])
    store.settle_soon(store.success(ids[1], 1))
    store.settle_soon(store.failure(ids[2], 1, "RuntimeError: boom"))  # a retry: back to the queue
    store.settle_soon(store.success(ids[3], 1))
    store.settle_soon(store.success(ids[4], 1))  # stale: its attempt is no longer the job's
    assert store.flush_settles(30)
    assert settles_sent(log) == [1, 4]
    assert statuses(store, ids) == ["succeeded", "succeeded", "queued", "succeeded", "running"]
    assert store.coll.find_one({"_id": ids[4]})["attempts"] == 2  # untouched
    assert metrics.COUNTERS["succeeded"]._value.get() == succeeded + 3  # the stale one is not counted


def test_a_job_settled_again_while_its_first_settle_is_in_flight_stays_pending_until_the_second_is_written(
    client: MongoClient, store: JobStore, log: CommandLog
) -> None:
    # Pending jobs are the ones the lease keeper keeps live and a worker's exit waits for: the end of the first write
    # must not take the second settle's job off the list.
    (job_id,) = held_jobs(store, 1)
    log.commands.clear()
    # Each write held 3 s: ample for the checks below to run while the second is held, on a busy machine too.
    fail_point(client, 2, failCommands=["update"], blockConnection=True, blockTimeMS=3000)
    store.settle_soon(store.success(job_id, 1))
    wait_for(lambda: settles_sent(log) == [1], message="the first settle sent")
    store.settle_soon(store.success(job_id, 1))
    wait_for(lambda: settles_sent(log) == [1, 1], message="the second settle sent")  # the first is answered
    assert job_id in settles.pending_jobs()
    assert not store.flush_settles(0.1)  # the second write is still held on the server
    assert store.flush_settles(30)
    assert job_id not in settles.pending_jobs()
    assert statuses(store, [job_id]) == ["succeeded"]


def test_an_outage_in_the_middle_of_a_batch_settles_each_job_once_after_it(
    own_server, client: MongoClient, store: JobStore, log: CommandLog
) -> None:
    ids = held_jobs(store, 4)
    first_settle_held_on_the_server(client, store, log, ids[0])
    for job_id in ids[1:]:
        store.settle_soon(store.success(job_id, 1, attempt={"n": 1, "outcome": "succeeded"}))
    own_server.stop()  # the first write is cut off, the batch behind it meets a server that is gone
    own_server.start()
    assert store.flush_settles(60)
    assert statuses(store, ids) == ["succeeded"] * 4
    for doc in store.coll.find({"_id": {"$in": ids[1:]}}):
        assert len(doc["history"]) == 1, doc["history"]  # written once, even where a write was tried again


def test_a_settle_in_a_batch_that_does_not_fit_fails_its_job_alone(
    client: MongoClient, store: JobStore, log: CommandLog
) -> None:
    ids = held_jobs(store, 2)
    (big,) = held_jobs(store, 1, payload={"args": ["x" * (9 * 1024 * 1024)]})  # 9 MB of arguments
    first_settle_held_on_the_server(client, store, log, ids[0])
    store.settle_soon(store.success(big, 1, result={"result": "y" * (9 * 1024 * 1024)}))  # fits alone, not beside
    store.settle_soon(store.success(ids[1], 1))
    assert store.flush_settles(60)
    assert statuses(store, [*ids, big]) == ["succeeded", "succeeded", "failed"]
    doc = store.coll.find_one({"_id": big}, {"lastError": 1, "result": 1})
    assert doc["lastError"] == TOO_LARGE_TO_SETTLE and "result" not in doc


def test_a_settle_bson_cannot_encode_fails_its_job_once_with_the_reason(
    client: MongoClient, store: JobStore, log: CommandLog
) -> None:
    # A result holding a lone surrogate (os.fsdecode of a name that is not UTF-8), in a batch and alone: the write can
    # never land, and left `running` the job would run again after the stale sweep. Each fails, saying why, once.
    ids = held_jobs(store, 2)
    batched, alone = held_jobs(store, 2)
    surrogate = {"state": "SUCCESS", "result": "caf\udce9.txt"}
    first_settle_held_on_the_server(client, store, log, ids[0])
    store.settle_soon(store.success(batched, 1, result=surrogate))
    store.settle_soon(store.success(ids[1], 1))
    assert store.flush_settles(60)
    store.settle_soon(store.success(alone, 1, result=surrogate))
    assert store.flush_settles(60)
    assert statuses(store, [*ids, batched, alone]) == ["succeeded", "succeeded", "failed", "failed"]
    for doc in store.coll.find({"_id": {"$in": [batched, alone]}}):
        assert doc["lastError"].startswith("the job's settle cannot be stored: BSON cannot encode it"), doc
        assert "\\udce9" in doc["lastError"] and "result" not in doc and doc["attempts"] == 1
    assert not settles.pending_jobs()
