"""A wire proxy in front of the stand-in that plays another deployment: a `mongos`, a standalone server, or an engine
that refuses what FerretDB 2 refuses. Every message goes through; the profile rewrites the server's handshake, answers
some commands itself with the refusal the real deployment gives, and rewrites some refusals as that engine reports
them. The broker only ever sees answers a real server gives: nothing here is known to bb_broker's code.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bson

from tests.support.servers import read_exactly

#: The wire protocol's opcodes: OP_REPLY (the first handshake's answer) and OP_MSG (everything else).
OP_REPLY, OP_MSG = 1, 2013
#: What a replica set member says of itself in its handshake, and a router or a standalone server never does.
REPLICA_SET_FIELDS = ("setName", "setVersion", "hosts", "passives", "arbiters", "primary", "secondary", "me",
                      "electionId", "lastWrite", "tags")  # fmt: skip


def _refusal(code: int, code_name: str, errmsg: str) -> dict[str, Any]:
    return {"ok": 0.0, "code": code, "codeName": code_name, "errmsg": errmsg}


def _has_change_stream(command: dict[str, Any]) -> bool:
    pipeline = command.get("pipeline")
    return "aggregate" in command and isinstance(pipeline, list) and any("$changeStream" in s for s in pipeline)


@dataclass
class Profile:
    """What a deployment does differently from the stand-in (a replica set member that does everything)."""

    name: str
    #: The handshake's answer as this deployment gives it.
    handshake: Callable[[dict[str, Any]], dict[str, Any]] = lambda answer: answer
    #: A command's refusal (the answer sent back without asking the server), or None to let it through.
    refuse: Callable[[dict[str, Any]], dict[str, Any] | None] = lambda command: None
    #: Any other answer as this deployment gives it.
    answer: Callable[[dict[str, Any]], dict[str, Any]] = lambda answer: answer
    #: How many commands the profile refused, by command name: what a test asserts the broker never sent again.
    refused: dict[str, int] = field(default_factory=dict)


def _without_replica_set(answer: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in answer.items() if name not in REPLICA_SET_FIELDS}


def router() -> Profile:
    """A `mongos`: its handshake says `isdbgrid` and names no replica set."""
    return Profile("mongos", handshake=lambda answer: {**_without_replica_set(answer), "msg": "isdbgrid"})


def standalone() -> Profile:
    """A standalone `mongod`: no replica set in its handshake, and change streams refused with 40573."""

    def refuse(command: dict[str, Any]) -> dict[str, Any] | None:
        if _has_change_stream(command):
            return _refusal(40573, "Location40573", "The $changeStream stage is only supported on replica sets")
        return None

    return Profile("standalone", handshake=_without_replica_set, refuse=refuse)


def ferretdb() -> Profile:
    """FerretDB 2.5 on DocumentDB, as issue 43 met it: no replica set in its handshake, `hint` on findAndModify and
    `$changeStream` refused with 115, and a unique index's refusal reported as code 1 with the index named nowhere (no
    keyPattern, no keyValue). (A handshake naming the stand-in's replica set would have pymongo discover the server
    behind the proxy and talk to it directly.)"""

    def refuse(command: dict[str, Any]) -> dict[str, Any] | None:
        if "findAndModify" in command and "hint" in command:
            return _refusal(115, "CommandNotSupported", "findAndModify.hint is not implemented yet")
        if _has_change_stream(command):
            return _refusal(115, "CommandNotSupported", "Stage $changeStream is not supported yet")
        return None

    def as_exclusion_constraint(error: dict[str, Any]) -> dict[str, Any]:
        if error.get("code") not in (11000, 11001):
            return error
        kept = {name: value for name, value in error.items() if name not in ("keyPattern", "keyValue", "errmsg")}
        return {**kept, "code": 1, "codeName": "InternalError",
                "errmsg": 'conflicting key value violates exclusion constraint "jobs_bb_index"'}  # fmt: skip

    def answer(document: dict[str, Any]) -> dict[str, Any]:
        if document.get("code") in (11000, 11001):
            document = as_exclusion_constraint(document)
        errors = document.get("writeErrors")
        if isinstance(errors, list):
            document = {**document, "writeErrors": [as_exclusion_constraint(error) for error in errors]}
        return document

    return Profile("ferretdb", handshake=_without_replica_set, refuse=refuse, answer=answer)


class WireProxy:
    """Listens on a port of its own and relays to `upstream_url`'s server through `profile`."""

    def __init__(self, upstream_url: str, profile: Profile) -> None:
        host, _, port = upstream_url.removeprefix("mongodb://").rstrip("/").partition(":")
        self.upstream = (host, int(port))
        self.profile = profile
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._counts_lock = threading.Lock()
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
            to_client = threading.Lock()  # both relays write to the client: one message at a time
            threading.Thread(target=self._requests, args=(client, server, to_client), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, to_client), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, to_client: threading.Lock) -> None:
        try:
            while header := read_exactly(client, 16):
                length, request_id, response_to, opcode = struct.unpack("<iiii", header)
                body = read_exactly(client, length - 16)
                refusal = self._refusal(opcode, body)
                if refusal is None:
                    server.sendall(header + body)
                    continue
                reply = struct.pack("<I", 0) + b"\x00" + bson.encode(refusal)
                with to_client:
                    client.sendall(struct.pack("<iiii", 16 + len(reply), 0, request_id, OP_MSG) + reply)
        except OSError:
            pass
        finally:
            client.close()
            server.close()

    def _answers(self, server: socket.socket, client: socket.socket, to_client: threading.Lock) -> None:
        try:
            while header := read_exactly(server, 16):
                length, request_id, response_to, opcode = struct.unpack("<iiii", header)
                body = self._rewritten(opcode, read_exactly(server, length - 16))
                with to_client:
                    client.sendall(struct.pack("<iiii", 16 + len(body), request_id, response_to, opcode) + body)
        except OSError:
            pass
        finally:
            server.close()
            client.close()

    def _refusal(self, opcode: int, body: bytes) -> dict[str, Any] | None:
        if opcode != OP_MSG or body[4] != 0:
            return None
        command = bson.decode(_first_document(body[5:]))
        refusal = self.profile.refuse(command)
        if refusal is not None:
            with self._counts_lock:
                name = next(iter(command))
                self.profile.refused[name] = self.profile.refused.get(name, 0) + 1
        return refusal

    def _rewritten(self, opcode: int, body: bytes) -> bytes:
        if opcode == OP_MSG and body[4] == 0:  # flags, then the one body section pymongo gets in an answer
            flags = struct.unpack("<I", body[:4])[0]
            assert not flags & 1, "a checksummed answer: the proxy cannot rewrite it"
            return body[:5] + self._rewritten_document(body[5:])
        if opcode == OP_REPLY:  # flags, cursor id, starting from, number returned, then the documents
            return body[:20] + self._rewritten_document(body[20:])
        return body

    def _rewritten_document(self, document: bytes) -> bytes:
        answer = bson.decode(document)
        if "maxWireVersion" in answer and {"ismaster", "isWritablePrimary"} & answer.keys():
            return bson.encode(self.profile.handshake(answer))
        rewritten = self.profile.answer(answer)
        return document if rewritten is answer else bson.encode(rewritten)


def _first_document(data: bytes) -> bytes:
    (size,) = struct.unpack("<i", data[:4])
    return data[:size]
