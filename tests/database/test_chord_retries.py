"""A chord's header task that failed for good and an operator retried, against the real server, the backend called as
a worker calls it: its success replaces its failed part once, and the chord's callback is sent once, whatever races."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.exceptions import TaskRevokedError
from pymongo.database import Database

from bb_broker.results.backend import JobResultBackend
from tests.support.workers import producer

ECHO = "tests.support.e2e_app.echo"


@pytest.fixture
def app(broker_url: str):
    app = producer(broker_url)
    app.conf.result_backend = broker_url
    yield app
    app.close()


def echo(app: Celery) -> Any:
    """The chord's body, its task id given as Celery gives it when the chord is applied."""
    return app.signature(ECHO).set(task_id="body-id")


def part(task_id: str, group_id: str, index: int, callback: Any) -> Context:
    return Context({"id": task_id, "group": group_id, "group_index": index, "chord": callback})


def chord_of(app: Celery, group_id: str, size: int) -> None:
    app.backend.apply_chord((group_id, [app.AsyncResult(f"t{i}") for i in range(size)]), echo(app))
    app.backend.set_chord_size(group_id, size)


def failed(app: Celery, group_id: str, index: int, backend: JobResultBackend | None = None) -> None:
    (backend or app.backend).on_chord_part_return(
        part(f"t{index}", group_id, index, echo(app)), states.FAILURE, RuntimeError(f"t{index} is broken")
    )


def succeeded(app: Celery, group_id: str, index: int, backend: JobResultBackend | None = None) -> None:
    (backend or app.backend).on_chord_part_return(
        part(f"t{index}", group_id, index, echo(app)), states.SUCCESS, f"value {index}"
    )


def bodies(db: Database) -> list[dict[str, Any]]:
    return list(db.jobs.find({"kind": ECHO}))


def test_a_failed_part_retried_sends_the_failed_chords_body_once_under_its_id(app: Celery, db: Database) -> None:
    chord_of(app, "g1", 3)
    succeeded(app, "g1", 0)
    failed(app, "g1", 1)
    failed(app, "g1", 2)
    assert db.bb_results.find_one({"_id": "chord:g1"})["failed"] is True
    assert db.bb_results.find_one({"_id": "task:body-id"})["state"] == "FAILURE"  # the ChordError
    succeeded(app, "g1", 1)  # one of the two retried: the chord stays failed
    failed(app, "g1", 2)  # the other retried, failing again
    assert bodies(db) == []
    succeeded(app, "g1", 2)
    succeeded(app, "g1", 2)  # its worker died after the send: it runs again
    succeeded(app, "g1", 0)  # a part that never failed, run again
    [body] = bodies(db)
    assert body["taskId"] == "body-id" and body["payload"]["args"] == [["value 0", "value 1", "value 2"]]
    counter = db.bb_results.find_one({"_id": "chord:g1"})
    assert counter["count"] == 3 and counter["fixedKeys"] == ["t1:1", "t2:2"] and counter["resent"]
    assert counter["resend"]["by"] == "t2:2"


def test_failed_parts_retried_together_send_the_body_once(app: Celery, db: Database) -> None:
    size = 6
    chord_of(app, "g2", size)
    for i in range(size):
        failed(app, "g2", i)
    barrier = threading.Barrier(size)

    def retried(i: int) -> None:
        backend = JobResultBackend(app, url=app.conf.result_backend)  # a backend per thread, as Celery has
        barrier.wait()
        succeeded(app, "g2", i, backend)

    threads = [threading.Thread(target=retried, args=(i,)) for i in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    [body] = bodies(db)
    assert body["payload"]["args"] == [[f"value {i}" for i in range(size)]]


def test_a_part_fixed_while_the_last_part_fails_the_chord_still_sends_the_body_once(
    app: Celery, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    chord_of(app, "g3", 2)
    failed(app, "g3", 0)
    chord_values = JobResultBackend._chord_values
    fixed: list[bool] = []

    def fixed_meanwhile(self: JobResultBackend, *args: Any) -> Any:
        # The last part read the parts (part 0 failed); part 0's retry succeeds before it marks the chord failed.
        if not fixed:
            fixed.append(True)
            succeeded(app, "g3", 0, JobResultBackend(app, url=app.conf.result_backend))
            assert bodies(db) == []  # the fix found the chord still completing: it only counted
        return chord_values(self, *args)

    monkeypatch.setattr(JobResultBackend, "_chord_values", fixed_meanwhile)
    succeeded(app, "g3", 1)
    [body] = bodies(db)
    assert body["taskId"] == "body-id" and body["payload"]["args"] == [["value 0", "value 1"]]


def test_a_revoked_part_retried_under_a_new_id_replaces_its_part_under_the_id_it_first_ran_under(
    app: Celery, db: Database
) -> None:
    chord_of(app, "g9", 3)
    succeeded(app, "g9", 0)
    app.backend.on_chord_part_return(part("t1", "g9", 1, echo(app)), states.REVOKED, TaskRevokedError("terminated"))
    succeeded(app, "g9", 2)
    assert db.bb_results.find_one({"_id": "chord:g9"})["failed"] is True
    # The retry under a new id, its delivery naming the id it first ran under: it replaces the revoked part, once.
    for _ in range(2):  # its worker died after the send: it runs again
        retried = part("t1-new", "g9", 1, echo(app))
        retried.bb_renamed_from = "t1"
        app.backend.on_chord_part_return(retried, states.SUCCESS, "value 1")
    [body] = bodies(db)
    assert body["taskId"] == "body-id" and body["payload"]["args"] == [["value 0", "value 1", "value 2"]]
    counter = db.bb_results.find_one({"_id": "chord:g9"})
    assert counter["fixedKeys"] == ["t1:1"]
    assert [(fixed["id"], fixed["firstId"]) for fixed in counter["fixed"]] == [("t1-new", "t1")]


def test_a_renamed_from_header_that_is_no_task_id_is_ignored(app: Celery, db: Database) -> None:
    chord_of(app, "g10", 2)
    for index, odd in enumerate((5, "x" * 256)):  # a hand edit: each part counted under its own id
        hand_edited = part(f"t{index}", "g10", index, echo(app))
        hand_edited.bb_renamed_from = odd
        app.backend.on_chord_part_return(hand_edited, states.SUCCESS, f"value {index}")
    assert db.bb_results.find_one({"_id": "chord:g10"})["members"] == ["t0:0", "t1:1"]
    [body] = bodies(db)
    assert body["payload"]["args"] == [["value 0", "value 1"]]
