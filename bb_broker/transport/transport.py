"""The Kombu Transport of `bbmongo://`: its connection errors, the delivery of each message, and the two ways it
waits for work (Celery's event loop, woken through a doorbell, and the blocking drain_events)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from queue import Empty
from time import monotonic, sleep
from typing import TYPE_CHECKING, Any, TypeAlias

from kombu.transport import virtual
from kombu.utils.scheduling import FairCycle
from pymongo import errors as mongo_errors
from pymongo.errors import PyMongoError

from bb_broker import connection
from bb_broker.jobs.outages import passes_with_time
from bb_broker.transport.channel import (
    Channel,
    ChannelTransport,
    ServerUnreachable,
    joined_event_loop,
    left_event_loop,
)
from bb_broker.transport.doorbell import Doorbell
from bb_broker.transport.qos import JobMessage
from bb_broker.transport.wakeups import Wakeups
from bb_broker.upstream import kombu as upstream_kombu

logger = logging.getLogger(__name__)


class ServerUnavailable(mongo_errors.ConnectionFailure):
    """A transient error the server answered a consumer with, raised as a lost connection: Celery reconnects on
    one (a connection error), while an OperationFailure (a channel error) ends its worker."""


@contextlib.contextmanager
def _transient_errors_as_lost_connection() -> Iterator[None]:
    try:
        yield
    except mongo_errors.OperationFailure as exc:
        if not passes_with_time(exc):
            raise
        name = (exc.details or {}).get("codeName") or "a transient error"
        raise ServerUnavailable(f"the server answered {name} (code {exc.code}): connecting again") from exc


#: Channel, for the annotations inside Transport, whose own Channel attribute hides the class there.
_JobChannel: TypeAlias = Channel


class Transport(virtual.Transport):
    Channel = Channel
    # Kombu's __init__ sets both; its channels are only ever this transport's Channel (the stubs say Kombu's).
    channels: list[_JobChannel]  # type: ignore[assignment]
    cycle: FairCycle

    can_parse_url = True
    polling_interval = 1.0
    default_port = 27017
    driver_type = "mongodb"
    driver_name = "pymongo"

    connection_errors = virtual.Transport.connection_errors + (mongo_errors.ConnectionFailure, ServerUnreachable)
    channel_errors = virtual.Transport.channel_errors + (mongo_errors.ConnectionFailure, mongo_errors.OperationFailure)
    # Asynchronous: a Celery worker runs its event loop (asynloop) on this transport, as on Redis and RabbitMQ,
    # and registers it with the loop (register_with_event_loop). The blocking drain_events serves everyone else.
    implements = virtual.Transport.implements.extend(
        asynchronous=True, exchange_type=frozenset(["direct", "topic", "fanout"])
    )

    #: The pause after a poll that found work; it doubles up to polling_interval while queues stay empty.
    min_polling_interval = 0.05
    #: The most messages one turn of the event loop delivers before the loop's other readers and timers get theirs.
    loop_delivery_limit = 64
    #: The longest one turn of the event loop delivers for: past it (a delivery that ran its task, in a solo pool),
    #: the loop's other work comes before the next delivery.
    loop_turn = 0.02
    #: The least an event loop waits after a look that delivered nothing: never a spin, whatever the wake-ups say.
    loop_idle_floor = 0.005

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.broker_url = connection.client_url(client)
        # Refused here, while the client still holds the URL as written: once exposed in Kombu's fields, a clone of
        # the connection (Celery's producer pool) rebuilds it from them, `bbmongo://host` as `bbmongo://host:27017//`.
        # Not a +srv URL: parsing one asks DNS, whose blip would end the caller here with a BrokerURLError that Kombu
        # does not retry; it stays whole in Kombu's fields, and the channel parses it.
        if not self.broker_url.partition("://")[0].lower().endswith("+srv"):
            connection.parse_broker_url(self.broker_url)
        connection.expose_as_kombu_does(client, self.broker_url)
        self.wakeups: Wakeups | None = None
        #: The thread inside _deliver, if any: a rejection there waits for its reason until the delivery returns.
        self._delivering_thread: int | None = None
        self._pause = self.min_polling_interval
        # On an event loop: the loop, the doorbell it watches, and the timer entry of the next poll that falls due.
        self._loop: Any = None
        self._loop_thread: int | None = None  # the thread the loop runs on (the one that registered it)
        self._bell: Doorbell | None = None
        self._timer: Any = None
        self._timer_due = float("inf")

    def watch(self, channel: _JobChannel) -> None:
        """Start the change stream that wakes this connection's consumers (once, for the first consumer)."""
        if self.wakeups is None and channel.options.use_change_streams:
            self.wakeups = Wakeups(
                channel.jobs.coll.database,
                jobs=channel.jobs.coll.name,
                messages=channel.plumbing.messages.name,
                bindings=channel.plumbing.bindings.name,
                controls=channel.queue_controls.coll.name,
                clock=channel.jobs.now,
                safety_poll_interval=channel.options.safety_poll_interval,
                on_news=self.ring,
            )

    def consumers_changed(self) -> None:
        """Tell the change stream which queues this connection's consumers read now: only their changes are news."""
        if self.wakeups is not None:
            self.wakeups.consume_only(
                {
                    queue
                    for channel in list(self.channels)
                    if upstream_kombu.has_consumers(channel)
                    for queue in upstream_kombu.consumed_queues(channel)
                }
            )

    def delivering_here(self) -> bool:
        """Whether the calling thread is inside this connection's delivery of a message."""
        return self._delivering_thread == threading.get_ident()

    def _deliver(self, message: Any, queue: str | None) -> None:
        self._delivering_thread = threading.get_ident()
        try:
            super()._deliver(message, queue)
        except Exception as exc:
            self._fail_unsettled_delivery(message, exc)
            raise
        finally:
            self._delivering_thread = None
            for channel in list(self.channels):
                channel.qos.settle_rejections()

    def _fail_unsettled_delivery(self, message: dict[str, Any], exc: Exception) -> None:
        """The consumer raised receiving a job it neither acked nor rejected: a message it chokes on in a way the
        claim's checks did not foresee. The job fails, once, before the error goes on (a Celery worker ends on it);
        left running, it would go back unspent and end every worker that takes it. A lost connection is no fault
        of the message: its jobs go back as after any outage."""
        if isinstance(exc, self.connection_errors + (PyMongoError,)):
            return
        tag = (message.get("properties") or {}).get("delivery_tag")
        if tag is None:
            return  # delivered by no channel here
        for channel in list(self.channels):
            delivered = upstream_kombu.delivered_messages(channel.qos).get(tag)
            if isinstance(delivered, JobMessage) and delivered.job_id and not delivered.acknowledged:
                reason = f"the worker could not take the message: {type(exc).__name__}: {exc}"
                try:
                    channel.qos.fail(delivered, reason, retryable=False)
                except PyMongoError as error:
                    logger.warning("could not fail job %s (%s)", delivered.job_id, type(error).__name__)
                    return
                upstream_kombu.ack_without_restore(channel.qos, tag)

    # --- Celery's event loop (asynloop) ----------------------------------------

    def register_with_event_loop(self, connection_: Any, loop: Any) -> None:
        """Join Celery's hub, as Kombu's qpid transport does: pymongo has no socket for the hub to watch, so a pipe
        (the doorbell) is rung whenever a consumer has something to do (news from the change stream, room made by
        an ack, a new consumer) and the hub reads it; a timer brings the due times and the safety polls."""
        self._leave_event_loop()
        self._loop = loop
        self._loop_thread = joined_event_loop()
        self._bell = Doorbell()
        loop.add_reader(self._bell.fileno(), self._on_readable)
        self._bell.ring()  # the first look, once the worker's consumers are declared

    def _on_readable(self) -> None:
        bell = self._bell
        if bell is None:
            return
        bell.drain()  # first: a ring from here on calls this again
        delivered, began = 0, monotonic()
        while True:
            if delivered >= self.loop_delivery_limit or (delivered and monotonic() - began >= self.loop_turn):
                # More may be waiting: after the loop's other work. A turn that took its time ran a task in its
                # delivery (the solo pool): the loop's signals (a stop asked for), controls and timers come first.
                bell.ring()
                return
            try:
                with _transient_errors_as_lost_connection():
                    self.cycle.get(self._deliver, timeout=0)
            except Empty:
                break
            delivered += 1
        self._arm_timer(self._next_poll_in(found=bool(delivered)), delivered)

    def _arm_timer(self, wait: float | None, delivered: int) -> None:
        if wait is None or self._loop is None:
            return  # every consumer is at its prefetch limit: only an ack makes room, and it rings
        if not delivered:
            wait = max(wait, self.loop_idle_floor)
        due = monotonic() + wait
        if self._timer is not None and not self._timer.canceled and self._timer_due <= due:
            return  # an earlier look is set already (if it finds nothing to do, it sets the next)
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_due = self._loop.call_later(wait, self._on_timer), due

    def _on_timer(self) -> None:
        # The look itself happens in the reader, where the hub hands a lost connection to Celery to reconnect.
        self._timer, self._timer_due = None, float("inf")
        self.ring()

    def ring(self) -> None:
        bell = self._bell
        if bell is not None:
            bell.ring()

    @property
    def on_event_loop(self) -> bool:
        return self._bell is not None

    def _leave_event_loop(self) -> None:
        loop, bell, timer = self._loop, self._bell, self._timer
        self._loop = self._bell = self._timer = None
        if self._loop_thread is not None:
            left_event_loop(self._loop_thread)
            self._loop_thread = None
        if timer is not None:
            timer.cancel()
        if loop is not None and bell is not None:
            with contextlib.suppress(Exception):  # a hub that was reset already forgot it
                loop.remove_reader(bell.fileno())
        if bell is not None:
            bell.close()

    def close_connection(self, connection_: Any) -> None:
        self._leave_event_loop()
        super().close_connection(connection_)
        # Its wake-ups end with it (a connection re-established later subscribes again).
        wakeups, self.wakeups = self.wakeups, None
        if wakeups is not None:
            wakeups.stop()

    def poke(self) -> None:
        """Something changed in this process (an ack made room): the consumers look again."""
        if self.wakeups is not None:
            self.wakeups.poke()
        else:
            self.ring()

    # --- the blocking loop (drain_events) ------------------------------------

    # Kombu's virtual Transport narrows its base's **kwargs to timeout as well (and its stubs ignore the same).
    def drain_events(self, connection: Any, timeout: float | None = None) -> None:  # type: ignore[override]
        # Kombu's loop, waiting for a wake-up (or adapting its pause) instead of sleeping a fixed interval.
        started = monotonic()
        while True:
            if self.wakeups is not None:
                self.wakeups.event.clear()
            try:
                with _transient_errors_as_lost_connection():
                    self.cycle.get(self._deliver, timeout=timeout)
            except Empty:
                pass
            else:
                self._pause = self.min_polling_interval
                return
            remaining = None if timeout is None else timeout - (monotonic() - started)
            if remaining is not None and remaining <= 0:
                raise TimeoutError()
            self._idle(remaining)

    def _idle(self, remaining: float | None) -> None:
        wait = self._next_poll_in(found=False)
        if wait is None:
            wait = self.polling_interval  # only an ack (a poke) makes room
        if remaining is not None:
            wait = min(wait, remaining)
        if self.wakeups is not None:
            self.wakeups.event.wait(wait)
        else:
            sleep(wait)

    # --- both loops ----------------------------------------------------------

    def _next_poll_in(self, *, found: bool) -> float | None:
        """Seconds until the consumers should look again; None when every one is at its prefetch limit."""
        # A consumer letting room build up for a batch claims when its patience ends, whatever else happens.
        batch_waits = [
            wait
            for channel in self.channels
            if upstream_kombu.has_consumers(channel) and (wait := channel.qos.batch_wait())
        ]
        pollable = self._pollable_queues()
        if not pollable:
            return min(batch_waits, default=None)  # else every consumer is at its limit: an ack makes room (a poke)
        wakeups = self.wakeups
        if wakeups is not None and wakeups.available:
            wait = wakeups.seconds_until_next_poll(pollable)
        else:
            # Polling, as Kombu's virtual transports do, pausing longer while the queues stay empty.
            if found:
                self._pause = self.min_polling_interval
            wait, self._pause = self._pause, min(self._pause * 2, self.polling_interval)
        return min([wait, *batch_waits])

    def _pollable_queues(self) -> set[str]:
        """The queues of the consumers with room for more: those a look may take from."""
        return {
            queue
            for channel in self.channels
            if upstream_kombu.has_consumers(channel) and channel.qos.can_consume()
            for queue in upstream_kombu.consumed_queues(channel)
            if not channel.claim_in_flight_for(queue)  # its claim rings when it lands
        }

    def driver_version(self) -> str:
        import pymongo

        return pymongo.version

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        url = connection.client_url(self.client)
        return url if include_password else connection.redact_url(url)


if TYPE_CHECKING:  # what a channel asks of its transport, checked by mypy
    _asked_by_channels: type[ChannelTransport] = Transport
