"""Result reads of jobs and `bb_results` documents written by hand, or by another client: one bad document fails
its own task's read, with a clear error, never the read of another task, and nothing a reader does not accept is
decoded."""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from bson import Binary, ObjectId
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from pymongo.database import Database

from bb_broker.results.backend import UnreadableResult
from tests.database.test_pickle_never_runs import Exploit
from tests.database.test_results_backend import part, tsum
from tests.support.workers import producer


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = producer(broker_url)
    app.conf.result_backend = broker_url
    app.conf.result_expires = 3600
    yield app
    app.close()


def finished(db: Database, job_id: Any, task_id: Any, **fields: Any) -> None:
    """A succeeded job of `task_id`, its result 3 unless `fields` say otherwise."""
    now = datetime.now(UTC)
    db.jobs.insert_one(
        {
            "_id": job_id, "taskId": task_id, "kind": "k", "queue": "celery", "attempts": 1, "createdAt": now,
            "updatedAt": now, "runAfter": now, "finishedAt": now, "status": "succeeded", "state": states.SUCCESS,
            "result": 3, "resultFormat": "json", **fields,
        }
    )  # fmt: skip


def test_a_job_whose_task_id_is_an_array_is_no_tasks_job(app: Celery, db: Database) -> None:
    finished(db, "01A", "good")
    finished(db, "01B", "other", result=4)
    finished(db, "01Z", ["good", "other"], result=666)  # newer than both: it would have been read as theirs
    assert app.AsyncResult("good").get(timeout=5) == 3
    assert app.GroupResult("g", [app.AsyncResult("good"), app.AsyncResult("other")]).join_native(timeout=5) == [3, 4]
    app.backend.store_result("good", {"done": 1}, "PROGRESS")  # a task's own state goes to its own job
    assert db.jobs.find_one({"_id": "01Z"})["result"] == 666
    assert app.AsyncResult("other").result == 4


def test_only_the_newest_job_of_a_task_id_is_decoded(app: Celery, db: Database) -> None:
    finished(db, "01A", "t", result=Binary(b"\xff"), resultFormat="encoded:json")  # an older run, unreadable
    finished(db, "01B", "t", result=5)
    assert app.AsyncResult("t").get(timeout=5) == 5


def test_a_hand_written_job_with_an_object_id_never_wins_over_the_task_s_own(app: Celery, db: Database) -> None:
    finished(db, "01A", "t", result=5)
    finished(db, ObjectId(), "t", result=666)  # an ObjectId sorts after every job id
    assert app.AsyncResult("t").get(timeout=5) == 5


@pytest.mark.parametrize(
    "fields",
    [
        {"result": datetime(2026, 1, 1, tzinfo=UTC), "resultFormat": "json"},
        {"result": "abc", "resultFormat": "encoded:json"},
        {"result": 400_000_000, "resultFormat": "encoded:json"},  # once bytes(400000000): 400 MB of zeros
        {"resultFormat": "encoded:nosuch"},
        {"resultFormat": 5},
        {"state": {"a": 1}},
        {"state": ["SUCCESS"]},
        {"state": 5},  # once read as a state not ready: get() waited for its timeout
        {"status": "failed", "state": states.FAILURE, "result": 5},
        {"result": Binary(b"\xff\xfe"), "resultFormat": "encoded:json"},
    ],
    ids=repr,
)
def test_a_result_that_cannot_be_read_fails_its_own_task_and_the_group_reads_the_others(
    app: Celery, db: Database, fields: dict[str, Any]
) -> None:
    finished(db, "01A", "good")
    finished(db, "01B", "bad", **fields)
    bad = app.AsyncResult("bad")
    with pytest.raises(UnreadableResult, match="task bad: the result stored in its (job 01B|stored exception) cannot"):
        bad.get(timeout=5)
    group = app.GroupResult("g", [app.AsyncResult("good"), app.AsyncResult("bad")])
    good_value, bad_value = group.join_native(timeout=5, propagate=False)
    assert good_value == 3 and isinstance(bad_value, UnreadableResult)


def test_a_failure_whose_result_a_hand_edit_took_away_reads_as_the_job_s_error(app: Celery, db: Database) -> None:
    finished(db, "01A", "t", status="failed", state=states.FAILURE, lastError="ValueError: no", result=None)
    db.jobs.update_one({"_id": "01A"}, {"$unset": {"result": "", "resultFormat": ""}})
    with pytest.raises(Exception, match="ValueError: no"):  # was: RuntimeError('No active exception to reraise')
        app.AsyncResult("t").get(timeout=5)


def test_fields_of_another_type_are_left_out_of_the_meta(app: Celery, db: Database) -> None:
    finished(db, "01A", "t", children=5, dateDone="yesterday", traceback=7)
    result = app.AsyncResult("t")
    assert (result.get(timeout=5), result.children, result.date_done, result.traceback) == (3, [], None, None)


def test_a_wait_on_a_job_with_an_object_id_times_out_as_any_other(app: Celery, db: Database) -> None:
    now = datetime.now(UTC)
    db.jobs.insert_one({"_id": ObjectId(), "taskId": "a", "status": "queued", "queue": "celery", "runAfter": now})
    db.jobs.insert_one({"_id": "01B", "taskId": "b", "status": "queued", "queue": "celery", "runAfter": now})
    group = app.GroupResult("g", [app.AsyncResult("a"), app.AsyncResult("b")])
    with pytest.raises(CeleryTimeoutError):  # was: TypeError, ObjectId and str compared
        group.join_native(timeout=1)


def test_result_extended_decodes_the_message_by_the_results_accept_list(
    broker_url: str, db: Database, tmp_path: Path
) -> None:
    app = producer(broker_url)
    app.conf.update(
        result_backend=broker_url,
        result_extended=True,
        accept_content=["json", "pickle"],
        result_accept_content=["json"],
    )
    marker = tmp_path / "unpickled"
    raw = {"headers": {"id": "p", "task": "k", "retries": 0}, "properties": {},
           "content-type": "application/x-python-serialize", "content-encoding": "binary"}  # fmt: skip
    body = base64.b64encode(pickle.dumps(((Exploit(marker),), {}, {}))).decode()
    finished(db, "01A", "p", payload={"raw": json.dumps(raw), "body": body})
    result = app.AsyncResult("p")
    assert (result.get(timeout=5), result.args) == (3, None)
    assert not marker.exists()
    app.close()


def test_a_saved_group_that_cannot_be_read_says_so(app: Celery, db: Database) -> None:
    for bad in ({}, {"result": None}, {"result": "garbage", "resultFormat": "json"}, {"result": {"result": 5}}):
        db.bb_results.replace_one({"_id": "group:g"}, {"kind": "group", **bad}, upsert=True)
        with pytest.raises(UnreadableResult, match="group g: its saved result cannot be read"):
            app.GroupResult.restore("g", backend=app.backend)


def chord_of_two(app: Celery, group_id: str) -> Any:
    """A chord of two header tasks applied, its callback (tsum): the counter as apply_chord writes it."""
    app.backend.apply_chord((group_id, [app.AsyncResult("t0"), app.AsyncResult("t1")]), tsum(app))
    app.backend.set_chord_size(group_id, 2)
    return tsum(app)


def callbacks_sent(db: Database) -> int:
    return db.jobs.count_documents({"kind": "tests.support.e2e_app.tsum"})


@pytest.mark.parametrize("size", [0, -1, "2", 1.5, True])
def test_a_chord_counter_whose_size_is_no_count_sends_no_callback_with_part_of_the_results(
    app: Celery, db: Database, size: Any, caplog: pytest.LogCaptureFixture
) -> None:
    callback = chord_of_two(app, "g")
    db.bb_results.update_one({"_id": "chord:g"}, {"$set": {"size": size}})
    app.backend.on_chord_part_return(part("t0", "g", 0, callback), states.SUCCESS, 5)
    assert callbacks_sent(db) == 0
    assert "chord g: its counter holds no counts" in caplog.text


def test_a_chord_counter_whose_size_a_shell_wrote_as_a_double_completes(app: Celery, db: Database) -> None:
    callback = chord_of_two(app, "g")
    db.bb_results.update_one({"_id": "chord:g"}, {"$set": {"size": 2.0}})  # mongosh's numbers are doubles
    for index, value in enumerate((5, 7)):
        app.backend.on_chord_part_return(part(f"t{index}", "g", index, callback), states.SUCCESS, value)
    assert callbacks_sent(db) == 1


@pytest.mark.parametrize("claim", ["x", {"by": "t0:0", "firstId": {"$ne": None}}, {"by": 5, "firstId": "c1"}])
def test_a_callback_claim_written_by_hand_is_read_as_data_and_sends_nothing(
    app: Celery, db: Database, claim: Any, caplog: pytest.LogCaptureFixture
) -> None:
    callback = chord_of_two(app, "g")
    finished(db, "01A", "someone-else")
    db.bb_results.update_one({"_id": "chord:g"}, {"$set": {"callback": claim}})
    for index, value in enumerate((5, 7)):
        app.backend.on_chord_part_return(part(f"t{index}", "g", index, callback), states.SUCCESS, value)
    assert callbacks_sent(db) == 0
    assert "chord g: its callback claim is not one" in caplog.text
    assert "sent" not in db.bb_results.find_one({"_id": "chord:g"})  # was: an operator query, and marked sent
