"""Fair queues against a real server: the claims of a fair queue rotate across the jobs' fair keys (the jobs without
a key as one more group), an unfair queue's claims read and write nothing more; fairness set, read back and refused
beside a rate per key through the controls; the options that give a job its key, and hostile ones published all
the same, with a bounded key or none."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from bb_broker.jobs.fair_keys import FAIR_COLLECTION, FAIR_INDEX_NAME, FAIR_KEY_HEADER, MAX_FAIR_KEY_LENGTH
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.queues import LimitError, QueueLimits, Rate
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.faults import fail_point_off, fail_point_on
from tests.support.servers import EmbeddedServer
from tests.support.store import CommandLog, FakeClock

FAIR = QueueLimits(fair=True)


def publish(store: JobStore, task_id: str, fair_key: str | None, queue: str = "mail") -> str:
    return store.publish(queue=queue, kind="app.task", task_id=task_id, payload={"args": [], "kwargs": {}},
                         priority=0, run_after=None, is_retry=False, fair_key=fair_key)  # fmt: skip


def claimed_tasks(store: JobStore, count: int, limits: QueueLimits | None = FAIR, queue: str = "mail") -> list[str]:
    tasks = []
    for _ in range(count):
        job = store.claim(queue, "w", limits)
        if job is None:
            break
        tasks.append(store.coll.find_one({"_id": job.id})["taskId"])
    return tasks


@pytest.fixture
def fair_store(store: JobStore) -> JobStore:
    Operations(store).set_limits("mail", fair=True, by="tester")
    return store


def test_the_claims_rotate_across_the_keys_and_the_jobs_without_one(fair_store: JobStore, clock: FakeClock) -> None:
    for n in range(6):
        publish(fair_store, f"big{n}", "big")
    for key in ("a", "b"):
        for n in range(2):
            publish(fair_store, f"{key}{n}", key)
    publish(fair_store, "none0", None)
    clock.advance(1)
    # Key order, wrapping around through the jobs without a key; each key's own jobs in claim order.
    assert claimed_tasks(fair_store, 20) == [
        "a0", "b0", "big0", "none0", "a1", "b1", "big1", "big2", "big3", "big4", "big5",
    ]  # fmt: skip
    assert fair_store.coll.database[FAIR_COLLECTION].find_one({"_id": "mail"})["last"] == "big"


def test_a_key_published_later_gets_the_next_turn_not_the_end_of_the_backlog(
    fair_store: JobStore, clock: FakeClock
) -> None:
    for n in range(50):
        publish(fair_store, f"big{n}", "big")
    clock.advance(1)
    assert claimed_tasks(fair_store, 3) == ["big0", "big1", "big2"]
    publish(fair_store, "late0", "late")
    publish(fair_store, "early0", "a-early")  # before "big" in key order: after the wrap
    clock.advance(1)
    assert claimed_tasks(fair_store, 4) == ["late0", "early0", "big3", "big4"]


def test_two_claimers_take_every_job_once_and_every_small_key_early(
    fair_store: JobStore, clock: FakeClock, mongo_url: str, db: Database
) -> None:
    import threading

    for n in range(60):
        publish(fair_store, f"big{n}", "big")
    small = [f"k{k}" for k in range(5)]
    for key in small:
        for n in range(3):
            publish(fair_store, f"{key}-{n}", key)
    clock.advance(1)
    taken: list[str] = []
    lock = threading.Lock()

    def claimer() -> None:
        other = JobStore(MongoClient(mongo_url, tz_aware=True)[db.name], clock=clock)
        while (job := other.claim("mail", "w", FAIR)) is not None:
            with lock:
                taken.append(job.id)

    threads = [threading.Thread(target=claimer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(taken) == len(set(taken)) == 75  # every job, none twice
    order = [fair_store.coll.find_one({"_id": job_id})["fairKey"] for job_id in taken]
    assert all(order.index(key) < 2 * (len(small) + 1) for key in small), order


def test_an_unfair_queue_claims_in_plain_order_and_reads_no_cursor(
    store: JobStore, db: Database, clock: FakeClock, mongo_url: str
) -> None:
    for n in range(4):
        publish(store, f"big{n}", "big", queue="plain")
    publish(store, "small0", "small", queue="plain")
    clock.advance(1)
    log = CommandLog()
    watched = JobStore(MongoClient(mongo_url, tz_aware=True, event_listeners=[log])[db.name], clock=clock)
    assert watched.server  # the deployment's probe, once per process: the first test to ask it pays it, not the claims
    log.commands.clear()
    jobs = [watched.claim("plain", "w") for _ in range(5)]
    assert [next(iter(command)) for command in log.commands] == ["findAndModify"] * 5
    assert [job.task_id for job in jobs if job is not None] == [f"big{n}" for n in range(4)] + ["small0"]
    assert all(command.get("hint") == "bb_claim" or "hint" not in command for command in log.commands)
    assert FAIR_COLLECTION not in db.list_collection_names()
    assert FAIR_INDEX_NAME not in {ix["name"] for ix in db.jobs.list_indexes()}  # no index until a queue is fair


def watched(mongo_url: str, db: Database, clock: FakeClock) -> tuple[JobStore, CommandLog]:
    """A store whose commands are logged, the deployment's probe already paid (once per process)."""
    log = CommandLog()
    store = JobStore(MongoClient(mongo_url, tz_aware=True, event_listeners=[log])[db.name], clock=clock)
    assert store.server
    log.commands.clear()
    return store, log


def names(log: CommandLog) -> list[str]:
    return [next(iter(command)) for command in log.commands]


def test_one_keys_backlog_costs_a_fair_queue_what_it_costs_an_unfair_one(
    fair_store: JobStore, db: Database, clock: FakeClock, mongo_url: str
) -> None:
    for n in range(40):
        publish(fair_store, f"big{n}", "big")
    clock.advance(1)
    store, log = watched(mongo_url, db, clock)
    first = store.claim("mail", "w", FAIR)  # the worker's look at the keys, and the cursor set once
    assert first is not None and first.task_id == "big0"
    log.commands.clear()
    singles = [store.claim("mail", "w", FAIR) for _ in range(3)]
    batches = [store.claim_many("mail", "w", 8, FAIR) for _ in range(3)]
    taken = [job.task_id for job in singles if job is not None] + [job.task_id for jobs in batches for job in jobs]
    assert taken == [f"big{n}" for n in range(1, 28)]
    # One key alone, nothing to rotate: a claim is one findAndModify, a batch one read and one write, as unfair.
    assert names(log) == ["findAndModify"] * 3 + ["find", "update"] * 3


def test_a_batch_of_a_fair_queue_takes_the_rotations_next_turns_a_read_per_key(
    fair_store: JobStore, db: Database, clock: FakeClock, mongo_url: str
) -> None:
    for key, count in (("big", 20), ("a", 3), ("b", 3)):
        for n in range(count):
            publish(fair_store, f"{key}{n}", key)
    publish(fair_store, "none0", None)
    clock.advance(1)
    store, log = watched(mongo_url, db, clock)
    # The order claims of one job would take them in (see the first test), in batches of 8.
    assert [job.task_id for job in store.claim_many("mail", "w", 8, FAIR)] == [
        "a0", "b0", "big0", "none0", "a1", "b1", "big1",
    ]  # fmt: skip
    # The look (the keys, then the jobs without one), the cursor, a read per turn, the cursor moved, the batch taken.
    assert names(log) == ["aggregate", "find", "find", *["find"] * 4, "update", "update"]
    assert [job.task_id for job in store.claim_many("mail", "w", 8, FAIR)] == ["a2", "b2", "big2", "big3"]
    assert fair_store.coll.database[FAIR_COLLECTION].find_one({"_id": "mail"})["last"] == "big"
    assert fair_store.coll.count_documents({"status": "running"}) == 11


class KeysAnswered(monitoring.CommandListener):
    """How many keys each answer to a look at a fair queue's keys (an aggregation or a distinct) held."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "distinct":
            self.counts.append(len(event.reply["values"]))
        elif event.command_name == "aggregate":
            self.counts.append(len(event.reply["cursor"]["firstBatch"]))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_past_a_views_keys_the_claims_rotate_window_by_window_in_the_same_order(
    fair_store: JobStore, clock: FakeClock, db: Database, mongo_url: str
) -> None:
    keys = "abcdefgh"
    for key in keys:
        for n in range(2):
            publish(fair_store, f"{key}{n}", key)
    publish(fair_store, "none0", None)
    clock.advance(1)
    answers = KeysAnswered()
    store = JobStore(MongoClient(mongo_url, tz_aware=True, event_listeners=[answers])[db.name], clock=clock)
    store.fairness.view_keys = 3  # eight keys: windows of three, the last one with the jobs without a key
    # As one view of every key would: each key's first job, the jobs without a key, each key's second.
    assert claimed_tasks(store, 20) == [f"{key}0" for key in keys] + ["none0"] + [f"{key}1" for key in keys]
    assert answers.counts and max(answers.counts) <= 4  # no look read more than a window's keys and one


def test_past_a_views_keys_a_batch_takes_the_windows_turns_and_two_claimers_take_each_job_once(
    fair_store: JobStore, clock: FakeClock, db: Database, mongo_url: str
) -> None:
    for key in "abcdefg":
        for n in range(3):
            publish(fair_store, f"{key}{n}", key)
    clock.advance(1)
    answers = KeysAnswered()
    client = MongoClient(mongo_url, tz_aware=True, event_listeners=[answers])
    other = JobStore(client[db.name], Policy(stale_after=30), clock=clock)
    fair_store.fairness.view_keys = other.fairness.view_keys = 2
    taken: list[str] = []
    while batch := fair_store.claim_many("mail", "w1", 2, FAIR) + other.claim_many("mail", "w2", 3, FAIR):
        taken += [job.task_id for job in batch]
    assert sorted(taken) == sorted(f"{key}{n}" for key in "abcdefg" for n in range(3))  # each once
    first_jobs = [taken.index(f"{key}0") for key in "abcdefg"]
    assert max(first_jobs) < 2 * 7, taken  # every key's first job within about a turn per key
    assert answers.counts and max(answers.counts) <= 3  # windows of two keys (and one to tell there are more)


def test_a_batch_of_a_window_takes_its_turns_once_and_the_next_look_the_window_after(
    fair_store: JobStore, clock: FakeClock
) -> None:
    for key in "abcdef":
        for n in range(3):
            publish(fair_store, f"{key}{n}", key)
    clock.advance(1)
    fair_store.fairness.view_keys = 2
    first = [job.task_id for job in fair_store.claim_many("mail", "w", 8, FAIR)]
    assert first == ["a0", "b0"]  # was: a and b again and again, four jobs each, the other keys waiting
    assert [job.task_id for job in fair_store.claim_many("mail", "w", 8, FAIR)] == ["c0", "d0"]


def test_a_hand_written_fair_key_that_is_an_array_neither_stops_the_queue_nor_is_lost(
    fair_store: JobStore, clock: FakeClock
) -> None:
    for key in ("a", "b"):
        for n in range(3):
            publish(fair_store, f"{key}{n}", key)
    odd = publish(fair_store, "odd", "c")
    fair_store.coll.update_one({"_id": odd}, {"$set": {"fairKey": ["x"]}})  # an array: matched by $type string
    clock.advance(1)
    # Was: TypeError at every look, nothing claimed; then last, after every key's backlog (the turn of the jobs
    # without a key found no array holding a string): it waits one turn, as a job without a key does.
    assert claimed_tasks(fair_store, 8)[:3] == ["a0", "b0", "odd"]


def test_a_fair_queue_is_claimed_where_a_distinct_of_its_keys_is_refused(
    fair_store: JobStore, clock: FakeClock, own_server: EmbeddedServer
) -> None:
    # A distinct answers every key at once, and MongoDB refuses one past 16 MB ("distinct too big, 16mb cap"): about
    # 30,000 keys of 512 characters. The looks did not use to read the keys in bounded windows: the queue stalled.
    with (
        MongoClient(own_server.url, tz_aware=True) as admin,
        MongoClient(own_server.url, tz_aware=True, appname="fair-looks") as looking,
    ):
        store = JobStore(looking.fair, Policy(stale_after=30), clock=clock)
        store.ensure_indexes()
        Operations(store).set_limits("mail", fair=True, by="tester")
        for key in ("a", "b"):
            publish(store, f"{key}0", key)
        clock.advance(1)
        refused = {"failCommands": ["distinct"], "appName": "fair-looks", "errorCode": 17217,
                   "errMsg": "distinct too big, 16mb cap"}  # fmt: skip
        fail_point_on(admin, **refused)
        try:
            assert claimed_tasks(store, 3) == ["a0", "b0"]
        finally:
            fail_point_off(admin)


def test_fairness_is_set_read_back_cleared_and_refused_beside_a_rate_per_key(store: JobStore, db: Database) -> None:
    operations = Operations(store)
    assert operations.set_limits("mail", fair="true", by="tester") == QueueLimits(fair=True)
    assert FAIR_INDEX_NAME in {ix["name"] for ix in db.jobs.list_indexes()}
    assert operations.queues()["mail"]["fair"] is True
    assert operations.set_limits("mail", concurrency=2, rate="5/s", by="tester") == QueueLimits(
        concurrency=2, rate=Rate(5, 1.0), fair=True
    )
    with pytest.raises(LimitError, match="a queue is fair or has a rate per key, not both"):
        operations.set_limits("mail", rate="5/s per key", by="tester")
    with pytest.raises(LimitError, match="fair is true or false, not 'maybe'"):
        operations.set_limits("mail", fair="maybe", by="tester")
    assert operations.set_limits("mail", fair=False, by="tester") == QueueLimits(concurrency=2, rate=Rate(5, 1.0))
    operations.set_limits("other", rate="5/s per key", by="tester")
    with pytest.raises(LimitError, match="a queue is fair or has a rate per key, not both"):
        operations.set_limits("other", fair=True, by="tester")
    operations.set_limits("mail", fair=True, by="tester")
    assert operations.set_limits("mail", clear=True, by="tester") == QueueLimits()


def test_fairness_holds_within_a_concurrency_limit_and_a_rate(fair_store: JobStore, clock: FakeClock) -> None:
    Operations(fair_store).set_limits("mail", concurrency=3, rate="1000/s", by="tester")
    for n in range(5):
        publish(fair_store, f"big{n}", "big")
    publish(fair_store, "small0", "small")
    clock.advance(1)
    limits = QueueLimits(concurrency=3, rate=Rate(1000, 1.0), fair=True)
    taken = []
    for _ in range(2):
        taken += claimed_tasks(fair_store, 1, limits)
        clock.advance(0.01)
    assert taken == ["big0", "small0"]
    docs = list(fair_store.coll.find({"status": "running"}))
    assert sorted(doc["limitSlot"] for doc in docs) == sorted({doc["limitSlot"] for doc in docs})


# --- the options ------------------------------------------------------------------------------------------------------

NAME = "tests.fair_keys."


@pytest.fixture
def tasks(app: Celery) -> dict[str, Any]:
    @app.task(name=NAME + "mail", fair_on=("customer_id",), shared=False)
    def mail(customer_id: Any, subject: str = "") -> str:
        return subject

    @app.task(name=NAME + "plain", shared=False)
    def plain(customer_id: Any) -> Any:
        return customer_id

    return {"mail": mail, "plain": plain}


def fair_key(db: Database, task_id: str) -> Any:
    doc = db.jobs.find_one({"taskId": task_id})
    assert doc is not None, "the task was not published"
    return doc.get("fairKey", "<none>")


def test_fair_on_keys_one_customers_jobs_together_and_a_call_overrides_it(tasks, db: Database) -> None:
    key = fair_key(db, tasks["mail"].delay(7, "hello").id)
    assert key.startswith(NAME + "mail:") and len(key) <= MAX_FAIR_KEY_LENGTH
    assert fair_key(db, tasks["mail"].apply_async(kwargs={"customer_id": 7}).id) == key
    assert fair_key(db, tasks["mail"].delay(8).id) not in ("<none>", key)
    assert fair_key(db, tasks["mail"].apply_async((7,), fair_key="customer:7").id) == "customer:7"
    assert fair_key(db, tasks["plain"].delay(7).id) == "<none>"  # a task without the option pays nothing
    assert fair_key(db, tasks["plain"].apply_async((3,), fair_key="customer:3").id) == "customer:3"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"fair_key": "k" * (MAX_FAIR_KEY_LENGTH * 100)}, "digest"),
        ({"fair_key": 42}, "digest"),
        ({"fair_key": {"tenant": {"id": [1, 2, {"deep": None}]}}}, "digest"),
        ({"fair_key": ""}, "<none>"),
        ({"fair_key": object()}, "<none>"),
        ({"fair_key": "a", "fair_on": ("customer_id",)}, "<none>"),
        ({"fair_on": ("account",)}, "<none>"),
        ({"headers": {FAIR_KEY_HEADER: ["nested", {"x": 1}]}}, "<none>"),
        ({"headers": {FAIR_KEY_HEADER: "k" * (MAX_FAIR_KEY_LENGTH + 1)}}, "<none>"),
        ({"fair_key": "caf\udce9"}, "digest"),  # a lone surrogate (an undecodable file name): the publish was refused
    ],
    ids=[
        "huge",
        "number",
        "nested",
        "empty",
        "not-json",
        "both",
        "unknown-name",
        "bad-header",
        "long-header",
        "surrogate",
    ],  # fmt: skip
)
def test_a_hostile_fair_key_never_fails_the_publish(tasks, db: Database, options, expected) -> None:
    task_id = tasks["mail"].apply_async((7,), **options).id
    key = fair_key(db, task_id)
    if expected == "digest":
        assert key.startswith(NAME + "mail:") and len(key) <= MAX_FAIR_KEY_LENGTH, key
    else:
        assert key == expected
    assert db.jobs.find_one({"taskId": task_id})["status"] == "queued"


def test_a_digested_key_is_the_same_for_the_same_value(tasks, db: Database) -> None:
    first = fair_key(db, tasks["plain"].apply_async((1,), fair_key={"tenant": 5}).id)
    assert fair_key(db, tasks["plain"].apply_async((2,), fair_key={"tenant": 5}).id) == first
    assert fair_key(db, tasks["plain"].apply_async((3,), fair_key={"tenant": 6}).id) != first
