"""Per-attempt state travels with the task's request: attempts in flight in one process never lose each other's."""

from __future__ import annotations

from datetime import UTC, datetime

from celery import Celery, signals
from celery.app.task import Context
from pymongo.database import Database

import bb_broker  # noqa: F401  (registers bbmongo://)
from bb_broker.jobs.payloads import ATTEMPTS_HEADER, JOB_ID_HEADER

#: More attempts in flight than the old module-level dicts held before they were emptied wholesale (1,000).
IN_FLIGHT = 1_050


def test_every_attempt_in_flight_keeps_its_start_however_many_there_are(app: Celery, db: Database) -> None:
    # A worker with many attempts started and not yet settled (a threads pool, long tasks): each settles with the
    # start its task_prerun recorded, whatever happened to the others meanwhile.
    @app.task(name="tests.attempt_state.work", shared=False)
    def work() -> None:
        """Never run: its signals are sent as Celery's tracer sends them, around a request it pushes."""

    now = datetime.now(UTC)
    db.jobs.insert_many(
        {"_id": f"job-{n}", "taskId": f"task-{n}", "status": "running", "attempts": 1, "queue": "celery",
         "createdAt": now, "updatedAt": now, "startedAt": now}
        for n in range(IN_FLIGHT)
    )  # fmt: skip
    requests = [
        Context(id=f"task-{n}", hostname="worker@test", headers={JOB_ID_HEADER: f"job-{n}", ATTEMPTS_HEADER: 1})
        for n in range(IN_FLIGHT)
    ]
    for request in requests:  # every attempt starts
        work.request_stack.push(request)  # as the tracer does
        try:
            signals.task_prerun.send(sender=work, task_id=request.id, task=work, args=(), kwargs={})
        finally:
            work.request_stack.pop()
    for request in requests:  # then each one ends
        work.request_stack.push(request)  # as the tracer does
        try:
            signals.task_success.send(sender=work, result=None)
        finally:
            work.request_stack.pop()
    entries = [doc["history"][-1] for doc in db.jobs.find({}, {"history": 1}).sort("_id")]
    assert len(entries) == IN_FLIGHT
    without_start = [entry["n"] for entry in entries if entry.get("startedAt") is None]
    assert without_start == [], f"{len(without_start)} attempts settled without the start recorded for them"
    assert {entry["outcome"] for entry in entries} == {"succeeded"}
