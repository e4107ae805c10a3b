"""Run now: a job waiting for an hour's countdown runs on a real worker once an operator says so, woken by the change.

The workers' safety poll is an hour too, and their timer for the job's runAfter an hour away: the only way the job
can run within the test is the change stream's news of its new runAfter.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from click.testing import CliRunner
from pymongo.database import Database

from bb_broker.cli import main
from bb_broker.clock import aware
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import RUN_NOW, Operations
from tests.support.workers import job, send, settled, wait_for

#: No safety poll within a test: a claim can only follow a wake-up.
NO_SAFETY_POLL = {"safety_poll_interval": 3600.0}


def waiting(db: Database, task_id: str) -> dict:
    """The task's job, once it is stored queued with its countdown."""
    return wait_for(settled(db, task_id, "queued"), message=f"{task_id} stored, waiting for its countdown")


def test_run_now_makes_a_job_with_an_hours_countdown_run_on_a_real_worker(app, db: Database, worker_factory) -> None:
    worker = worker_factory(options=NO_SAFETY_POLL)
    wait_for(lambda: app.control.inspect(timeout=1).ping(), message="the worker answered a ping")
    task_id = send(app, "add", 2, 3, countdown=3600)
    before = waiting(db, task_id)
    assert aware(before["runAfter"]) > datetime.now(UTC) + timedelta(minutes=50)
    assert "startedAt" not in before

    doc = Operations(JobStore(db, Policy())).act(RUN_NOW, task_id, by="ops@example")
    # Read back after the write: the woken worker may have claimed the job already (it claims at once).
    assert doc["status"] in ("queued", "running", "succeeded") and aware(doc["runAfter"]) <= datetime.now(UTC)
    assert doc["actions"][-1]["action"] == RUN_NOW and doc["actions"][-1]["by"] == "ops@example"

    done = wait_for(settled(db, task_id, "succeeded"), message="the job ran after run-now")
    assert aware(done["startedAt"]) < aware(before["runAfter"]) and done["attempts"] == 1
    assert done["history"][-1]["outcome"] == "succeeded"
    assert "no change streams" not in worker.log()


def test_bb_broker_run_now_by_filter_wakes_the_worker_for_every_waiting_job(
    app, broker_url: str, db: Database, worker_factory
) -> None:
    worker_factory(options=NO_SAFETY_POLL, extra_args=("-Q", "celery,mail"))
    wait_for(lambda: app.control.inspect(timeout=1).ping(), message="the worker answered a ping")
    mail = [send(app, "add", n, n, countdown=3600, queue="mail") for n in range(3)]
    other = send(app, "add", 9, 9, countdown=3600)
    for task_id in [*mail, other]:
        waiting(db, task_id)

    blank = CliRunner().invoke(main, ["run-now", "--queue", "   ", "--broker", broker_url])  # was: every queue's jobs
    assert (blank.exit_code, blank.output) == (
        2,
        "bb-broker: run-now: --queue is blank: give the name of a queue or a task\n",
    )
    assert all(aware(job(db, task_id)["runAfter"]) > datetime.now(UTC) for task_id in [*mail, other])
    result = CliRunner().invoke(main, ["run-now", "--queue", "mail", "--broker", broker_url])
    assert result.exit_code == 0, result.output
    assert result.output == "3 waiting jobs due now\n"
    for task_id in mail:
        done = wait_for(settled(db, task_id, "succeeded"), message=f"{task_id} ran after run-now")
        assert done["actions"][-1]["action"] == RUN_NOW and done["actions"][-1]["by"].endswith("(bb-broker)")
    # The job of the other queue still waits for its countdown, untouched.
    left = job(db, other)
    assert left["status"] == "queued" and "actions" not in left
    assert aware(left["runAfter"]) > datetime.now(UTC) + timedelta(minutes=50)
