"""Fixtures: a real MongoDB (embedded unless BB_TEST_MONGO_URL is set), a database per test, and workers."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.server import capabilities
from tests.support.servers import AUTH_PASSWORD, EmbeddedServer, external_url, with_database
from tests.support.workers import STARTED, Worker, process_factory, producer

#: The folders of tests/ by what their tests need, each the name of the marker its tests get (`-m database`).
FOLDERS = ("unit", "database", "e2e", "faults", "flower", "packaging")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        folder = item.path.resolve().relative_to(here).parts[0]
        if folder not in FOLDERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of tests/{{{','.join(FOLDERS)}}}")
        item.add_marker(folder)


def _embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedServer(tmp_path_factory.mktemp("mongo") / "data")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def suite_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server the suite runs against: BB_TEST_MONGO_URL's deployment, or an embedded server."""
    url = external_url()
    if url:
        yield url
    else:
        yield from _embedded(tmp_path_factory)


@pytest.fixture(scope="session")
def stand_in_url(suite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded server (a replica set member that has change streams and fail points): the suite's own, or under
    BB_TEST_MONGO_URL one more, started the first time a test asks for it."""
    if external_url():
        yield from _embedded(tmp_path_factory)
    else:
        yield suite_url


class Clients(dict[str, MongoClient]):
    """One client per server URL for the whole session."""

    def __missing__(self, url: str) -> MongoClient:
        client: MongoClient = MongoClient(url, tz_aware=True)
        self[url] = client
        return client


@pytest.fixture(scope="session")
def clients() -> Iterator[Clients]:
    made = Clients()
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="session")
def suite_has_change_streams(suite_url: str, clients: Clients) -> bool:
    return capabilities(clients[suite_url]["bbt_capabilities"]).change_streams


@pytest.fixture
def mongo_url(request: pytest.FixtureRequest, suite_url: str) -> str:
    """The server this test runs on: the suite's, except for a test marked `stand_in` (a wire proxy plays another
    deployment in front of the embedded server) or `change_streams` (it tests what a change stream does) where the
    suite's deployment has none (a standalone mongod): those select the embedded server, which is what they test."""
    if request.node.get_closest_marker("stand_in") or (
        request.node.get_closest_marker("change_streams") and not request.getfixturevalue("suite_has_change_streams")
    ):
        return str(request.getfixturevalue("stand_in_url"))
    return suite_url


@pytest.fixture
def mongo_client(mongo_url: str, clients: Clients) -> MongoClient:
    return clients[mongo_url]


@pytest.fixture
def db_name(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9]", "_", request.node.name)[-40:]
    # Under pytest-xdist each process starts its own server, unless BB_TEST_MONGO_URL names one they all share.
    process = os.environ.get("PYTEST_XDIST_WORKER", "") if external_url() else ""
    return f"bbt_{process}{name}"


@pytest.fixture
def db(mongo_client: MongoClient, db_name: str) -> Iterator[Database]:
    mongo_client.drop_database(db_name)
    yield mongo_client[db_name]
    mongo_client.drop_database(db_name)


@pytest.fixture(scope="session")
def auth_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data directory of a stopped server that has the user `bb` (AUTH_PASSWORD, root on admin), made once a
    session: each auth_server starts from a copy of it instead of creating the user itself."""
    data = tmp_path_factory.mktemp("auth") / "data"
    server = EmbeddedServer(data)
    server.start()
    with MongoClient(server.url) as client:
        client.admin.command("createUser", "bb", pwd=AUTH_PASSWORD, roles=[{"role": "root", "db": "admin"}])
    server.stop()
    return data


@pytest.fixture
def auth_server(tmp_path: Path, auth_data: Path) -> Iterator[EmbeddedServer]:
    """A server of this test's own that asks for a password: user `bb`, AUTH_PASSWORD, root on admin."""
    shutil.copytree(auth_data, tmp_path / "data")
    server = EmbeddedServer(tmp_path / "data", auth=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def broker_url(mongo_url: str, db: Database) -> str:
    return with_database(mongo_url, db.name)


@pytest.fixture
def results_app(broker_url: str) -> Iterator[Celery]:
    """A producer app whose result backend is the broker's own database (bbmongo://)."""
    app = producer(broker_url)
    app.conf.result_backend = broker_url
    yield app
    app.close()


@pytest.fixture(autouse=True)
def _kill_every_worker_started() -> Iterator[None]:
    yield
    while STARTED:
        STARTED.pop().kill()


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = producer(broker_url)
    yield app
    app.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def worker_factory(request: pytest.FixtureRequest, broker_url: str, tmp_path: Path) -> Iterator:
    def build(n: int, **kwargs) -> Worker:
        return Worker(broker_url, log_dir=tmp_path, name=f"w{n}", **kwargs)

    yield from process_factory(request, build, Worker.kill)


@pytest.fixture
def results_worker(worker_factory, broker_url: str) -> Callable[..., Worker]:
    """worker_factory's workers with the broker's own result backend (bbmongo://) as the app's."""

    def start(**kwargs: Any) -> Worker:
        env = {"BB_RESULT_BACKEND": broker_url, **kwargs.pop("env", {})}
        return worker_factory(env=env, **kwargs)

    return start


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A server of this test's own, to stop, restart or give fail points: the embedded one, even under
    BB_TEST_MONGO_URL."""
    server = EmbeddedServer(tmp_path / "data")
    server.start()
    yield server
    server.stop()
