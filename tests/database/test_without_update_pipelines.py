"""The writes that use an update pipeline where the server takes one, on a server that refuses them, as Amazon
DocumentDB does (the wire proxy's amazon_documentdb profile): the probe finds it at connect, and the stale sweep (and
the release at shutdown) reads the lost jobs, then writes each one fenced on what it read. Each lost job is settled
once, as the pipeline settles it; a job whose lease is renewed, or that another sweeper settles, between the read and
the write is left alone. A result's forget() reads, then writes, too."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from celery.result import AsyncResult
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.connection import new_client
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.server import capabilities
from tests.support import wire
from tests.support.servers import with_database
from tests.support.store import FakeClock
from tests.support.workers import producer

pytestmark = pytest.mark.stand_in

STALE_AFTER = 30


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def profile() -> wire.Profile:
    return wire.amazon_documentdb()


@pytest.fixture
def proxy(mongo_url: str, profile: wire.Profile) -> Iterator[wire.WireProxy]:
    proxy = wire.WireProxy(mongo_url, profile)
    yield proxy
    proxy.close()


@pytest.fixture
def sweeper(proxy: wire.WireProxy, db: Database, clock: FakeClock) -> Iterator[Callable[[], JobStore]]:
    """Makes the store of one more worker, on a client of its own through the proxy."""
    clients: list[MongoClient] = []

    def make() -> JobStore:
        clients.append(MongoClient(f"mongodb://{proxy.address}", tz_aware=True))
        return JobStore(clients[-1][db.name], Policy(stale_after=STALE_AFTER), clock=clock)

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def direct(db: Database, clock: FakeClock) -> JobStore:
    """The store of the workers that claimed and lost the jobs: straight to the server."""
    store = JobStore(db, Policy(stale_after=STALE_AFTER), clock=clock)
    store.ensure_indexes()
    return store


def publish(store: JobStore, task_id: str) -> str:
    return store.publish(queue="celery", kind="app.task", task_id=task_id, payload={"args": [], "kwargs": {}},
                         priority=0, run_after=None, is_retry=False)  # fmt: skip


def hold_updates_of_jobs(profile: wire.Profile, until: Callable[[], None]) -> None:
    """The proxy holds each `update` of the jobs collection in `until` before it answers (or refuses) it: the test
    chooses what happens between a sweep's read and its write."""
    refuse = profile.refuse

    def held(command: dict[str, Any]) -> dict[str, Any] | None:
        if command.get("update") == "jobs":
            until()
        return refuse(command)

    profile.refuse = held


def lost_entries(db: Database, job_id: str) -> list[dict[str, Any]]:
    return [entry for entry in db.jobs.find_one({"_id": job_id}).get("history", []) if entry["outcome"] == "lost"]


def test_the_probe_finds_no_update_pipelines_and_the_sweep_requeues_a_lost_job_once(
    direct: JobStore, sweeper, profile: wire.Profile, db: Database, clock: FakeClock
) -> None:
    job_id = publish(direct, "lost")
    direct.claim("celery", "dead-worker")
    clock.advance(STALE_AFTER + 1)
    store = sweeper()
    assert store.requeue_stale() == (1, 0)
    assert not capabilities(store.coll.database).update_pipelines
    assert "Failed to parse update" in capabilities(store.coll.database).refusals["update_pipelines"]
    assert profile.refused == {"update": 1}  # the probe's, once: the sweep never sent a pipeline
    doc = db.jobs.find_one({"_id": job_id})
    assert (doc["status"], doc["attempts"], doc["runAfter"]) == ("queued", 1, clock.now)
    assert "leaseOwner" not in doc and "worker lost" in doc["lastError"]
    assert [(e["n"], e["worker"], e["outcome"]) for e in doc["history"]] == [(1, "dead-worker", "lost")]
    assert store.requeue_stale() == (0, 0)
    assert direct.claim("celery", "survivor").attempts == 2


def sweep_through(proxy_profile: wire.Profile, mongo_url: str, db: Database, clock: FakeClock) -> tuple[int, int]:
    """One stale sweep by a store of the product's own client (new_client: LENIENT_DECODING) through a proxy of
    `proxy_profile` that holds and takes what a `mongod` keeps (wire.keeping_what_the_stand_in_refuses)."""
    proxy = wire.WireProxy(mongo_url, wire.keeping_what_the_stand_in_refuses(proxy_profile))
    client = new_client(f"mongodb://{proxy.address}", tz_aware=True)  # as every client of the product is made
    try:
        return JobStore(client[db.name], Policy(stale_after=STALE_AFTER), clock=clock).requeue_stale()
    finally:
        client.close()
        proxy.close()


def test_the_sweep_copies_a_lost_jobs_text_and_dates_python_cannot_hold_as_they_are(
    direct: JobStore, mongo_url: str, db: Database, clock: FakeClock
) -> None:
    # Written by another program, kept by a mongod (the proxy answers as one: wire.as_mongod_keeps): a start before
    # year 1, an owner whose bytes are not UTF-8. pymongo's default decoding raised InvalidBSON on the sweep's read,
    # and every sweep failed, for every lost job; read leniently, the history entry took U+FFFD and 0001-01-01.
    job_id = publish(direct, "lost")
    direct.claim("celery", f"dead-worker-{wire.NOT_UTF8_MARKER}")
    clock.advance(STALE_AFTER + 1)
    db.jobs.update_one({"_id": job_id}, {"$set": {"startedAt": wire.BEFORE_YEAR_1_MARKER}})
    assert sweep_through(wire.amazon_documentdb(), mongo_url, db, clock) == (1, 0)
    doc = db.jobs.find_one({"_id": job_id})
    assert (doc["status"], doc["attempts"]) == ("queued", 1)
    # Each marker kept: the bytes a mongod held, written back as they were.
    [entry] = doc["history"]
    assert (entry["worker"], entry["outcome"]) == (f"dead-worker-{wire.NOT_UTF8_MARKER}", "lost")
    assert entry["startedAt"] == wire.BEFORE_YEAR_1_MARKER


@pytest.mark.parametrize(
    "deployment", [wire.amazon_documentdb, lambda: wire.Profile("mongod")], ids=["without pipelines", "mongod"]
)
def test_a_lost_job_last_updated_before_year_1_is_swept(
    direct: JobStore, mongo_url: str, db: Database, clock: FakeClock, deployment: Callable[[], wire.Profile]
) -> None:
    # Its updatedAt read as 0001-01-01 (the nearest date Python holds): the fence of a server without update
    # pipelines matched it against that, not what the job holds, and the job was never swept.
    job_id = publish(direct, "lost")
    direct.claim("celery", "dead-worker")
    db.jobs.update_one({"_id": job_id}, {"$set": {"updatedAt": wire.BEFORE_YEAR_1_MARKER}})
    assert sweep_through(deployment(), mongo_url, db, clock) == (1, 0)
    doc = db.jobs.find_one({"_id": job_id})
    assert (doc["status"], doc["attempts"], doc["updatedAt"]) == ("queued", 1, clock.now)
    assert [(e["n"], e["worker"], e["outcome"]) for e in doc["history"]] == [(1, "dead-worker", "lost")]


def test_two_sweepers_racing_settle_each_lost_job_once(
    direct: JobStore, sweeper, profile: wire.Profile, db: Database, clock: FakeClock
) -> None:
    ids = [publish(direct, f"lost{n}") for n in range(5)]
    for _ in ids:
        direct.claim("celery", "dead-worker")
    exhausted = publish(direct, "exhausted")
    db.jobs.update_one({"_id": exhausted}, {"$set": {"attempts": 2}})
    direct.claim("celery", "dead-worker")
    clock.advance(STALE_AFTER + 1)
    sweepers = [sweeper(), sweeper()]
    for store in sweepers:
        store.server  # noqa: B018 (each probes now, so that the barrier below holds only the sweeps' writes)
    both_read = threading.Barrier(2, timeout=60)
    hold_updates_of_jobs(profile, both_read.wait)  # each sweeper writes only once both have read the lost jobs
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda store: store.requeue_stale(), sweepers))
    # The five were requeued by one sweeper or the other, the exhausted one failed by one: never by both.
    assert sum(retried for retried, _ in results) == 5 and sum(failed for _, failed in results) == 1, results
    for job_id in ids:
        doc = db.jobs.find_one({"_id": job_id})
        assert (doc["status"], doc["attempts"]) == ("queued", 1) and len(lost_entries(db, job_id)) == 1, doc
    doc = db.jobs.find_one({"_id": exhausted})
    assert doc["status"] == "failed" and "no attempt is left" in doc["lastError"]
    assert len(lost_entries(db, exhausted)) == 1


def test_a_lease_renewed_between_the_sweeps_read_and_its_write_is_not_swept(
    direct: JobStore, sweeper, profile: wire.Profile, db: Database, clock: FakeClock
) -> None:
    live = publish(direct, "live")
    direct.claim("celery", "slow-worker")
    lost = publish(direct, "lost")
    direct.claim("celery", "dead-worker")
    clock.advance(STALE_AFTER + 1)
    store = sweeper()
    store.server  # noqa: B018 (probed now: the hold below is for the sweep's write)
    read, renewed = threading.Event(), threading.Event()

    def renewal_first() -> None:
        read.set()
        assert renewed.wait(60)

    hold_updates_of_jobs(profile, renewal_first)
    with ThreadPoolExecutor(1) as pool:
        sweep = pool.submit(store.requeue_stale)
        assert read.wait(60), "the sweep wrote nothing"
        assert direct.heartbeat([live], "slow-worker") == 1  # just in time: after the read, before the write
        renewed.set()
        assert sweep.result(60) == (1, 0)
    doc = db.jobs.find_one({"_id": live})
    assert (doc["status"], doc["attempts"], doc["leaseOwner"]) == ("running", 1, "slow-worker")
    assert not doc.get("history") and "lastError" not in doc
    assert db.jobs.find_one({"_id": lost})["status"] == "queued"


def test_the_read_and_write_leave_each_job_as_the_pipeline_does(db: Database, sweeper, clock: FakeClock) -> None:
    # The same lost jobs in two databases, at the same times: one swept by the pipeline (the stand-in takes it), the
    # other through the proxy.
    with_pipelines = db.client[f"{db.name}_pipelines"]
    try:
        stores = {
            "pipeline": JobStore(with_pipelines, Policy(stale_after=STALE_AFTER), clock=clock),
            "read and write": sweeper(),
        }
        for store in stores.values():
            store.ensure_indexes()
        lose_jobs_of_every_kind(list(stores.values()), clock)
        clock.advance(STALE_AFTER + 1)
        for store in stores.values():
            publish(store, "held-at-shutdown")
            store.claim("celery", "leaving-worker")
        swept = {name: store.requeue_stale() for name, store in stores.items()}
        assert swept["pipeline"] == swept["read and write"] == (5, 2)
        reason = "the worker shut down"
        released = {name: store.release_owner("leaving-worker", reason) for name, store in stores.items()}
        assert released["pipeline"] == released["read and write"] == (1, 0)
        jobs = {name: as_left(store.coll.database) for name, store in stores.items()}
        assert jobs["read and write"] == jobs["pipeline"]
        assert not capabilities(stores["read and write"].coll.database).update_pipelines
    finally:
        db.client.drop_database(with_pipelines.name)


def lose_jobs_of_every_kind(stores: list[JobStore], clock: FakeClock) -> None:
    """Running jobs of a worker that is gone, each in a state the sweep treats in its own way, alike in each store."""
    kinds = ("plain", "recorded", "history-by-hand", "history-null", "exhausted", "exhausted-unique", "unique")
    for store in stores:
        for task_id in kinds:
            publish(store, task_id)
            store.claim("celery", "dead-worker")
    clock.advance(1)
    for store in stores:
        db = store.coll.database
        recorded = db.jobs.find_one({"taskId": "recorded"})
        entry = {"n": 1, "worker": "dead-worker", "startedAt": recorded["startedAt"], "finishedAt": clock.now,
                 "outcome": "failed"}  # fmt: skip
        assert store.record_failed_attempt(recorded["_id"], 1, "ValueError: boom", attempt=entry)
        db.jobs.update_one({"taskId": "history-by-hand"}, {"$set": {"history": "written by hand"}})
        db.jobs.update_one({"taskId": "history-null"}, {"$set": {"history": None}})
        db.jobs.update_many({"taskId": {"$regex": "^exhausted"}}, {"$set": {"attempts": 3}})
        for task_id in ("exhausted-unique", "unique"):
            db.jobs.update_one({"taskId": task_id}, {"$set": {"uniqueActive": f"key-{task_id}"}})


def as_left(db: Database) -> dict[str, dict[str, Any]]:
    return {doc.pop("taskId"): doc for doc in db.jobs.find({}, {"_id": 0, "createdAt": 0, "payload": 0})}


def test_forget_forgets_a_success_and_a_failure(proxy: wire.WireProxy, db: Database, clock: FakeClock) -> None:
    db.jobs.insert_many([
        {"_id": "job-ok", "taskId": "ok", "status": "succeeded", "attempts": 1, "finishedAt": clock.now},
        {"_id": "job-bad", "taskId": "bad", "status": "failed", "attempts": 3, "finishedAt": clock.now,
         "lastError": "ValueError: boom"},
    ])  # fmt: skip
    url = with_database(f"mongodb://{proxy.address}", db.name)
    app = producer(url)
    app.conf.result_backend = url
    try:
        app.backend.store_result("ok", 42, "SUCCESS")
        assert (AsyncResult("ok", app=app).get(timeout=10), AsyncResult("bad", app=app).state) == (42, "FAILURE")
        for task_id in ("ok", "bad"):
            AsyncResult(task_id, app=app).forget()
            assert AsyncResult(task_id, app=app).state == "PENDING", task_id
        assert not capabilities(app.backend.database).update_pipelines
    finally:
        app.close()
    ok, bad = db.jobs.find_one({"_id": "job-ok"}), db.jobs.find_one({"_id": "job-bad"})
    assert "state" not in ok and "result" not in ok and ok["forgotten"] is None
    assert bad["forgotten"] == bad["finishedAt"] and bad["status"] == "failed"
