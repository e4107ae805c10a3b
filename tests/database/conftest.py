"""Fixtures of the database tests that work on one store with a clock of their own (a module may define its own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from tests.support.store import CommandLog, FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db: Database, clock: FakeClock) -> JobStore:
    """A store on the test's database with its indexes, a 30 s lease and the fake `clock`."""
    store = JobStore(db, Policy(stale_after=30), clock=clock)
    store.ensure_indexes()
    return store


@pytest.fixture
def log() -> CommandLog:
    """The commands `client` sends."""
    return CommandLog()


@pytest.fixture
def client(own_server, log: CommandLog) -> Iterator[MongoClient]:
    """A client of the test's own server whose commands go to `log`."""
    with MongoClient(own_server.url, tz_aware=True, event_listeners=[log]) as client:
        yield client
