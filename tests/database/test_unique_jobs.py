"""Unique jobs from Celery's side: the task options and apply_async's, the key they make, the modes, the refusals
and the bad options (each refused with nothing written), and the operator's writes that give a key back or take it
again. What needs a worker is in tests/e2e/test_unique_jobs.py."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from pymongo.database import Database

from bb_broker import DuplicateJob, MalformedTaskMessage, UniqueOptionError, metrics
from bb_broker.cli import main
from bb_broker.jobs.revokes import revoke_queued
from bb_broker.jobs.unique import (
    MAX_UNIQUE_KEY_LENGTH,
    UNIQUE_KEY_HEADER,
    UNIQUE_MODE_HEADER,
    UNIQUE_PERIOD_HEADER,
    period_bucket,
)
from bb_broker.ops.operations import ActionRefused, Operations
from bb_broker.options import BrokerOptions, open_store
from tests.support import unique_app
from tests.support.workers import producer, wait_for


@pytest.fixture
def tasks(app: Celery) -> dict[str, Any]:
    return unique_app.register(app)


@pytest.fixture
def operations(broker_url: str) -> Iterator[Operations]:
    from bb_broker.connection import parse_broker_url

    yield Operations(open_store(parse_broker_url(broker_url), BrokerOptions()))


def the_job(db: Database, task_id: str) -> dict[str, Any]:
    doc = db.jobs.find_one({"taskId": task_id})
    assert doc is not None
    return doc


def test_the_default_key_is_the_task_and_its_arguments(tasks, db: Database) -> None:
    first = tasks["add"].delay(2, 3)
    with pytest.raises(DuplicateJob) as refused:
        tasks["add"].delay(2, 3)
    assert refused.value.task_id == first.id
    other = tasks["add"].delay(2, 4)  # other arguments, another key
    assert db.jobs.count_documents({}) == 2
    job = the_job(db, first.id)
    assert job["unique"]["mode"] == "active" and job["uniqueActive"] == job["unique"]["key"]
    assert job["unique"]["key"].startswith(unique_app.NAME + "add:") and len(job["unique"]["key"]) < 200
    assert the_job(db, other.id)["unique"]["key"] != job["unique"]["key"]


def test_keyword_and_positional_arguments_make_the_same_key_only_when_they_are_the_same(tasks, db: Database) -> None:
    tasks["add"].apply_async(kwargs={"x": 2, "y": 3})
    with pytest.raises(DuplicateJob):
        tasks["add"].apply_async(kwargs={"y": 3, "x": 2})  # key order does not matter
    tasks["add"].apply_async((2, 3))  # positional arguments hash as themselves: another key
    assert db.jobs.count_documents({}) == 2


def test_unique_on_keys_on_the_named_arguments_positional_or_not(tasks, db: Database) -> None:
    first = tasks["charge"].delay(7, 10)
    for duplicate in (
        lambda: tasks["charge"].delay(7, 20),
        lambda: tasks["charge"].apply_async(kwargs={"account_id": 7}),
    ):
        with pytest.raises(DuplicateJob) as refused:
            duplicate()
        assert refused.value.task_id == first.id
    tasks["charge"].delay(8, 10)
    assert db.jobs.count_documents({}) == 2


def test_a_call_gives_its_own_key_or_turns_the_task_option_off(tasks, db: Database) -> None:
    first = tasks["plain"].apply_async((1,), unique_key="nightly-export")
    with pytest.raises(DuplicateJob) as refused:
        tasks["plain"].apply_async((2,), unique_key="nightly-export")
    assert refused.value.task_id == first.id and refused.value.unique_key == "nightly-export"
    tasks["add"].delay(1, 1)
    tasks["add"].apply_async((1, 1), unique=False)  # this call is not unique
    assert db.jobs.count_documents({}) == 3
    assert "unique" not in the_job(db, tasks["plain"].apply_async((3,)).id)  # a task without the options


def test_send_task_by_name_takes_the_options_too(app: Celery, db: Database) -> None:
    first = app.send_task("reports.build", args=("eu",), unique=True, unique_while="queued")
    with pytest.raises(DuplicateJob):
        app.send_task("reports.build", args=("eu",), unique=True, unique_while="queued")
    app.send_task("reports.build", args=("eu",), unique=True)  # another mode: a key space of its own
    assert db.jobs.count_documents({}) == 2
    job = the_job(db, first.id)
    assert job["unique"]["mode"] == "queued" and "uniqueQueued" in job
    assert "unique" not in job["payload"]["properties"] and "unique_while" not in job["payload"]["properties"]


def test_the_period_mode_folds_its_time_bucket_into_the_key(tasks, db: Database) -> None:
    first = tasks["daily"].delay("sales")
    with pytest.raises(DuplicateJob):
        tasks["daily"].delay("sales")
    job = the_job(db, first.id)
    key = job["unique"]["key"]
    assert job["unique"]["mode"] == "period" and job["uniquePeriod"] == key
    bucket = period_bucket(24 * 3600, job["createdAt"])
    assert key.endswith("@" + bucket) and bucket.startswith(job["createdAt"].strftime("%Y-%m-%dT00:00:00"))


def test_two_publishers_at_once_make_one_job_and_both_learn_its_id(broker_url: str, db: Database) -> None:
    apps = [producer(broker_url) for _ in range(2)]
    made: list[str] = []
    refused: list[str | None] = []
    go = threading.Barrier(len(apps))

    def publish(app: Celery) -> None:
        add = unique_app.register(app)["add"]
        go.wait()
        for _ in range(20):
            try:
                made.append(add.delay(20, 22).id)
            except DuplicateJob as exc:
                refused.append(exc.task_id)

    threads = [threading.Thread(target=publish, args=(app,)) for app in apps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for app in apps:
        app.close()
    assert len(made) == 1 and refused == made * 39
    assert db.jobs.count_documents({}) == 1


def test_a_refused_duplicate_is_counted(tasks, db: Database) -> None:
    counted = metrics.COUNTERS["refused_duplicate"]._value.get()
    tasks["add"].delay(5, 5)
    for _ in range(2):
        with pytest.raises(DuplicateJob):
            tasks["add"].delay(5, 5)
    assert metrics.COUNTERS["refused_duplicate"]._value.get() == counted + 2


BAD_OPTIONS = [
    ({"unique_key": 42}, "unique_key must be a non-empty string"),
    ({"unique_key": ""}, "unique_key must be a non-empty string"),
    ({"unique_key": "k" * (MAX_UNIQUE_KEY_LENGTH + 1)}, f"at most {MAX_UNIQUE_KEY_LENGTH} characters"),
    ({"unique_key": ["a"]}, "unique_key must be a non-empty string"),
    ({"unique": True, "unique_while": "sometimes"}, "unique_while must be one of queued, active"),
    ({"unique_period": 0}, "unique_period must be a number of seconds, at least 0.001"),
    ({"unique_period": -5}, "unique_period must be a number of seconds, at least 0.001"),
    ({"unique_period": "1h"}, "unique_period must be a number of seconds, at least 0.001"),
    ({"unique_period": math.inf}, "unique_period must be a number of seconds, at least 0.001"),
    ({"unique_period": True}, "unique_period must be a number of seconds, at least 0.001"),
    ({"unique_period": 1e-300}, "unique_period must be a number of seconds, at least 0.001"),  # no bucket of its own
    ({"unique_period": 10**400}, "unique_period must be a number of seconds, at least 0.001"),  # no float holds it
    ({"unique_period": 60, "unique_while": "queued"}, "do not go together"),
    ({"unique_on": ("nope",)}, "unique_on names 'nope', not an argument of tests.support.unique_app.add"),
    ({"unique_on": (5,)}, "unique_on position 5 is not among the 2 positional arguments"),
    ({"unique_on": ()}, "unique_on must be argument names or positions"),
    ({"unique_on": ("x",), "unique_key": "k"}, "do not go together"),
    ({"unique": "yes"}, "unique must be True or False"),
]


@pytest.mark.parametrize(("options", "reason"), BAD_OPTIONS)
def test_a_bad_option_is_refused_and_nothing_is_published(tasks, db: Database, options, reason) -> None:
    with pytest.raises(UniqueOptionError, match=reason) as refused:
        tasks["add"].apply_async((1, 2), **options)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, TypeError)
    assert db.jobs.count_documents({}) == 0


def test_arguments_that_are_not_json_cannot_make_a_key(tasks, db: Database) -> None:
    with pytest.raises(UniqueOptionError, match="not JSON"):
        tasks["add"].apply_async((object(), 1), serializer="pickle")
    assert db.jobs.count_documents({}) == 0


@pytest.mark.parametrize(
    ("headers", "field"),
    [
        ({UNIQUE_KEY_HEADER: "k", UNIQUE_MODE_HEADER: "sometimes"}, UNIQUE_MODE_HEADER),
        ({UNIQUE_KEY_HEADER: "k", UNIQUE_MODE_HEADER: "period"}, UNIQUE_PERIOD_HEADER),
        ({UNIQUE_KEY_HEADER: "k", UNIQUE_MODE_HEADER: "period", UNIQUE_PERIOD_HEADER: -1}, UNIQUE_PERIOD_HEADER),
        ({UNIQUE_KEY_HEADER: "k", UNIQUE_PERIOD_HEADER: 60}, UNIQUE_PERIOD_HEADER),
        ({UNIQUE_MODE_HEADER: "active"}, UNIQUE_KEY_HEADER),
    ],
)
def test_a_hand_written_header_that_is_wrong_is_refused(app: Celery, db: Database, headers, field) -> None:
    with pytest.raises(MalformedTaskMessage, match=field):
        app.send_task("reports.build", headers=headers)
    assert db.jobs.count_documents({}) == 0


def test_a_cancelled_or_revoked_job_gives_its_key_back(tasks, operations: Operations, db: Database) -> None:
    first = tasks["add"].delay(1, 1)
    operations.act("cancel", first.id, by="ops")
    second = tasks["add"].delay(1, 1)  # the key is free
    revoke_queued(operations.store, [second.id], by="ops")
    third = tasks["add"].delay(1, 1)
    assert the_job(db, third.id)["status"] == "queued"
    assert db.jobs.count_documents({"uniqueActive": {"$exists": True}}) == 1
    daily = tasks["daily"].delay("x")
    operations.act("cancel", daily.id, by="ops")  # a period's key too
    tasks["daily"].delay("x")


def test_a_beat_slot_key_stays_held_when_its_job_is_cancelled(app: Celery, operations: Operations, db) -> None:
    first = app.send_task("reports.build", headers={UNIQUE_KEY_HEADER: "beat:nightly:2026-12-02T00:00:00.000+00:00"})
    operations.act("cancel", first.id, by="ops")
    with pytest.raises(DuplicateJob):
        app.send_task("reports.build", headers={UNIQUE_KEY_HEADER: "beat:nightly:2026-12-02T00:00:00.000+00:00"})
    assert the_job(db, first.id)["unique"] == {"key": "beat:nightly:2026-12-02T00:00:00.000+00:00", "mode": "forever"}


def test_an_operator_retry_takes_the_key_again_or_says_who_holds_it(
    tasks, operations: Operations, broker_url: str, db: Database
) -> None:
    first = tasks["add"].delay(3, 3)
    operations.act("cancel", first.id, by="ops")  # failed, its key given back
    second = tasks["add"].delay(3, 3)
    with pytest.raises(ActionRefused, match=f"held by job .* \\(task {second.id}, queued\\)"):
        operations.act("retry", first.id, by="ops")
    assert the_job(db, first.id)["status"] == "failed"
    retried = operations.retry([first.id], by="ops")
    assert retried.job_ids == [] and second.id in retried.held[the_job(db, first.id)["_id"]]
    result = CliRunner().invoke(main, ["retry", "--broker", broker_url, first.id])
    assert result.exit_code == 1 and f"task {second.id}" in result.output and "left failed" in result.output
    operations.act("cancel", second.id, by="ops")
    operations.act("retry", first.id, by="ops")  # free again: taken back
    job = the_job(db, first.id)
    assert job["status"] == "queued" and job["uniqueActive"] == job["unique"]["key"]
    with pytest.raises(DuplicateJob) as refused:
        tasks["add"].delay(3, 3)
    assert refused.value.task_id == first.id


def test_show_tells_the_key_its_mode_and_whether_it_is_held(tasks, operations, broker_url: str) -> None:
    first = tasks["hold_queued"].delay("/nowhere")
    shown = CliRunner().invoke(main, ["show", "--broker", broker_url, first.id])
    assert shown.exit_code == 0, shown.output
    line = next(line for line in shown.output.splitlines() if line.startswith("unique key"))
    assert "(mode queued: held while queued; held now)" in line and unique_app.NAME + "hold_queued:" in line
    operations.act("cancel", first.id, by="ops")
    shown = CliRunner().invoke(main, ["show", "--broker", broker_url, first.id])
    assert "held while queued; given back)" in shown.output


@pytest.mark.parametrize(("max_attempts", "after", "held"), [(3, "queued", True), (1, "failed", False)])
def test_the_stale_sweep_keeps_the_key_of_a_job_it_requeues_and_frees_one_it_fails(
    tasks, db: Database, max_attempts: int, after: str, held: bool
) -> None:
    from datetime import UTC, datetime, timedelta

    from bb_broker.jobs.lifecycle import Policy
    from bb_broker.jobs.store import JobStore

    first = tasks["add"].delay(9, 9)
    store = JobStore(db)  # due by the publisher's reading of the server's clock, by this one's a moment later maybe
    claimed = wait_for(lambda: store.claim("celery", "crashed-worker"), timeout=30, message="the job claimed")
    assert claimed.task_id == first.id
    later = datetime.now(UTC) + timedelta(hours=1)  # the lease long expired: the worker is gone
    JobStore(db, Policy(max_attempts=max_attempts), clock=lambda: later).requeue_stale()
    swept = the_job(db, first.id)
    assert swept["status"] == after and ("uniqueActive" in swept) is held
    if held:
        assert refused_task_id(lambda: tasks["add"].delay(9, 9)) == first.id
    else:
        assert tasks["add"].delay(9, 9).id != first.id


def test_the_claim_frees_a_queued_only_key_and_leaves_the_others(tasks, db: Database) -> None:
    from bb_broker.jobs.store import JobStore

    queued_only, active = tasks["hold_queued"].delay("/x"), tasks["hold"].delay("/x")
    store = JobStore(db)
    assert {job.task_id for job in store.claim_many("celery", "w", 5)} == {queued_only.id, active.id}
    assert "uniqueQueued" not in the_job(db, queued_only.id) and "uniqueActive" in the_job(db, active.id)
    tasks["hold_queued"].delay("/x")
    assert refused_task_id(lambda: tasks["hold"].delay("/x")) == active.id


def refused_task_id(publish) -> str | None:
    with pytest.raises(DuplicateJob) as duplicate:
        publish()
    assert type(duplicate.value) is DuplicateJob
    return duplicate.value.task_id


def test_the_refusals_counter_is_exposed_to_prometheus(tasks) -> None:
    from prometheus_client import REGISTRY, generate_latest

    tasks["add"].delay(6, 6)
    with pytest.raises(DuplicateJob):
        tasks["add"].delay(6, 6)
    assert "jobs_duplicates_refused_total" in generate_latest(REGISTRY).decode()
