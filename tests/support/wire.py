"""A wire proxy in front of the stand-in that plays another deployment: a `mongos`, a standalone server, an engine
that refuses what FerretDB 2 refuses, one that refuses update pipelines as Amazon DocumentDB does, or a replica set
through an election. Every message goes through; the profile rewrites the server's handshake, answers some commands
itself with the refusal the real deployment gives, and rewrites some refusals as that engine reports them. The broker
only ever sees answers a real server gives: nothing here is known to bb_broker's code.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

import bson

from tests.support.servers import read_exactly

#: The wire protocol's opcodes: OP_REPLY (the first handshake's answer) and OP_MSG (everything else).
OP_REPLY, OP_MSG = 1, 2013
#: What a replica set member says of itself in its handshake, and a router or a standalone server never does.
REPLICA_SET_FIELDS = ("setName", "setVersion", "hosts", "passives", "arbiters", "primary", "secondary", "me",
                      "electionId", "lastWrite", "tags")  # fmt: skip
#: The fields of a replica set member's handshake that name members by address.
MEMBER_ADDRESS_FIELDS = ("hosts", "passives", "arbiters", "primary", "me")
#: OP_MSG flag bits: more answers follow this one unasked (moreToCome); the request allows that (exhaustAllowed).
MORE_TO_COME, EXHAUST_ALLOWED = 1 << 1, 1 << 16
#: The commands a member refuses with NotWritablePrimary unless it is the primary.
WRITE_COMMANDS = frozenset({"insert", "update", "delete", "findAndModify", "findandmodify", "create", "createIndexes",
                            "drop", "dropIndexes", "dropDatabase", "collMod", "renameCollection", "commitTransaction",
                            "abortTransaction"})  # fmt: skip
#: What any member answers whatever its state: the handshake, and commands on no collection's data.
ANY_MEMBER_COMMANDS = frozenset({"hello", "isMaster", "ismaster", "ping", "buildInfo", "buildinfo", "endSessions",
                                 "killCursors", "saslStart", "saslContinue", "getParameter", "serverStatus",
                                 "connectionStatus", "listDatabases"})  # fmt: skip


def _refusal(code: int, code_name: str, errmsg: str, **fields: Any) -> dict[str, Any]:
    return {"ok": 0.0, "code": code, "codeName": code_name, "errmsg": errmsg, **fields}


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
    #: Every answer's document as this deployment's bytes say it (as_mongod_keeps): what no decoded value can carry.
    raw: Callable[[bytes], bytes] = lambda document: document
    #: Every request's bytes as the stand-in takes them (as_stand_in_takes): what a client writes back of `raw`.
    raw_request: Callable[[bytes], bytes] = lambda request: request
    #: How many commands the profile refused, by command name: what a test asserts the broker never sent again.
    refused: dict[str, int] = field(default_factory=dict)
    #: A replica set's: set while it has no primary (WireProxy.hold_election). A proxy whose profile has one keeps
    #: the topology's version itself, so that its clients' monitors hear of each change at once, as from a member.
    electing: threading.Event | None = None


def _without_replica_set(answer: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in answer.items() if name not in REPLICA_SET_FIELDS}


#: What a `mongod` keeps as a driver wrote it and the stand-in refuses at insert ("invalid BSON in body", code 2):
#: text whose bytes are not UTF-8 (another language's driver, a Latin-1 file name), and dates before year 1 or after
#: 9999 (BSON's dates are int64 milliseconds). A test stores the marker, and as_mongod_keeps answers the other in
#: its place, of the same size: the text's eight bytes, the date's sorting where the marker sorts.
NOT_UTF8_MARKER, NOT_UTF8 = "NOTUTF8!", b"caf\xe9.txt"
AFTER_9999_MARKER, AFTER_9999_MS = datetime(9999, 1, 1, tzinfo=UTC), 568_000_000_000_000  # in the year 19969
BEFORE_YEAR_1_MARKER, BEFORE_YEAR_1_MS = datetime(1, 1, 2, tzinfo=UTC), -62_200_000_000_000  # in 1 BC


def _millis(moment: datetime) -> bytes:
    """The eight bytes BSON holds of a date: its int64 milliseconds (the end of `{d: moment}`, before its 0)."""
    return bson.encode({"d": moment})[-9:-1]


_MONGOD_KEEPS = {
    NOT_UTF8_MARKER.encode(): NOT_UTF8,
    _millis(AFTER_9999_MARKER): struct.pack("<q", AFTER_9999_MS),
    _millis(BEFORE_YEAR_1_MARKER): struct.pack("<q", BEFORE_YEAR_1_MS),
}


def as_mongod_keeps(document: bytes) -> bytes:
    """An answer's document with each marker of what a `mongod` keeps (NOT_UTF8_MARKER, the date markers) replaced
    by what it stands for: the bytes pymongo reads from a mongod holding it."""
    for marker, kept in _MONGOD_KEEPS.items():
        document = document.replace(marker, kept)
    return document


def as_stand_in_takes(request: bytes) -> bytes:
    """A request with what a `mongod` keeps and the stand-in refuses (a client writing back what as_mongod_keeps
    answered) replaced by its marker: the stand-in stores the marker, which a test reads as those bytes kept."""
    for marker, kept in _MONGOD_KEEPS.items():
        request = request.replace(kept, marker)
    return request


def keeping_what_the_stand_in_refuses(profile: Profile) -> Profile:
    """`profile`'s deployment holding, and taking, text that is not UTF-8 and dates outside years 1 to 9999."""
    kept = {"raw": as_mongod_keeps, "raw_request": as_stand_in_takes}
    return replace(profile, name=f"{profile.name} (as a mongod keeps)", **kept)


def mongod_keeping_what_the_stand_in_refuses() -> Profile:
    """A `mongod` (the stand-in's replica set) holding text that is not UTF-8 and dates outside years 1 to 9999."""
    return keeping_what_the_stand_in_refuses(Profile("mongod"))


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


def _is_pipeline_update(command: dict[str, Any]) -> bool:
    """An `update` with a statement whose update is a pipeline (a list), or a findAndModify with one."""
    if "findAndModify" in command:
        return isinstance(command.get("update"), list)
    return "update" in command and any(isinstance(s.get("u"), list) for s in command.get("updates", []))


def amazon_documentdb() -> Profile:
    """Amazon DocumentDB (5.0), as its users meet it: an update with an aggregation pipeline refused as a whole with
    code 9 (FailedToParse), `Failed to parse update: field must be of BSON type object` (its developer guide lists
    only the classic update operators; the answer as reported in Matgenix/jobflow-remote#299). Its handshake names no
    replica set here, for the reason ferretdb() gives (a real cluster's does; it takes no retryable writes either)."""

    def refuse(command: dict[str, Any]) -> dict[str, Any] | None:
        if _is_pipeline_update(command):
            return {"ok": 0.0, "code": 9, "errmsg": "Failed to parse update: field must be of BSON type object"}
        return None

    return Profile("amazon documentdb", handshake=_without_replica_set, refuse=refuse)


def _has_output_stage(command: dict[str, Any]) -> bool:
    pipeline = command.get("pipeline")
    return isinstance(pipeline, list) and any("$out" in s or "$merge" in s for s in pipeline if isinstance(s, dict))


def replica_set() -> Profile:
    """A replica set (the stand-in, a one-member set) that can go through an election (WireProxy.hold_election).

    While it has no primary, its member says so in its handshake (a secondary, naming no primary: pymongo's server
    selection waits), refuses writes as a stepped-down primary does (10107 NotWritablePrimary, labelled
    RetryableWriteError: pymongo tries a retryable write once more, on the next primary) and reads that must go to
    the primary (13435 NotPrimaryNoSecondaryOk)."""
    electing = threading.Event()

    def handshake(answer: dict[str, Any]) -> dict[str, Any]:
        if not electing.is_set():
            return answer
        kept = {name: value for name, value in answer.items() if name not in ("primary", "electionId")}
        return {**kept, "isWritablePrimary": False, "ismaster": False, "secondary": True}

    def refuse(command: dict[str, Any]) -> dict[str, Any] | None:
        name = next(iter(command))
        if not electing.is_set() or name in ANY_MEMBER_COMMANDS:
            return None
        if name in WRITE_COMMANDS or _has_output_stage(command):
            return _refusal(10107, "NotWritablePrimary", "not primary", errorLabels=["RetryableWriteError"])
        mode = (command.get("$readPreference") or {}).get("mode", "primary")
        if mode == "primary":
            return _refusal(13435, "NotPrimaryNoSecondaryOk", "not primary and secondaryOk=false")
        return None  # a read a secondary serves

    return Profile("replica set", handshake=handshake, refuse=refuse, electing=electing)


@dataclass
class _Link:
    """One client connection and the proxy's own to the server for it."""

    client: socket.socket
    server: socket.socket
    #: Both relays write to the client: one message at a time.
    to_client: threading.Lock = field(default_factory=threading.Lock)
    #: Writes relayed and not yet answered (request ids), and those answered by the proxy already (interrupted):
    #: the server's own answer to one of those is not relayed.
    writes_in_flight: set[int] = field(default_factory=set)
    interrupted: set[int] = field(default_factory=set)


@dataclass
class Election:
    """One election WireProxy.hold_election holds: when it started and ended (time.time(), the proxy's clock)."""

    seconds: float
    drop_after: float
    started_at: float = 0.0
    ended_at: float = 0.0
    ended: threading.Event = field(default_factory=threading.Event)


class WireProxy:
    """Listens on a port of its own and relays to `upstream_url`'s server through `profile`. Its clients know the
    server by the proxy's address only: a replica set member's handshake names the proxy where it names itself, so
    that pymongo's discovery stays on the proxy (`relayed` counts the commands that went through)."""

    def __init__(self, upstream_url: str, profile: Profile) -> None:
        host, _, port = upstream_url.removeprefix("mongodb://").rstrip("/").partition(":")
        self.upstream = (host, int(port))
        self.profile = profile
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.relayed = 0
        #: Writes in flight an election's step-down interrupted.
        self.interrupted = 0
        self._links: list[_Link] = []
        self._counts_lock = threading.Lock()
        self._closed = threading.Event()
        # The topology's version as the proxy's clients know it, where the profile can change it (an election):
        # the proxy answers their monitors' awaitable hellos itself, at once when the topology changes.
        self._topology = threading.Condition()
        self._topology_version = {"processId": bson.ObjectId(), "counter": bson.Int64(0)}
        self._last_handshake: dict[str, Any] = {}
        self._reply_ids = iter(range(1 << 30, 1 << 31))
        self._election_at: tuple[Callable[[dict[str, Any]], bool], Election] | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        self.drop_connections()
        with self._topology:
            self._topology.notify_all()

    def drop_connections(self) -> None:
        """Close every open connection, both ways, as a server that went away does."""
        links, self._links = self._links, []
        for sock in (sock for link in links for sock in (link.client, link.server)):
            with contextlib.suppress(OSError):  # wakes the relay blocked reading it: close alone does not
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def hold_election(
        self, seconds: float, drop_after: float = 0.5, at: Callable[[dict[str, Any]], bool] | None = None
    ) -> Election:
        """From now on for `seconds`, the replica set has no primary, then it is the primary again; returns at once.

        As a maintenance's election goes (the primary steps down, then shuts down): the member answers as a
        secondary from the start (see replica_set), refusing on the connections open then, and `drop_after` seconds
        in every open connection is dropped; new ones are answered as a secondary until the end.

        `at`: the election starts at the first write it matches instead, while that write is in flight: the write is
        applied, and answered as interrupted (11602)."""
        if self.profile.electing is None:
            raise ValueError(f"a {self.profile.name} holds no elections")
        election = Election(seconds, drop_after)
        if at is None:
            threading.Thread(target=self._elect, args=(election,), daemon=True).start()
        else:
            self._election_at = (at, election)
        return election

    def _step_down(self, election: Election) -> None:
        assert self.profile.electing is not None
        election.started_at = time.time()
        self._change_topology(self.profile.electing.set)
        self._interrupt_writes_in_flight()

    def _elect(self, election: Election, stepped_down: bool = False) -> None:
        if not stepped_down:
            self._step_down(election)
        self._closed.wait(election.drop_after)
        self.drop_connections()
        self._closed.wait(election.seconds - election.drop_after)
        self._change_topology(self.profile.electing.clear)
        election.ended_at = time.time()
        election.ended.set()

    def _interrupt_writes_in_flight(self) -> None:
        """A primary stepping down interrupts the writes it is running: each is answered with 11602
        InterruptedDueToReplStateChange, whether or not it was applied (a retryable write's retry learns which)."""
        for link in list(self._links):
            with link.to_client:
                for request_id in list(link.writes_in_flight):
                    interrupted = _refusal(
                        11602,
                        "InterruptedDueToReplStateChange",
                        "operation was interrupted because of a replication state change",
                        errorLabels=["RetryableWriteError"],
                        topologyVersion=self._topology_version,
                    )
                    with contextlib.suppress(OSError):
                        self._send(link.client, request_id, interrupted, 0)
                    link.interrupted.add(request_id)
                    self.interrupted += 1
                link.writes_in_flight.clear()

    def _change_topology(self, change: Callable[[], None]) -> None:
        with self._topology:
            change()
            counter = bson.Int64(self._topology_version["counter"] + 1)
            self._topology_version = {**self._topology_version, "counter": counter}
            self._topology.notify_all()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:  # closed: the test is over
                return
            link = _Link(client, server)
            self._links.append(link)
            threading.Thread(target=self._requests, args=(link,), daemon=True).start()
            threading.Thread(target=self._answers, args=(link,), daemon=True).start()

    def _requests(self, link: _Link) -> None:
        client, server = link.client, link.server
        try:
            while header := read_exactly(client, 16):
                length, request_id, response_to, opcode = struct.unpack("<iiii", header)
                body = self.profile.raw_request(read_exactly(client, length - 16))
                command = self._command(opcode, body)
                if command is not None and self._awaits_topology(command):
                    exhaust = bool(struct.unpack("<I", body[:4])[0] & EXHAUST_ALLOWED)
                    self._await_topology(link, request_id, command, exhaust)
                    continue
                refusal = None if command is None else self._refusal(command)
                if refusal is None:
                    with self._counts_lock:
                        self.relayed += 1
                    with link.to_client:
                        if command is not None and next(iter(command)) in WRITE_COMMANDS:
                            link.writes_in_flight.add(request_id)
                    if command is not None and self._election_at is not None and self._election_at[0](command):
                        election, self._election_at = self._election_at[1], None
                        self._step_down(election)  # before the server answers: this write is interrupted
                        threading.Thread(target=self._elect, args=(election, True), daemon=True).start()
                    server.sendall(header + body)
                    continue
                with link.to_client:
                    self._send(client, request_id, refusal, 0)
        except OSError:
            pass
        finally:
            client.close()
            server.close()

    def _answers(self, link: _Link) -> None:
        client, server = link.client, link.server
        try:
            while header := read_exactly(server, 16):
                length, request_id, response_to, opcode = struct.unpack("<iiii", header)
                body = self._rewritten(opcode, read_exactly(server, length - 16))
                with link.to_client:
                    link.writes_in_flight.discard(response_to)
                    if response_to in link.interrupted:
                        link.interrupted.discard(response_to)
                        continue
                    client.sendall(struct.pack("<iiii", 16 + len(body), request_id, response_to, opcode) + body)
        except OSError:
            pass
        finally:
            server.close()
            client.close()

    @staticmethod
    def _command(opcode: int, body: bytes) -> dict[str, Any] | None:
        """An OP_MSG's command, with its document sequences (pymongo sends an update's statements as one) in it."""
        if opcode != OP_MSG or body[4] != 0:
            return None
        first = _first_document(body[5:])
        command = bson.decode(first)
        at = 5 + len(first)
        end = len(body) - (4 if struct.unpack("<I", body[:4])[0] & 1 else 0)  # a checksum last
        while at < end and body[at] == 1:
            (size,) = struct.unpack("<i", body[at + 1 : at + 5])
            identifier, _, documents = body[at + 5 : at + 1 + size].partition(b"\x00")
            command[identifier.decode()] = bson.decode_all(documents)
            at += 1 + size
        return command

    def _refusal(self, command: dict[str, Any]) -> dict[str, Any] | None:
        refusal = self.profile.refuse(command)
        if refusal is not None:
            with self._counts_lock:
                name = next(iter(command))
                self.profile.refused[name] = self.profile.refused.get(name, 0) + 1
            if self.profile.electing is not None:  # a member's "not primary" names the topology it is in
                refusal = {**refusal, "topologyVersion": self._topology_version}
        return refusal

    def _send(self, client: socket.socket, response_to: int, document: dict[str, Any], flags: int) -> int:
        reply = struct.pack("<I", flags) + b"\x00" + bson.encode(document)
        reply_id = next(self._reply_ids)
        client.sendall(struct.pack("<iiii", 16 + len(reply), reply_id, response_to, OP_MSG) + reply)
        return reply_id

    def _awaits_topology(self, command: dict[str, Any]) -> bool:
        """A monitor's awaitable hello, on a proxy that keeps the topology's version itself."""
        return (
            self.profile.electing is not None
            and next(iter(command)) in ("hello", "isMaster", "ismaster")
            and "topologyVersion" in command
            and "maxAwaitTimeMS" in command
        )

    def _await_topology(self, link: _Link, request_id: int, command: dict[str, Any], exhaust: bool) -> None:
        """Answer an awaitable hello as a member does: at once if it names a topology other than the current one,
        else when the topology changes or after maxAwaitTimeMS; streamed (moreToCome) while the request allows it."""
        response_to, known = request_id, command["topologyVersion"]
        while True:
            with self._topology:
                self._topology.wait_for(partial(self._topology_is_not, known), command["maxAwaitTimeMS"] / 1000)
                known = self._topology_version
                answer = self._as_member(dict(self._last_handshake))
            if self._closed.is_set():
                raise OSError("the proxy is closed")
            with link.to_client:
                response_to = self._send(link.client, response_to, answer, MORE_TO_COME if exhaust else 0)
            if not exhaust:
                return

    def _topology_is_not(self, known: dict[str, Any]) -> bool:
        return known != self._topology_version or self._closed.is_set()

    def _rewritten(self, opcode: int, body: bytes) -> bytes:
        if opcode == OP_MSG and body[4] == 0:  # flags, then the one body section pymongo gets in an answer
            flags = struct.unpack("<I", body[:4])[0]
            assert not flags & 1, "a checksummed answer: the proxy cannot rewrite it"
            return body[:5] + self.profile.raw(self._rewritten_document(body[5:]))
        if opcode == OP_REPLY:  # flags, cursor id, starting from, number returned, then the documents
            return body[:20] + self.profile.raw(self._rewritten_document(body[20:]))
        return body

    def _rewritten_document(self, document: bytes) -> bytes:
        answer = bson.decode(document)
        if "maxWireVersion" in answer and {"ismaster", "isWritablePrimary"} & answer.keys():
            self._last_handshake = answer
            return bson.encode(self._as_member(dict(answer)))
        rewritten = self.profile.answer(answer)
        return document if rewritten is answer else bson.encode(rewritten)

    def _as_member(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The server's handshake as the profile's deployment gives it, naming the proxy where it named the server."""
        me = answer.get("me")
        for name in MEMBER_ADDRESS_FIELDS:
            value = answer.get(name)
            if value == me:
                answer[name] = self.address
            elif isinstance(value, list):
                answer[name] = [self.address if host == me else host for host in value]
        if self.profile.electing is not None:
            answer["topologyVersion"] = self._topology_version
        return self.profile.handshake(answer)


def _first_document(data: bytes) -> bytes:
    (size,) = struct.unpack("<i", data[:4])
    return data[:size]
