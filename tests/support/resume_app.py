"""The e2e app with tasks that resume from their checkpoints (tests/e2e/test_checkpoints_e2e.py): run a worker with
`app="tests.support.resume_app"`. Each records what it did in `runs`, as e2e_app's tasks do."""

from __future__ import annotations

import time

import bb_broker
from tests.support.e2e_app import app, record, runs

__all__ = ["app"]


def _gate(key: str) -> None:
    """Wait until the test opens `key` (a document in `fixes`)."""
    while runs().database.fixes.find_one({"_id": key}) is None:
        time.sleep(0.05)


@app.task(bind=True)
def items(self, total, stop_after, how):
    """Does items 1..`total`, one checkpoint after each, resuming after the last checkpointed one. On its first
    attempt it stops after item `stop_after`: `hold` (waits there, to be killed), `retry` (Celery's self.retry;
    `retry-later` with a countdown of 3 s) or `raise` (an exception: the broker's retry); `until-fixed` stops there
    on every attempt while `fixed` is not in `fixes` (an operator's retry then)."""
    resumed = bb_broker.last_checkpoint()
    record(self, phase="start", resumed=resumed)
    start = resumed["done"] if resumed else 0
    for item in range(start + 1, total + 1):
        record(self, item=item)
        bb_broker.checkpoint({"done": item, "total": total})
        if how == "until-fixed" and item == stop_after and not runs().database.fixes.find_one({"_id": "fixed"}):
            raise RuntimeError(f"stopped after item {item} until fixed")
        if item == stop_after and self.request.bb_attempts == 1 and how != "until-fixed":
            if how == "hold":
                record(self, phase="holding")
                _gate("never")
            if how in ("retry", "retry-later"):
                countdown = 3 if how == "retry-later" else 0
                raise self.retry(countdown=countdown, exc=RuntimeError(f"stopped after item {item}"))
            raise RuntimeError(f"stopped after item {item}")
    return total


@app.task(bind=True)
def save_after_gate(self, key):
    """Waits for `<key>:<attempt>`, saves a checkpoint naming its attempt and records whether it landed and what it
    reads back; then waits for `<key>:<attempt>:end`."""
    attempt = self.request.bb_attempts
    record(self, phase="start")
    _gate(f"{key}:{attempt}")
    saved = bb_broker.checkpoint({"attempt": attempt})
    record(self, phase="saved", saved=saved, reads=bb_broker.last_checkpoint())
    _gate(f"{key}:{attempt}:end")
    return attempt


#: The values bad_checkpoint tries, by name: none of them can be a checkpoint.
BAD_VALUES = {
    "object": lambda: {"cursor": object()},
    "nan": lambda: {"done": float("nan")},
    "int key": lambda: {1: "one"},
    "oversize": lambda: {"blob": "x" * (17 * 1024)},
    "deep": lambda: _nested(40),
}


def _nested(depth):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@app.task(bind=True)
def bad_checkpoint(self, kind):
    """Saves one of BAD_VALUES; records the error it met, then raises it (the task's own failure)."""
    try:
        bb_broker.checkpoint(BAD_VALUES[kind]())
    except bb_broker.CheckpointError as exc:
        record(self, error=f"{type(exc).__name__}: {exc}")
        raise
    record(self, error=None)


@app.task(bind=True)
def show_progress(self, steps, key, how):
    """Reports each of `steps` (`{done, total}`) as Celery's PROGRESS state (`how` "state") or as its checkpoint
    ("checkpoint"), then waits for `<key>:<index>`: its job shows a progress bar meanwhile."""
    for index, step in enumerate(steps):
        if how == "state":
            self.update_state(state="PROGRESS", meta=step)
        else:
            bb_broker.checkpoint(step)
        record(self, phase="reported", step=index)
        _gate(f"{key}:{index}")
    return len(steps)
