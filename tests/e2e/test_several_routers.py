"""A broker URL listing several `mongos` routers (the sharded deployment docs/scale.md recommends) carries work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pymongo.database import Database
from pymongo.errors import InvalidOperation

from bb_broker.connection import get_database, parse_broker_url
from tests.support.servers import with_database
from tests.support.wire import WireProxy, router
from tests.support.workers import Worker, producer, send, settled, wait_for

#: The routers stand in front of the embedded server: a real `mongod` behind them would answer as itself (a standalone
#: refuses the retryable writes pymongo sends a router), and BB_TEST_MONGO_URL's real routers are the sharded job's.
pytestmark = pytest.mark.stand_in


@pytest.fixture
def two_routers(mongo_url: str) -> Iterator[tuple[WireProxy, WireProxy]]:
    routers = WireProxy(mongo_url, router()), WireProxy(mongo_url, router())
    yield routers
    for proxy in routers:
        proxy.close()


@pytest.fixture
def routers_url(two_routers: tuple[WireProxy, WireProxy], db: Database) -> str:
    return with_database(f"mongodb://{two_routers[0].address},{two_routers[1].address}", db.name)


def test_pymongo_sees_the_two_routers_as_a_sharded_cluster_whose_client_has_no_single_address(routers_url) -> None:
    # What made the lease keeper's registry refuse such a URL: the premise of the test below.
    client = get_database(parse_broker_url(routers_url)).client
    client.admin.command("ping")
    wait_for(lambda: len(client.nodes) == 2, 30, "both routers known")
    assert client.topology_description.topology_type_name == "Sharded"
    with pytest.raises(InvalidOperation, match="mongoses"):
        _ = client.address


def test_a_worker_on_a_url_of_two_routers_runs_a_task_to_succeeded(routers_url, db, tmp_path: Path) -> None:
    app = producer(routers_url)
    try:
        task_id = send(app, "add", 2, 3)
        Worker(routers_url, log_dir=tmp_path, name="w0").start()
        done = wait_for(settled(db, task_id, "succeeded"), 60, "the job succeeded")
    finally:
        app.close()
    assert done["attempts"] == 1
    assert [entry["outcome"] for entry in done["history"]] == ["succeeded"]
