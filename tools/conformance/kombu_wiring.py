"""Kombu's integration classes wired for bbmongo://, as Kombu's t/integration/test_mongodb.py wires mongodb://.

Copied next to Kombu's own common.py and test_mongodb.py (from Kombu's sdist) and run from there, so the
relative imports are Kombu's. Besides the classes test_mongodb.py runs (with its overrides), the common classes
it leaves out run too: time-to-live, failover and the event loop.
"""

from __future__ import annotations

import os
import socket

import kombu
import pytest

import bb_broker  # noqa: F401 (registers bbmongo://)

from . import common
from . import test_mongodb as mongodb_wiring

URL = os.environ["BB_CONFORMANCE_URL"]  # bbmongo://host:port/database


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def connection():
    return kombu.Connection(URL)


@pytest.fixture()
def invalid_connection():
    return kombu.Connection(f"bbmongo://127.0.0.1:{_dead_port()}/tests", connect_timeout=1)


@pytest.fixture()
def failover_connection():
    database = URL.rsplit("/", 1)[1]
    return kombu.Connection(f"bbmongo://127.0.0.1:{_dead_port()}/{database};{URL}", connect_timeout=1)


class test_BBMongoBasicFunctionality(mongodb_wiring.test_MongoDBBasicFunctionality):
    pass


class test_BBMongoExchangeTypes(mongodb_wiring.test_MongoDBBaseExchangeTypes):
    pass


class test_BBMongoFanoutDeclaredFirst(common.BaseExchangeTypes):
    """Kombu's own fanout test (publish, then declare the consumers), which test_mongodb.py replaces."""

    test_direct = test_direct_routing_keys = test_topic = test_publish_empty_exchange = None


class test_BBMongoPriority(mongodb_wiring.test_MongoDBPriority):
    pass


class test_BBMongoMessage(mongodb_wiring.test_MongoDBMessage):
    pass


class test_BBMongoTimeToLive(common.BaseTimeToLive):
    pass


class test_BBMongoFailover(common.BaseFailover):
    pass


class test_BBMongoEventLoop(common.BaseEventLoop):
    pass
