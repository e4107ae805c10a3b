"""Kombu's plumbing traffic (events, remote control, replies) and exchange bindings, kept apart from `jobs`."""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import ObjectId
from bson.errors import InvalidDocument
from kombu import compression
from kombu.transport import virtual
from kombu.utils.json import dumps, loads
from pymongo import ASCENDING, DESCENDING, IndexModel
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import BulkWriteError, ConnectionFailure, DuplicateKeyError, OperationFailure, PyMongoError

from bb_broker.connection import SHUTDOWN_PATIENCE, scrub, scrub_value, server_gone_at_shutdown
from bb_broker.forks import reset_in_child
from bb_broker.jobs.indexes import ensure_plain_indexes, say_no_ttl_once
from bb_broker.jobs.outages import is_transient
from bb_broker.jobs.payloads import CompressedBodyError, decompress_bounded
from bb_broker.server import capabilities, is_not_implemented, unique_refusals
from bb_broker.threads import start_supervised
from bb_broker.upstream import kombu as upstream_kombu

logger = logging.getLogger(__name__)

#: Seconds the outbox waits before it tries again a write the server did not answer, doubling up to the last.
OUTBOX_RETRY = (0.05, 5.0)


class BindingsWatch:
    """What a live change stream says about a bindings collection, shared by every channel of the process.

    A worker publishes its events (a heartbeat every 2 s) on a connection that consumes nothing, so the
    news comes from the consuming connection's watcher, through this registry.
    """

    _watched: dict[tuple[int, str], BindingsWatch] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.live_since: float | None = None  # monotonic; None while no change stream covers the collection
        self.changed_at = 0.0
        self._live: set[int] = set()  # the watchers (one per consuming connection) whose stream is live
        self._guard = threading.Lock()

    @classmethod
    def of(cls, bindings: Collection) -> BindingsWatch:
        key = (id(bindings.database.client), bindings.full_name)
        with cls._lock:
            return cls._watched.setdefault(key, cls())

    def went_live(self, watcher: object) -> None:
        with self._guard:
            self._live.add(id(watcher))
            self.live_since = time.monotonic()

    def went_dark(self, watcher: object) -> None:
        """`watcher`'s stream is down or stopped: the tables are vouched for while another one is live."""
        with self._guard:
            self._live.discard(id(watcher))
            if not self._live:
                self.live_since = None

    def changed(self) -> None:
        self.changed_at = time.monotonic()

    def vouches_for(self, read_at: float) -> bool:
        """True when the stream was live when the table was read and has reported no change since."""
        live = self.live_since
        return live is not None and read_at > live and read_at > self.changed_at


def _forget_parent_watches() -> None:
    # The parent's watcher does not follow a fork; a child's clients are new and start unwatched.
    BindingsWatch._watched = {}
    BindingsWatch._lock = threading.Lock()


reset_in_child(_forget_parent_watches)


def secret_forms(secrets: Iterable[str]) -> tuple[str, ...]:
    """Each secret as it may appear inside a repr() (an exception's, in an event) as well as plain, longest first."""
    forms = set()
    for secret in secrets:
        escaped = secret.replace("\\", "\\\\")
        forms |= {secret, escaped, escaped.replace("'", "\\'"), escaped.replace('"', '\\"')}
    return tuple(sorted(forms, key=len, reverse=True))


def _mentions(raw: bytes, secrets: tuple[str, ...]) -> bool:
    """Whether JSON text may hold a secret: as UTF-8, or as JSON escapes it (quotes, backslashes, non-ASCII)."""
    spellings = {json.dumps(secret, ensure_ascii=ascii)[1:-1] for secret in secrets for ascii in (True, False)}
    return any(spelling.encode() in raw for spelling in spellings | set(secrets))


#: The content type of Kombu's JSON serializer, the one body format read here (as its consumers read it).
JSON_CONTENT = "application/json"


def unmasked_reason(content_type: str) -> str | None:
    """Why a body of `content_type` is stored as it came, or None for one masked here (JSON and text).

    Anything else (pickle, YAML, msgpack, raw bytes) is never decoded: loading a pickle runs whatever its sender
    put in it, and a message is stored again wherever a consumer puts it back, whatever that consumer accepts. A
    search and replace would break the framing of a binary format (and YAML reads `**` as an alias).
    """
    if content_type == JSON_CONTENT or content_type.startswith("text/"):
        return None
    return (
        f"body not masked: the broker never decodes {content_type[:100]!r} bodies (only JSON and text);"
        " publish with the json serializer to have the broker URL's password masked"
    )


def scrub_message(message: dict[str, Any], secrets: tuple[str, ...]) -> tuple[dict[str, Any], str | None]:
    """The Kombu message with every secret masked in its headers and, if JSON or text, its body; and, for a body left
    as it came, why (see unmasked_reason).

    A JSON body is parsed by Kombu's JSON (plain values, and the few types Kombu's encoder marks), cleaned as data,
    and encoded again; one that does not parse, and text, are masked as text. A message that mentions no secret is
    returned as it is.
    """
    headers = message.get("headers") or {}
    content_type = message.get("content-type") or ""
    reason = unmasked_reason(content_type)
    if reason is not None:  # headers are JSON already (the stored payload's): masked; the body is left alone
        return {**message, "headers": scrub_value(headers, secrets)}, reason
    properties = message.get("properties") or {}
    encoding = properties.get("body_encoding")
    body = message["body"]
    content_encoding = message.get("content-encoding") or "utf-8"
    raw = virtual.Channel.codecs[encoding].decode(body) if encoding else body
    raw = raw.encode(content_encoding) if isinstance(raw, str) else raw
    if headers.get("compression"):
        try:
            decompressed = decompress_bounded(raw, str(headers["compression"]))
        except CompressedBodyError as exc:
            decompressed, why = None, str(exc)
        else:
            why = f"its compression {str(headers['compression'])[:100]!r} is not one the broker can bound"
        if decompressed is None:  # never expanded without a bound (a bomb), nor guessed at: left as it came
            return {**message, "headers": scrub_value(headers, secrets)}, f"body not masked: {why}"
        raw = decompressed
    if not _mentions(raw + dumps(headers).encode(), secrets):
        return message, None
    clean = None
    if content_type == JSON_CONTENT:
        try:
            clean = dumps(scrub_value(loads(raw.decode(content_encoding)), secrets)).encode(content_encoding)
        # Kombu's type markers ({"__type__": "decimal", ...}) raise what their decoders raise (AttributeError,
        # decimal.InvalidOperation, ...): any failure to read it as JSON leaves it to be masked as text below
        except Exception:
            clean = None
    if clean is None:
        clean = scrub(raw.decode("utf-8", "surrogateescape"), secrets).encode("utf-8", "surrogateescape")
    if headers.get("compression"):
        clean = compression.compress(clean, headers["compression"])[0]
    stored: bytes | str = clean
    if encoding:
        stored = virtual.Channel.codecs[encoding].encode(clean)
    elif isinstance(body, str):
        stored = clean.decode(content_encoding)
    return {**message, "body": stored, "headers": scrub_value(headers, secrets)}, None


class Outbox:
    """The plain messages (events, replies) an event loop's thread publishes, stored by a thread of their own.

    Celery's worker sends its task events from its event loop's thread; an insert there held the loop (and the
    claims, acks and hand-offs behind it) for a round trip per event, as a Redis or AMQP publish does not. Here
    they are written in the order given, as many as are waiting in one insert, and a write the server did not
    answer is tried again until it lands (each document has its _id already: one that landed is not written
    twice). A message may also linger a moment for others to be stored with it: Celery's task events, a few per
    task, then cost the server, and the monitors that read them, an insert, a change and a read per batch rather than
    per message. One outbox per process and collection; the process waits for each at exit (a stopping server's
    patience at most), as a worker stops.
    """

    _boxes: dict[tuple[int, str], Outbox] = {}
    _lock = threading.Lock()

    def __init__(self, messages: Collection) -> None:
        self.messages = messages
        self._waiting: deque[dict[str, Any]] = deque()
        self._writing = 0  # documents taken by the writer and not yet stored (or given up)
        self._due = float("inf")  # monotonic time by which the waiting documents are to be written
        self._changed = threading.Condition()
        # A daemon: a write stuck on a server that is gone must not hold the process at exit (flush bounds it).
        self._thread = start_supervised("bb-outbox", self._run)

    @staticmethod
    def _key(messages: Collection) -> tuple[int, str]:
        return (id(messages.database.client), messages.full_name)

    @classmethod
    def of(cls, messages: Collection) -> Outbox:
        with cls._lock:
            box = cls._boxes.get(cls._key(messages))
            if box is None:
                box = cls._boxes[cls._key(messages)] = cls(messages)
            return box

    @classmethod
    def flush_all_at_exit(cls) -> None:
        """The process ends: what the outboxes hold is stored first, waiting a stopping server's patience at most."""
        deadline = time.monotonic() + (0.0 if server_gone_at_shutdown() else SHUTDOWN_PATIENCE)
        for box in list(cls._boxes.values()):
            left = box.flush(max(deadline - time.monotonic(), 0.0))
            if left:
                logger.warning("%d messages (events, replies) were not stored: the server did not answer", left)

    def add(self, document: dict[str, Any], linger: float = 0.0) -> None:
        """Store `document` soon: at once, or within `linger` seconds with the others given meanwhile."""
        with self._changed:
            self._waiting.append(document)
            self._due = min(self._due, time.monotonic() + linger)
            self._changed.notify_all()

    def flush(self, timeout: float) -> int:
        """Wait up to `timeout` seconds until every message given so far is stored; how many are still held."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self._due = 0.0  # nothing lingers now
            self._changed.notify_all()
            while self._waiting or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return len(self._waiting) + self._writing

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._waiting or time.monotonic() < self._due:
                    self._changed.wait(None if not self._waiting else self._due - time.monotonic())
                batch = list(self._waiting)
                self._waiting.clear()
                self._writing, self._due = len(batch), float("inf")
            try:
                self._store(batch)
            except Exception:  # never seen; the writer must outlive it, or the loop's messages would pile up
                logger.exception("%d messages could not be stored", len(batch))
            finally:
                with self._changed:
                    self._writing = 0
                    self._changed.notify_all()

    def _store(self, batch: list[dict[str, Any]]) -> None:
        pause, said = OUTBOX_RETRY[0], False
        while batch:
            try:
                # Unordered: a try after a lost answer skips, in one pass, what had landed (duplicate _ids); the
                # order consumers see is the _ids', given at publish time.
                self.messages.insert_many(batch, ordered=False)
                return
            except BulkWriteError as exc:
                server = capabilities(self.messages.database)
                for error in exc.details.get("writeErrors") or []:  # none: only the write concern complained
                    if not server.only_unique_refusals([error]):  # a duplicate landed on a try whose answer was lost
                        logger.error(
                            "a message for queue %r was refused by the server and is dropped: %s",
                            batch[error["index"]]["queue"],
                            error.get("errmsg"),
                        )
                return
            except InvalidDocument as exc:  # too large for the server, say: refused before it is sent
                if len(batch) == 1:
                    logger.error("a message for queue %r cannot be stored and is dropped: %s", batch[0]["queue"], exc)
                    return
                for document in batch:  # the others go on their own
                    self._store([document])
                return
            except (ConnectionFailure, OperationFailure) as exc:
                if not is_transient(exc):
                    logger.error("%d messages were refused by the server and are dropped (%s)", len(batch), exc)
                    return
                if not said:
                    logger.warning("%d messages wait for the server (%s); trying again", len(batch), type(exc).__name__)
                    said = True
                time.sleep(pause)
                pause = min(pause * 2, OUTBOX_RETRY[1])
                now = datetime.now(UTC)
                batch = [document for document in batch if document["expiresAt"] > now]  # never read once expired


def _forget_parent_outboxes() -> None:
    # The parent's writer thread does not follow a fork (nor should what it held be written twice).
    Outbox._boxes = {}
    Outbox._lock = threading.Lock()


reset_in_child(_forget_parent_outboxes)
atexit.register(Outbox.flush_all_at_exit)


#: The order a queue's messages are delivered in: higher priority first, then the oldest.
FETCH_ORDER = [("priority", DESCENDING), ("_id", ASCENDING)]
#: The field marking messages a consumer is taking in a batch (see MessageStore.take).
TAKER = "takenBy"
#: The fewest messages a batched take reads: it costs three round trips, so below that each is taken on its own.
TAKE_BATCH_MIN = 3
#: Seconds after which messages marked by a batched take that never deleted them (its consumer lost the server
#: between the two writes, and went away) are free to take again: a take's writes are milliseconds apart.
TAKE_LEASE = 60.0


#: The taker's mark of a message no consumer can read: later than any take's, so none takes it again (see take).
SET_ASIDE = ObjectId("f" * 24)


class UnreadableMessage(ValueError):
    """A stored document holds no message Kombu can deliver (one written by hand, or by another program)."""


def payload_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The Kombu message a stored document holds, with what Kombu's Message reads sure to be there."""
    try:
        message = loads(doc["payload"])
    except (KeyError, TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested beyond any message
        raise UnreadableMessage(f"payload is not a JSON message: {exc}") from None
    properties = message.get("properties") if isinstance(message, dict) else None
    if not isinstance(properties, dict):
        raise UnreadableMessage("payload is not a message: it needs a `properties` document")
    if not isinstance(properties.setdefault("delivery_info", {}), dict):
        raise UnreadableMessage("the message's delivery_info property is not a document")
    if not isinstance(message.get("headers") or {}, dict):
        raise UnreadableMessage("the message's headers are not a document")
    encoding, body = properties.get("body_encoding"), message.get("body")
    if encoding == "base64":
        try:
            base64.b64decode(body or "", validate=True)
        except (TypeError, ValueError) as exc:
            raise UnreadableMessage(f"the body is not base64: {exc}") from None
    elif encoding not in (None, "utf-8"):
        raise UnreadableMessage(f"unknown body_encoding {encoding!r}")
    return message


def _takeable(queue: Any) -> dict[str, Any]:
    """The filter of the messages of `queue` (a name, or a query on it) a take may have."""
    now = datetime.now(UTC)
    # The TTL monitor deletes expired messages only every minute or so: one past its time is never delivered.
    # A mark older than TAKE_LEASE is a take that never finished (its consumer lost the server and went away).
    abandoned = ObjectId.from_datetime(now - timedelta(seconds=TAKE_LEASE))
    # One predicate, not an $or: a server may evaluate an $or against every document (see document.attempts_fence).
    unmarked = {"$not": {"$gte": abandoned}}  # no mark, or an older one
    return {"queue": queue, "expiresAt": {"$gt": now}, TAKER: unmarked}


class MessageStore:
    """Transient messages: deleted when fetched, expired by a TTL index when nobody fetches them.

    `secrets` (the broker URL's password) are masked in every message stored whose body is JSON or text (Celery's
    default for all of them): events carry a task's exception, traceback and result, replies and RPC results carry
    what tasks return, and all of them reach Flower and logs. Any other body is stored as it came, the document's
    `unmasked` saying why (see unmasked_reason).
    """

    def __init__(self, db: Database, *, ttl: float = 300.0, prefix: str = "bb_", secrets: Iterable[str] = ()) -> None:
        self.messages = db[f"{prefix}messages"]
        self.bindings = db[f"{prefix}bindings"]
        self.ttl = ttl
        self.secrets = secret_forms(secrets)
        self._said_unmasked = False  # a body stored unmasked is logged once (each document says so itself)
        self._table_cache: dict[str, tuple[float, list[tuple[str, str, str]]]] = {}
        self._watch = BindingsWatch.of(self.bindings)
        #: True where the server has no TTL index, so a worker's periodic sweep deletes expired messages.
        self.expiry_sweep = False

    def ensure_indexes(self) -> None:
        fetch = IndexModel([("queue", ASCENDING), ("priority", DESCENDING), ("_id", ASCENDING)], name="bb_fetch")
        try:
            self.messages.create_indexes(
                [fetch, IndexModel([("expiresAt", ASCENDING)], name="bb_expiry", expireAfterSeconds=0)]
            )
        except OperationFailure as exc:
            if not is_not_implemented(exc):
                raise
            ensure_plain_indexes(self.messages, [fetch])
            say_no_ttl_once(exc)
            self.expiry_sweep = True
        ensure_plain_indexes(
            self.bindings,
            [
                IndexModel(
                    [("exchange", ASCENDING), ("routing_key", ASCENDING), ("queue", ASCENDING)],
                    name="bb_binding",
                    unique=True,
                ),
                IndexModel([("queue", ASCENDING)], name="bb_binding_queue"),
            ],
        )

    def expire(self) -> int:
        """Where the server has no TTL index: delete the messages past their expiry (a worker's periodic sweep)."""
        if not self.expiry_sweep:
            return 0
        return self.messages.delete_many({"expiresAt": {"$lt": datetime.now(UTC)}}).deleted_count

    def put(
        self,
        queue: str,
        message: dict[str, Any],
        priority: int,
        *,
        ttl: float | None = None,
        soon: bool = False,
        linger: float = 0.0,
        expires_at: datetime | None = None,
        message_id: ObjectId | None = None,
    ) -> None:
        """Store a message for `queue`; `ttl` (seconds, the message's own expiration) shortens the store's.

        `message_id`: the _id its publish chose (the first try's): a publish tried again after its insert landed
        unanswered finds that insert instead of storing a twin.

        `expires_at`: the expiry of a message stored before and given back (a requeue keeps it, as on RabbitMQ); one
        already past it is not stored again. `soon`: hand it to the process's outbox, which stores it in order with
        the others it holds, and return at once (an event loop's thread: see Outbox); there it may wait `linger`
        seconds for others to be stored with it. The message is encoded and masked here either way."""
        now = datetime.now(UTC)
        if expires_at is not None and expires_at <= now:
            return
        unmasked = None
        if self.secrets:
            message, unmasked = scrub_message(message, self.secrets)
        if expires_at is None:
            expires_at = now + timedelta(seconds=self.ttl if ttl is None else min(ttl, self.ttl))
        # The _id is given here: it keeps the publishing order, and makes a write tried again idempotent.
        document = {"_id": message_id or ObjectId(), "queue": queue, "priority": priority, "payload": dumps(message)}
        document["expiresAt"] = expires_at
        if unmasked is not None:
            document["unmasked"] = unmasked
            self._say_unmasked(message.get("content-type") or "", queue)
        if soon:
            Outbox.of(self.messages).add(document, linger)
            return
        # A duplicate _id (the only unique key): an earlier try of this publish stored it, and its answer was lost.
        with contextlib.suppress(DuplicateKeyError), unique_refusals(self.messages.database):
            self.messages.insert_one(document)

    def _say_unmasked(self, content_type: str, queue: str) -> None:
        if not self._said_unmasked:
            self._said_unmasked = True
            logger.warning(
                "a %r message for queue %r is stored without the broker URL's password masked: only JSON and text"
                " bodies are masked (others are never decoded by the broker); see the message's `unmasked` field",
                content_type[:100],
                queue,
            )

    def any_waiting(self, queues: Iterable[str]) -> bool:
        """Whether any of `queues` has a message to take: a safety poll's one read for them all."""
        return self.messages.find_one(_takeable({"$in": list(queues)}), {"_id": 1}) is not None

    def take(self, queue: str, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Take up to `limit` of `queue`'s messages, in order, each to one taker: their stored documents (to deliver,
        `payload_of`; to give back, `give_back`), and whether that was all the queue had. One round trip each
        below TAKE_BATCH_MIN; from there, a read, a mark and a delete for them all."""
        live = _takeable(queue)
        unmarked = live[TAKER]
        if limit < TAKE_BATCH_MIN:
            taken: list[dict[str, Any]] = []
            while len(taken) < max(limit, 1):
                try:
                    doc = self.messages.find_one_and_delete(live, sort=FETCH_ORDER)
                except PyMongoError:
                    if not taken:
                        raise
                    return taken, False  # what was taken off the server already is delivered, not dropped
                if doc is None:
                    return taken, True
                taken.append(doc)
            return taken, False
        while True:
            head = list(self.messages.find(live, sort=FETCH_ORDER, limit=limit))
            if not head:
                return [], True
            # Marked first, so that of messages another consumer reads at the same time each goes to one of them.
            taker, ids = ObjectId(), [doc["_id"] for doc in head]
            try:
                marked = self.messages.update_many({"_id": {"$in": ids}, TAKER: unmarked}, {"$set": {TAKER: taker}})
                all_mine = marked.modified_count == len(head)
            except ConnectionFailure:  # the mark may have landed unanswered: what is marked `taker` is read back
                all_mine = False
            if not all_mine:
                # Compared, not hashed: a hand-written message's _id may be a document.
                mine = [doc["_id"] for doc in self.messages.find({"_id": {"$in": ids}, TAKER: taker}, {"_id": 1})]
                head = [doc for doc in head if doc["_id"] in mine]
            if head:  # else another consumer took them all: read on
                mine_only = {"_id": {"$in": [doc["_id"] for doc in head]}, TAKER: taker}
                try:
                    self.messages.delete_many(mine_only)
                except ConnectionFailure:  # nobody else takes what is marked `taker` (TAKE_LEASE): delete again
                    self.messages.delete_many(mine_only)
                return head, len(ids) < limit

    def set_aside(self, taken: dict[str, Any], reason: str) -> None:
        """Store again a message taken that no consumer can read, with why, never to be taken again: it stays where
        its sender can see it until its expiry, as an undelivered message would."""
        self.messages.insert_one({**taken, TAKER: SET_ASIDE, "unreadable": reason})

    def give_back(self, taken: Iterable[dict[str, Any]]) -> None:
        """Store again messages taken and never delivered (their consumer stopped first), as they were."""
        docs = [{key: value for key, value in doc.items() if key != TAKER} for doc in taken]
        if docs:
            self.messages.insert_many(docs, ordered=False)

    def size(self, queue: str) -> int:
        live = {"queue": queue, "expiresAt": {"$gt": datetime.now(UTC)}, TAKER: {"$ne": SET_ASIDE}}
        return self.messages.count_documents(live)

    def purge(self, queue: str) -> int:
        return self.messages.delete_many({"queue": queue}).deleted_count

    def bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        key = {"exchange": exchange, "routing_key": routing_key, "queue": queue}
        self.bindings.update_one(key, {"$set": {**key, "pattern": pattern}}, upsert=True)
        self._table_cache.pop(exchange, None)
        self._watch.changed()  # the tables other connections of this process keep are read again

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        self.bindings.delete_one({"exchange": exchange, "routing_key": routing_key, "queue": queue})
        self._table_cache.pop(exchange, None)
        self._watch.changed()  # the tables other connections of this process keep are read again

    def table(self, exchange: str, max_age: float = 0.0) -> list[tuple[str, str, str]]:
        """The bindings of an exchange, as kombu's (routing_key, pattern, queue) rows.

        A table that may be `max_age` seconds old may also be kept for as long as a live change stream on
        the bindings reports no change; `max_age` 0 always reads, and so does any once a binding changed since
        (a queue bound by this process, or by another one the change stream told of).
        """
        cached = self._table_cache.get(exchange)
        if cached is not None and max_age > 0:
            read_at, kept = cached
            unchanged = read_at > self._watch.changed_at
            if unchanged and (time.monotonic() - read_at < max_age or self._watch.vouches_for(read_at)):
                return kept
        # A binding is data: one written by hand (or by another client) whose queue is not a name is no binding, a
        # missing routing key is the empty one (a fanout's), and the pattern a topic exchange matches with is made of
        # the routing key as Kombu makes it, never compiled from the document (`"("` failed every publish).
        rows = [
            (routing_key, upstream_kombu.topic_pattern(routing_key), queue)
            for b in self.bindings.find({"exchange": exchange})
            if isinstance(queue := b.get("queue"), str) and isinstance(routing_key := b.get("routing_key", ""), str)
        ]
        self._table_cache[exchange] = (time.monotonic(), rows)
        return rows

    def delete_exchange(self, exchange: str) -> None:
        self.bindings.delete_many({"exchange": exchange})
        self._table_cache.pop(exchange, None)
        self._watch.changed()

    def delete_queue(self, queue: str) -> None:
        self.bindings.delete_many({"queue": queue})
        self.messages.delete_many({"queue": queue})
        self._table_cache.clear()
        self._watch.changed()
