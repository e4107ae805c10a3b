"""Unique tasks, registered on any app: the e2e worker's (tests/support/e2e_app.py) runs them, and a test's producer
registers the same ones so that their task options (`unique=True`, `unique_on=...`) are read where it publishes."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

#: The prefix of every task name here.
NAME = "tests.support.unique_app."


def _wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def register(app: Celery) -> dict[str, Any]:
    """Define the unique tasks on `app`; returns them by their short name."""

    @app.task(name=NAME + "add", unique=True, shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name=NAME + "hold", unique=True, shared=False)
    def hold(path: str) -> str:
        """Runs until `path` exists: a unique job kept running while the test looks at its key."""
        _wait_for_file(path)
        return path

    @app.task(name=NAME + "hold_queued", unique=True, unique_while="queued", shared=False)
    def hold_queued(path: str) -> str:
        _wait_for_file(path)
        return path

    @app.task(name=NAME + "daily", unique_period=24 * 3600, shared=False)
    def daily(report: str) -> str:
        return report

    @app.task(name=NAME + "charge", unique_on=("account_id",), shared=False)
    def charge(account_id: int, amount: int = 0) -> int:
        return amount

    @app.task(name=NAME + "notify", fair_on=("customer_id",), shared=False)
    def notify(customer_id: int, subject: str = "") -> str:
        return subject

    @app.task(name=NAME + "fails", unique=True, shared=False)
    def fails(text: str) -> None:
        raise ValueError(text)

    @app.task(name=NAME + "fails_until_file", unique=True, shared=False)
    def fails_until_file(path: str) -> str:
        """Fails (the broker retries it) until `path` exists."""
        if not os.path.exists(path):
            raise ValueError("not yet")
        return path

    @app.task(bind=True, name=NAME + "retries_self", unique=True, max_retries=50, shared=False)
    def retries_self(self: Any, path: str) -> str:
        """Its own Celery retry (`self.retry()`), until `path` exists."""
        if not os.path.exists(path):
            raise self.retry(countdown=0.2, exc=RuntimeError("not yet"))
        return path

    @app.task(name=NAME + "plain", shared=False)
    def plain(x: int) -> int:
        return x

    return {
        task.name.removeprefix(NAME): task
        for task in (add, hold, hold_queued, daily, charge, notify, fails, fails_until_file, retries_self, plain)
    }
