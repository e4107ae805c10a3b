"""The Kombu Channel of `bbmongo://`: task messages become `jobs` documents, the rest is plumbing (plain messages)."""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from queue import Empty
from time import monotonic
from typing import TYPE_CHECKING, Any, Protocol

import pymongo
from kombu.exceptions import ChannelError, OperationalError
from kombu.transport import virtual
from pymongo import errors as mongo_errors
from pymongo.errors import OperationFailure, PyMongoError

from bb_broker import connection
from bb_broker.app_stores import store_revoked_results, tell_of_undeliverable_job
from bb_broker.clock import ServerClock
from bb_broker.forks import reset_in_child
from bb_broker.jobs import leases
from bb_broker.jobs.document import task_id_of
from bb_broker.jobs.leases import LeaseKeeper
from bb_broker.jobs.payloads import (
    ATTEMPTS_HEADER,
    JOB_ID_HEADER,
    RENAMED_FROM_HEADER,
    MalformedTaskMessage,
    PayloadError,
    check_encodable,
    check_envelope,
    chord_body_id,
    deliverable_message,
    is_task_message,
)
from bb_broker.jobs.queues import KnownControls, QueueControls
from bb_broker.jobs.revokes import revoke_queued, revoked_task_ids
from bb_broker.options import DEFAULTS, TRANSPORT_OPTIONS, BrokerOptions, open_store
from bb_broker.server import capabilities, describe_failure
from bb_broker.transport.claims import Claimer, ClaimOnItsWay
from bb_broker.transport.plumbing import MessageStore, UnreadableMessage, payload_of
from bb_broker.transport.publishing import expiration, moment, names_a_task, plain_publish, put_job, put_plain
from bb_broker.transport.qos import STORED_AS, HoldingChannel, JobMessage, JobQoS
from bb_broker.transport.wakeups import Look, Wakeups
from bb_broker.upstream import kombu as upstream_kombu

logger = logging.getLogger(__name__)

#: Seconds the first look at the topology waits while a new channel waits for its server; each next look waits twice
#: as long as the one before, within the connect timeout.
REACHABLE_SLICE = 0.25

#: The threads running an event loop a connection of this process joined (register_with_event_loop), by how many
#: joined it: the plain messages they publish go through the outbox (MessageStore.put's `soon`).
_loop_threads: Counter[int] = Counter()
reset_in_child(_loop_threads.clear)  # a pool process runs no loop of its parent's


def _on_a_loop_thread() -> bool:
    return threading.get_ident() in _loop_threads


def joined_event_loop() -> int:
    """The calling thread runs an event loop a connection of this process joined; returns the thread's id."""
    thread = threading.get_ident()
    _loop_threads[thread] += 1
    return thread


def left_event_loop(thread: int) -> None:
    """A connection left the event loop `thread` runs (the id joined_event_loop returned)."""
    _loop_threads[thread] -= 1
    if _loop_threads[thread] <= 0:
        del _loop_threads[thread]


#: Per (server, database, jobs collection) indexed by this process: the deletes its server's missing TTL indexes
#: leave to the workers' periodic sweep.
_indexed: dict[tuple[str, str, str], list[Callable[[], int]]] = {}
_indexed_lock = threading.Lock()


@reset_in_child
def _forget_parent_indexing() -> None:
    # A task that publishes runs a channel in its pool process: a lock a parent's thread held at the fork would
    # never be released there. What the parent indexed stays known: the same server has the same indexes.
    global _indexed_lock
    _indexed_lock = threading.Lock()


class ServerUnreachable(OperationalError):
    """No server of the broker URL answers: one line naming the URL as written (password masked) and the cause in
    words, as `bb-broker` prints it. Kombu's OperationalError, and one of the transport's connection errors, so that
    Kombu's and Celery's retries and reconnects treat it as every transport's lost connection."""


class ChannelTransport(Protocol):
    """What a channel asks of its transport (transport.py's), which Kombu hands it as `connection`."""

    @property
    def broker_url(self) -> str: ...

    @property
    def wakeups(self) -> Wakeups | None: ...

    @property
    def on_event_loop(self) -> bool: ...

    def watch(self, channel: Channel) -> None: ...

    def consumers_changed(self) -> None: ...

    def poke(self) -> None: ...

    def ring(self) -> None: ...

    def delivering_here(self) -> bool: ...


class Channel(virtual.Channel):
    QoS = JobQoS
    Message = JobMessage
    supports_fanout = True

    # Kombu hands a channel its transport as `connection`: transport.py's, of which the channel asks only what
    # ChannelTransport says (the stubs say Kombu's virtual Transport, which has none of it).
    connection: ChannelTransport  # type: ignore[assignment]

    if TYPE_CHECKING:  # Kombu's property makes a QoS of the class above

        @property
        def qos(self) -> JobQoS: ...

    # The transport options (broker_transport_options): Kombu sets each on the channel (from_transport_options),
    # which reads them into its BrokerOptions (self.options); their defaults, and what each does, are BrokerOptions'.
    max_attempts = DEFAULTS.policy.max_attempts
    backoff_base = DEFAULTS.policy.backoff_base
    stale_after = DEFAULTS.policy.stale_after
    message_ttl = DEFAULTS.message_ttl
    jobs_collection = DEFAULTS.jobs_collection
    max_claim_batch = DEFAULTS.max_claim_batch
    retention = DEFAULTS.retention
    safety_poll_interval = DEFAULTS.safety_poll_interval
    use_change_streams = DEFAULTS.use_change_streams
    events_linger = DEFAULTS.events_linger
    settle_linger = DEFAULTS.settle_linger  # read by the worker's SettleRelay (worker/startup.py), not the channel
    from_transport_options = virtual.Channel.from_transport_options + TRANSPORT_OPTIONS

    #: Seconds a consumer trusts what it read of the paused queues without a change stream (with one, it reads
    #: again when the stream reports a change, and at least every minute). Not a transport option (yet).
    pause_check_interval = 1.0

    #: Seconds a topic exchange's bindings (Celery events) may be reused before they are read again.
    topic_table_max_age = 1.0

    def __init__(self, connection_: Any, **kwargs: Any) -> None:
        super().__init__(connection_, **kwargs)
        self.options = BrokerOptions.parse({name: getattr(self, name) for name in TRANSPORT_OPTIONS})
        self.target = connection.parse_broker_url(connection_.broker_url)
        self.jobs = open_store(self.target, self.options)
        #: Where a task message's job goes (JobStore.publish's keywords): inserted at once, or, while bb_broker.bulk
        #: builds a batch on this channel, kept for the batch's insert.
        self.publish_job: Callable[..., Any] = self.jobs.publish
        db = self.jobs.coll.database
        self.clock = ServerClock.of(db)
        self.plumbing = MessageStore(db, ttl=self.options.message_ttl, secrets=self.target.secrets)
        self.queue_controls = QueueControls(db)
        #: The paused and limited queues, as this consumer last read them.
        self.known_controls = KnownControls(
            self.queue_controls, max_age=float(self.pause_check_interval), version=self._controls_version
        )
        self.owner = connection.lease_owner()
        #: Queues declared here as auto-delete or bound to a fanout exchange: messages, not jobs, are expected
        #: there. Only a hint for the order of the reads and for wake-ups: every queue reads both collections.
        self._plain_queues: set[str] = set()
        #: Queues declared here as auto-delete: they leave fanout and topic exchanges with their last consumer here.
        self._auto_delete_queues: set[str] = set()
        # What the consumer read ahead is the consuming thread's alone (the event loop's, or the one in drain_events);
        # the jobs it claimed, its claimer's (whose docstring says which thread owns what).
        self._held_plain: dict[str, deque[dict[str, Any]]] = {}  # plain messages taken in a batch, not yet delivered
        self.claimer = Claimer(self, secrets=self.target.secrets)
        self._keeper: LeaseKeeper | None = None
        self._check_reachable(db, connection_.client)
        self._ensure_indexes()
        # What the server offers, probed once per process at connect (server.py): its fallbacks are chosen now and
        # said in the log at start, not met at the first claim.
        capabilities(db)

    def _check_reachable(self, db: Any, client: Any) -> None:
        # A dead server is refused within the connect timeout the user set (Kombu's connect_timeout, Celery's
        # broker_connection_timeout), not after server selection timed out for each index this channel creates;
        # and at once when every server refused the connection, so that a failover URL list moves on.
        started = monotonic()
        deadline = started + float(getattr(client, "connect_timeout", None) or 5)
        look = REACHABLE_SLICE
        while True:
            try:
                with pymongo.timeout(min(max(deadline - monotonic(), 0.01), look)):
                    db.command("ping")
                return
            except mongo_errors.ConnectionFailure as exc:
                if monotonic() >= deadline or _every_server_refused(db.client):
                    shown = describe_failure(exc, self.connection.broker_url, waited=monotonic() - started)
                    raise ServerUnreachable(shown) from None  # pymongo's topology dump says it in 100 lines
            except PyMongoError:
                if monotonic() >= deadline or _every_server_refused(db.client):
                    raise
            # Longer each time: pymongo refuses, without sending it, a command whose time left is under the server's
            # round trip, so a server further away than one look (another continent, a loaded machine) would have
            # every ping refused until the connect timeout, and the worker exit at its start.
            look *= 2

    def _ensure_indexes(self) -> None:
        key = (self.target.mongo_uri, self.target.database, self.options.jobs_collection)
        with _indexed_lock:
            if key not in _indexed:
                self.jobs.ensure_indexes(retention=self.options.retention)
                self.plumbing.ensure_indexes()
                expiries = [self.jobs.expire_succeeded] if self.jobs.retention_sweep else []
                _indexed[key] = expiries + ([self.plumbing.expire] if self.plumbing.expiry_sweep else [])

    # --- queues -------------------------------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        check_encodable({"the queue name": queue})  # Kombu's declare counts it next: a query BSON cannot encode
        # Celery's own plumbing queues (remote control, replies, events) are auto-delete; task queues are not.
        if kwargs.get("auto_delete"):
            self._plain_queues.add(queue)
            self._auto_delete_queues.add(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return True

    # Where a message is stored is decided by the message alone (a Celery task message is a job, anything else a
    # plain message), so every queue reads, counts and purges both collections: what a queue holds never depends
    # on which channel, connection or process declared it.

    # What this channel's consumer read ahead in a batch and has not delivered is still the queue's: counted, and
    # purged or deleted with the rest (given back first) rather than delivered after the queue was emptied.

    def _size(self, queue: str) -> int:
        self.claimer.take_landed()
        read_ahead = len(self._held_plain.get(queue, ())) + self.claimer.held_count(queue)
        return self.plumbing.size(queue) + self.jobs.queued_count(queue) + read_ahead

    def _purge(self, queue: str) -> int:
        self._give_back(queue)
        return self.plumbing.purge(queue) + self.jobs.purge_queued(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._give_back(queue)
        self.plumbing.delete_queue(queue)
        self.jobs.purge_queued(queue)
        self._plain_queues.discard(queue)
        self._auto_delete_queues.discard(queue)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any) -> None:
        # Kombu deletes only through the bindings this channel declared: here the queue is deleted whoever declared
        # it, its messages and every binding to it, as on RabbitMQ.
        if if_empty and self._size(queue):
            return
        self._delete(queue)
        self.state.queue_bindings_delete(queue)
        # Kombu keeps this connection's bindings in each exchange's table too, which routes as the stored ones do.
        upstream_kombu.drop_bindings(self.state, lambda row: row[2] != queue)

    def queue_unbind(
        self, queue: str, exchange: str | None = None, routing_key: str = "", arguments: Any = None, **kwargs: Any
    ) -> None:
        # Kombu's removes the binding from a copy of the table: here it goes from the stored bindings every connection
        # routes by, and from this connection's own table.
        exchange = exchange or "amq.direct"
        self.state.binding_delete(queue, exchange, routing_key)
        row = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        upstream_kombu.drop_bindings(self.state, lambda kept: kept != tuple(row), exchange)
        self.plumbing.unbind(exchange, routing_key, queue)

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",  # Kombu's name, shadowing the builtin
        durable: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        # Kombu's virtual channel takes any type and fails each later bind and publish with a bare KeyError.
        if not passive and (type or "direct") not in self.exchange_types:
            raise ChannelError(
                f"NOT_IMPLEMENTED - exchange type {type!r} of exchange {exchange!r}: bbmongo:// routes "
                f"{', '.join(sorted(self.exchange_types))} exchanges",
                (40, 10),
                "Channel.exchange_declare",
                540,
            )
        super().exchange_declare(exchange, type, durable, auto_delete, arguments, nowait, passive)

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        super().exchange_delete(exchange, if_unused=if_unused, nowait=nowait)
        self.plumbing.delete_exchange(exchange)  # its bindings, which every connection reads

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        check_encodable({"the exchange name": exchange, "the routing key": routing_key, "the queue name": queue})
        if self.typeof(exchange).type == "fanout":
            self._plain_queues.add(queue)
        self.plumbing.bind(exchange, routing_key, pattern, queue)

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        local = upstream_kombu.exchange_table(self.state, exchange)
        max_age = self.topic_table_max_age if self.typeof(exchange).type == "topic" else 0.0
        return list({*local, *self.plumbing.table(exchange, max_age=max_age)})

    def _lookup(self, exchange: str, routing_key: str, default: str | None = None) -> Any:
        # A routing key this connection bound itself on a direct exchange (a task queue) is routed without a read;
        # any other is looked up in the bindings every connection writes: a worker that once bound a reply queue of
        # its own must still reach the reply queue of each process that asks it something.
        kind = self.typeof(exchange) if exchange else None
        if kind is not None and kind.type == "direct":
            local = upstream_kombu.exchange_table(self.state, exchange)
            if routed := kind.lookup(local, exchange, routing_key, default):
                return routed
        return super()._lookup(exchange, routing_key, default)

    # --- publishing -------------------------------------------------------

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any) -> Any:
        if is_task_message(message):
            return super().basic_publish(message, exchange, routing_key, **kwargs)
        # Events, replies and control messages are best-effort: each try waits for the server a bounded time (Kombu
        # retries what it must), and a stopping worker whose server is gone drops them rather than wait again.
        # On an event loop's thread the outbox stores them; what goes to a topic exchange (Celery's task events, a
        # few per task) may linger there a moment to be stored with others.
        lingering = bool(exchange) and self.typeof(exchange).type == "topic"
        try:
            with connection.shutdown_patience():
                return super().basic_publish(
                    message, exchange, routing_key, **kwargs, linger=self.options.events_linger if lingering else 0.0
                )
        except PyMongoError:
            if not connection.server_gone_at_shutdown():
                raise
            _say_once("the worker is stopping and its server does not answer: its last events are not sent")
            return None

    def _put(self, queue: str, message: dict[str, Any], linger: float = 0.0, **kwargs: Any) -> None:
        priority = self._get_message_priority(message)
        if not is_task_message(message):
            put_plain(self.plumbing, queue, message, priority, soon=_on_a_loop_thread(), linger=linger)
            return
        body = self.decode_body(message["body"], message["properties"].get("body_encoding"))
        put_job(self.publish_job, self.clock, queue, message, body, priority)

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any) -> None:
        self._revoke_durably(message)
        priority = self._get_message_priority(message)
        for queue in {queue for _, _, queue in self.get_table(exchange)}:
            stored, message_id = plain_publish(message, queue)
            ttl = expiration(message)
            self.plumbing.put(queue, stored, priority, ttl=ttl, soon=_on_a_loop_thread(), message_id=message_id)

    def _revoke_durably(self, message: dict[str, Any]) -> None:
        """A revoke broadcast (app.control.revoke, Flower's button) fails the tasks' queued jobs before it goes out,
        here in the revoker's process: workers keep revokes in memory only, and may all be down or restart first."""
        properties = message.get("properties") or {}
        task_ids = revoked_task_ids(message, self.decode_body(message.get("body"), properties.get("body_encoding")))
        if task_ids:
            revoke_queued(self.jobs, task_ids, by=f"revoke from {self.owner}")
            store_revoked_results(self.jobs, task_ids)  # no worker will: the app's own result backend is told here

    def _restore(self, message: Any) -> None:
        if isinstance(message, JobMessage) and message.job_id:
            # Its job is on the server whatever happens here: nothing for Kombu to dump ("UNABLE TO RESTORE").
            if leases.started_here(message.job_id):
                # An unacked message whose run goes on (acks_late, through a reconnect): the run settles its job, and
                # the job keeps its lease. Given back, it would run a second time at the same attempt meanwhile.
                # Celery's rejection of it (a lost pool process, say) still fails the job.
                self.qos.keep_running(message)
                return
            if message.cut_short:
                # Started, then cancelled by Celery (acks_late, a cold shutdown): its attempt ran, and counts.
                self.claimer.recover_cut_short(message.job_id, message.attempts)
                return
            self.claimer.release_job(message.job_id, message.attempts)
            return
        # Kombu's own restore, with `redelivered` where Kombu and Celery read it.
        delivery_info = message.delivery_info
        payload = message.serializable()
        payload["properties"].setdefault("delivery_info", {})["redelivered"] = True
        if isinstance(message, JobMessage) and message.stored_as is not None:
            # Back to the queue it was read from, expiring when it would have: the other queues an exchange routed it
            # to have their own copy.
            queue, expires_at = message.stored_as
            priority = self._get_message_priority(payload)
            self.plumbing.put(queue, payload, priority, expires_at=expires_at, soon=_on_a_loop_thread())
            return
        for queue in self._lookup(delivery_info["exchange"], delivery_info["routing_key"]):
            self._put(queue, payload)

    # --- consuming ----------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str | None, **kwargs: Any) -> Any:
        if queue not in self._plain_queues and self._keeper is None:
            self._keeper = LeaseKeeper.for_store(self.jobs, self.owner)
            self._keeper.add_source(self._live_jobs)
            self._give_back_unreleased(self._keeper)
            for expire in _indexed.get((self.target.mongo_uri, self.target.database, self.options.jobs_collection), []):
                self._keeper.add_expiry(expire)
        self.connection.watch(self)
        tag = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.connection.consumers_changed()
        self.connection.poke()  # a new queue to look at
        return tag

    def _give_back_unreleased(self, keeper: LeaseKeeper) -> None:
        """What a lost connection of this process could not give back goes back before this consumer claims (its
        claims must not race those releases): bounded by a stop's patience, the keeper waits out any outage."""
        if not leases.unreleased(self.jobs):
            return
        try:
            with connection.shutdown_patience():
                keeper.give_back_unreleased(wait=connection.SHUTDOWN_PATIENCE)
        except PyMongoError as exc:
            logger.warning("could not give back the jobs a lost connection held (%s): later", type(exc).__name__)

    def basic_qos(self, *args: Any, **kwargs: Any) -> None:
        super().basic_qos(*args, **kwargs)
        self.connection.poke()  # Celery raises the limit as its pool grows: room to take more

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        self.claimer.take_landed()
        if (error := self.claimer.error_met()) is not None:
            raise error  # where the event loop hands it to Celery (to reconnect)
        if self.claimer.held_count(queue):
            return self._claim(queue)
        if self._held_plain.get(queue):
            return self._fetch_plain(queue)
        if self.claim_in_flight_for(queue):
            raise ClaimOnItsWay()
        plain = queue in self._plain_queues
        wakeups = self.connection.wakeups
        look = Look() if wakeups is None else wakeups.look(queue, job_queue=not plain)
        if look is None:
            raise Empty()
        # Each collection is read only where the change stream told of something there (or on a safety poll):
        # a lone task's claim is not followed by a read of bb_messages, nor by a second claim that finds nothing.
        reads = (("messages", lambda queue: self._fetch_plain(queue, look)), ("jobs", self._claim))
        try:
            if self.claimer.backed_off(queue) > 0:
                _spend(look)  # backed off from a server answer (refused): its wake-up comes at the pause's end
                raise Empty()
            if look.safety and wakeups is not None:
                self._safety_probe(queue, look, wakeups)  # inside: a probe that fails leaves the look's news as news
            for source, read in reads if plain else reversed(reads):
                if not getattr(look, source):
                    continue
                try:
                    message = read(queue)
                except ClaimOnItsWay:
                    # The claim takes the look's news of jobs with it (news that comes meanwhile stays news), and
                    # rings when it lands.
                    look.took(source, 0, all_there_was=True)
                    break
                except Empty:
                    look.took(source, 0, all_there_was=True)
                    continue
                if source == "jobs":  # one claim may have taken a batch, and found the queue empty doing it
                    taken = 1 + self.claimer.held_count(queue)
                    look.took(source, taken, all_there_was=not self.claimer.queue_backlogged(queue))
                return message
            raise Empty()
        except OperationFailure as exc:
            # A safety probe's or a plain message's read (a claim's own is handled where it is made): as a claim's.
            self.claimer.refused(queue, exc, wakeups)
            _spend(look)
            raise Empty() from None
        finally:
            if wakeups is not None:
                wakeups.looked(queue, look)

    def _safety_probe(self, queue: str, look: Look, wakeups: Wakeups) -> None:
        """A safety poll of `queue`, and of the other consumed queues whose safety poll is half due: one read per
        collection says whether anything waits in any of them (an idle worker's steady cost, whatever the number of
        queues it consumes); only where something does are they read queue by queue, as news."""
        began, others = wakeups.due_for_safety_soon(queue)
        queues = [queue, *others]
        jobs, messages = self.jobs.any_due(queues), self.plumbing.any_waiting(queues)
        wakeups.safety_polled(others, at=began, jobs=jobs, messages=messages)
        look.jobs, look.messages = (look.jobs if jobs else 0.0), (look.messages if messages else 0.0)

    def _fetch_plain(self, queue: str, look: Look | None = None) -> dict[str, Any]:
        """The next plain message of `queue`: one held from a batch, else a batch of up to what the `look`'s news
        told of and the consumer has room for (the read is taken off the look)."""
        held = self._held_plain.setdefault(queue, deque())
        while True:
            if not held:
                # A batch only for a queue being consumed: what basic_get leaves here would wait for no one.
                room = self.qos.claimable() if queue in upstream_kombu.consumed_queues(self) else 1
                told = look.messages if look is not None else 0
                wanted = int(max(min(told, room, self.options.max_claim_batch), 1))
                taken, exhausted = self.plumbing.take(queue, wanted)
                held.extend(taken)
                if look is not None:
                    look.took("messages", len(taken), all_there_was=exhausted)
                    look = None  # one read per call: the news is spent
                if not held:
                    raise Empty()
            stored = held.popleft()
            try:
                message = payload_of(stored)
                if names_a_task(message):
                    # Celery's consumer takes it as a task (its `task` header says so), and a task the transport
                    # did not store as a job lacks what a worker needs: it would end every worker it reaches.
                    check_envelope(message)
            except (UnreadableMessage, MalformedTaskMessage) as exc:
                logger.error("message %s of queue %s cannot be delivered: %s", stored["_id"], queue, exc)
                self.plumbing.set_aside(stored, str(exc))
                continue
            message["properties"].setdefault("delivery_tag", upstream_kombu.next_delivery_tag(self))
            return {**message, STORED_AS: (stored["queue"], stored["expiresAt"])}

    def _claim(self, queue: str) -> dict[str, Any]:
        """The message of the next job of `queue` this consumer claims (Claimer.next_job), as Celery takes it."""
        while True:
            job = self.claimer.next_job(queue)
            try:
                message = deliverable_message(job.payload)
            except PayloadError as exc:
                logger.error("job %s cannot be delivered: %s", job.id, exc)
                reason = f"stored message is unreadable: {exc}"
                if self.claimer.fail_undeliverable(job, reason):
                    tell_of_undeliverable_job(self.jobs, task_id_of(job.task_id), reason, chord_body=None)
                continue
            except MalformedTaskMessage as exc:
                # Handed to Celery, it would end the worker (or fail every attempt the same way): its own job fails,
                # once, and the queue behind it moves on.
                logger.error("job %s cannot be delivered: %s", job.id, exc)
                if self.claimer.fail_undeliverable(job, str(exc)):  # not where a sweep or an operator came first
                    tell_of_undeliverable_job(
                        self.jobs, task_id_of(job.task_id), str(exc), chord_body=chord_body_id(job.payload)
                    )
                continue
            message["headers"].update({JOB_ID_HEADER: job.id, ATTEMPTS_HEADER: job.attempts})
            message["headers"].pop(RENAMED_FROM_HEADER, None)  # only the job's own `renamedFrom` says it
            if job.renamed_from is not None:
                message["headers"][RENAMED_FROM_HEADER] = job.renamed_from
            headers = message["headers"]
            if headers.get("eta") and job.run_after is not None:
                # The claim found the job due by the server's clock; the ETA is the publisher's, and Celery compares
                # it with this process's clock: a worker whose clock is behind would wait the difference again.
                headers["eta"] = self.clock.to_local(job.run_after).isoformat()
            expires = moment(headers, "expires", strict=False)
            if expires is not None and expires.tzinfo is not None:
                # Stored on the server's clock; Celery compares it with this process's (a clock ahead expired it early).
                headers["expires"] = self.clock.to_local(expires).isoformat()
            message["properties"]["delivery_tag"] = job.id
            # Where Kombu's messages and Celery's requests read it (delivery_info), as Kombu's Redis sets it.
            message["properties"]["delivery_info"]["redelivered"] = job.attempts > 1
            return message

    def _controls_version(self) -> int | None:
        wakeups = self.connection.wakeups
        return wakeups.controls_version if wakeups is not None and wakeups.available else None

    def is_holding(self) -> bool:
        """Whether jobs claimed in a batch wait here to be delivered."""
        return self.claimer.is_holding()

    def is_backlogged(self) -> bool:
        """Whether a queue this channel consumes had more jobs than its last claim took."""
        return self.claimer.is_backlogged()

    def claim_in_flight_for(self, queue: str) -> bool:
        """Whether a claim of `queue` is on its way in the background (it rings the event loop when it lands)."""
        return self.claimer.in_flight(queue)

    def _live_jobs(self) -> list[str]:
        return self.qos.live_jobs() + self.claimer.held_ids()

    def _give_back(self, queue: str) -> None:
        self.claimer.give_back(queue)
        plain = self._held_plain.pop(queue, None)
        if plain:
            try:
                self.plumbing.give_back(plain)
            except PyMongoError as exc:
                logger.warning("could not give back %d messages of %s (%s)", len(plain), queue, type(exc).__name__)

    def basic_cancel(self, consumer_tag: str) -> Any:
        # Also how close() ends each consumer: jobs are held only for a queue being consumed.
        queue = upstream_kombu.queue_of_consumer(self, consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if self.connection is not None:  # None once the channel closed (a consumer cancelled at shutdown)
            self.connection.consumers_changed()
        if queue is not None:
            self._give_back(queue)
            if queue in self._auto_delete_queues and queue not in upstream_kombu.consumed_queues(self):
                self._unbind_from_broadcasts(queue)
        return result

    def _unbind_from_broadcasts(self, queue: str) -> None:
        """An auto-delete queue whose last consumer here was cancelled leaves the fanout and topic exchanges it was
        bound to: left bound, a stopped event receiver's queue (Flower, `celery events`) was stored a copy of every
        event published after it, for ever. RabbitMQ deletes the queue; its messages stay here until they expire,
        for a consumer that reads it again (Celery's rpc:// results queue is cancelled after each result)."""
        for exchange, routing_key, arguments in list(self.state.queue_bindings(queue)):
            if self.typeof(exchange).type not in ("fanout", "topic"):
                continue
            try:
                with connection.shutdown_patience():  # best effort: a consumer cancelled as its server went away
                    self.queue_unbind(queue, exchange, routing_key, arguments)
            except PyMongoError as exc:
                logger.warning(
                    "could not unbind auto-delete queue %s from %s (%s)", queue, exchange, type(exc).__name__
                )

    def close(self) -> None:
        self.claimer.close()  # what its claims ahead brought: the consumers' cancels below give back what is held
        if self._keeper is not None:
            self._keeper.remove_source(self._live_jobs)
            self._keeper = None
        with connection.shutdown_patience():  # a server that is gone must not hold a worker's stop
            super().close()


if TYPE_CHECKING:  # what the QoS asks of its channel, checked by mypy (the claimer's: at Claimer(self))
    _asked_by_qos: type[HoldingChannel] = Channel

_said: set[str] = set()


def _spend(look: Look) -> None:
    """Take a look's news of both collections as read: what it told of is read again at its queue's next wake-up."""
    for source in ("messages", "jobs"):
        look.took(source, 0, all_there_was=True)


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning(message)


def _every_server_refused(client: Any) -> bool:
    # A server whose answer did not come in time has not refused: it may answer a longer look (pymongo 4.6 marks a
    # server so when a connection's handshake ran out of a command's time; 4.20 does not).
    servers = list(client.topology_description.server_descriptions().values())
    return bool(servers) and all(
        server.error is not None and not isinstance(server.error, mongo_errors.NetworkTimeout) for server in servers
    )
