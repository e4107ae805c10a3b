"""`bb_broker.enqueue_many(signatures)`: many tasks published in a few inserts, each job as `apply_async` writes it.

Each signature is published as its own `apply_async` would, with a producer of this module's (Celery's `producer=`
argument): Celery builds the message (routing by task_routes, countdown and expires, the task's options, the
before_task_publish receivers: the unique, serial and rate keys), Kombu serializes and compresses it, and the
transport's checks and conversion make its job, exactly as for one publish. Only the last step differs: the jobs
are kept and inserted `batch_size` at a time (bb_broker.jobs.batched), once every message is built. A signature
refused while the messages are built stops the call with nothing written.

Per task, `apply_async` costs more than the insert it saves: the first signature of each kind (_Shapes: the same
task, type and options but for OWN_OPTIONS) goes through it, and the others of its kind replay what it computed
before Celery's message builder and sender, which still run per task (_Shapes._replay), and the message Kombu's
publish made of it, each with its own body (_Template).

The job ids are chosen once per signature and kept in its options, as one publish keeps them in its properties
(payloads.PUBLISH_ID_PROPERTY) for Kombu's retry: the same signatures sent again (a caller retrying after an error or
a lost answer) find the jobs that landed and write only the others.
"""

from __future__ import annotations

import copy
import gc
import inspect
import reprlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import NoneType
from typing import TYPE_CHECKING, Any, cast

import bson
from celery import Celery, Task, current_app
from celery.app.routes import MapRoute
from celery.canvas import Signature
from celery.result import AsyncResult
from kombu import Producer
from kombu.common import maybe_declare
from kombu.serialization import dumps

from bb_broker.jobs import fair_keys, rate_keys, serial, unique
from bb_broker.jobs.batched import Outcome, Pending, insert_queued, queued_job
from bb_broker.jobs.payloads import PUBLISH_ID_PROPERTY
from bb_broker.jobs.refusals import PublishRefused
from bb_broker.transport.publishing import put_job
from bb_broker.upstream import celery as upstream_celery
from bb_broker.upstream.celery import CREATE_ARGS, CREATE_ETA, CREATE_KWARGS, CREATE_TASK_ID

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
        batch = _Batch(channel, app)
        results = batch.build(signatures)
        outcome = insert_queued(channel.jobs, batch.jobs, batch_size=batch_size)
        batch.send_deferred(outcome, pooled)
    return _results_or_raise(signatures, results, outcome)


def _check_signatures(signatures: list[Any], app: Celery) -> None:
    first_at: dict[int, int] = {}  # id() of each signature -> its first index
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
        if (first := first_at.setdefault(id(signature), index)) != index:
            # Its task id and job id are kept in it (see the module's doc): every repeat would be the same job, one
            # written where the call answered for several.
            raise TypeError(
                f"#{index} ({signature.task}) is the same signature object as #{first}: give each task its own "
                "(signature.clone(), as a group does)"
            )


class _Batch:
    """The jobs of the call's messages, built on `channel` (whose publish_job keeps them instead of inserting)."""

    def __init__(self, channel: Channel, app: Celery) -> None:
        self.channel = channel
        self.jobs: list[Pending] = []
        #: Messages that are not tasks Celery sent on the way (task-sent events): sent once the jobs are in.
        self.deferred: list[tuple[Any, dict[str, Any]]] = []
        self._index = 0
        self._producer = Producer(channel, auto_declare=False)
        self._declared: dict[int, Any] = {}
        self._shapes = _Shapes(app, self)
        #: The publish the task being sent replays (its shape's), or None: Kombu's and the channel's own.
        self.template: _Template | None = None
        self.learning: _Learning | None = None

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
                before = len(self.jobs)
                try:
                    if not signature.options.get("task_id", True):
                        # None or "": send_task gives such a signature a new id (`task_id or uuid()`), where freeze()
                        # would keep it and fail.
                        del signature.options["task_id"]
                    frozen = signature.freeze()  # its task id, in its options: the same on the call's next try
                    signature.options.setdefault(PUBLISH_ID_PROPERTY, {})  # its job ids, likewise (see _keep)
                    results.append(self._shapes.send(signature, cast(Producer, self), frozen))
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
        template = self.template
        if template is not None and template.publish(self, body, options, self._keep):
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
        if self.learning is not None:
            self.learning.published.append((body, options))
        self._producer.publish(body, **{**options, "declare": [], "retry": False})

    @contextmanager
    def learn(self) -> Iterator[_Learning]:
        """Record the one task message Kombu hands the channel in the block (its queue, message and priority, as
        Channel._put gets them) and the job its put_job makes: a _Template's first publish."""
        learning = self.learning = _Learning()
        put = self.channel._put

        def recorded(queue: str, message: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            learning.put.append((queue, copy.deepcopy(message)))
            return put(queue, message, *args, **kwargs)

        def kept(**job: Any) -> str:
            learning.kept.append(job)
            return self._keep(**job)

        self.channel._put = recorded  # type: ignore[method-assign]  # our own channel's, for the block
        self.channel.publish_job = kept
        try:
            yield learning
        finally:
            del self.channel._put
            self.channel.publish_job = self._keep
            self.learning = None

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


#: A signature's options each task of a call gives its own of: every other option its shape's (see _Shapes).
OWN_OPTIONS = frozenset(
    {"task_id", "eta", PUBLISH_ID_PROPERTY, *unique.OPTION_NAMES, *serial.OPTION_NAMES}
    | {*rate_keys.OPTION_NAMES, *fair_keys.OPTION_NAMES}
)
#: Those of them that apply_async passes on to send_task_message, where they become the message's properties.
OWN_PROPERTIES = OWN_OPTIONS - {"task_id", "eta"}


@dataclass
class _Learning:
    """What a shape's first publish handed the producer (Celery's body and publish keywords), what Kombu's publish
    then handed the channel's _put (the queue, the message), and the job put_job made of it: one of each."""

    published: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    put: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    kept: list[dict[str, Any]] = field(default_factory=list)


#: Producer.publish's own parameters: every other keyword it is given is a property of the message.
_PUBLISH_PARAMETERS = frozenset(inspect.signature(Producer.publish).parameters) - {"self", "body", "properties"}
#: Those of them each task's publish has its own of (Celery's headers), or that make nothing of the message.
_PER_PUBLISH = frozenset({"headers", "declare", "retry", "retry_policy", "timeout", "confirm_timeout"})


@dataclass
class _Template:
    """A shape's publish below Celery: the message Kombu's Producer.publish made of its first task for the channel
    (its queue, content type, the properties Kombu and the channel add), for the others of the shape, whose publish
    keywords may differ from the first's only in the headers and the properties Celery gives each task
    (`correlation_id`, the job ids): each body is serialized by Kombu's own `dumps` and put_job makes the job of the
    message, as the channel's _put does. A publish that differs otherwise goes through Kombu's publish.

    Made only when its first task's message, made again this way, gives the very job Kombu's publish gave."""

    queue: str
    priority: int
    serializer: str
    named: dict[str, Any]
    #: The properties Celery gives the publish (each task its own values): the others are Kombu's and the channel's.
    extra: frozenset[str]
    message: dict[str, Any]

    #: The publish keywords the shape's first was given, but those each publish has its own of.
    keywords: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.keywords = frozenset(self.named) | self.extra

    @classmethod
    def learned(cls, learning: _Learning, batch: _Batch) -> _Template | None:
        if not len(learning.published) == len(learning.put) == len(learning.kept) == 1:
            return None
        (body, options), (queue, message), kept = learning.published[0], learning.put[0], learning.kept[0]
        serializer = options.get("serializer")
        if options.get("compression") or not isinstance(serializer, str) or not isinstance(body, tuple | list):
            return None
        named = {k: v for k, v in options.items() if k in _PUBLISH_PARAMETERS and k not in _PER_PUBLISH}
        extra = frozenset(k for k in options if k not in _PUBLISH_PARAMETERS)
        if not extra <= message["properties"].keys():
            return None
        template = cls(queue, kept["priority"], serializer, named, extra, message)
        again: list[dict[str, Any]] = []

        def keep_again(**job: Any) -> str:
            again.append(job)
            return str(job["job_id"])

        try:
            template.publish(batch, body, options, keep_again)
            same = [_off_the_clock(job) for job in again] == [_off_the_clock(kept)]
        except Exception:  # what Kombu's publish took, this one cannot: Kombu's publish it is
            return None
        return template if same else None

    def publish(self, batch: _Batch, body: Any, options: dict[str, Any], keep: Callable[..., str]) -> bool:
        """Make the job of this publish as Kombu's would (False, nothing done, when it differs from the shape's)."""
        if options.keys() - _PER_PUBLISH != self.keywords:
            return False  # a publish keyword or property the shape's first did not have, or the other way
        for name, value in self.named.items():
            if options[name] != value:
                return False
        extra = {name: options[name] for name in self.extra}
        if not isinstance(extra.get("reply_to", ""), str):
            return False  # a Queue, whose name Kombu's publish takes
        content_type, content_encoding, data = dumps(body, self.serializer)
        if (content_type, content_encoding) != (self.message["content-type"], self.message["content-encoding"]):
            return False
        # In Kombu's order: the properties as the first message has them, each task's own values in.
        properties = {k: extra.get(k, v) for k, v in self.message["properties"].items()}
        properties["delivery_info"] = dict(properties["delivery_info"])
        message = {**self.message, "body": data, "headers": options.get("headers") or {}, "properties": properties}
        put_job(keep, batch.channel.clock, self.queue, message, data, self.priority)
        return True


def _off_the_clock(job: dict[str, Any]) -> dict[str, Any]:
    """A job put_job made, as two makings of one message compare: without the times it takes from the server's clock
    (the ETA and the expiry, each mapped at its making, microseconds apart), the payload as BSON (its order too)."""
    payload = job["payload"]
    headers = {k: v for k, v in payload.get("headers", {}).items() if k != "expires"}
    return {**job, "run_after": None, "payload": bson.encode({**payload, "headers": headers})}


def _exactly(value: Any) -> Any:
    """`value` as a shape compares it: by type at every level, and a mapping's keys in their order. Python's `==`
    takes True, 1 and 1.0 for one value, in a link's arguments or a header too, where the message of each keeps its
    own."""
    if isinstance(value, dict):
        return (type(value), tuple((_exactly(key), _exactly(item)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return (type(value), tuple(_exactly(item) for item in value))
    return (type(value), value)


@dataclass
class _Shape:
    """The signatures of a call that publish alike but for their own arguments and OWN_OPTIONS: the same task, type
    and other options. `call` is what Celery's send_task handed its message builder and sender for the first of them
    (its own apply_async, recorded), None when that publish cannot be replayed for the others (they take apply_async
    each)."""

    task_name: str
    options: dict[str, Any]
    has_eta: bool
    call: upstream_celery.SendTaskCall | None = None
    template: _Template | None = None
    task: Any = None
    ignored: bool = False


class _Shapes:
    """Each signature published as its own apply_async would, its shape's first through apply_async itself and the
    others by replaying that publish (upstream_celery.recording_send_task) with their own task id, arguments and
    OWN_OPTIONS: Celery's own message builder (`app.amqp.create_task_message`) and sender (`send_task_message`,
    which runs the before_task_publish receivers that make each task's unique, serial, rate and fair keys) per task,
    what send_task computes before them (exec options, routing, expiry, the parent task's ids) once per shape.

    A shape is replayed only when nothing of that computation can depend on a task's arguments: a plain Signature
    of a Task whose apply_async, shadow_name and argument conversion are Celery's own, the app's routes all maps
    (a router function sees the arguments), an expiry in seconds (a date's is counted from the moment it is sent)."""

    def __init__(self, app: Celery, batch: _Batch) -> None:
        self.app, self.batch = app, batch
        self.by_task: dict[str, list[_Shape]] = {}
        self.routed_by_name = all(isinstance(route, MapRoute) for route in app.amqp.routes)
        self.plain_send_task = getattr(type(app), "send_task", None) is Celery.send_task

    def send(self, signature: Signature, producer: Producer, frozen: AsyncResult) -> AsyncResult:
        """Publish `signature` (frozen: `frozen` is the AsyncResult its freeze() made, as send_task makes one)."""
        options = signature.options
        shared = {name: _exactly(value) for name, value in options.items() if name not in OWN_OPTIONS}
        has_eta = bool(options.get("eta"))
        task_name = str(signature.task)
        for shape in self.by_task.setdefault(task_name, []):
            if shape.has_eta == has_eta and shape.options == shared:
                if shape.call is None:
                    return signature.apply_async(producer=producer)
                self.batch.template = shape.template
                try:
                    return self._replay(shape, signature, producer, frozen)
                finally:
                    self.batch.template = None
        shape = _Shape(task_name, shared, has_eta)
        self.by_task[task_name].append(shape)
        if not self._replayable(signature, shape):
            return signature.apply_async(producer=producer)
        with upstream_celery.recording_send_task(self.app) as call, self.batch.learn() as learning:
            result = signature.apply_async(producer=producer)
        if self._recorded_as_given(call, signature, has_eta):
            shape.call, shape.ignored = call, bool(getattr(result, "ignored", False))
            shape.template = _Template.learned(learning, self.batch)
        return result

    @staticmethod
    def _recorded_as_given(call: upstream_celery.SendTaskCall, signature: Signature, has_eta: bool) -> bool:
        """Whether one message was built and sent, of the signature's task id, arguments and ETA as given."""
        if not len(call.created) == len(call.sent) == 1:
            return False
        created = call.created[0][0]
        given = (signature.id, signature.args, signature.kwargs, signature.options.get("eta") if has_eta else None)
        return (created[CREATE_TASK_ID], created[CREATE_ARGS], created[CREATE_KWARGS], created[CREATE_ETA]) == given

    def _replayable(self, signature: Signature, shape: _Shape) -> bool:
        if type(signature) is not Signature or not (self.routed_by_name and self.plain_send_task):
            return False
        if not isinstance(signature.options.get("expires"), int | float | NoneType):
            return False
        try:
            task = signature.type
        except KeyError:  # a name this app does not know: apply_async is send_task's
            return True
        own_task_steps = (
            getattr(type(task), "apply_async", None) is Task.apply_async
            and getattr(type(task), "shadow_name", None) is Task.shadow_name
        )
        if not own_task_steps or upstream_celery.converts_arguments(task):
            return False
        if task.soft_time_limit and task.time_limit and task.soft_time_limit > task.time_limit:
            return False  # apply_async refuses each: the first's refusal stops the call
        shape.task = task
        return True

    def _replay(self, shape: _Shape, signature: Signature, producer: Producer, result: AsyncResult) -> AsyncResult:
        """What Task.apply_async and send_task do for this signature, given what they computed for its shape."""
        assert shape.call is not None
        args, kwargs, options = signature.args, signature.kwargs, signature.options
        if shape.task is not None and (check := upstream_celery.argument_check(shape.task)) is not None:
            check(*(args or ()), **(kwargs or {}))
        (created, create_options), (name, send_options) = shape.call.created[0], shape.call.sent[0]
        positional = list(created)
        task_id = options["task_id"]
        positional[CREATE_TASK_ID], positional[CREATE_ARGS], positional[CREATE_KWARGS] = task_id, args, kwargs
        if shape.has_eta:
            positional[CREATE_ETA] = options["eta"]
        own = {option: options[option] for option in OWN_PROPERTIES if option in options}
        create_options, send_options = _with_own(create_options, own), _with_own(send_options, own)
        message = shape.call.create(*positional, **create_options)
        if not shape.ignored:
            self.app.backend.on_task_call(producer, task_id)
        shape.call.send(producer, name, message, **send_options)
        # The signature's AsyncResult (Signature.AsyncResult: the task's, or the app's for a name it does not know),
        # the class send_task makes its result of.
        result.ignored = shape.ignored
        parent = self.app.current_worker_task if options.get("add_to_parent", True) else None
        if parent:
            parent.add_trail(result)
        return result


def _with_own(recorded: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """A shape's recorded keywords with a task's OWN_PROPERTIES instead of its first task's, in the same order (the
    message's properties keep it)."""
    keywords = {k: v for k, v in recorded.items() if k not in OWN_PROPERTIES or k in own}
    keywords.update(own)
    return keywords


def _results_or_raise(signatures: list[Signature], results: list[AsyncResult], outcome: Outcome) -> list[AsyncResult]:
    if not outcome.refused:
        return results
    refused_at = {job.index for job, _ in outcome.refused}
    refused = [(job.index, job.task_id, reason) for job, reason in sorted(outcome.refused, key=lambda r: r[0].index)]
    published = [(i, str(results[i].id)) for i in range(len(signatures)) if i not in refused_at]
    kept: list[AsyncResult | None] = [None if i in refused_at else result for i, result in enumerate(results)]
    raise EnqueueManyError(len(signatures), published, refused, kept)
