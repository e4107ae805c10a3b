"""Queue limits in the store against a real server: a concurrency limit's slots, held by the claim itself, given back
by every write that ends an attempt (the stale sweep's too), and set, changed and refused through the controls."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from bb_broker.jobs.document import attempt_entry
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.queues import KnownControls, LimitError, LimitReached, QueueControls, QueueLimits, Rate
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.store import CommandLog, assert_each_reads_through_an_index


def publish(store: JobStore, task_id: str, queue: str = "limited") -> str:
    return store.publish(queue=queue, kind="app.task", task_id=task_id, payload={"args": [], "kwargs": {}},
                         priority=0, run_after=None, is_retry=False)  # fmt: skip


def running(db: Database, queue: str = "limited") -> list[dict]:
    return list(db.jobs.find({"queue": queue, "status": "running"}))


TWO = QueueLimits(concurrency=2)


def test_a_concurrency_limit_lets_n_jobs_run_and_each_holds_its_own_slot(store: JobStore, db: Database) -> None:
    for n in range(4):
        publish(store, f"t{n}")
    first = store.claim("limited", "w1", TWO)
    second = store.claim("limited", "w2", TWO)
    assert first is not None and second is not None
    with pytest.raises(LimitReached, match="concurrency limit 2 reached"):
        store.claim("limited", "w3", TWO)
    held = running(db)
    assert sorted(doc["limitSlot"] for doc in held) == [0, 1]
    assert all(doc["claimLimits"] == {"concurrency": 2} for doc in held)
    assert db.jobs.count_documents({"status": "queued", "limitSlot": {"$exists": True}}) == 0

    assert store.succeed(first.id, first.attempts)
    done = db.jobs.find_one({"_id": first.id})
    assert "limitSlot" not in done and done["claimLimits"] == {"concurrency": 2}  # the record stays, the slot goes
    third = store.claim("limited", "w3", TWO)
    assert third is not None and len(running(db)) == 2


def test_a_queue_without_a_limit_and_other_queues_are_not_counted(store: JobStore, db: Database) -> None:
    for n in range(3):
        publish(store, f"free{n}", queue="free")
        publish(store, f"lim{n}")
    assert [store.claim("free", "w") is not None for _ in range(3)] == [True, True, True]
    assert all("limitSlot" not in doc for doc in running(db, "free"))
    assert store.claim("limited", "w", QueueLimits(concurrency=1)) is not None
    with pytest.raises(LimitReached):
        store.claim("limited", "w", QueueLimits(concurrency=1))


def test_every_write_that_ends_an_attempt_gives_its_slot_back(store: JobStore, db: Database, clock) -> None:
    one = QueueLimits(concurrency=1)
    for n in range(6):
        publish(store, f"t{n}")

    def cycle(end) -> None:
        job = store.claim("limited", "w", one)
        assert job is not None
        with pytest.raises(LimitReached):
            store.claim("limited", "w", one)
        end(job)
        assert db.jobs.count_documents({"limitSlot": {"$exists": True}}) == 0

    cycle(lambda job: store.succeed(job.id, job.attempts))
    cycle(lambda job: store.fail(job.id, job.attempts, "boom", retryable=False))
    cycle(lambda job: store.fail(job.id, job.attempts, "again", backoff=False))  # back to the queue
    cycle(lambda job: store.release(job.id, job.attempts))

    def retried(job) -> None:  # a Celery retry's reschedule (the broker's, or self.retry())
        entry = attempt_entry(job.attempts, worker="w", started_at=None, finished_at=clock(), outcome="retry")
        store.record_failed_attempt(job.id, job.attempts, "retry", attempt=entry)
        store.publish(queue="limited", kind="app.task", task_id=job.task_id, payload={}, priority=0,
                      run_after=None, is_retry=True, retry_of=(job.id, job.attempts))  # fmt: skip

    cycle(retried)

    def lost(job) -> None:  # the worker died: the stale sweep settles its job
        clock.advance(31)
        assert sum(store.requeue_stale()) == 1

    cycle(lost)
    cycle(lambda job: store.release_owner("w", "worker stopped"))


def test_the_stale_sweep_frees_the_slot_of_a_job_with_no_attempt_left(store: JobStore, db: Database, clock) -> None:
    store.policy = Policy(stale_after=30, max_attempts=1)
    publish(store, "once")
    publish(store, "next")
    assert store.claim("limited", "dead", QueueLimits(concurrency=1)) is not None
    clock.advance(31)
    assert store.requeue_stale() == (0, 1)
    assert store.claim("limited", "alive", QueueLimits(concurrency=1)) is not None


def test_an_operators_requeue_of_an_expired_lease_frees_its_slot(store: JobStore, db: Database, clock) -> None:
    publish(store, "t0")
    publish(store, "t1")
    job = store.claim("limited", "dead", QueueLimits(concurrency=1))
    clock.advance(31)
    Operations(store).act("requeue", job.id, by="tester")
    assert db.jobs.count_documents({"limitSlot": {"$exists": True}}) == 0


def test_a_lowered_limit_drains_the_slots_above_it_and_a_raised_one_takes_effect_at_once(
    store: JobStore, db: Database
) -> None:
    for n in range(8):
        publish(store, f"t{n}")
    jobs = [store.claim("limited", "w", QueueLimits(concurrency=4)) for _ in range(4)]
    slot_of = {doc["_id"]: doc["limitSlot"] for doc in running(db)}
    lowered = QueueLimits(concurrency=2)
    with pytest.raises(LimitReached):
        store.claim("limited", "w", lowered)
    for job in jobs:
        if slot_of[job.id] >= 2:
            store.succeed(job.id, job.attempts)
    with pytest.raises(LimitReached):  # slots 2 and 3 are free, but no longer the queue's
        store.claim("limited", "w", lowered)
    assert len(running(db)) == 2
    raised = QueueLimits(concurrency=5)
    assert [store.claim("limited", "w", raised) is not None for _ in range(3)] == [True, True, True]
    with pytest.raises(LimitReached):
        store.claim("limited", "w", raised)


def test_a_batch_claim_of_a_limited_queue_stops_at_the_limit_with_what_it_took(store: JobStore, db: Database) -> None:
    for n in range(6):
        publish(store, f"t{n}")
    with pytest.raises(LimitReached) as reached:
        store.claim_many("limited", "w", 5, QueueLimits(concurrency=3))
    assert len(reached.value.claimed) == 3 and len(running(db)) == 3
    assert store.claim_many("other", "w", 5, QueueLimits(concurrency=3)) == []  # an empty queue is not a limit


def test_a_batch_claim_of_a_queue_below_its_limit_is_a_read_and_one_update_many_with_a_slot_each(
    store: JobStore, db: Database, mongo_url: str
) -> None:
    for n in range(6):
        publish(store, f"t{n}")
    # A job whose id starts with `$` (any string is an id a producer may give) at the head, and one of `$_id`.
    for new_id in ("$t.0", "$_id"):
        doc = db.jobs.find_one_and_delete({"queue": "limited", "_id": {"$not": {"$regex": "^[$]"}}}, sort=[("_id", 1)])
        db.jobs.insert_one({**doc, "_id": new_id})
    log = CommandLog()
    client: MongoClient = MongoClient(mongo_url, tz_aware=True, event_listeners=[log])
    watched = JobStore(client[db.name], Policy(), clock=store.now)
    owner = "$w.1"  # a pipeline reads a string starting with `$` as a field path unless it is written as a literal
    jobs = watched.claim_many("limited", owner, 4, QueueLimits(concurrency=100))
    client.close()
    assert len(jobs) == 4
    assert [next(iter(command)) for command in log.commands] == ["find", "update"]  # as without a limit
    # One statement for the four jobs, as without a limit: the server counts one operation, not four.
    assert len(log.commands[1]["updates"]) == 1 and log.commands[1]["updates"][0]["multi"] is True
    held = running(db)
    assert len(held) == 4 and len({doc["limitSlot"] for doc in held}) == 4
    assert all(0 <= doc["limitSlot"] < 100 and doc["claimLimits"] == {"concurrency": 100} for doc in held)
    assert all(doc["leaseOwner"] == owner and doc["attempts"] == 1 and doc["status"] == "running" for doc in held)
    assert {"$t.0", "$_id"} <= {doc["_id"] for doc in held}  # each in a slot of its own, as its id named it
    assert all(doc["startedAt"] == store.now() for doc in held)
    assert_each_reads_through_an_index(db, log.commands)


def test_a_batch_claim_whose_guessed_slots_are_taken_takes_the_free_ones_and_stops_at_the_limit(
    store: JobStore, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    for n in range(8):
        publish(store, f"t{n}")
    four = QueueLimits(concurrency=4)
    assert len(store.claim_many("limited", "w1", 2, four)) == 2  # slots, say, 0 and 1 (random)
    taken = sorted(doc["limitSlot"] for doc in running(db))
    # The next batch guesses every slot, the two taken among them: only two of its jobs can be taken.
    monkeypatch.setattr(random, "sample", lambda population, k: list(population)[:k])
    with pytest.raises(LimitReached) as reached:
        store.claim_many("limited", "w2", 4, four)
    assert len(reached.value.claimed) == 2
    held = running(db)
    assert len(held) == 4 and sorted(doc["limitSlot"] for doc in held) == [0, 1, 2, 3], taken
    assert db.jobs.count_documents({"status": "queued", "limitSlot": {"$exists": True}}) == 0
    with pytest.raises(LimitReached) as again:
        store.claim_many("limited", "w3", 4, four)
    assert again.value.claimed == [] and len(running(db)) == 4


@pytest.mark.parametrize("edit", ["attempts", "_id"])
def test_a_hand_edited_job_at_a_limited_queues_head_fails_alone_and_the_batch_claims_keep_the_limit(
    store: JobStore, db: Database, edit: str
) -> None:
    publish(store, "t0")
    bad: Any = publish(store, "bad")  # second in the queue: the batch's read finds it behind a good job
    if edit == "attempts":
        db.jobs.update_one({"_id": bad}, {"$set": {"attempts": "two"}})
    else:  # an _id the batch could not even hash (it ended the worker); first, as a document sorts after every string
        doc = db.jobs.find_one_and_delete({"_id": bad})
        bad = {"legacy": bad}
        db.jobs.insert_one({**doc, "_id": bad, "priority": 1})
    for n in range(1, 4):
        publish(store, f"t{n}")
    three = QueueLimits(concurrency=3)
    claimed: list[str] = []
    with pytest.raises(LimitReached):
        for _ in range(5):
            claimed += [job.task_id for job in store.claim_many("limited", "w", 4, three)]
    failed = db.jobs.find_one({"_id": bad})
    assert failed["status"] == "failed" and edit in failed.get("lastError", ""), failed
    held = running(db)
    assert len(held) == 3 and sorted(doc["limitSlot"] for doc in held) == [0, 1, 2]


@pytest.mark.parametrize(("limit", "batch"), [(3, 1), (5, 3)], ids=["claims of one", "batch claims"])
def test_many_claimers_at_once_never_exceed_the_limit(
    mongo_url: str, db: Database, clock, limit: int, batch: int
) -> None:
    import threading

    store = JobStore(db, Policy(), clock=clock)
    store.ensure_indexes()
    for n in range(40):
        publish(store, f"t{n}")
    limits = QueueLimits(concurrency=limit)
    won: list[str] = []
    lock = threading.Lock()

    def claimer(name: str) -> None:
        own = JobStore(MongoClient(mongo_url, tz_aware=True)[db.name], Policy(), clock=clock)
        for _ in range(10):
            try:
                jobs = own.claim_many("limited", name, batch, limits)
            except LimitReached as exc:
                jobs = exc.claimed
            with lock:
                won.extend(job.id for job in jobs)

    threads = [threading.Thread(target=claimer, args=(f"w{n}",)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = running(db)
    assert len(won) == limit == len(set(won)) and len(held) == limit
    assert sorted(doc["limitSlot"] for doc in held) == list(range(limit))


def test_the_read_of_the_slots_taken_goes_through_its_index(store: JobStore, db: Database, mongo_url: str) -> None:
    for n in range(3):
        publish(store, f"t{n}")
    log = CommandLog()
    client: MongoClient = MongoClient(mongo_url, tz_aware=True, event_listeners=[log])
    watched = JobStore(client[db.name], Policy(), clock=store.now)
    one = QueueLimits(concurrency=1)
    watched.claim("limited", "w", one)
    log.commands.clear()
    with pytest.raises(LimitReached):
        watched.claim("limited", "w", one)
    reads = [command for command in log.commands if "find" in command]
    assert len(reads) == 1
    flags = [command for command in log.commands if "updates" in command]  # the holders flagged
    assert len(flags) == 1 and flags[0]["updates"][0]["multi"]
    assert_each_reads_through_an_index(db, reads + flags)
    client.close()


@pytest.mark.change_streams
def test_only_a_limit_reached_flags_the_slot_holders_and_only_their_ends_wake_anyone(
    store: JobStore, db: Database
) -> None:
    from bb_broker.transport.wakeups import FREED_FIELDS

    for n in range(5):
        publish(store, f"t{n}")
    two = QueueLimits(concurrency=2)
    freed = [{"updateDescription.removedFields": name} for name in FREED_FIELDS]
    with db.jobs.watch([{"$match": {"$or": freed}}]) as stream:
        alone = store.claim("limited", "w", two)
        assert db.jobs.find_one({"_id": alone.id}).get("slotWaiters") is None
        assert store.succeed(alone.id, alone.attempts)  # within the limit: its end is news to nobody
        first, second = store.claim("limited", "w", two), store.claim("limited", "w", two)
        with pytest.raises(LimitReached):
            store.claim("limited", "w", two)
        assert {doc["_id"] for doc in db.jobs.find({"slotWaiters": True})} == {first.id, second.id}
        assert store.succeed(first.id, first.attempts)
        ended = []
        while not ended:
            change = stream.try_next()
            if change is not None:
                ended.append(change["documentKey"]["_id"])
    assert ended == [first.id]  # the change stream is in order: the first job's end would have come before
    assert "slotWaiters" not in db.jobs.find_one({"_id": first.id})


class EndsAJobBeforeItsHoldersAreFlagged(monitoring.CommandListener):
    """Succeeds `job` from another client the moment a claim sends the flag of the slot holders: a slot freed after
    the claim found none free, before anything would report its end."""

    def __init__(self, other: JobStore) -> None:
        self.other = other
        self.job: Any = None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        job, updates = self.job, event.command.get("updates") or []
        if job is not None and updates and updates[0].get("hint") == "bb_limit_slot":
            self.job = None
            assert self.other.succeed(job.id, job.attempts)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_a_slot_freed_before_its_holders_are_flagged_is_taken_not_waited_for(
    store: JobStore, db: Database, mongo_url: str
) -> None:
    for n in range(3):
        publish(store, f"t{n}")
    one = QueueLimits(concurrency=1)
    ender = EndsAJobBeforeItsHoldersAreFlagged(store)
    client: MongoClient = MongoClient(mongo_url, tz_aware=True, event_listeners=[ender])
    watched = JobStore(client[db.name], Policy(), clock=store.now)
    ender.job = watched.claim("limited", "w1", one)
    taken = watched.claim("limited", "w2", one)  # refused, then the slot frees before the flag
    assert taken is not None and ender.job is None
    assert [doc["_id"] for doc in running(db)] == [taken.id]
    client.close()


def test_a_claim_within_the_limit_costs_one_round_trip(store: JobStore, db: Database, mongo_url: str) -> None:
    publish(store, "t0")
    log = CommandLog()
    client: MongoClient = MongoClient(mongo_url, tz_aware=True, event_listeners=[log])
    watched = JobStore(client[db.name], Policy(), clock=store.now)
    assert watched.claim("limited", "w", QueueLimits(concurrency=2)) is not None
    assert [next(iter(command)) for command in log.commands] == ["findAndModify"]
    client.close()


# --- the controls ----------------------------------------------------------------------------------------------------


def test_limits_are_set_changed_and_cleared_and_workers_read_them_with_the_pauses(
    store: JobStore, db: Database
) -> None:
    controls = QueueControls(db)
    operations = Operations(store, controls)
    known = KnownControls(controls, max_age=0.0)  # read again at every look
    assert not known.limits("limited")
    operations.set_limits("limited", concurrency=3, by="tester")
    assert known.limits("limited") == QueueLimits(concurrency=3)
    assert "limited" not in known  # limited, not paused
    operations.pause("limited", by="tester")
    assert "limited" in known and known.limits("limited").concurrency == 3
    operations.set_limits("limited", concurrency=1, by="tester")
    assert known.limits("limited").concurrency == 1
    row = operations.queues()["limited"]
    assert row["concurrency"] == 1 and row["limitedBy"] == "tester" and row["paused"]
    operations.set_limits("limited", clear=True, by="tester")
    assert not known.limits("limited") and "concurrency" not in operations.queues()["limited"]


@pytest.mark.parametrize("bad", [0, -1, "2.5", "two", "", " ", "1e3", "²", 10_001, True])
def test_a_limit_that_cannot_be_is_refused_and_nothing_changes(store: JobStore, db: Database, bad) -> None:
    operations = Operations(store)
    operations.set_limits("limited", concurrency=4, by="tester")
    before = db.bb_queues.find_one({"_id": "limited"})
    with pytest.raises(LimitError, match="a concurrency limit is a whole number from 1 to 10000"):
        operations.set_limits("limited", concurrency=bad, by="mallory")
    assert db.bb_queues.find_one({"_id": "limited"}) == before


def test_a_control_document_edited_by_hand_limits_nothing(store: JobStore, db: Database) -> None:
    for value in ("2", 0, -3, 2.5, [2], None, True):
        db.bb_queues.replace_one({"_id": "limited"}, {"concurrency": value}, upsert=True)
        assert not KnownControls(QueueControls(db), max_age=0.0).limits("limited")


def test_limits_written_as_64_bit_integers_limit_as_they_say(store: JobStore, db: Database) -> None:
    # NumberLong(2) in a shell, or another driver's 64-bit integer: every worker read it as no limit at all.
    from bson.int64 import Int64

    db.bb_queues.replace_one(
        {"_id": "limited"}, {"concurrency": Int64(2), "rateStarts": Int64(5), "ratePeriod": Int64(60)}, upsert=True
    )
    limits = KnownControls(QueueControls(db), max_age=0.0).limits("limited")
    assert (limits.concurrency, limits.rate) == (2, Rate(5, 60.0))
    for n in range(3):
        publish(store, f"t{n}")
    two = QueueLimits(concurrency=limits.concurrency)
    assert store.claim("limited", "w", two) is not None and store.claim("limited", "w", two) is not None
    with pytest.raises(LimitReached, match="concurrency limit 2"):
        store.claim("limited", "w", two)


# --- serial keys -----------------------------------------------------------------------------------------------------


def publish_keyed(store: JobStore, task_id: str, key: str | None, queue: str = "keyed") -> str:
    return store.publish(queue=queue, kind="app.task", task_id=task_id, payload={"args": [], "kwargs": {}},
                         priority=0, run_after=None, is_retry=False, serial_key=key)  # fmt: skip


def test_one_job_per_serial_key_runs_and_the_others_of_the_key_wait_in_order(store: JobStore, db: Database) -> None:
    for n in range(3):
        publish_keyed(store, f"a{n}", "account-a")
    publish_keyed(store, "b0", "account-b")
    publish_keyed(store, "free", None)
    busy: set[str] = set()
    taken = [store.claim("keyed", "w", busy_keys=busy) for _ in range(4)]
    assert [job.task_id if job else None for job in taken] == ["a0", "b0", "free", None]
    assert busy == {"account-a"}  # the key found busy, skipped by the next claims
    holder = db.jobs.find_one({"taskId": "a0"})
    assert holder["serialKey"] == "account-a" and holder["serialWaiters"] is True  # its end wakes the waiters
    assert db.jobs.find_one({"taskId": "free"}).get("serialWaiters") is None

    assert store.succeed(taken[0].id, taken[0].attempts)
    assert "serialWaiters" not in db.jobs.find_one({"taskId": "a0"})
    order = []
    for _ in range(2):
        job = store.claim("keyed", "w")  # a fresh claimer: tries every key
        order.append(job.task_id)
        assert store.claim("keyed", "other") is None  # the key is busy again
        store.succeed(job.id, job.attempts)
    assert order == ["a1", "a2"]


def test_every_write_that_ends_a_keyed_attempt_frees_its_key(store: JobStore, db: Database, clock) -> None:
    for n in range(5):
        publish_keyed(store, f"k{n}", "key")

    def cycle(end) -> None:
        job = store.claim("keyed", "w")
        assert job is not None and store.claim("keyed", "w") is None
        end(job)
        assert db.jobs.count_documents({"serialWaiters": {"$exists": True}}) == 0

    cycle(lambda job: store.succeed(job.id, job.attempts))
    cycle(lambda job: store.fail(job.id, job.attempts, "again", backoff=False))
    cycle(lambda job: store.release(job.id, job.attempts))

    def lost(job) -> None:
        clock.advance(31)
        assert sum(store.requeue_stale()) == 1

    cycle(lost)
    assert db.jobs.find_one({"taskId": "k0"})["status"] == "succeeded"


def test_a_batch_claim_takes_keyed_jobs_one_by_one(store: JobStore, db: Database) -> None:
    for n in range(3):
        publish_keyed(store, f"a{n}", "a")
        publish_keyed(store, f"free{n}", None)
    jobs = store.claim_many("keyed", "w", 6)
    assert sorted(job.task_id for job in jobs) == ["a0", "free0", "free1", "free2"]
    assert db.jobs.count_documents({"serialKey": "a", "status": "running"}) == 1


def test_serial_keys_and_a_concurrency_limit_together(store: JobStore, db: Database) -> None:
    for n in range(2):
        publish_keyed(store, f"a{n}", "a")
    publish_keyed(store, "b0", "b")
    publish_keyed(store, "c0", "c")
    limits = QueueLimits(concurrency=2)
    busy: set[str] = set()
    first = store.claim("keyed", "w", limits, busy)
    second = store.claim("keyed", "w", limits, busy)  # a1 is skipped (its key is busy), b0 takes the second slot
    assert (first.task_id, second.task_id) == ("a0", "b0") and busy == {"a"}
    with pytest.raises(LimitReached):
        store.claim("keyed", "w", limits, busy)


# --- rates -----------------------------------------------------------------------------------------------------------


def test_a_rate_spaces_starts_evenly_and_says_when_the_next_may_come(store: JobStore, db: Database, clock) -> None:
    for n in range(8):
        publish(store, f"t{n}")
    limits = QueueLimits(rate=Rate(3, 60.0))  # a start every 20 s
    assert store.claim("limited", "w1", limits) is not None
    with pytest.raises(LimitReached, match="rate limit 3/m reached") as reached:
        store.claim("limited", "w2", limits)
    assert reached.value.retry_in == 20.0
    clock.advance(5)
    with pytest.raises(LimitReached) as reached:
        store.claim("limited", "w2", limits)
    assert reached.value.retry_in == 15.0
    clock.advance(15)
    assert store.claim("limited", "w2", limits) is not None
    assert db.jobs.count_documents({"status": "running"}) == 2
    assert {doc["claimLimits"]["rate"] for doc in running(db)} == {"3/m"}
    assert db.bb_rates.count_documents({}) == 1


def test_no_period_anywhere_holds_more_starts_than_the_rate(store: JobStore, db: Database, clock) -> None:
    """Fixed windows let 2N starts through across a window's edge; evenly spaced starts never do."""
    for n in range(40):
        publish(store, f"t{n}")
    limits = QueueLimits(rate=Rate(4, 1.0))
    clock.advance(0.5)  # half way into a second of the clock
    starts = []
    for _ in range(60):  # 15 seconds, five workers claiming every quarter of a second
        for worker in range(5):
            try:
                if store.claim("limited", f"w{worker}", limits) is not None:
                    starts.append(clock.now)
            except LimitReached:
                pass
        clock.advance(0.25)
    assert len(starts) >= 40 - 1  # the rate lets through all it allows
    for first in range(len(starts) - 4):
        assert starts[first + 4] - starts[first] >= timedelta(seconds=1), starts[first : first + 5]


def test_a_rate_changed_starts_a_counter_of_its_own(store: JobStore, db: Database, clock) -> None:
    for n in range(4):
        publish(store, f"t{n}")
    assert store.claim("limited", "w", QueueLimits(rate=Rate(1, 3600.0))) is not None
    assert store.claim("limited", "w", QueueLimits(rate=Rate(10, 1.0))) is not None  # the faster rate at once
    assert [doc["_id"] for doc in db.bb_rates.find()] == [{"queue": "limited", "starts": 10, "period": 1.0}]


def test_a_claim_that_starts_nothing_spends_no_start(store: JobStore, db: Database) -> None:
    limits = QueueLimits(rate=Rate(1, 3600.0))
    assert store.claim("limited", "w", limits) is None  # an empty queue
    publish(store, "t0")
    assert store.claim("limited", "w", limits) is not None
    publish(store, "t1")
    with pytest.raises(LimitReached):
        store.claim("limited", "w", limits)


def test_a_rate_and_a_concurrency_limit_together(store: JobStore, db: Database, clock) -> None:
    for n in range(4):
        publish(store, f"t{n}")
    limits = QueueLimits(concurrency=1, rate=Rate(5, 3600.0))
    job = store.claim("limited", "w", limits)
    assert running(db)[0]["claimLimits"] == {"rate": "5/h", "concurrency": 1}
    clock.advance(720)  # the rate's spacing: the next start is the concurrency limit's to refuse
    before = db.bb_rates.find_one()["next"]
    with pytest.raises(LimitReached, match="concurrency limit 1"):
        store.claim("limited", "w", limits)
    assert db.bb_rates.find_one()["next"] == before  # the start the concurrency limit refused was given back
    store.succeed(job.id, job.attempts)
    assert store.claim("limited", "w", limits) is not None


@pytest.mark.parametrize("edited", ["soon", 2**62, 4.0e18, True, None])
def test_a_rate_counter_edited_by_hand_is_replaced_and_never_stops_the_queue(
    store: JobStore, db: Database, clock, edited, caplog
) -> None:
    publish(store, "t0")
    key = {"queue": "limited", "starts": 1, "period": 60.0}
    db.bb_rates.insert_one({"_id": key, "next": edited})
    with caplog.at_level("WARNING", logger="bb_broker.jobs.rates"):
        assert store.claim("limited", "w", QueueLimits(rate=Rate(1, 60.0))) is not None
    assert "rate counter's next start" in caplog.text
    assert isinstance(db.bb_rates.find_one({"_id": key})["next"], int)
    publish(store, "t1")
    with pytest.raises(LimitReached) as reached:  # and the rate holds again
        store.claim("limited", "w", QueueLimits(rate=Rate(1, 60.0)))
    assert reached.value.retry_in == 60.0


def test_rates_are_set_changed_cleared_and_refused_through_the_controls(store: JobStore, db: Database) -> None:
    operations = Operations(store)
    known = KnownControls(QueueControls(db), max_age=0.0)
    assert operations.set_limits("limited", rate="10/s", by="tester") == QueueLimits(rate=Rate(10, 1.0))
    assert known.limits("limited").rate == Rate(10, 1.0)
    operations.set_limits("limited", concurrency="2", by="tester")  # the rate stays
    assert known.limits("limited") == QueueLimits(concurrency=2, rate=Rate(10, 1.0))
    assert operations.queues()["limited"]["rate"] == "10/s"
    operations.set_limits("limited", rate="none", by="tester")
    assert known.limits("limited") == QueueLimits(concurrency=2)
    before = db.bb_queues.find_one({"_id": "limited"})
    for bad in ("10", "10/week", "0/s", "-1/m", "x/m", "1.5/s", "/s", "10/"):
        with pytest.raises(LimitError):
            operations.set_limits("limited", rate=bad, by="mallory")
    with pytest.raises(LimitError, match="clear removes every limit"):
        operations.set_limits("limited", rate="1/s", clear=True, by="mallory")
    with pytest.raises(LimitError, match="give a concurrency limit, a rate, fair, or clear"):
        operations.set_limits("limited", by="mallory")
    assert db.bb_queues.find_one({"_id": "limited"}) == before


# --- wake-ups ----------------------------------------------------------------------------------------------------


@pytest.mark.change_streams
def test_a_held_back_queue_is_woken_by_a_freed_slot_or_key_and_by_nothing_else(
    mongo_url: str, db: Database, store: JobStore
) -> None:
    from datetime import UTC, datetime

    from bb_broker.transport.wakeups import Wakeups
    from tests.support.workers import wait_for

    with MongoClient(mongo_url, tz_aware=True) as client:
        wakeups = Wakeups(client[db.name], jobs="jobs", messages="bb_messages", clock=lambda: datetime.now(UTC),
                          safety_poll_interval=3600)  # fmt: skip
        wakeups.consume_only({"limited", "keyed", "marker"})
        wait_for(lambda: wakeups.available, message="the change stream is live")

        def drain(queue: str) -> bool:
            """Take every look `queue` is owed; whether there was one."""
            looked = False
            while (look := wakeups.look(queue, job_queue=True)) is not None:
                look.took("jobs", 0, all_there_was=True)
                look.took("messages", 0, all_there_was=True)
                wakeups.looked(queue, look)
                looked = True
            return looked

        for queue in ("limited", "keyed", "marker"):
            drain(queue)  # the first looks: everything once
        publish(store, "slot")
        publish(store, "slot-waiter")
        publish_keyed(store, "k0", "key")
        publish_keyed(store, "k1", "key")
        publish(store, "m0", queue="marker")  # the stream is in order: once this is news, so is everything before
        wait_for(lambda: drain("marker"), message="the inserts are news")
        assert drain("limited") and drain("keyed")

        slot = store.claim("limited", "w", QueueLimits(concurrency=1))
        with pytest.raises(LimitReached):  # the limit reached: only now does the slot's end wake anyone
            store.claim("limited", "w", QueueLimits(concurrency=1))
        busy: set[str] = set()
        key = store.claim("keyed", "w", busy_keys=busy)
        assert store.claim("keyed", "w", busy_keys=busy) is None and busy == {"key"}
        wakeups.wake_when_freed("limited")
        freed = wakeups.freed
        store.heartbeat([slot.id, key.id], "w")  # a running job's lease: news to nobody
        store.succeed(slot.id, slot.attempts)  # frees the slot
        wait_for(lambda: wakeups.freed > freed, message="the freed slot is reported")
        assert drain("limited") and not drain("keyed")  # only the queue held back on a slot looks again
        wakeups.wake_when_freed("keyed")
        freed = wakeups.freed
        store.succeed(key.id, key.attempts)  # frees the key others wait for
        wait_for(lambda: wakeups.freed > freed, message="the freed key is reported")
        assert drain("keyed")
        wakeups.stop()


@pytest.mark.change_streams
def test_a_rates_next_start_is_a_look_that_claims_until_the_rate_stops_it(mongo_url: str, db: Database) -> None:
    """A due time tells of one job; a rate's next start tells of every job held back by it. Were it one job, a claim
    of it that the rate let through would spend the news, and the jobs behind it would wait for the safety poll."""
    import math
    from datetime import UTC, datetime

    from bb_broker.transport.wakeups import Wakeups
    from tests.support.workers import wait_for

    with MongoClient(mongo_url, tz_aware=True) as client:
        wakeups = Wakeups(client[db.name], jobs="jobs", messages="bb_messages", clock=lambda: datetime.now(UTC),
                          safety_poll_interval=3600)  # fmt: skip
        wakeups.consume_only({"limited"})
        wait_for(lambda: wakeups.available, message="the change stream is live")
        look = wakeups.look("limited", job_queue=True)  # the first look: everything once
        assert look is not None
        look.took("jobs", 0, all_there_was=True)
        look.took("messages", 0, all_there_was=True)
        wakeups.looked("limited", look)
        assert wakeups.look("limited", job_queue=True) is None
        wakeups.wake_in("limited", 0.0)
        look = wakeups.look("limited", job_queue=True)
        assert look is not None and look.jobs == math.inf
        look.took("jobs", 1, all_there_was=False)  # a claim of one job, which the rate let through
        wakeups.looked("limited", look)
        look = wakeups.look("limited", job_queue=True)  # the next look claims again, until the rate says when
        assert look is not None and look.jobs == math.inf
        look.took("jobs", 0, all_there_was=True)  # held back by the rate: the news is spent, the next wake-up set
        wakeups.looked("limited", look)
        assert wakeups.look("limited", job_queue=True) is None
        wakeups.stop()


@pytest.mark.parametrize(
    "stray",
    [
        {"status": "failed", "limitSlot": 0, "lastError": "marked failed by hand"},  # an operator's edit in a shell
        {
            "status": "queued",
            "limitSlot": 0.0,
            "priority": -1,
        },  # written by hand, a double where the claim writes an int
    ],
    ids=["failed-by-hand", "queued-with-a-slot"],
)
def test_a_slot_left_on_a_job_that_is_not_running_is_given_back_and_the_queue_runs(
    store: JobStore, db: Database, stray: dict[str, Any]
) -> None:
    # The index refused slot 0 for good: no running job held it, so nothing ever gave it back.
    db.jobs.update_one({"_id": publish(store, "stray")}, {"$set": stray})
    for n in range(2):
        publish(store, f"t{n}")
    one = QueueLimits(concurrency=1)
    first = store.claim("limited", "w1", one)
    assert first is not None and first.task_id == "t0"
    assert "limitSlot" not in db.jobs.find_one({"taskId": "stray"})  # given back
    with pytest.raises(LimitReached):
        store.claim("limited", "w2", one)  # the limit still holds
    assert store.succeed(first.id, first.attempts)
    second = store.claim("limited", "w2", one)
    assert second is not None and second.task_id == "t1"
