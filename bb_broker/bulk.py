"""`bb_broker.enqueue_many(signatures)`: many tasks published in a few inserts, each job as `apply_async` writes it.

Each signature is sent through Celery's own `apply_async`, with a producer of this module's (Celery's `producer=`
argument): Celery builds the message (routing by task_routes, countdown and expires, the task's options, the
before_task_publish receivers: the unique, serial and rate keys), Kombu serializes and compresses it, and the
transport's checks and conversion make its job, exactly as for one publish. Only the last step differs: the jobs
are kept and inserted `batch_size` at a time (bb_broker.jobs.batched), once every message is built. A signature
refused while the messages are built stops the call with nothing written.

The job ids are chosen once per signature and kept in its options, as one publish keeps them in its properties
(payloads.PUBLISH_ID_PROPERTY) for Kombu's retry: the same signatures sent again (a caller retrying after an error or
a lost answer) find the jobs that landed and write only the others.
"""

from __future__ import annotations

import gc
import reprlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from celery import Celery, current_app
from celery.canvas import Signature
from celery.result import AsyncResult
from kombu import Producer
from kombu.common import maybe_declare

from bb_broker.jobs.batched import Outcome, Pending, insert_queued, queued_job
from bb_broker.jobs.payloads import PUBLISH_ID_PROPERTY
from bb_broker.jobs.refusals import PublishRefused

if TYPE_CHECKING:
    from bb_broker.transport.channel import Channel

#: Jobs per insert: about a megabyte of small tasks, well under a server's 48 MB message.
DEFAULT_BATCH_SIZE = 1000
#: The refusals an EnqueueManyError's message names one by one (all are in its `refused`).
NAMED_REFUSALS = 10


class EnqueueManyError(PublishRefused):
    """Some signatures of an enqueue_many were not published. `published` and `refused` say which, by their index in
    the call and task id (`refused` with each one's PublishRefused: a DuplicateJob, a JobTooLarge, the server's
    words); `results` has the AsyncResult of each published one and None for the others, in the call's order.
    Calling again with the same signatures publishes the refused ones that can be, and nothing twice."""

    def __init__(
        self,
        total: int,
        published: list[tuple[int, str]],
        refused: list[tuple[int, str, Exception]],
        results: list[AsyncResult | None],
    ) -> None:
        named = "; ".join(f"#{index} ({task_id}): {reason}" for index, task_id, reason in refused[:NAMED_REFUSALS])
        more = f"; and {len(refused) - NAMED_REFUSALS} more" if len(refused) > NAMED_REFUSALS else ""
        super().__init__(f"{len(refused)} of {total} signatures not published ({len(published)} were): {named}{more}")
        self.published, self.refused, self.results = published, refused, results


def enqueue_many(
    signatures: Iterable[Signature], *, app: Celery | None = None, batch_size: int = DEFAULT_BATCH_SIZE
) -> list[AsyncResult]:
    """Publish the task `signatures` (`add.s(1, 2)`, with any option apply_async takes) as jobs, `batch_size` per
    insert, durable (the broker URL's write concern) when it returns; their AsyncResults, in order.

    `app`: the Celery app whose bbmongo:// broker takes them (the signatures' own by default). Each job is the one
    `signature.apply_async()` would have written. Raises EnqueueManyError when some were refused (the others are
    published), TypeError for what is not a single task's signature, and whatever a signature's own apply_async
    would raise while its message is built, naming its index: then nothing is written."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {reprlib.repr(batch_size)}")
    signatures = list(signatures)
    app = app or (signatures[0].app if signatures and isinstance(signatures[0], Signature) else current_app)
    _check_signatures(signatures, app)
    if not signatures:
        return []
    if app.conf.task_always_eager:
        return [signature.apply_async() for signature in signatures]  # run here, as apply_async runs them
    with app.producer_or_acquire() as pooled:
        channel = pooled.channel
        from bb_broker.transport.channel import Channel

        if not isinstance(channel, Channel):
            scheme = pooled.connection.transport_cls
            raise TypeError(f"enqueue_many needs a bbmongo:// broker; this app's is {scheme}://")
        batch = _Batch(channel)
        results = batch.build(signatures)
        outcome = insert_queued(channel.jobs, batch.jobs, batch_size=batch_size)
        batch.send_deferred(outcome, pooled)
    return _results_or_raise(signatures, results, outcome)


def _check_signatures(signatures: list[Any], app: Celery) -> None:
    for index, signature in enumerate(signatures):
        if not isinstance(signature, Signature):
            shown = reprlib.repr(signature)
            raise TypeError(f"enqueue_many takes Celery signatures (task.s(...)); #{index} is {shown}")
        if signature.get("subtask_type"):
            raise TypeError(
                f"enqueue_many takes single tasks' signatures; #{index} is a {signature['subtask_type']} "
                "(publish a canvas with its apply_async())"
            )
        if signature.app is not app:
            raise TypeError(f"#{index} ({signature.task}) belongs to another Celery app than the call's")


class _Batch:
    """The jobs of the call's messages, built on `channel` (whose publish_job keeps them instead of inserting)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.jobs: list[Pending] = []
        #: Messages that are not tasks Celery sent on the way (task-sent events): sent once the jobs are in.
        self.deferred: list[tuple[Any, dict[str, Any]]] = []
        self._index = 0
        self._producer = Producer(channel, auto_declare=False)
        self._declared: dict[int, Any] = {}

    def build(self, signatures: list[Signature]) -> list[AsyncResult]:
        results = []
        self.channel.publish_job = self._keep
        collecting = gc.isenabled()
        # Every message and job built here lives until the insert: the collector's passes over them, as they pile
        # up, cost about as much as building them. Paused (process-wide) for the build only; nothing it makes is
        # garbage before the call returns.
        gc.disable()
        try:
            for index, signature in enumerate(signatures):
                self._index = index
                signature.freeze()  # its task id, in its options: the same on the call's next try
                signature.options.setdefault(PUBLISH_ID_PROPERTY, {})  # its job ids, likewise (see _keep)
                before = len(self.jobs)
                try:
                    # Celery's send_task uses a producer's publish() and connection only: this one's.
                    results.append(signature.apply_async(producer=cast(Producer, self)))
                except Exception as exc:
                    exc.add_note(f"enqueue_many: signature #{index} ({signature.task}); nothing was published")
                    raise
                if len(self.jobs) == before:
                    raise TypeError(f"enqueue_many: signature #{index} ({signature.task}) made no job")
        finally:
            self.channel.publish_job = self.channel.jobs.publish
            if collecting:
                gc.enable()
        return results

    # --- the producer Celery's send_task publishes with ---------------------------------------------------------

    @property
    def connection(self) -> Any:
        return self._producer.connection

    def publish(self, body: Any, **options: Any) -> None:
        headers = options.get("headers") or {}
        if not ("task" in headers and "id" in headers):
            self.deferred.append((body, options))
            return
        exchange = options.get("exchange")
        if exchange and self.channel.typeof(exchange).type != "direct":
            raise TypeError(
                f"enqueue_many publishes to queues; {headers['task']} is routed to the {exchange!r} exchange"
            )
        for entity in options.get("declare") or ():
            if id(entity) not in self._declared:  # once per call, as Kombu's cache does per connection
                maybe_declare(entity, self.channel)
                self._declared[id(entity)] = entity
        self._producer.publish(body, **{**options, "declare": [], "retry": False})

    # --- the channel's publish_job while the call builds --------------------------------------------------------

    def _keep(
        self,
        *,
        queue: str,
        kind: str,
        task_id: str,
        payload: dict[str, Any],
        priority: int,
        run_after: Any,
        is_retry: bool,
        job_id: str | None = None,
        unique: Any = None,
        schedule: str | None = None,
        serial_key: str | None = None,
        rate_key: str | None = None,
        fair_key: str | None = None,
        canvas: dict[str, Any] | None = None,
        **_: Any,
    ) -> str:
        if is_retry:
            raise PublishRefused(f"a Celery retry (its `retries` option) is not enqueued in bulk: {task_id}")
        assert job_id is not None  # the channel chose it in the properties, where the signature's options keep it
        now = self.channel.jobs.now()
        document = queued_job(
            job_id=job_id,
            kind=kind,
            task_id=task_id,
            queue=queue,
            priority=priority,
            payload=payload,
            due=run_after or now,
            now=now,
            unique=unique,
            schedule=schedule,
            serial_key=serial_key,
            rate_key=rate_key,
            fair_key=fair_key,
            canvas=canvas,
        )
        self.jobs.append(Pending(self._index, document, unique))
        return job_id

    def send_deferred(self, outcome: Outcome, producer: Producer) -> None:
        """The deferred messages of the published tasks (an event names its task by `uuid`), or not about one."""
        published = {job.task_id for job in outcome.published}
        for body, options in self.deferred:
            task_id = body.get("uuid") if isinstance(body, dict) else None
            if task_id is None or task_id in published:
                producer.publish(body, **options)


def _results_or_raise(signatures: list[Signature], results: list[AsyncResult], outcome: Outcome) -> list[AsyncResult]:
    if not outcome.refused:
        return results
    refused_at = {job.index for job, _ in outcome.refused}
    refused = [(job.index, job.task_id, reason) for job, reason in sorted(outcome.refused, key=lambda r: r[0].index)]
    published = [(i, str(results[i].id)) for i in range(len(signatures)) if i not in refused_at]
    kept: list[AsyncResult | None] = [None if i in refused_at else result for i, result in enumerate(results)]
    raise EnqueueManyError(len(signatures), published, refused, kept)
