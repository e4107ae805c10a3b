"""A pytest plugin for Celery's integration suites: the run's transport options, and a suite time limit.

Celery's conftest builds its app from TEST_BROKER and TEST_BACKEND alone; BB_CONFORMANCE_TRANSPORT_OPTIONS (JSON)
adds `broker_transport_options` to its `celery_config` fixture, for the columns that need them.
BB_CONFORMANCE_DEADLINE (a Unix time) ends the session after the test that passes it, so that pytest still writes
its report: Celery's in-process worker ignores SIGINT, so interrupting the run would lose it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Iterator[None]:
    outcome = yield
    options = os.environ.get("BB_CONFORMANCE_TRANSPORT_OPTIONS")
    if fixturedef.argname == "celery_config" and options:
        outcome.get_result()["broker_transport_options"] = json.loads(options)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    deadline = os.environ.get("BB_CONFORMANCE_DEADLINE")
    if deadline and time.time() > float(deadline) and _session is not None:
        _session.shouldstop = "the suite's time limit was reached"


_session: Any = None


def pytest_sessionstart(session: Any) -> None:
    global _session
    _session = session
