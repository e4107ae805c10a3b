"""The acks and rejections side of the `bbmongo://` transport (Kombu's QoS): a delivered message knows its job, a
rejection settles that job on the server, and the prefetch limit says how much the next claim may take."""

from __future__ import annotations

import sys
from datetime import datetime
from time import monotonic
from typing import TYPE_CHECKING, Any, Protocol

from kombu.transport import virtual

from bb_broker.jobs.document import attempt_entry
from bb_broker.jobs.payloads import ATTEMPTS_HEADER, JOB_ID_HEADER
from bb_broker.upstream import kombu as upstream_kombu

if TYPE_CHECKING:
    from bb_broker.jobs.store import JobStore
    from bb_broker.options import BrokerOptions

#: lastError of a job rejected without a reason given (Celery gives one for the messages it refuses).
REJECTED = "the worker rejected the message without requeue"

REQUEUED = "the worker rejected the task and requeued it"

#: The fewest jobs a batch claim takes: it costs two round trips, so it pays from three jobs up.
BATCH_MIN = 3

#: Where a delivered plain message was stored, (queue, expiresAt), kept beside its Kombu payload: a requeue gives it
#: back to that queue only, with that expiry (not routed again, which would copy a fanout message to every queue).
STORED_AS = "bb_stored_as"


class DeliveringConnection(Protocol):
    """What the QoS asks of its channel's connection (the transport)."""

    def delivering_here(self) -> bool: ...

    def poke(self) -> None: ...


class HoldingChannel(Protocol):
    """What the QoS asks of its channel: where it settles a job, and whether claimed jobs wait to be delivered."""

    @property
    def connection(self) -> DeliveringConnection | None: ...  # None once Kombu closed the channel

    @property
    def jobs(self) -> JobStore: ...

    @property
    def owner(self) -> str: ...

    @property
    def options(self) -> BrokerOptions: ...

    def is_holding(self) -> bool: ...

    def is_backlogged(self) -> bool: ...


class JobMessage(virtual.Message):
    """A delivered message that remembers which job, and which attempt of it, it is."""

    def __init__(self, payload: dict[str, Any], channel: Any = None, **kwargs: Any) -> None:
        super().__init__(payload, channel=channel, **kwargs)
        headers = self.headers or {}
        self.job_id: str | None = headers.get(JOB_ID_HEADER)
        #: Which attempt of the job this delivery is; set with job_id by the claim, 0 on a plain message.
        self.attempts: int = int(headers.get(ATTEMPTS_HEADER) or 0)
        #: Why the consumer refused it, when it says: set only through explain_rejection.
        self.rejection_reason: str | None = None
        #: Its run started, then Celery cancelled it (mark_cut_short): restored unacked, its attempt counts.
        self.cut_short = False
        #: A plain message's queue and expiry where it was stored (see STORED_AS).
        self.stored_as: tuple[str, datetime] | None = payload.get(STORED_AS)


def explain_rejection(message: Any, reason: str) -> None:
    """The one way a reason reaches a job's rejection. Celery's receivers (worker/receivers.py) say it before the
    rejection (a lost pool process) or just after it, still inside the delivery (an unknown task, an invalid message):
    the QoS fails the job with it, in the write that settles the rejection. A message not of a job has nothing to tell.
    """
    if isinstance(message, JobMessage):
        message.rejection_reason = reason


def mark_cut_short(message: Any) -> None:
    """Celery cancels the started run of `message` (its cold shutdown): if its message comes back unacked (acks_late),
    its job is settled as an attempt cut short, not given back as one that never started (Channel._restore)."""
    if isinstance(message, JobMessage):
        message.cut_short = True


class JobQoS(virtual.QoS):
    """A rejected job message settles its job; nothing is restored from memory."""

    # Kombu hands a QoS its channel: bb_broker's Channel, of which the QoS asks only what HoldingChannel says (the
    # stubs say Kombu's virtual Channel, which has none of it).
    channel: HoldingChannel  # type: ignore[assignment]

    #: Seconds a consumer working through a backlog waits for room for a batch before it claims fewer jobs.
    batch_patience = 0.05

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rejected_in_delivery: list[JobMessage] = []
        self._waiting_for_batch_since: float | None = None
        # The messages a lost connection's restore took from the delivered ones while their runs go on (see
        # Channel._restore): their acks and rejections still come here, on Celery's event loop, which owns them.
        self._running_on: dict[str, JobMessage] = {}

    def keep_running(self, message: JobMessage) -> None:
        """A delivered message whose run goes on though its channel closed: its rejection still fails its job."""
        if message.delivery_tag is not None:
            self._running_on[message.delivery_tag] = message

    def ack(self, delivery_tag: str) -> None:
        self._running_on.pop(delivery_tag, None)
        super().ack(delivery_tag)
        self._poke()

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        delivered = upstream_kombu.delivered_messages(self)
        message = delivered.get(delivery_tag) or self._running_on.pop(delivery_tag, None)
        if not (isinstance(message, JobMessage) and message.job_id):
            if delivery_tag not in delivered:
                return  # restored already, with its channel (a lost connection): nothing left to reject
            return super().reject(delivery_tag, requeue=requeue)
        if requeue:
            # Due again at once, delivered with `redelivered` set; the delivery counted as an attempt, so a message
            # every worker rejects (a poison pill) ends failed after max_attempts instead of looping for ever. The
            # reason is the message's own when it has one (worker/receivers.py names a lost pool process).
            self.fail(message, message.rejection_reason or REQUEUED, backoff=False)
        elif self.channel.connection is not None and self.channel.connection.delivering_here():
            # Celery says why it refused a message (task_unknown, task_rejected) just after rejecting it, still
            # inside the delivery: the job is failed when the delivery returns, with that reason, in one write.
            self._rejected_in_delivery.append(message)
        else:
            self._fail_rejected(message)
        upstream_kombu.ack_without_restore(self, delivery_tag)
        self._poke()

    def settle_rejections(self) -> None:
        """Fail the jobs rejected during the delivery that just ended; at once when none was (no poke)."""
        if not self._rejected_in_delivery:
            return
        while self._rejected_in_delivery:
            self._fail_rejected(self._rejected_in_delivery.pop(0))
        self._poke()

    def _poke(self) -> None:
        # The consumers look again: an ack made room. Not on a channel closed by a lost connection (Kombu took its
        # connection away), which still gets the acks of the tasks that ran on through the reconnect.
        connection = self.channel.connection
        if connection is not None:
            connection.poke()

    def _fail_rejected(self, message: JobMessage) -> None:
        self.fail(message, message.rejection_reason or REJECTED, retryable=False)

    def fail(self, message: JobMessage, reason: str, *, retryable: bool = True, backoff: bool = True) -> None:
        """Fail the job of a delivered `message` that never ran, for `reason`."""
        # The attempt goes in the job's history in the same write; it never ran, so it has no start.
        if message.job_id is None:
            return  # a plain message: no job to fail (each caller checked already)
        jobs = self.channel.jobs
        entry = attempt_entry(
            message.attempts,
            worker=self.channel.owner,
            started_at=None,
            finished_at=jobs.now(),
            outcome="failed",
            error=reason,
        )
        jobs.fail(message.job_id, message.attempts, reason, attempt=entry, retryable=retryable, backoff=backoff)

    def live_jobs(self) -> list[str]:
        delivered = upstream_kombu.delivered_messages(self)  # not those acked since (see there)
        return [m.job_id for m in list(delivered.values()) if isinstance(m, JobMessage) and m.job_id]

    def claimable(self) -> int:
        """How many more messages the prefetch limit lets this consumer take now: a batch claim takes no more.

        Celery sets the limit (worker_prefetch_multiplier × pool size) and grows and shrinks it with the pool; a
        Celery worker acks a task message when a pool process starts it, which makes room for the next."""
        estimate = self.can_consume_max_estimate()  # None without a prefetch limit
        return sys.maxsize if estimate is None else estimate

    def can_consume(self) -> bool:
        return super().can_consume() and self.batch_wait() == 0.0

    def batch_wait(self) -> float:
        """Seconds this consumer should let room build up before it claims again; 0 when it should claim now.

        Working through a backlog, a consumer whose prefetch holds a batch lets freed slots wait, up to batch_room,
        while messages it took still wait in the worker (Celery acks each as a pool process starts it): the next
        claim then takes a batch, not a job per round trip. Never longer than batch_patience, for a consumer that acks
        only once it has more."""
        room = self.claimable()
        holding = self.channel.is_holding()  # jobs claimed already are handed out at once, whatever the room
        if holding or not (
            BATCH_MIN <= self.batch_room() <= self.prefetch_count
            and 0 < room < self.batch_room()  # below the limit: messages it took wait in the worker
            and self.channel.is_backlogged()
        ):
            self._waiting_for_batch_since = None
            return 0.0
        now = monotonic()
        if self._waiting_for_batch_since is None:
            self._waiting_for_batch_since = now
        return max(self._waiting_for_batch_since + self.batch_patience - now, 0.0)

    def batch_room(self) -> int:
        """The room worth a batch claim: half the prefetch limit, at least BATCH_MIN, at most what one claim takes
        (below BATCH_MIN no claim is a batch, and nothing is worth waiting for). Each claim costs the server a read
        of the queue's head, so fewer and larger batches; the other half, still waiting in the worker, keeps the
        pool busy while the claim is on its way."""
        return min(max(BATCH_MIN, self.prefetch_count // 2), self.channel.options.max_claim_batch)

    def claimed(self) -> None:
        """A claim was made: the next wait for a batch starts afresh."""
        self._waiting_for_batch_since = None
