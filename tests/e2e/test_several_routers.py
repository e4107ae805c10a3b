"""A broker URL listing several `mongos` routers (the sharded deployment docs/scale.md recommends) carries work."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import bson
import pytest
from pymongo.database import Database
from pymongo.errors import InvalidOperation

from bb_broker.connection import get_database, parse_broker_url
from tests.support.servers import read_exactly, with_database
from tests.support.workers import Worker, producer, send, settled, wait_for

#: The routers stand in front of the embedded server: a real `mongod` behind them would answer as itself (a standalone
#: refuses the retryable writes pymongo sends a router), and BB_TEST_MONGO_URL's real routers are the sharded job's.
pytestmark = pytest.mark.stand_in

#: The wire protocol's opcodes a router rewrites the answers of: OP_REPLY (the first handshake) and OP_MSG.
OP_REPLY, OP_MSG = 1, 2013
#: What a replica set member says of itself in its handshake, and a router never does.
REPLICA_SET_FIELDS = ("setName", "setVersion", "hosts", "passives", "arbiters", "primary", "secondary", "me",
                      "electionId", "lastWrite", "tags")  # fmt: skip


class Router:
    """A stand-in for a `mongos` in front of one server: every message goes through as it is, but the server's
    handshake answers come back as a router's (`msg: "isdbgrid"`, no replica set fields), so that pymongo sees
    the routers of a sharded cluster."""

    def __init__(self, upstream_url: str) -> None:
        host, _, port = upstream_url.removeprefix("mongodb://").rstrip("/").partition(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for sock in list(self._sockets):
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:  # closed: the test is over
                return
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while header := read_exactly(source, 16):
                length, request_id, response_to, opcode = struct.unpack("<iiii", header)
                body = read_exactly(source, length - 16)
                if answers:
                    body = _as_router(opcode, body)
                sink.sendall(struct.pack("<iiii", 16 + len(body), request_id, response_to, opcode) + body)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()


def _as_router(opcode: int, body: bytes) -> bytes:
    """An answer as a router gives it: a handshake's without the replica set, anything else as it is."""
    if opcode == OP_MSG and body[4] == 0:  # flags, then the one body section pymongo gets in an answer
        flags = struct.unpack("<I", body[:4])[0]
        assert not flags & 1, "a checksummed answer: the stand-in cannot rewrite it"
        return body[:5] + _router_handshake(body[5:])
    if opcode == OP_REPLY:  # flags, cursor id, starting from, number returned, then the documents
        return body[:20] + _router_handshake(body[20:])
    return body


def _router_handshake(document: bytes) -> bytes:
    answer = bson.decode(document)
    if "maxWireVersion" not in answer or not ({"ismaster", "isWritablePrimary"} & answer.keys()):
        return document
    for name in REPLICA_SET_FIELDS:
        answer.pop(name, None)
    return bson.encode({**answer, "msg": "isdbgrid"})


@pytest.fixture
def two_routers(mongo_url: str) -> Iterator[tuple[Router, Router]]:
    routers = Router(mongo_url), Router(mongo_url)
    yield routers
    for router in routers:
        router.close()


@pytest.fixture
def routers_url(two_routers: tuple[Router, Router], db: Database) -> str:
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
