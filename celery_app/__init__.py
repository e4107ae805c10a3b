"""The example Celery app: its broker is the `jobs` collection, through bbmongo://."""

from __future__ import annotations

import os

from celery import Celery

import bb_broker  # noqa: F401  (registers bbmongo://)

BROKER_URL = os.environ.get("BB_BROKER_URL", "bbmongo://localhost:27017/bountyboard")

app = Celery("celery_app", include=["celery_app.tasks"])
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=BROKER_URL,  # results live on the job documents too (bb_broker.results.backend)
    task_time_limit=600,  # the seed's 10 minutes; a task past it counts as a failure
    worker_prefetch_multiplier=1,  # claim only what a pool process is about to run
    worker_send_task_events=True,
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
)
