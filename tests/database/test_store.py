"""The job store against a real server, with a clock the test moves: claims, backoff, leases, sweeps."""

from __future__ import annotations

import multiprocessing
import threading
from datetime import UTC, datetime, timedelta

import pytest
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from bb_broker import statuses
from bb_broker.jobs.document import JobTooLarge, attempt_entry
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.store import CommandLog, FakeClock, assert_each_reads_through_an_index


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db: Database, clock: FakeClock) -> JobStore:
    store = JobStore(db, Policy(), clock=clock)
    store.ensure_indexes()
    return store


def publish(store: JobStore, task_id: str = "t", *, queue: str = "celery", priority: int = 0, run_after=None) -> str:
    return store.publish(queue=queue, kind="app.task", task_id=task_id, payload={"args": [1], "kwargs": {}},
                         priority=priority, run_after=run_after, is_retry=False)  # fmt: skip


def test_publish_writes_the_seed_fields(store: JobStore, clock: FakeClock, db: Database) -> None:
    job_id = publish(store, "task-1")
    doc = db.jobs.find_one({"_id": job_id})
    assert len(job_id) == 26  # a ULID
    assert doc["status"] == "queued" and doc["attempts"] == 0 and doc["kind"] == "app.task"
    assert doc["taskId"] == "task-1" and doc["queue"] == "celery" and doc["priority"] == 0
    assert doc["runAfter"] == doc["createdAt"] == doc["updatedAt"] == clock.now
    assert doc["payload"] == {"args": [1], "kwargs": {}}


def test_claim_takes_priority_then_due_time_then_age(store: JobStore, clock: FakeClock) -> None:
    early = publish(store, "early", run_after=clock.now - timedelta(seconds=5))
    normal = publish(store, "normal")
    urgent = publish(store, "urgent", priority=9)
    later = publish(store, "later", run_after=clock.now + timedelta(seconds=30))
    publish(store, "other-queue", queue="other")

    order = [store.claim("celery", "w").task_id for _ in range(3)]
    assert order == ["urgent", "early", "normal"]
    assert store.claim("celery", "w") is None  # `later` is not due
    clock.advance(30)
    claimed = store.claim("celery", "w")
    assert claimed.id == later and claimed.attempts == 1
    assert {urgent, early, normal}  # claimed once each above


def test_claim_many_takes_the_head_of_the_queue_in_two_round_trips(mongo_url: str, db: Database, clock) -> None:
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        store = JobStore(client[db.name], clock=clock)
        store.ensure_indexes()
        for name, priority in (("a", 0), ("b", 0), ("urgent", 9), ("c", 0)):
            publish(store, name, priority=priority)
        publish(store, "later", run_after=clock.now + timedelta(seconds=30))
        publish(store, "elsewhere", queue="other")
        log.commands.clear()
        first = store.claim_many("celery", "w", 3)
        assert [next(iter(c)) for c in log.commands] == ["find", "update"]
        rest = store.claim_many("celery", "w", 10)
    assert [job.task_id for job in first] == ["urgent", "a", "b"] and [job.task_id for job in rest] == ["c"]
    for job in first + rest:
        doc = db.jobs.find_one({"_id": job.id})
        assert (doc["status"], doc["attempts"], doc["leaseOwner"], job.attempts) == ("running", 1, "w", 1)
    assert statuses(db) == {"queued": 2, "running": 4, "succeeded": 0, "failed": 0}


class TakenMeanwhile(monitoring.CommandListener):
    """Once a batch claim has read the head of the queue, another worker takes `job_id` and gives it back failed
    (attempts up by one, queued and due again), before the claim's write: the race its fence is there for."""

    def __init__(self, mongo_url: str, db_name: str) -> None:
        self.jobs = MongoClient(mongo_url)[db_name].jobs
        self.job_id: str | None = None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "find" and self.job_id is not None:
            job_id, self.job_id = self.job_id, None
            self.jobs.update_one({"_id": job_id}, {"$inc": {"attempts": 1}})

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.parametrize("head", ["first attempts", "mixed attempts"])
def test_a_batch_claim_takes_each_job_at_the_attempt_it_read(mongo_url: str, db: Database, clock, head: str) -> None:
    race = TakenMeanwhile(mongo_url, db.name)
    with MongoClient(mongo_url, event_listeners=[race], tz_aware=True) as client:
        store = JobStore(client[db.name], clock=clock)
        store.ensure_indexes()
        retried, raced, fresh = (publish(store, name) for name in ("retried", "raced", "fresh"))
        if head == "mixed attempts":  # one job of the head failed once and is due again
            job = store.claim("celery", "w")
            store.fail(job.id, job.attempts, "boom", backoff=False)
        race.job_id = raced
        claimed = store.claim_many("celery", "w", 3)
    first = 2 if head == "mixed attempts" else 1
    assert [(job.id, job.attempts) for job in claimed] == [(retried, first), (fresh, 1)]
    for job in claimed:
        doc = db.jobs.find_one({"_id": job.id})
        assert (doc["status"], doc["attempts"], doc["leaseOwner"]) == ("running", job.attempts, "w")
    assert db.jobs.find_one({"_id": raced})["status"] == "queued"  # not taken on the attempt read before the race


@pytest.mark.parametrize("batch", [1, 4])
def test_threads_never_hold_the_same_job(store: JobStore, batch: int) -> None:
    for i in range(60):
        publish(store, f"t{i}")
    claimed: list[str] = []
    lock = threading.Lock()

    def drain(owner: str) -> None:
        while jobs := store.claim_many("celery", owner, batch):
            with lock:
                claimed.extend(job.task_id for job in jobs)

    threads = [threading.Thread(target=drain, args=(f"w{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == sorted(f"t{i}" for i in range(60))


def _drain_in_process(url: str, owner: str, batch: int, out: multiprocessing.Queue) -> None:
    from bb_broker.connection import get_database, parse_broker_url

    store = JobStore(get_database(parse_broker_url(url)))
    got = []
    while jobs := store.claim_many("celery", owner, batch):
        got.extend(job.task_id for job in jobs)
    out.put(got)


@pytest.mark.parametrize("batch", [1, 5])
def test_processes_racing_claim_each_job_once(store: JobStore, broker_url: str, batch: int) -> None:
    for i in range(60):
        publish(store, f"t{i}", run_after=datetime(2000, 1, 1, tzinfo=UTC))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_drain_in_process, args=(broker_url, f"p{i}", batch, out)) for i in range(3)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    claimed = [task for result in results for task in result]
    assert sorted(claimed) == sorted(f"t{i}" for i in range(60))
    assert statuses(broker_url) == {"queued": 0, "running": 60, "succeeded": 0, "failed": 0}


def test_failures_back_off_then_fail_on_the_final_attempt(store: JobStore, clock: FakeClock, db: Database) -> None:
    job_id = publish(store)
    delays = []
    for attempt in (1, 2):
        job = store.claim("celery", "w")
        assert job.attempts == attempt
        outcome = store.fail(job.id, job.attempts, "boom")
        delays.append((outcome.run_after - clock.now).total_seconds())
        assert store.claim("celery", "w") is None  # waiting out its backoff
        clock.advance(delays[-1])
    assert delays == [10.0, 20.0]
    job = store.claim("celery", "w")
    assert job.attempts == 3 and store.policy.is_final_attempt(job.attempts)
    store.fail(job.id, job.attempts, "boom")
    doc = db.jobs.find_one({"_id": job_id})
    assert doc["status"] == "failed" and doc["lastError"] == "boom" and doc["attempts"] == 3


def test_a_fail_written_before_its_answer_was_lost_is_still_its_callers(store: JobStore, db: Database) -> None:
    # fail() answers None where a try after a lost answer found the fence gone: its own write had landed. A claim that
    # refused the job's message asks failed_with before it tells the app's result backend (transport/claims.py).
    publish(store, "t")
    job = store.claim("celery", "w")
    refused = "malformed message: header 'x' must be a list, got " + "'x'" * 1000  # stored cut to a lastError's length
    assert store.fail(job.id, job.attempts, refused, retryable=False)
    assert store.fail(job.id, job.attempts, refused, retryable=False) is None
    assert store.failed_with(job.id, job.attempts, refused)
    assert not store.failed_with(job.id, job.attempts, "another failure")
    assert not store.failed_with(job.id, job.attempts + 1, refused)


def test_a_late_write_from_a_lost_lease_changes_nothing(store: JobStore, clock: FakeClock, db: Database) -> None:
    job_id = publish(store)
    first = store.claim("celery", "old-worker")
    clock.advance(301)
    assert store.requeue_stale() == (1, 0)
    second = store.claim("celery", "new-worker")
    assert second.attempts == 2
    assert not store.succeed(first.id, first.attempts)
    assert store.fail(first.id, first.attempts, "late") is None
    assert store.heartbeat([job_id], "old-worker") == 0
    assert db.jobs.find_one({"_id": job_id})["status"] == "running"
    assert store.succeed(second.id, second.attempts)


def test_stale_sweep_requeues_lost_jobs_and_fails_exhausted_ones(store: JobStore, clock: FakeClock, db) -> None:
    lost = publish(store, "lost")
    live = publish(store, "live")
    store.claim("celery", "dead")
    store.claim("celery", "alive")
    exhausted = publish(store, "exhausted")
    db.jobs.update_one({"_id": exhausted}, {"$set": {"attempts": 2}})
    store.claim("celery", "dead")
    clock.advance(200)
    store.heartbeat([live], "alive")
    clock.advance(200)  # the dead worker's jobs are 400 s old, the live one 200 s
    assert store.requeue_stale() == (1, 1)
    docs = {d["taskId"]: d for d in db.jobs.find()}
    assert docs["lost"]["status"] == "queued" and "worker lost" in docs["lost"]["lastError"]
    assert docs["live"]["status"] == "running"
    assert docs["exhausted"]["status"] == "failed" and "no attempt is left" in docs["exhausted"]["lastError"]
    assert lost and "leaseOwner" not in docs["lost"]


def test_the_sweep_adds_no_second_entry_for_an_attempt_a_broker_retry_recorded(store: JobStore, clock, db) -> None:
    # The broker's retry records the failed attempt, then publishes; a worker lost between the two leaves the entry.
    job_id = publish(store)
    job = store.claim("celery", "dead")
    clock.advance(1)
    entry = {"n": 1, "worker": "dead", "startedAt": clock.now, "finishedAt": clock.now, "outcome": "failed"}
    assert store.record_failed_attempt(job_id, job.attempts, "ValueError: boom", attempt=entry)
    clock.advance(400)
    assert store.requeue_stale() == (1, 0)
    doc = db.jobs.find_one({"_id": job_id})
    assert doc["status"] == "queued" and doc["lastError"] == "ValueError: boom"
    assert [(a["n"], a["outcome"]) for a in doc["history"]] == [(1, "failed")]
    # An entry with the same number from before `bb-broker retry` is another attempt's: this one's loss is recorded.
    store.claim("celery", "dead")
    assert store.fail(job_id, 2, "ValueError: boom", retryable=False, attempt={**entry, "n": 2}).status == "failed"
    assert Operations(store).retry([job_id]).job_ids == [job_id]
    store.claim("celery", "dead")
    db.jobs.update_one({"_id": job_id}, {"$set": {"history": [{**entry, "n": 1}]}})  # as if the run ended at 1
    clock.advance(400)
    assert store.requeue_stale() == (1, 0)
    doc = db.jobs.find_one({"_id": job_id})
    assert [(a["n"], a["outcome"]) for a in doc["history"]] == [(1, "failed"), (1, "lost")]
    assert "worker lost" in doc["lastError"]


def test_a_task_s_own_retry_keeps_its_entry_when_the_job_was_claimed_again_first(store: JobStore, clock, db) -> None:
    # self.retry() publishes first (the job is queued again), and Celery's retry signal writes the attempt's entry
    # after: on a busy machine another worker has claimed the job, even run it, in between.
    job_id = publish(store)
    first = store.claim("celery", "w1")
    started = clock.now
    clock.advance(1)
    retry_ended = clock.now
    retried = store.publish(queue="celery", kind="app.task", task_id="t", payload={"args": [1], "kwargs": {}},
                            priority=0, run_after=None, is_retry=True, retry_of=(job_id, first.attempts))  # fmt: skip
    assert retried == job_id
    second = store.claim("celery", "w2")
    clock.advance(1)
    failed = {"n": 2, "worker": "w2", "startedAt": clock.now, "finishedAt": clock.now, "outcome": "failed"}
    assert store.record_failed_attempt(job_id, second.attempts, "ValueError: boom", attempt=failed)
    late = {"n": 1, "worker": "w1", "startedAt": started, "finishedAt": retry_ended, "outcome": "retry"}
    assert store.record_retry(job_id, first.attempts, late)
    doc = db.jobs.find_one({"_id": job_id})
    assert [(a["n"], a["outcome"]) for a in doc["history"]] == [(1, "retry"), (2, "failed")]
    # An attempt the stale sweep took over has the sweep's entry: its retry, come late, adds no second one.
    taken = publish(store, "taken")
    held = store.claim("celery", "w3")
    held_since = clock.now
    clock.advance(400)
    assert store.requeue_stale() == (2, 0)
    late = {"n": held.attempts, "worker": "w3", "startedAt": held_since, "finishedAt": clock.now, "outcome": "retry"}
    assert not store.record_retry(taken, held.attempts, late)
    assert [(a["n"], a["outcome"]) for a in db.jobs.find_one({"_id": taken})["history"]] == [(1, "lost")]


def test_release_gives_back_an_unstarted_job_without_using_an_attempt(store: JobStore, db: Database) -> None:
    job_id = publish(store)
    job = store.claim("celery", "w")
    assert store.release(job.id, job.attempts)
    doc = db.jobs.find_one({"_id": job_id})
    assert doc["status"] == "queued" and doc["attempts"] == 0 and "startedAt" not in doc and "leaseOwner" not in doc


def test_a_released_job_keeps_the_start_of_its_previous_attempt(store: JobStore, clock: FakeClock, db: Database):
    # startedAt is the start of the job's last attempt (the Jobs view shows it); a claim given back unstarted is no
    # attempt, so the job must read as it did before that claim, not as if attempt 1 had never started.
    job_id = publish(store)
    first = store.claim("celery", "w1")
    first_start = db.jobs.find_one({"_id": job_id})["startedAt"]
    clock.advance(1)
    entry = attempt_entry(1, worker="w1", started_at=first_start, finished_at=clock.now, outcome="failed", error="x")
    store.fail(first.id, first.attempts, "x", backoff=False, attempt=entry)
    clock.advance(1)
    second = store.claim("celery", "w2")
    assert second.attempts == 2
    assert store.release(second.id, second.attempts)
    doc = db.jobs.find_one({"_id": job_id})
    assert (doc["status"], doc["attempts"], doc.get("startedAt")) == ("queued", 1, first_start), doc
    assert "leaseOwner" not in doc


def test_release_owner_at_shutdown(store: JobStore, db: Database) -> None:
    publish(store, "a")
    publish(store, "b")
    store.claim("celery", "me")
    store.claim("celery", "someone-else")
    assert store.release_owner("me", "the worker shut down") == (1, 0)
    assert sorted(d["status"] for d in db.jobs.find()) == ["queued", "running"]


def test_statuses_has_all_four_keys(store: JobStore, db: Database) -> None:
    assert statuses(db) == {"queued": 0, "running": 0, "succeeded": 0, "failed": 0}
    publish(store, "a")
    publish(store, "b")
    job = store.claim("celery", "w")
    store.succeed(job.id, job.attempts)
    assert statuses(db) == {"queued": 1, "running": 0, "succeeded": 1, "failed": 0}


def test_an_oversized_payload_is_refused_with_nothing_written(store: JobStore, db: Database) -> None:
    with pytest.raises(JobTooLarge, match="does not fit in a MongoDB document"):
        store.publish(queue="celery", kind="k", task_id="big", payload={"args": ["x" * (17 * 1024 * 1024)]},
                      priority=0, run_after=None, is_retry=False)  # fmt: skip
    assert db.jobs.count_documents({}) == 0


def test_a_document_edited_into_nonsense_fails_instead_of_blocking(store: JobStore, db: Database) -> None:
    bad = publish(store, "bad", priority=5)
    good = publish(store, "good")
    db.jobs.update_one({"_id": bad}, {"$set": {"attempts": "three"}})
    # The bad head is failed on the way, and the claim takes the job behind it: a claim that came back empty would
    # leave the queue to wait for its next wake-up (seconds) with a job in it.
    assert store.claim("celery", "w").id == good
    doc = db.jobs.find_one({"_id": bad})
    assert doc["status"] == "failed" and "malformed job document" in doc["lastError"]


@pytest.mark.parametrize(
    "edit", [{"$set": {"attempts": "three"}}, {"$set": {"history": "none"}}], ids=["unclaimable", "malformed"]
)
def test_a_batch_claim_takes_other_jobs_in_place_of_the_hand_edited_ones_it_failed(
    store: JobStore, db: Database, edit: dict
) -> None:
    bad = [publish(store, f"bad{i}", priority=5) for i in range(2)]
    good = [publish(store, f"good{i}") for i in range(4)]
    db.jobs.update_many({"_id": {"$in": bad}}, edit)
    assert sorted(job.id for job in store.claim_many("celery", "w", 4)) == sorted(good)
    assert {doc["status"] for doc in db.jobs.find({"_id": {"$in": bad}})} == {"failed"}


def test_claim_sweep_and_statuses_read_through_an_index(mongo_url: str, db: Database, clock: FakeClock) -> None:
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        store = JobStore(client[db.name], clock=clock)
        store.ensure_indexes()
        for i in range(5):
            publish(store, f"t{i}")
        store.claim("celery", "w")
        store.claim_many("celery", "w", 3)
        store.requeue_stale()
        store.statuses()
    assert [c["findAndModify"] if "findAndModify" in c else next(iter(c)) for c in log.commands] == [
        "jobs", "find", "update", "update", "update", "aggregate",
    ]  # fmt: skip
    assert_each_reads_through_an_index(db, log.commands)


def test_statuses_answers_before_any_worker_created_the_indexes(db: Database) -> None:
    db.jobs.insert_one({"_id": "x", "status": "queued"})
    assert statuses(db) == {"queued": 1, "running": 0, "succeeded": 0, "failed": 0}


def test_a_dropped_collection_gets_its_indexes_back_on_the_next_claim(store: JobStore, db: Database) -> None:
    publish(store, "before")
    db.jobs.drop()  # an operator resetting the queue under running workers
    assert store.claim("celery", "w") is None
    publish(store, "after")
    assert store.claim("celery", "w").task_id == "after"
    assert store.requeue_stale() == (0, 0)
    assert "bb_claim" in db.jobs.index_information()


def test_queue_depths_answer_before_any_worker_created_the_indexes(db: Database) -> None:
    db.jobs.insert_one({"_id": "x", "status": "queued", "queue": "celery"})
    assert Operations(JobStore(db)).queue_depths(["celery", "empty"]) == {
        "celery": {"queued": 1, "running": 0, "failed": 0},
        "empty": {"queued": 0, "running": 0, "failed": 0},
    }


class ReplyLog(monitoring.CommandListener):
    def __init__(self) -> None:
        self.replies: dict[str, list[dict]] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self.replies.setdefault(event.command_name, []).append(dict(event.reply))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_a_claim_brings_back_what_the_worker_needs_not_the_jobs_history(mongo_url: str, db: Database) -> None:
    log = ReplyLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        store = JobStore(client[db.name])
        store.ensure_indexes()
        for task_id in ("one", "two", "three"):
            publish(store, task_id)
        # As a job retried after a failure carries them: its attempts' history and an earlier result.
        db.jobs.update_many({}, {"$set": {"history": [{"n": 1, "traceback": "x" * 4000}], "result": "r" * 1000}})
        single = store.claim("celery", "w")
        batch = store.claim_many("celery", "w", 2)
    assert single.payload == {"args": [1], "kwargs": {}} and single.task_id == "one" and single.attempts == 1
    assert [(job.task_id, job.attempts, job.payload) for job in batch] == [
        ("two", 1, single.payload),
        ("three", 1, single.payload),
    ]
    sent = [log.replies["findAndModify"][0]["value"], *log.replies["find"][0]["cursor"]["firstBatch"]]
    claimed = {"_id", "attempts", "taskId", "payload", "runAfter", "queue", "historyType"}  # the last two checked
    assert [set(doc) for doc in sent] == [claimed] * 3


def test_a_failure_known_only_by_task_id_adds_no_second_entry_for_an_attempt_its_retry_recorded(
    broker_url: str, db: Database
) -> None:
    # The broker's retry records the failed attempt, then publishes the retry; the worker's main process kills the
    # pool process in between (a hard time limit, a lost pool process) and Celery's task_failure reaches it without
    # the task's request (Celery 5.5 sends it so): only the task id is known, and the attempt has its entry already.
    from celery import signals
    from celery.exceptions import TimeLimitExceeded

    from bb_broker import app_stores, connection
    from tests.support.workers import producer

    app = producer(broker_url)
    store = app_stores.store_for(app)
    store.ensure_indexes()
    publish(store, "limited")
    held = store.claim("celery", connection.lease_owner())
    error = "RuntimeError: the first attempt fails"
    recorded = attempt_entry(
        held.attempts, worker="w0", started_at=store.now(), finished_at=store.now(), outcome="failed", error=error
    )
    assert store.record_failed_attempt(held.id, held.attempts, error, attempt=recorded)

    @app.task(name="tests.limited", shared=False)
    def limited() -> None: ...

    task = app.tasks["tests.limited"]
    assert task.request.id is None  # the main process runs no task: the handler knows the task id only
    signals.task_failure.send(sender=task, task_id="limited", exception=TimeLimitExceeded(8))
    doc = db.jobs.find_one({"_id": held.id})
    assert (doc["status"], doc["attempts"]) == ("queued", 1)
    assert [(a["n"], a["error"]) for a in doc["history"]] == [(1, error)], doc["history"]


def test_a_claim_reads_the_task_id_a_job_first_ran_under_when_it_is_one(store: JobStore, db: Database) -> None:
    for value, read in (("first-id", "first-id"), (5, None), ("x" * 256, None), ({"$ne": 1}, None)):
        job_id = publish(store, f"t-{read}-{len(str(value))}")
        db.jobs.update_one({"_id": job_id}, {"$set": {"renamedFrom": value}})  # a retry's, or a hand edit
        claimed = store.claim("celery", "w")
        assert claimed is not None and claimed.id == job_id and claimed.renamed_from == read
    assert publish(store, "t-none") and store.claim("celery", "w").renamed_from is None
