"""MongoDB-compatible servers without TTL indexes, collMod or change streams: degrade where safe, refuse where not."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from kombu import Connection
from pymongo import MongoClient

import bb_broker  # noqa: F401  (registers bbmongo://)
from bb_broker.jobs.indexes import ServerLacksFeature
from bb_broker.jobs.store import JobStore
from bb_broker.transport.plumbing import MessageStore
from bb_broker.transport.wakeups import Look, Wakeups
from tests.support.servers import with_database
from tests.support.spies import watcher_thread
from tests.support.workers import Worker, producer, send, settled, wait_for

NOT_IMPLEMENTED = 238
NO_TTL_LINE = "this server cannot make TTL indexes"


def refuse(client: MongoClient, commands: list[str], code: int) -> None:
    client.admin.command(
        "configureFailPoint", "failCommand", mode="alwaysOn", data={"failCommands": commands, "errorCode": code}
    )


def test_without_ttl_indexes_or_collmod_workers_sweep_and_a_missing_claim_index_is_refused(own_server, tmp_path):
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.nottl
    # Indexes made while the server still could: the claim indexes, and a retention the workers will change.
    JobStore(db).ensure_indexes(retention=3600)
    MessageStore(db).ensure_indexes()
    db.bb_messages.drop_index("bb_expiry")
    refuse(client, ["createIndexes", "collMod"], NOT_IMPLEMENTED)

    # A database without the claim indexes cannot be used safely: a clear error, not a retry loop.
    fresh = Connection(with_database(own_server.url, "fresh"))
    with pytest.raises(ServerLacksFeature, match=r"cannot create the indexes .*bb_claim.*code 238"):
        fresh.default_channel  # noqa: B018  (opening a channel creates the indexes)
    fresh.release()

    url = with_database(own_server.url, "nottl")
    worker = Worker(url, log_dir=tmp_path, name="w0", options={"retention": 1, "stale_after": 2.0})
    worker.start()
    task_id = send(producer(url), "add", 1, 2)
    wait_for(settled(db, task_id, "succeeded"), message="the task ran on a server without TTL indexes")
    expired = datetime.now(UTC) - timedelta(seconds=1)
    db.bb_messages.insert_one({"queue": "nobody.reads", "priority": 0, "payload": "{}", "expiresAt": expired})
    wait_for(lambda: db.jobs.find_one({"taskId": task_id}) is None, message="the succeeded job swept")
    wait_for(lambda: db.bb_messages.find_one({"queue": "nobody.reads"}) is None, message="the expired message swept")
    assert "bb_retention" not in {ix["name"] for ix in db.jobs.list_indexes()}
    assert worker.log().count(NO_TTL_LINE) == 1
    worker.kill()


@pytest.mark.parametrize("code", [NOT_IMPLEMENTED, 9])
def test_a_server_refusing_change_streams_means_polling_not_retrying(own_server, code, caplog):
    client = MongoClient(own_server.url, tz_aware=True)
    caplog.set_level(logging.INFO, logger="bb_broker")
    refuse(client, ["aggregate"], code)  # every aggregate: a worker could not even count a queue, so no worker here
    wakeups = Wakeups(client.nostreams, jobs="jobs", messages="bb_messages", clock=lambda: datetime.now(UTC),
                      safety_poll_interval=10.0)  # fmt: skip
    # The probe (bb_broker/server.py) found no change streams, whatever the refusal's code: the watcher gives up for
    # good and consumers poll. Before, it retried with backoff forever.
    wait_for(lambda: not watcher_thread(wakeups).is_alive(), message="the watcher to give up")
    assert not wakeups.available and wakeups.look("celery", job_queue=True) == Look()  # both collections
    assert "no change streams on this deployment: polling" in caplog.text
    lacks = [record.getMessage() for record in caplog.records if " lacks " in record.getMessage()]
    assert lacks and "change_streams" in lacks[0], caplog.text
