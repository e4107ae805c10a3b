"""The settle relay (bb_broker/jobs/settles.py SettleRelay): a prefork worker's main process writes the settles its
pool processes send, several in one write; a datagram that is not a settle is dropped, never written and never
the relay's end; a relayed settle that does not fit in its document fails its job."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import bson
import pytest
from pymongo import MongoClient

from bb_broker.jobs.settles import Settle, SettleRelay
from bb_broker.jobs.store import JobStore
from tests.support.faults import fail_point
from tests.support.store import CommandLog, held_jobs, send_from_a_child, send_from_children_at_once, settles_sent
from tests.support.workers import wait_for


@pytest.fixture
def store(client: MongoClient) -> JobStore:
    store = JobStore(client.relayed)
    store.ensure_indexes()
    return store


def replaced(store: JobStore, settle: Settle, with_result: bool, cause: str) -> Settle:
    return store.failure(settle.job_id, settle.fence["attempts"], f"replaced ({with_result})", retryable=False)


@pytest.fixture
def relay(store: JobStore) -> Iterator[SettleRelay]:
    relay = SettleRelay(lambda: store, replaced)
    relay.start()
    yield relay
    relay.close()


def test_settles_sent_from_a_pool_process_are_written_by_the_main_process_in_fewer_writes(
    store: JobStore, relay: SettleRelay, client: MongoClient, log: CommandLog
) -> None:
    ids = held_jobs(store, 6)
    # The first write waits a second on the server: the five sent meanwhile go out together in the next.
    fail_point(client, 1, failCommands=["update"], blockConnection=True, blockTimeMS=1000)
    log.commands.clear()
    send_from_a_child(relay, [store.success(ids[0], 1)])
    wait_for(lambda: settles_sent(log), message="the first settle sent")
    send_from_a_child(relay, [store.success(job_id, 1) for job_id in ids[1:]])
    assert relay.flush(30)
    assert settles_sent(log) == [1, 5]
    assert [doc["status"] for doc in store.coll.find({"_id": {"$in": ids}})] == ["succeeded"] * 6
    # The relay's own process writes its settles itself (its GroupCommit): it sends none to itself.
    assert not relay.send(store.success(ids[0], 1))


def test_a_datagram_that_is_no_settle_is_dropped_and_the_settles_beside_it_land(
    store: JobStore, relay: SettleRelay, caplog: pytest.LogCaptureFixture
) -> None:
    ids = held_jobs(store, 2)
    untouched = store.coll.find_one({"_id": ids[1]})
    hostile = [
        b"\x00not bson at all",
        bson.encode({"job": ids[1], "attempts": 1, "update": {"$rename": {"payload": "x"}}, "outcome": "succeeded"}),
        bson.encode({"job": ids[1], "attempts": "1", "update": {"$set": {"status": "failed"}}, "outcome": "failed"}),
        bson.encode({"job": {"$gt": ""}, "attempts": 1, "update": {"$set": {"status": "x"}}, "outcome": "failed"}),
        bson.encode({"job": ids[1], "attempts": 1, "update": {"$set": {"status": "x"}}, "outcome": "anything"}),
        bson.encode({"flush": "not a token"}),
        bson.encode({"job": ids[1], "attempts": 1, "update": {}, "outcome": "succeeded"}),  # pymongo refuses it
        bson.encode({"job": ids[1], "attempts": 1, "update": {"$set": {"status": "x"}}, "outcome": "failed"}),
    ]
    for data in hostile:
        relay._sending.send(data)  # as a pool process's send would, with what no pool process sends
    send_from_a_child(relay, [store.success(ids[0], 1)])
    assert relay.flush(30)
    assert store.coll.find_one({"_id": ids[0]})["status"] == "succeeded"
    assert store.coll.find_one({"_id": ids[1]}) == untouched
    assert sum("relayed settle" in record.getMessage() for record in caplog.records) == len(hostile)
    # The relay still works after them.
    send_from_a_child(relay, [store.success(ids[1], 1)])
    assert relay.flush(30)
    assert store.coll.find_one({"_id": ids[1]})["status"] == "succeeded"


def test_a_relayed_settle_that_does_not_fit_fails_its_job_with_the_replacement(
    store: JobStore, relay: SettleRelay
) -> None:
    # Arguments that fill the document: a settle under the relay's size no longer fits beside them.
    (job_id,) = held_jobs(store, 1, payload={"args": ["x" * (16 * 1024 * 1024 - 10 * 1024)]})
    result = {"state": "SUCCESS", "result": "r" * (30 * 1024)}
    send_from_a_child(relay, [store.success(job_id, 1, result=result, subject="too large here")])
    assert relay.flush(30)
    doc = store.coll.find_one({"_id": job_id}, {"payload": 0})
    assert doc["status"] == "failed" and doc["lastError"] == "replaced (True)" and "result" not in doc


def refused_in_a_child(relay: SettleRelay, settle: Settle) -> bool:
    pid = os.fork()
    if pid == 0:
        os._exit(1 if relay.send(settle) else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def test_a_settle_too_large_for_a_datagram_stays_with_its_pool_process(store: JobStore, relay: SettleRelay) -> None:
    (job_id,) = held_jobs(store, 1)
    large = store.success(job_id, 1, result={"state": "SUCCESS", "result": "r" * SettleRelay.max_bytes})
    assert refused_in_a_child(relay, large)  # the pool process writes it itself, at once (JobStore.settle_soon)
    assert store.coll.find_one({"_id": job_id})["status"] == "running"


def test_once_the_main_process_is_gone_a_pool_process_writes_its_settles_itself(store: JobStore) -> None:
    (job_id,) = held_jobs(store, 1)
    relay = SettleRelay(lambda: store, replaced)
    relay._receiving.close()  # as the main process's death closes it
    assert refused_in_a_child(relay, store.success(job_id, 1))


def test_a_pool_process_never_waits_for_a_full_buffer(store: JobStore) -> None:
    # A relay whose main process writes nothing (held up by an outage): its socket's buffer fills, and a send then
    # says no at once, so that the pool process hands its settle to its own writer instead of stopping.
    (job_id,) = held_jobs(store, 1)
    relay = SettleRelay(lambda: store, replaced)
    settle = store.success(job_id, 1, result={"state": "SUCCESS", "result": "r" * 8000})
    pid = os.fork()
    if pid == 0:
        sent = 0
        while relay.send(settle):
            sent += 1
        os._exit(0 if sent > 0 else 1)
    _, status = os.waitpid(pid, 0)  # a send that waited would never return
    assert os.waitstatus_to_exitcode(status) == 0
    relay.close()


def test_a_settle_waits_for_the_next_when_settles_come_close_together(
    store: JobStore, relay: SettleRelay, log: CommandLog
) -> None:
    relay.linger = 60.0  # no cap: the wait is `hold_gaps` times the gap the settles come at
    relay.hold_gaps = 0.5  # a wait shorter than the gap: each of the first four ends before the next comes
    ids = held_jobs(store, 7)
    log.commands.clear()
    # Settles a second apart: each written alone (the first with no gap before it to go by, the others after a
    # wait of about half a second that the next does not come in).
    for count, job_id in enumerate(ids[:4], start=1):
        send_from_a_child(relay, [store.success(job_id, 1)])
        alone = [1] * count
        wait_for(lambda alone=alone: settles_sent(log) == alone, message=f"settle {count} written")
        time.sleep(1.0)
    # Three tasks that end together, each in its own pool process: one write (the wait goes on after the second,
    # for as long again).
    send_from_children_at_once(relay, [store.success(job_id, 1) for job_id in ids[4:]])
    wait_for(lambda: store.coll.count_documents({"_id": {"$in": ids}, "status": "succeeded"}) == 7)
    assert settles_sent(log) == [1, 1, 1, 1, 3]
