"""A task message's `bb_unique_key` header: one job per key, a second publish refused with the first's task id."""

from __future__ import annotations

import pytest
from celery import Celery
from pymongo import monitoring
from pymongo.database import Database

from bb_broker import DuplicateJob, MalformedTaskMessage
from bb_broker.jobs.unique import MAX_UNIQUE_KEY_LENGTH, UNIQUE_KEY_HEADER
from tests.support.workers import producer


class JobCommands(monitoring.CommandListener):
    """The commands sent to one database's `jobs` collection, by name, while recording."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.sent: list[str] = []
        self.recording = False

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self.recording and event.database_name == self.database and event.command.get(event.command_name) == "jobs":
            self.sent.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def publish(app: Celery, key: object) -> str:
    return app.send_task("tests.support.e2e_app.add", args=(1, 2), headers={UNIQUE_KEY_HEADER: key}).id


def test_a_second_job_with_the_same_key_is_refused_naming_the_first(app: Celery, db: Database) -> None:
    first = publish(app, "report:2026-12-01")
    with pytest.raises(DuplicateJob) as refused:
        publish(app, "report:2026-12-01")
    assert refused.value.task_id == first
    assert refused.value.unique_key == "report:2026-12-01"
    assert refused.value.job_id == db.jobs.find_one({"taskId": first})["_id"]
    assert [doc["taskId"] for doc in db.jobs.find({}, {"taskId": 1})] == [first]
    assert db.jobs.find_one({"taskId": first})["uniqueKey"] == "report:2026-12-01"
    other = publish(app, "report:2026-12-02")  # another key is another job
    assert db.jobs.count_documents({}) == 2 and db.jobs.find_one({"taskId": other})["status"] == "queued"


def test_jobs_without_a_key_are_not_limited_by_the_index(app: Celery, db: Database) -> None:
    for _ in range(3):
        app.send_task("tests.support.e2e_app.add", args=(1, 2))
    publish(app, "only-one")
    assert db.jobs.count_documents({}) == 4
    assert db.jobs.count_documents({"uniqueKey": {"$exists": True}}) == 1
    index = next(ix for ix in db.jobs.list_indexes() if ix["name"] == "bb_unique_key")
    assert index["unique"] is True and dict(index["partialFilterExpression"]) == {"uniqueKey": {"$exists": True}}


def test_a_refused_duplicate_costs_one_insert_and_one_read_after_it(broker_url: str, db: Database) -> None:
    listener = JobCommands(db.name)
    monitoring.register(listener)  # heard by the clients made from now on: this test's database has its own
    app = producer(broker_url)
    try:
        publish(app, "once")
        listener.recording = True
        with pytest.raises(DuplicateJob):
            publish(app, "once")
    finally:
        listener.recording = False
        app.close()
    assert listener.sent == ["insert", "find"]


@pytest.mark.parametrize("key", ["", "k" * (MAX_UNIQUE_KEY_LENGTH + 1), 42, None, ["a"]])
def test_a_key_that_is_not_a_bounded_string_is_refused_and_nothing_written(app: Celery, db: Database, key) -> None:
    with pytest.raises(MalformedTaskMessage, match=UNIQUE_KEY_HEADER):
        publish(app, key)
    assert db.jobs.count_documents({}) == 0


def test_the_longest_key_allowed_makes_its_job(app: Celery, db: Database) -> None:
    task_id = publish(app, "k" * MAX_UNIQUE_KEY_LENGTH)
    assert db.jobs.find_one({"taskId": task_id})["uniqueKey"] == "k" * MAX_UNIQUE_KEY_LENGTH


def test_the_refusal_survives_pickling_as_a_celery_task_error_would_need() -> None:
    import pickle

    refused = pickle.loads(pickle.dumps(DuplicateJob("k", "task-1", "job-1")))
    assert (refused.unique_key, refused.task_id, refused.job_id) == ("k", "task-1", "job-1")
    assert str(refused) == "a job with unique key 'k' exists already (task id task-1)"
