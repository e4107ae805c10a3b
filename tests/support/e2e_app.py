"""The Celery app the end-to-end tests run in real workers; its tasks record what they did in `runs`."""

from __future__ import annotations

import json
import os
import signal
import time

from celery import Celery, signals
from celery.exceptions import Ignore
from celery.worker.control import inspect_command
from pymongo import monitoring

import bb_broker
from bb_broker.connection import get_database, parse_broker_url
from tests.support import unique_app

app = Celery("e2e_app")
app.conf.update(
    broker_url=os.environ["BB_BROKER_URL"],
    broker_transport_options=json.loads(os.environ.get("BB_TRANSPORT_OPTIONS", "{}")),
    worker_prefetch_multiplier=int(os.environ.get("BB_PREFETCH_MULTIPLIER", "1")),
    task_time_limit=600,
    accept_content=os.environ.get("BB_ACCEPT_CONTENT", "json").split(","),  # Celery's default: JSON only
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    result_backend=os.environ.get("BB_RESULT_BACKEND"),  # "rpc://": results come back through the broker
    # Celery cancels the running acks_late tasks on a reconnect, for the broker to deliver them again.
    worker_cancel_long_running_tasks_on_connection_loss=os.environ.get("BB_CANCEL_ON_CONNECTION_LOSS") == "1",
)
if os.environ.get("BB_RESULT_BACKEND"):
    # The result backend on the job documents (tests/e2e/test_results_e2e.py; "broker" means the broker's URL, to run
    # any other test with results on); other tests run without one.
    backend = os.environ["BB_RESULT_BACKEND"]
    app.conf.result_backend = app.conf.broker_url if backend == "broker" else backend
    # Celery >= 5.7 compresses results with it (tests/e2e/test_compression_e2e.py); older ones ignore it.
    app.conf.result_compression = os.environ.get("BB_RESULT_COMPRESSION") or None


class ReadLog(monitoring.CommandListener):
    """BB_TEST_READ_LOG: a line per read of a queue this process sends (`findAndModify` or `find`, the collection,
    the queue, or the queues of a read of several, joined by commas), for tests/e2e/test_wakeups_e2e.py to count
    what a task costs the worker."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name = event.command_name
        if name not in ("findAndModify", "find"):
            return
        query = event.command.get("query" if name == "findAndModify" else "filter") or {}
        queue = query.get("queue")
        if isinstance(queue, dict) and isinstance(queue.get("$in"), list):
            queue = ",".join(sorted(str(name) for name in queue["$in"]))
        if isinstance(queue, str):
            os.write(self.fd, f"{name} {event.command[name]} {queue}\n".encode())

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


class SettleLog(monitoring.CommandListener):
    """BB_TEST_SETTLE_LOG: a line per `update` of held jobs this process sends (`update`, the number of statements
    it carries, the sending process, the time, the jobs' ids), for tests/e2e/test_group_commit_e2e.py to count the
    round trips of a worker's settles and see which process sent them."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name != "update" or event.command["update"] != "jobs":
            return
        statements = event.command.get("updates") or []
        fence = statements[0].get("q", {}) if statements else {}
        if fence.get("status") == "running" and "_id" in fence and "attempts" in fence:  # a settle's fence
            ids = ",".join(str(statement["q"].get("_id")) for statement in statements)
            os.write(self.fd, f"update {len(statements)} {os.getpid()} {time.time():.4f} {ids}\n".encode())

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


if os.environ.get("BB_TEST_SETTLE_LOG"):
    monitoring.register(SettleLog(os.environ["BB_TEST_SETTLE_LOG"]))

if os.environ.get("BB_TEST_READ_LOG"):
    monitoring.register(ReadLog(os.environ["BB_TEST_READ_LOG"]))  # before any client, so the worker's reports


@inspect_command()
def consumer_loop(state) -> dict:
    """Which of Celery's loops this worker's consumer runs: `asynloop` on its event loop, `synloop` blocking."""
    return {"loop": state.consumer.loop.__name__, "hub": state.consumer.hub is not None}


@inspect_command()
def threads(state) -> list[str]:
    """The names of this worker's live threads (tests/flower/test_malformed_documents.py: bb_broker's own are alive)."""
    import threading

    return sorted(thread.name for thread in threading.enumerate())


def _monitoring() -> dict:
    """How often this process's bb_broker client has pymongo look at the server (seconds), and the process."""
    client = get_database(parse_broker_url(app.conf.broker_url)).client
    return {"pid": os.getpid(), "heartbeat_seconds": client.options.heartbeat_frequency}


@inspect_command()
def monitoring(state) -> dict:
    """_monitoring in the worker's main process (tests/e2e/test_wakeups_e2e.py)."""
    return _monitoring()


def _crash_at(point: str) -> None:
    """Fault injection for tests/e2e/test_results_e2e.py: the whole worker is SIGKILLed at one step of a chord's
    completion (`part-counted`: a part counted, its job not settled; `callback-claimed`: the last part claimed the
    callback, not sent; `callback-sent`: sent, not marked sent), as a crash there would."""
    from bb_broker.results.backend import JobResultBackend

    def crash() -> None:
        runs().insert_one({"name": "crash", "point": point, "pid": os.getpid(), "at": time.time()})
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the main process and the whole pool at once

    steps = {"part-counted": "_count_part", "callback-claimed": "_send_callback", "callback-sent": "_send_callback"}
    original = getattr(JobResultBackend, steps[point])

    def crashing(*args, **kwargs):
        if point == "callback-claimed":
            crash()
        done = original(*args, **kwargs)
        crash()
        return done

    setattr(JobResultBackend, steps[point], crashing)


if os.environ.get("BB_TEST_CRASH_AT"):
    _crash_at(os.environ["BB_TEST_CRASH_AT"])


def _hold_after_recording(key: str) -> None:
    """Fault injection for tests/faults/test_faults.py: a pool process that recorded its attempt's failure waits for
    `<key>:go` in `fixes` before the broker's retry is published, as one descheduled on a busy machine would."""
    from bb_broker.jobs.store import JobStore

    record_failed_attempt = JobStore.record_failed_attempt

    def holding(self, *args, **kwargs):
        recorded = record_failed_attempt(self, *args, **kwargs)
        runs().insert_one({"name": "recorded", "pid": os.getpid(), "at": time.time()})
        while runs().database.fixes.find_one({"_id": f"{key}:go"}) is None:
            time.sleep(0.05)
        return recorded

    JobStore.record_failed_attempt = holding


if os.environ.get("BB_TEST_HOLD_AFTER_RECORDING"):
    _hold_after_recording(os.environ["BB_TEST_HOLD_AFTER_RECORDING"])


def runs():
    return get_database(parse_broker_url(app.conf.broker_url))["runs"]


def record(task, **fields) -> None:
    runs().insert_one(
        {
            "taskId": task.request.id,
            "name": task.name,
            "attempt": task.request.bb_attempts,
            "retries": task.request.retries,
            "pid": os.getpid(),
            "at": time.time(),
            **fields,
        }
    )


@app.task(bind=True)
def add(self, x, y):
    record(self)
    return x + y


@app.task(bind=True)
def revoke(self, task_ids):
    """A task that revokes others, as an app's own code does: the revoke is made from the pool process."""
    record(self)
    self.app.control.revoke(task_ids)
    return len(task_ids)


@app.task
def pool_monitoring():
    """_monitoring in the pool process that runs it."""
    return _monitoring()


@app.task(bind=True)
def fail_until(self, succeed_on_attempt):
    record(self)
    if self.request.bb_attempts < succeed_on_attempt:
        raise RuntimeError(f"failing attempt {self.request.bb_attempts}")
    return "ok"


class NotesItsHooks(app.Task):
    """Records the hooks Celery calls on a failed attempt: what its tracer decided (and Flower's events show)."""

    def on_retry(self, exc, task_id, args, kwargs, einfo):
        runs().insert_one({"name": "on_retry", "taskId": task_id, "error": str(exc), "at": time.time()})

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        runs().insert_one({"name": "on_failure", "taskId": task_id, "error": str(exc), "at": time.time()})


@app.task(bind=True, base=NotesItsHooks)
def noted_fail_until(self, succeed_on_attempt):
    record(self, final=bb_broker.is_final_attempt(self))
    if self.request.bb_attempts < succeed_on_attempt:
        raise RuntimeError(f"failing attempt {self.request.bb_attempts}")
    return "ok"


@app.task(bind=True)
def always_fails(self):
    record(self, final=bb_broker.is_final_attempt(self))
    raise ValueError("always fails")


@app.task(bind=True)
def sleep(self, seconds):
    record(self, phase="start")
    time.sleep(seconds)
    record(self, phase="end")
    return seconds


@app.task(bind=True)
def hold_until(self, path):
    """Keeps its pool process busy until the file `path` exists: a gate the test opens, needing no server."""
    record(self, phase="start")
    while not os.path.exists(path):
        time.sleep(0.05)
    return path


@app.task(bind=True)
def hold_until_then_retry_once(self, path):
    """As hold_until, then a Celery retry (`self.retry()`: its job goes back to the queue), which succeeds."""
    record(self, phase="start")
    while not os.path.exists(path):
        time.sleep(0.05)
    if not self.request.retries:
        raise self.retry(countdown=0, exc=RuntimeError("once more"))
    return path


@app.task(bind=True, acks_late=True)
def hold_until_acked_late(self, path):
    """As hold_until, its message acked only when it returns (acks_late): unacked all the while it runs."""
    record(self, phase="start")
    while not os.path.exists(path):
        time.sleep(0.05)
    return path


@app.task(bind=True, acks_late=True, reject_on_worker_lost=True)
def hold_until_then_exit_acked_late(self, path):
    """As hold_until, then its pool process exits: Celery rejects its message (reject_on_worker_lost), requeued."""
    record(self, phase="start")
    while not os.path.exists(path):
        time.sleep(0.05)
    os._exit(1)


@app.task(bind=True)
def exit_process(self):
    record(self)
    os._exit(1)


@app.task(bind=True)
def segfault(self):
    record(self)
    import ctypes

    ctypes.string_at(0)  # SIGSEGV: the pool process dies on the spot


@app.task(bind=True, max_retries=2)
def retry_self(self, countdown):
    record(self)
    raise self.retry(countdown=countdown, exc=RuntimeError("not yet"))


@app.task(bind=True, autoretry_for=(KeyError,), max_retries=1, default_retry_delay=0)
def autoretry(self):
    record(self, final=bb_broker.is_final_attempt(self))
    raise KeyError("missing")


@app.task(bind=True, time_limit=1)
def overrun(self):
    record(self)
    time.sleep(30)


@app.task(bind=True)
def echo(self, value):
    record(self)
    return value


@app.task
def identity(value):
    """Its argument, with no write of its own: a burst of these finishes tasks faster than a round trip apart."""
    return value


@app.task(bind=True)
def length(self, value):
    """How long its argument is: a large argument, a small result."""
    record(self)
    return len(value)


@app.task(bind=True)
def raise_message(self, text):
    record(self)
    raise RuntimeError(text)


@app.task(bind=True, max_retries=1)
def retry_message(self, text):
    record(self)
    raise self.retry(countdown=0, exc=RuntimeError(text))


@app.task(bind=True)
def tsum(self, values):
    record(self, values=values)
    return sum(values)


@app.task(bind=True, track_started=True)
def started_then_sleep(self, seconds):
    record(self, phase="start")
    time.sleep(seconds)
    return "slept"


@app.task(bind=True)
def progress(self, steps, pause):
    for step in range(steps):
        self.update_state(state="PROGRESS", meta={"step": step + 1, "of": steps})
        time.sleep(pause)
    return steps


@app.task(bind=True)
def replaced_by_add(self, x, y):
    record(self)
    raise self.replace(add.s(x, y))


@app.task(bind=True)
def noted_then_ignored(self, note):
    record(self)
    self.update_state(state="NOTED", meta={"note": note})
    raise Ignore()


@app.task(bind=True, ignore_result=True)
def ignored(self):
    record(self)
    return "not kept"


@app.task(bind=True)
def big_result(self, size, ballast=""):
    """A result of `size` characters; `ballast`, an argument that only fills the job's document."""
    record(self)
    return "x" * size


@app.task(bind=True)
def unencodable_result(self):
    record(self)
    return object()  # no serializer Celery accepts by default can encode it


#: A file name whose bytes are not UTF-8, as os.fsdecode gives it: a str holding a lone surrogate ('\udce9'), which
#: JSON carries and BSON (UTF-8 only) cannot. Made in the task: a producer cannot send one through bbmongo://.
NOT_UTF8_NAME = os.fsdecode(b"caf\xe9.txt")


@app.task(bind=True)
def surrogate_result(self):
    record(self)
    return NOT_UTF8_NAME


@app.task(bind=True)
def surrogate_error(self):
    record(self)
    raise ValueError(NOT_UTF8_NAME)


@app.task(bind=True, max_retries=1)
def surrogate_retry(self):
    """Retries itself once with a surrogate in the retry's exception, then succeeds."""
    record(self)
    if not self.request.retries:
        raise self.retry(countdown=0, exc=ValueError(NOT_UTF8_NAME))
    return "ok"


@app.task(bind=True)
def note_error(self, failed_task_id):
    # An errback taking only the failed task's id: Celery sends it as a task of its own.
    record(self, failed=failed_task_id)


@app.task
def note_failure(request, exc, traceback):
    # A new-style errback: Celery calls it in the failing task's process with its request, exception and traceback.
    runs().insert_one({"name": "note_failure", "failed": request.id, "error": str(exc), "at": time.time()})


@app.task(bind=True)
def fails_until_fixed(self, key):
    """Fails while nobody has fixed `key` (a document in `fixes`): a bug, fixed, then the job retried."""
    record(self)
    if runs().database.fixes.find_one({"_id": key}) is None:
        raise RuntimeError(f"{key} is broken (attempt {self.request.bb_attempts})")
    return "fixed"


@app.task(bind=True)
def fails_until_fixed_when_let(self, key):
    """As fails_until_fixed, each run waiting first for `<key>:<run>` in `fixes` (its runs under its task id counted
    from 1): a test looks at what its canvas reads while an operator's retry of it runs."""
    record(self)
    fixes = runs().database.fixes
    run = runs().count_documents({"taskId": self.request.id})
    while fixes.find_one({"_id": f"{key}:{run}"}) is None:
        time.sleep(0.05)
    if fixes.find_one({"_id": key}) is None:
        raise RuntimeError(f"{key} is broken (run {run})")
    return "fixed"


@app.task(bind=True)
def waits_then_fails_first(self, key, own_retry=False):
    """Waits for `<key>:<attempt>` in `fixes`; then the first attempt fails (or retries itself, `own_retry`) and any
    later one succeeds."""
    record(self)
    while runs().database.fixes.find_one({"_id": f"{key}:{self.request.bb_attempts}"}) is None:
        time.sleep(0.05)
    if self.request.bb_attempts == 1:
        if own_retry:
            raise self.retry(countdown=0)
        raise RuntimeError("the first attempt fails")
    return "ok"


@signals.task_postrun.connect(sender=waits_then_fails_first)
def _waited_attempt_done(task_id=None, state=None, **_):
    # After Celery and the broker dealt with the attempt's outcome (a retry published, say): tests wait for this.
    record(waits_then_fails_first, phase="postrun", state=state)


@app.task(bind=True, acks_late=True)
def reject_once(self):
    """Rejected with requeue on its first delivery; succeeds once the delivery says it is a redelivery."""
    from celery.exceptions import Reject

    redelivered = bool(self.request.delivery_info.get("redelivered"))
    record(self, redelivered=redelivered)
    if not redelivered:
        raise Reject("first delivery", requeue=True)
    return "second pass"


@app.task(bind=True, acks_late=True)
def reject_always(self):
    """A poison pill: every worker rejects it with requeue."""
    from celery.exceptions import Reject

    record(self)
    raise Reject("never", requeue=True)


@app.task(bind=True, acks_late=False)
def reject_once_acked_at_start(self):
    """reject_once without acks_late: its message was acked as it started, so the rejection reaches no message."""
    from celery.exceptions import Reject

    record(self)
    if runs().count_documents({"taskId": self.request.id}) == 1:
        raise Reject("first run", requeue=True)
    return "second pass"


@app.task(bind=True)
def header_value(self, name):
    record(self, value=repr(self.request.get(name)))
    return repr(self.request.get(name))


@app.task(bind=True)
def reject_for_good(self):
    """Rejects its message without requeue: it must never run again."""
    from celery.exceptions import Reject

    record(self)
    raise Reject("bad input", requeue=False)


@app.task(bind=True, acks_late=True, reject_on_worker_lost=True)
def lost_and_requeued(self, succeed_on_attempt):
    """Its pool process dies until `succeed_on_attempt`; Celery then rejects its message with requeue."""
    record(self)
    if self.request.bb_attempts < succeed_on_attempt:
        os._exit(1)
    return "ok"


@app.task(bind=True)
def exits_until(self, succeed_on_attempt):
    """Its pool process dies until `succeed_on_attempt`: the worker's main process reports the WorkerLostError."""
    record(self)
    if self.request.bb_attempts < succeed_on_attempt:
        os._exit(1)
    return "ok"


unique_tasks = unique_app.register(app)  # tests/e2e/test_unique_jobs.py
