"""Fixtures of the database tests that work on one store with a clock of their own (a module may define its own)."""

from __future__ import annotations

import pytest
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from tests.support.store import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db: Database, clock: FakeClock) -> JobStore:
    """A store on the test's database with its indexes, a 30 s lease and the fake `clock`."""
    store = JobStore(db, Policy(stale_after=30), clock=clock)
    store.ensure_indexes()
    return store
