"""A unique job's page in the Jobs tab: its key, its mode, and whether it holds the key now."""

from __future__ import annotations

import html

from pymongo.database import Database

from bb_broker.jobs.store import JobStore
from bb_broker.jobs.unique import Hold


def test_a_unique_jobs_page_shows_its_key_and_mode(db: Database, flower_factory) -> None:
    store = JobStore(db)
    store.ensure_indexes()
    payload = {"args": [7], "kwargs": {}, "options": {}, "headers": {"id": "task-u"}, "properties": {}}
    hold = Hold("invoice:7", "active")
    store.publish(queue="celery", kind="app.bill", task_id="task-u", payload=payload, priority=0, run_after=None,
                  is_retry=False, unique=hold)  # fmt: skip
    flower = flower_factory()
    page = html.unescape(flower.page("/jobs/job?id=task-u"))
    assert "unique key" in page and "invoice:7 (mode active: held while queued or running; held now)" in page
    job = store.claim("celery", "worker-1")
    assert job is not None and store.succeed(job.id, job.attempts)
    page = html.unescape(flower.page("/jobs/job?id=task-u"))
    assert "invoice:7 (mode active: held while queued or running; given back)" in page
