"""A pytest plugin for Celery's integration suites: the run's broker transport options go into Celery's test app.

Celery's conftest builds its app from TEST_BROKER and TEST_BACKEND alone; BB_CONFORMANCE_TRANSPORT_OPTIONS (JSON)
adds `broker_transport_options` to its `celery_config` fixture, for the columns that need them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Iterator[None]:
    outcome = yield
    options = os.environ.get("BB_CONFORMANCE_TRANSPORT_OPTIONS")
    if fixturedef.argname == "celery_config" and options:
        outcome.get_result()["broker_transport_options"] = json.loads(options)
