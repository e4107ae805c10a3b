"""A task revoked while queued, told to the app's own result backend (not bbmongo://) by the revoker's process
(bb_broker.app_stores.store_revoked_results), when its job's message was written by hand or corrupted: read as a claim
reads it, refused in one line naming the job and the field, and told REVOKED with nothing of it; the other revoked
tasks are told as they are, and the revoker goes on.

Every process reaches the server through a wire proxy answering as a `mongod` holding text that is not UTF-8
(wire.mongod_keeping_what_the_stand_in_refuses); the test writes and reads the stand-in directly."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pymongo.database import Database

from tests.support import wire
from tests.support.servers import with_database
from tests.support.workers import job, producer, send, settled, wait_for

pytestmark = pytest.mark.stand_in


@pytest.fixture
def broker_url(mongo_url: str, db: Database) -> Iterator[str]:
    proxy = wire.WireProxy(mongo_url, wire.mongod_keeping_what_the_stand_in_refuses())
    yield with_database(f"mongodb://{proxy.address}", db.name)
    proxy.close()


def parked(app: Celery, db: Database, edit: dict[str, Any] | None = None) -> str:
    """A queued job of `add` in a group, on a queue no worker reads, its document then given the update `edit` by hand:
    its task id."""
    task_id = send(app, "add", 1, 2, queue="parked", group_id="g-1")
    if edit:
        assert db.jobs.update_one({"taskId": task_id}, edit).modified_count == 1
    return task_id


def test_a_revoked_jobs_message_that_is_no_workers_is_refused_naming_it_and_the_others_are_told(
    app: Celery, db: Database, worker_factory, tmp_path: Path
) -> None:
    backend = f"file://{tmp_path / 'results'}"
    (tmp_path / "results").mkdir()
    worker = worker_factory(env={"BB_RESULT_BACKEND": backend})
    first = parked(app, db)
    bad = {
        # Celery's app.tasks.get([...]) raised TypeError: the revoking task failed, and no later job was told.
        "header 'task'": parked(app, db, {"$set": {"payload.headers.task": ["tests.support.e2e_app.add"]}}),
        "payload is a str": parked(app, db, {"$set": {"payload": "add(1, 2)"}}),
        "headers is a str, not a document": parked(app, db, {"$set": {"payload.headers": "add"}}),
        # Stored as the REVOKED result's group_id, a number where Celery reads a group's id.
        "header 'group'": parked(app, db, {"$set": {"payload.headers.group": 5}}),
        # Stored as group_id "g-caf\ufffd.txt": read with U+FFFD in place of its byte.
        "payload holds text that is not UTF-8": parked(
            app, db, {"$set": {"payload.headers.group": f"g-{wire.NOT_UTF8_MARKER}"}}
        ),
        # Stored with its args and kwargs as null.
        "the body must be JSON": parked(
            app,
            db,
            {
                "$set": {"payload.body": base64.b64encode(b"\x00not json").decode(), "payload.bodyFormat": "base64"},
                "$unset": dict.fromkeys(("payload.args", "payload.kwargs", "payload.options"), ""),
            },
        ),
    }
    last = parked(app, db)
    revoker = send(app, "revoke", [first, *bad.values(), last])

    wait_for(settled(db, revoker, "succeeded"), timeout=120, message="the revoking task")
    reader = producer(app.conf.broker_url)
    reader.conf.result_backend = backend
    try:
        for task_id in (first, last):
            told = reader.backend.get_task_meta(task_id)
            assert (told["status"], told.get("group_id")) == ("REVOKED", "g-1"), told
        for field, task_id in bad.items():
            told = reader.backend.get_task_meta(task_id)
            # REVOKED, and nothing of the message: no group id, no children.
            assert told["status"] == "REVOKED" and "group_id" not in told and not told["children"], (field, told)
            assert job(db, task_id)["lastError"] == "revoked before it ran"
    finally:
        reader.close()
    log = worker.log()
    for field, task_id in bad.items():
        [line] = [line for line in log.splitlines() if f"task {task_id} was revoked;" in line]
        assert f"the message of its job {job(db, task_id)['_id']!r} is refused" in line and field in line, line
    assert "Traceback" not in log, log[-3000:]
    later = send(app, "add", 3, 4)  # the worker still runs tasks
    wait_for(settled(db, later, "succeeded"), timeout=60, message="a task sent after the revoke")
