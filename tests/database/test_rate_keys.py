"""A queue's rate per key against a real server: each rate key's starts spaced by the rate, the keys apart from each
other (the jobs without a key as one more), a held key skipped without a write until its next start, its counters
expiring; set and refused through the controls; the options that give a job its key, and the bad ones refused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker import UniqueOptionError
from bb_broker.jobs.payloads import MalformedTaskMessage
from bb_broker.jobs.queues import KnownControls, LimitError, LimitReached, QueueControls, QueueLimits, Rate
from bb_broker.jobs.rate_keys import MAX_RATE_KEY_LENGTH, RATE_KEY_HEADER, RateHolds
from bb_broker.jobs.rates import RateCounters
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.store import CommandLog, FakeClock

PER_KEY = QueueLimits(rate=Rate(1, 60.0, per_key=True))  # a start a minute for each key


@pytest.fixture
def clock() -> FakeClock:
    """The store's fake clock, a day ahead of the real one. A rate key's counter expires at its next start through
    a TTL index, which the server applies by its own clock: at FakeClock's 2026-01-01 every counter had expired, and
    a TTL pass in the middle of a test took counters away (a key then started more often than its rate)."""
    clock = FakeClock()
    clock.now = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)
    return clock


def publish(store: JobStore, task_id: str, rate_key: str | None) -> str:
    return store.publish(queue="limited", kind="app.task", task_id=task_id, payload={"args": [], "kwargs": {}},
                         priority=0, run_after=None, is_retry=False, rate_key=rate_key)  # fmt: skip


def claimed_task(store: JobStore, holds: RateHolds, limits: QueueLimits = PER_KEY) -> str | None:
    job = store.claim("limited", "w", limits, rate_holds=holds)
    return None if job is None else store.coll.find_one({"_id": job.id})["taskId"]


def test_each_key_starts_at_the_rate_and_a_held_key_holds_back_only_its_own_jobs(
    store: JobStore, db: Database, clock: FakeClock
) -> None:
    for task_id, key in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("none1", None), ("b2", "b"), ("none2", None)):
        publish(store, task_id, key)
    holds = RateHolds(PER_KEY.rate)  # type: ignore[arg-type]
    assert claimed_task(store, holds) == "a1"
    assert claimed_task(store, holds) == "b1"  # a2 waits for a's next start; the jobs behind it do not
    assert set(holds.until) == {"a", "b"}  # a refused, b by its own start
    assert claimed_task(store, holds) == "none1"  # the jobs without a key are one more key
    with pytest.raises(LimitReached, match="rate limit 1/m per key reached") as reached:
        claimed_task(store, holds)
    assert reached.value.retry_in == 60.0  # every key is held: until the first of them may start again
    assert set(holds.until) == {"a", "b", None}
    clock.advance(30)
    with pytest.raises(LimitReached) as reached:
        claimed_task(store, holds)
    assert reached.value.retry_in == 30.0
    clock.advance(30)
    assert [claimed_task(store, holds) for _ in range(3)] == ["a2", "b2", "none2"]  # each in queue order
    running = list(db.jobs.find({"status": "running"}))
    assert {doc["claimLimits"]["rate"] for doc in running} == {"1/m per key"}
    counters = {doc["_id"].get("key", "-"): doc for doc in db.bb_rates.find()}
    assert set(counters) == {"a", "b", None}
    assert all(doc["_id"]["queue"] == "limited" for doc in counters.values())
    # Each counter expires once its next start has come: a key not seen again leaves nothing behind.
    assert all(doc["expireAt"].timestamp() * 1_000_000 == doc["next"] for doc in counters.values())
    expiry = next(ix for ix in db.bb_rates.list_indexes() if ix["name"] == "bb_rate_expiry")
    assert dict(expiry["key"]) == {"expireAt": 1} and expiry["expireAfterSeconds"] == 0


def test_a_held_key_costs_no_write_until_its_next_start(
    store: JobStore, db: Database, clock: FakeClock, mongo_url: str
) -> None:
    for n in range(3):
        publish(store, f"a{n}", "a")
    publish(store, "b0", "b")
    log = CommandLog()
    watched = JobStore(MongoClient(mongo_url, event_listeners=[log])[db.name], clock=clock)
    holds = RateHolds(PER_KEY.rate)  # type: ignore[arg-type]
    assert claimed_task(watched, holds) == "a0"
    assert claimed_task(watched, holds) == "b0"
    with pytest.raises(LimitReached):
        claimed_task(watched, holds)
    log.commands.clear()
    for _ in range(5):  # the claims of a consumer woken meanwhile (a job ended, another queue's news)
        with pytest.raises(LimitReached):
            claimed_task(watched, holds)
    # One read of the queue each, leaving the held keys out: no counter taken, no job written.
    assert [next(iter(command)) for command in log.commands] == ["find"] * 5
    assert all(command["filter"]["rateKey"] == {"$nin": ["a", "b"]} for command in log.commands)
    clock.advance(60)
    assert claimed_task(watched, holds) == "a1"


def test_no_period_anywhere_holds_more_starts_of_a_key_than_the_rate(
    store: JobStore, db: Database, clock: FakeClock
) -> None:
    keys = ["k0", "k1", "k2"]
    for n in range(30):
        publish(store, f"t{n}", keys[n % 3])
    limits = QueueLimits(rate=Rate(4, 1.0, per_key=True))
    holds = [RateHolds(limits.rate) for _ in range(5)]  # type: ignore[arg-type]
    clock.advance(0.5)
    starts: dict[str, list[Any]] = {key: [] for key in keys}
    for _ in range(20):  # 5 seconds, five workers claiming every quarter of a second, each keeping its own holds
        for worker in range(5):
            try:
                job = store.claim("limited", f"w{worker}", limits, rate_holds=holds[worker])
            except LimitReached:
                continue
            if job is not None:
                starts[db.jobs.find_one({"_id": job.id})["rateKey"]].append(clock.now)
        clock.advance(0.25)
    assert sum(len(times) for times in starts.values()) == 30  # 12 a second for the three keys together
    for times in starts.values():
        assert len(times) == 10
        for first in range(len(times) - 4):
            assert times[first + 4] - times[first] >= timedelta(seconds=1), times[first : first + 5]


def test_a_head_another_worker_takes_between_the_read_and_the_claim_spends_no_start(
    store: JobStore, db: Database, clock: FakeClock, monkeypatch
) -> None:
    publish(store, "a0", "a")
    publish(store, "b0", "b")
    other = JobStore(db, clock=clock)
    read_head = RateCounters.head

    def then_taken(self: RateCounters, *args: Any) -> Any:
        head = read_head(self, *args)
        if head is not None and head["_id"] == db.jobs.find_one({"taskId": "a0"})["_id"]:
            assert other.claim("limited", "w2") is not None  # a worker whose limits read no rate yet takes a0
        return head

    monkeypatch.setattr(RateCounters, "head", then_taken)
    holds = RateHolds(PER_KEY.rate)  # type: ignore[arg-type]
    assert claimed_task(store, holds) == "b0"  # a0 was gone: its key's start given back, and the next job claimed
    assert set(holds.until) == {"b"}  # held by its own start, which the next claim leaves out without a write
    monkeypatch.undo()
    publish(store, "a1", "a")
    assert claimed_task(store, holds) == "a1"  # a's start was never spent


def test_more_held_keys_than_one_claim_skips_leave_the_next_claim_the_keys_behind_them(
    store: JobStore, db: Database
) -> None:
    keys = [f"k{n:02}" for n in range(20)]
    for key in keys:
        publish(store, f"{key}-first", key)
    for key in keys:
        publish(store, f"{key}-second", key)
    publish(store, "free", "free")
    first = RateHolds(PER_KEY.rate)  # type: ignore[arg-type]
    assert [claimed_task(store, first) for _ in keys] == [f"{key}-first" for key in keys]
    assert claimed_task(store, first) == "free"  # its own starts are held: no refusal on the way
    publish(store, "free2", "free2")
    another = RateHolds(PER_KEY.rate)  # type: ignore[arg-type]  # a worker that knows of no held key yet
    with pytest.raises(LimitReached) as reached:
        claimed_task(store, another)
    assert reached.value.retry_in == 0.0 and len(another.until) == 16  # sixteen refused: look again at once
    assert claimed_task(store, another) == "free2"  # the four keys left, then the free one


def test_a_queue_wide_rates_counter_does_not_expire(store: JobStore, db: Database) -> None:
    publish(store, "t0", None)
    assert store.claim("limited", "w", QueueLimits(rate=Rate(1, 60.0))) is not None
    assert "expireAt" not in db.bb_rates.find_one()


def test_rates_per_key_are_set_shown_and_refused_through_the_controls(store: JobStore, db: Database) -> None:
    operations = Operations(store)
    known = KnownControls(QueueControls(db), max_age=0.0)
    assert operations.set_limits("limited", rate="10/s  per  key", by="tester") == QueueLimits(
        rate=Rate(10, 1.0, per_key=True)
    )
    assert known.limits("limited").rate == Rate(10, 1.0, per_key=True)
    assert operations.queues()["limited"]["rate"] == "10/s per key"
    operations.set_limits("limited", rate="10/s", by="tester")  # back to one rate for the queue
    assert known.limits("limited").rate == Rate(10, 1.0)
    assert "ratePerKey" not in db.bb_queues.find_one({"_id": "limited"})
    before = db.bb_queues.find_one({"_id": "limited"})
    for bad, message in (
        ("10/s per kye", "what follows a rate is 'per key'"),
        ("10/s per", "what follows a rate is 'per key'"),
        ("10/s each", "what follows a rate is 'per key'"),
        ("0/s per key", "a rate is N/s"),
        ("10/week per key", "a rate's period is s, m, h or d"),
    ):
        with pytest.raises(LimitError, match=message):
            operations.set_limits("limited", rate=bad, by="mallory")
    assert db.bb_queues.find_one({"_id": "limited"}) == before


@pytest.mark.parametrize("edited", ["yes", 1, None])
def test_a_per_key_flag_edited_by_hand_limits_nothing(db: Database, edited: Any) -> None:
    db.bb_queues.insert_one({"_id": "limited", "rateStarts": 1, "ratePeriod": 60.0, "ratePerKey": edited})
    assert KnownControls(QueueControls(db), max_age=0.0).limits("limited") == QueueLimits()


def test_a_hand_written_rate_key_counts_with_the_jobs_without_one_and_one_too_long_fails(
    store: JobStore, db: Database
) -> None:
    publish(store, "plain", None)
    for task_id, edited in (("document", {"$gt": ""}), ("array", ["a"]), ("number", 7), ("long", "k" * 600)):
        publish(store, task_id, None)
        db.jobs.update_one({"taskId": task_id}, {"$set": {"rateKey": edited}})
    holds = RateHolds(PER_KEY.rate)  # type: ignore[arg-type]
    assert claimed_task(store, holds) == "plain"
    with pytest.raises(LimitReached) as reached:  # the keyless jobs' key held: the edited jobs wait with them
        claimed_task(store, holds)
    assert reached.value.retry_in == 60.0
    assert {doc["taskId"] for doc in db.jobs.find({"status": "queued"})} == {"document", "array", "number"}
    # A string no publish writes is failed at its claim, never counted (see test_limits_e2e.py for what it did).
    long = db.jobs.find_one({"taskId": "long"})
    assert (long["status"], long["attempts"]) == ("failed", 0)
    assert long["lastError"] == (
        "malformed job document: rateKey must be a string of 1 to 512 characters, not a string of 600"
    )
    assert db.bb_rates.count_documents({"_id.key": "k" * 600}) == 0


# --- the options ------------------------------------------------------------------------------------------------------

NAME = "tests.rate_keys."


@pytest.fixture
def tasks(app: Celery) -> dict[str, Any]:
    @app.task(name=NAME + "mail", rate_on=("customer",), shared=False)
    def mail(customer: int, subject: str = "") -> str:
        return subject

    @app.task(name=NAME + "plain", shared=False)
    def plain(customer: int) -> int:
        return customer

    return {"mail": mail, "plain": plain}


def rate_key(db: Database, task_id: str) -> Any:
    doc = db.jobs.find_one({"taskId": task_id})
    assert doc is not None
    return doc.get("rateKey")


def test_rate_on_keys_one_customers_jobs_together_and_a_call_overrides_it(tasks, db: Database) -> None:
    first = tasks["mail"].delay(7, "hello")
    key = rate_key(db, first.id)
    assert key.startswith(NAME + "mail:") and len(key) <= MAX_RATE_KEY_LENGTH
    assert rate_key(db, tasks["mail"].apply_async(kwargs={"customer": 7}).id) == key
    assert rate_key(db, tasks["mail"].delay(8).id) not in (None, key)
    assert rate_key(db, tasks["mail"].apply_async((7,), rate_key="customer:7").id) == "customer:7"
    assert rate_key(db, tasks["plain"].delay(7).id) is None  # a task without the option pays nothing
    assert rate_key(db, tasks["plain"].apply_async((3,), rate_key="customer:3").id) == "customer:3"
    assert rate_key(db, tasks["plain"].apply_async((3,), headers={RATE_KEY_HEADER: "by-hand"}).id) == "by-hand"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rate_key": 42}, "rate_key must be a non-empty string of at most 512 characters, not 42"),
        ({"rate_key": ""}, "rate_key must be a non-empty string"),
        ({"rate_key": "k" * (MAX_RATE_KEY_LENGTH + 1)}, "rate_key must be a non-empty string"),
        ({"rate_key": "a", "rate_on": ("customer",)}, "rate_key and rate_on do not go together"),
        ({"rate_on": ("account",)}, "rate_on names 'account', not an argument of tests.rate_keys.mail"),
    ],
    ids=["not-a-string", "empty", "too-long", "both", "unknown-name"],
)
def test_a_bad_rate_option_is_refused_with_nothing_written(tasks, db: Database, options, message) -> None:
    with pytest.raises(UniqueOptionError, match=message):
        tasks["mail"].apply_async((7,), **options)
    assert db.jobs.count_documents({}) == 0


@pytest.mark.parametrize("bad", [42, "", "k" * (MAX_RATE_KEY_LENGTH + 1), ["a"], {"$gt": ""}])
def test_a_rate_key_header_that_cannot_be_is_refused_at_the_producer(tasks, db: Database, bad: Any) -> None:
    with pytest.raises(MalformedTaskMessage, match="'bb_rate_key'.*a non-empty string of at most 512 characters"):
        tasks["plain"].apply_async((3,), headers={RATE_KEY_HEADER: bad})
    assert db.jobs.count_documents({}) == 0


def test_a_channel_keeps_its_held_keys_between_claims_and_forgets_them_when_the_rate_changes(
    broker_url: str, db: Database
) -> None:
    from kombu import Connection

    from tests.support.workers import wait_for

    store = JobStore(db)
    operations = Operations(store)
    operations.set_limits("limited", rate="1/h per key", by="tester")
    for task_id, key in (("a0", "a"), ("a1", "a"), ("b0", "b")):
        publish(store, task_id, key)
    with Connection(broker_url) as conn:
        channel = conn.default_channel
        assert {job.id for job in channel.claimer._claim_many("limited", 4)} == {
            doc["_id"] for doc in db.jobs.find({"taskId": {"$in": ["a0", "b0"]}})
        }
        assert set(channel.claimer._rate_holds["limited"].until) == {"a", "b"}
        before = db.command("serverStatus")["opcounters"]["update"]
        assert channel.claimer._claim_many("limited", 4) == []
        assert db.command("serverStatus")["opcounters"]["update"] == before  # no start asked of a held key
        operations.set_limits("limited", rate="2/h per key", by="tester")
        wait_for(lambda: channel.known_controls.limits("limited").rate == Rate(2, 3600.0, per_key=True))
        a1 = db.jobs.find_one({"taskId": "a1"})["_id"]
        assert [job.id for job in channel.claimer._claim_many("limited", 4)] == [a1]
        assert channel.claimer._rate_holds["limited"].rate == Rate(2, 3600.0, per_key=True)
