"""Unique jobs: a job's `uniqueKey`, kept unique by a partial index, and the error a second job with it raises.

A task message whose header UNIQUE_KEY_HEADER holds a key becomes a job with that key in `uniqueKey`; the index
UNIQUE_INDEX (over the documents that have the field, so that jobs without a key are not limited) refuses a second
job with the same key, and the publish raises DuplicateJob. Whoever publishes decides what a key means: `celery
beat` on bb_broker.beat uses `beat:<entry>:<slot>` and never gives a key back.
"""

from __future__ import annotations

from pymongo import ASCENDING, IndexModel

#: The header of a task message that carries its job's unique key.
UNIQUE_KEY_HEADER = "bb_unique_key"
#: The longest key a header may carry (an index key must stay well below the server's limits).
MAX_UNIQUE_KEY_LENGTH = 512

UNIQUE_INDEX = IndexModel(
    [("uniqueKey", ASCENDING)],
    name="bb_unique_key",
    unique=True,
    partialFilterExpression={"uniqueKey": {"$exists": True}},
)


class DuplicateJob(Exception):
    """A job with this unique key exists already: the publish wrote nothing.

    `task_id` and `job_id` are the existing job's, read once after the index refused the insert (None when that job
    was deleted in between)."""

    def __init__(self, unique_key: str, task_id: str | None, job_id: str | None) -> None:
        # The fields as its args: pickle, and Celery's serialized exceptions, rebuild it as cls(*args).
        super().__init__(unique_key, task_id, job_id)
        self.unique_key = unique_key
        self.task_id = task_id
        self.job_id = job_id

    def __str__(self) -> str:
        return f"a job with unique key {self.unique_key!r} exists already (task id {self.task_id})"
