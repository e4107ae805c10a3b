"""A finished task's job stays live until its settle is written (bb_broker/jobs/settles.py, leases.py).

Its Celery request is done, so the worker no longer names it; while the server refuses the settle for longer than
`stale_after`, the lease keeper still heartbeats the job, so that another worker's sweep leaves it alone, and its own
sweep waits until its process's settles are written. It used to take the job back as lost after such an outage,
before the settle landed, and the task ran again. Here the server refuses only the settles' client (a fail point on
its `appName`): the heartbeats and sweeps go on."""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Iterator

import pytest
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.clock import ServerClock
from bb_broker.jobs.leases import LeaseKeeper
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.settles import Settle, SettleRelay
from bb_broker.jobs.store import JobStore
from tests.support.store import held_jobs, send_from_a_child
from tests.support.workers import wait_for

#: A heartbeat every 0.4 s, a sweep every second.
LEASE = Policy(stale_after=2.0)
SETTLES_APP = "bb-settles-under-test"
OWNER = "w"  # the owner held_jobs claims for


def store_on(db: Database) -> JobStore:
    return JobStore(db, LEASE, clock=ServerClock(db))


@pytest.fixture
def keeper_store(client: MongoClient) -> JobStore:
    store = store_on(client.leased)
    store.ensure_indexes()
    return store


@pytest.fixture
def settles_store(own_server) -> Iterator[JobStore]:
    """The store the settles are written through: its own client, which the fail point names."""
    with MongoClient(own_server.url, tz_aware=True, appname=SETTLES_APP) as client:
        yield store_on(client.leased)


@pytest.fixture
def keeper(keeper_store: JobStore) -> Iterator[LeaseKeeper]:
    keeper = LeaseKeeper(keeper_store, owner=OWNER)
    atexit.unregister(keeper._release_at_exit)  # this process is no worker: nothing of its own to release
    yield keeper
    keeper._done.set()
    keeper._thread.join(10)  # before the fixtures close its client


def refuse_settles(client: MongoClient, on: bool) -> None:
    """The settles' updates fail with a transient error (HostUnreachable, a retryable write), the others go on."""
    data = {"failCommands": ["update"], "appName": SETTLES_APP, "errorCode": 6, "errorLabels": ["RetryableWriteError"]}
    client.admin.command("configureFailPoint", "failCommand", mode="alwaysOn" if on else "off", data=data)


def jobs(store: JobStore, ids: list[str]) -> list[dict]:
    docs = {doc["_id"]: doc for doc in store.coll.find({"_id": {"$in": ids}})}
    return [docs[job_id] for job_id in ids]


def held_through_three_leases(store: JobStore, ids: list[str], *, other_worker: JobStore | None = None) -> None:
    """Three times `stale_after` with the settles refused (and `other_worker` sweeping all the while): the jobs stay
    the worker's, at their first attempt."""
    ends = time.monotonic() + 3 * LEASE.stale_after
    while time.monotonic() < ends:
        if other_worker is not None:
            other_worker.requeue_stale()
        assert [(job["status"], job["attempts"]) for job in jobs(store, ids)] == [("running", 1)] * len(ids)
        time.sleep(0.2)


def settled_once(store: JobStore, ids: list[str]) -> None:
    for job in jobs(store, ids):
        assert job["status"] == "succeeded" and job["attempts"] == 1, job
        assert [entry["outcome"] for entry in job["history"]] == ["succeeded"], "no attempt was taken back as lost"


def success(store: JobStore, job_id: str) -> Settle:
    return store.success(job_id, 1, attempt={"n": 1, "outcome": "succeeded"})


def test_a_job_whose_settle_the_server_refuses_longer_than_its_lease_is_kept_and_settled_once(
    client: MongoClient, keeper_store: JobStore, settles_store: JobStore, keeper: LeaseKeeper
) -> None:
    (job_id,) = held_jobs(keeper_store, 1)
    refuse_settles(client, True)
    try:
        settles_store.settle_soon(success(settles_store, job_id))  # a threads pool's settle: this process writes it
        held_through_three_leases(keeper_store, [job_id], other_worker=store_on(client.leased))
    finally:
        refuse_settles(client, False)
    assert settles_store.flush_settles(30)
    settled_once(keeper_store, [job_id])


@pytest.fixture
def relay(settles_store: JobStore) -> Iterator[SettleRelay]:
    relay = SettleRelay(lambda: settles_store, lambda store, settle, with_result: settle)
    relay.start()
    yield relay
    relay.close()


def test_a_relayed_settle_held_up_by_the_server_keeps_its_job_from_another_workers_sweep(
    client: MongoClient, keeper_store: JobStore, settles_store: JobStore, keeper: LeaseKeeper, relay: SettleRelay
) -> None:
    (job_id,) = held_jobs(keeper_store, 1)
    refuse_settles(client, True)
    try:
        send_from_a_child(relay, [success(settles_store, job_id)])
        held_through_three_leases(keeper_store, [job_id], other_worker=store_on(client.leased))
    finally:
        refuse_settles(client, False)
    assert relay.flush(30)
    settled_once(keeper_store, [job_id])


def test_the_workers_own_sweep_waits_for_settles_still_in_the_relays_socket(
    client: MongoClient, keeper_store: JobStore, settles_store: JobStore, keeper: LeaseKeeper, relay: SettleRelay
) -> None:
    ids = held_jobs(keeper_store, 2)
    refuse_settles(client, True)
    try:
        send_from_a_child(relay, [success(settles_store, ids[0])])
        wait_for(lambda: relay.pending_jobs() == {ids[0]}, message="the first settle in the relay's write")
        # The second waits in the socket, behind the write the server holds up: the relay has not read it, and no
        # heartbeat names it. Another worker's sweep could take it once the server answers, before it is written,
        # as it could a running job before its worker's first heartbeat; this worker's own sweep does not.
        send_from_a_child(relay, [success(settles_store, ids[1])])
        held_through_three_leases(keeper_store, ids)
    finally:
        refuse_settles(client, False)
    assert relay.flush(30)
    settled_once(keeper_store, ids)


def test_a_pool_process_whose_relay_is_gone_writes_its_settle_before_it_goes_on(
    own_server, client: MongoClient, keeper_store: JobStore
) -> None:
    # Written before settle_soon returns, so before the task's result reaches the main process: until then the main
    # process holds the request and heartbeats the job. The server holds the write half a second.
    (job_id,) = held_jobs(keeper_store, 1)
    relay = SettleRelay(lambda: keeper_store, lambda store, settle, with_result: settle)
    relay._receiving.close()  # as the main process's death closes it
    client.admin.command(
        "configureFailPoint", "failCommand", mode={"times": 1},
        data={"failCommands": ["update"], "blockConnection": True, "blockTimeMS": 500},
    )  # fmt: skip
    pid = os.fork()
    if pid == 0:
        with MongoClient(own_server.url, tz_aware=True) as own:
            store = store_on(own.leased)
            store.settle_relay = relay
            store.settle_soon(success(store, job_id))
            written = store.coll.find_one({"_id": job_id})["status"] == "succeeded"
        os._exit(0 if written else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "settle_soon returned before its settle was written"
    relay._sending.close()
