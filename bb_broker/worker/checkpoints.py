"""Jobs that resume: `bb_broker.checkpoint(value)` saves where a task is on its own job document, and
`bb_broker.last_checkpoint()` reads it back when the job runs again (jobs/checkpoints.py keeps the document's side).

Both act for the task running now (Celery's `current_task`), or the bound task given as `task=`. The checkpoint read
once per attempt is kept on the attempt's request (which lives exactly as long as the attempt), and so is each one
the attempt saves: reading it again costs no round trip.
"""

from __future__ import annotations

from typing import Any

from celery import current_task

from bb_broker.jobs import checkpoints
from bb_broker.worker import settle

#: The attribute of a task's request that holds the attempt's checkpoint as last read or saved: a 1-tuple, so that a
#: checkpoint of None is told from none read yet.
_KNOWN = "bb_checkpoint"


def _running(task: Any, verb: str) -> tuple[Any, tuple[str, int], Any]:
    """The task, its (job id, attempt) and its job store; RuntimeError outside a task delivered through bbmongo://."""
    task = task if task is not None else current_task
    request = getattr(task, "request", None) if task else None
    job = settle.job_of(request) if request is not None else None
    store = settle.store_of(task) if job is not None else None
    if job is None or store is None:
        raise RuntimeError(f"{verb}() works only inside a task delivered through bbmongo://")
    return request, job, store


def checkpoint(value: Any, *, task: Any = None) -> bool:
    """Save `value` (JSON types only, at most jobs.checkpoints.MAX_CHECKPOINT_BYTES as JSON) as the job's checkpoint,
    for its next attempt to resume from; an object with numeric `done` and `total` shows as the job's progress bar.

    Returns False, having changed nothing, when this attempt no longer holds its job (the stale sweep gave it to
    another worker): the task may stop there. Raises CheckpointError for a value that cannot be one, in the task:
    the attempt fails as any exception of its own would."""
    text = checkpoints.encoded(value)  # checked before any round trip
    request, job, store = _running(task, "checkpoint")
    saved = checkpoints.save(store, job, text, checkpoints.counts_of(value), store.now())
    if saved:
        setattr(request, _KNOWN, (checkpoints.decoded(text, job[0]),))  # a copy, as a read would give it
    return saved


def last_checkpoint(*, task: Any = None) -> Any:
    """The job's last saved checkpoint (by this attempt or an earlier one), or None when it has none (a first run)."""
    request, job, store = _running(task, "last_checkpoint")
    known = getattr(request, _KNOWN, None)
    if known is None:
        known = (checkpoints.load(store, job[0]),)
        setattr(request, _KNOWN, known)
    return known[0]
