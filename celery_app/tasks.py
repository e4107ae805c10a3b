"""Example tasks, one for each path through the job lifecycle."""

from __future__ import annotations

import time

from celery.utils.log import get_task_logger

import bb_broker

from . import app

logger = get_task_logger(__name__)


@app.task
def add(x: int, y: int) -> int:
    """Succeeds at once."""
    return x + y


@app.task(bind=True)
def flaky(self, label: str) -> str:
    """Fails on its first attempt, succeeds on the retry the broker schedules."""
    if self.request.bb_attempts < 2:
        raise RuntimeError(f"{label}: transient failure on attempt {self.request.bb_attempts}")
    return f"{label}: ok on attempt {self.request.bb_attempts}"


@app.task(bind=True)
def always_fails(self, label: str) -> None:
    """Fails every attempt; on the last one it runs its compensation logic first."""
    if bb_broker.is_final_attempt(self):
        logger.warning("%s: final attempt, compensating", label)
    raise RuntimeError(f"{label}: permanent failure")


@app.task
def long_running(seconds: float) -> float:
    """Works for a while, as a report or an export would."""
    time.sleep(seconds)
    return seconds
