"""One benchmark round per broker: publish, drain, idle cost, memory and latency, with a real `celery worker -c 2`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from celery.utils.nodenames import host_format
from pymongo import MongoClient

from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.servers import with_database
from tests.support.workers import ROOT, Worker, wait_for
from tools.bench.app import HOLD_TASK, PROBE_QUEUE, QUEUE, TASK
from tools.bench.servers import Server

#: Options for the bench's own MongoDB clients (the measuring one and the producer): no background
#: monitoring traffic during a measured window, so the server's counters see the workers' operations only.
QUIET_CLIENT = {"serverMonitoringMode": "poll", "heartbeatFrequencyMS": 3_600_000}
#: Celery's own worker_prefetch_multiplier, for a second drain figure.
DEFAULT_PREFETCH = 4
#: Pings an idle worker gets to answer one before the saturated figure is given up for that round.
IDLE_PINGS = 3
#: Held tasks queued behind the ones that take every pool process, while the saturated worker is pinged.
QUEUED_BEHIND = 4
#: An events-on drain that makes no progress for this long is given up and reported, not waited on for minutes.
EVENTS_STALL_SECONDS = 30.0
#: How long the monitor may take, after the last events-on worker stopped, to have read every task's events.
EVENTS_CATCH_UP_SECONDS = 20.0


@dataclass(frozen=True)
class Settings:
    n: int
    repeat: int
    idle_window: float
    probes: int
    concurrency: int = 2
    prefetch: int = 1
    #: Log every command the workers send and break the loaded window's down per task (BENCH_DIAGNOSE=1).
    diagnose: bool = False
    #: `ping` round trips to a worker whose every pool process is busy (0: not measured), each waiting this long.
    ping_probes: int = 10
    ping_timeout: float = 5.0
    #: The drains with task events on and an event monitor reading them (BENCH_EVENTS=0: not measured).
    events: bool = True

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            n=int(os.environ.get("BENCH_N", "500")),
            repeat=int(os.environ.get("BENCH_REPEAT", "3")),
            idle_window=float(os.environ.get("BENCH_IDLE_SECONDS", "15")),
            probes=int(os.environ.get("BENCH_PROBES", "20")),
            prefetch=int(os.environ.get("BENCH_PREFETCH", "1")),
            diagnose=os.environ.get("BENCH_DIAGNOSE", "") not in ("", "0"),
            ping_probes=int(os.environ.get("BENCH_PING_PROBES", "10")),
            ping_timeout=float(os.environ.get("BENCH_PING_TIMEOUT", "5")),
            events=os.environ.get("BENCH_EVENTS", "1") not in ("", "0"),
        )


class Counter:
    """A server's count of the operations it served, less the measuring command's own; and, where the server keeps
    one, of the requests it answered (round trips: a bulk write of many statements is one request, many ops)."""

    #: Operations one reading adds to the count (its own command), measured by calibrate().
    own = 1
    #: Requests one reading adds to theirs.
    own_requests = 1
    #: The server's count of requests at the last total(), or None where it keeps none.
    requests: int | None = None

    def total(self) -> int:
        raise NotImplementedError

    def calibrate(self) -> None:
        samples = [(self.total(), self.requests) for _ in range(6)]
        # Back to back, the only operations in between are the measuring commands themselves.
        self.own = min(b[0] - a[0] for a, b in zip(samples, samples[1:], strict=False))
        requests = [count for _, count in samples if count is not None]
        if len(requests) == len(samples):
            self.own_requests = min(b - a for a, b in zip(requests, requests[1:], strict=False))

    def delta(self, before: int, after: int) -> int:
        return after - before - self.own

    def requests_since(self, before: int | None) -> int | None:
        """Requests since the total() that read `before`, to the last total(); None where the server counts none."""
        if before is None or self.requests is None:
            return None
        return self.requests - before - self.own_requests


class MongoOps(Counter):
    """serverStatus opcounters (insert, query, update, delete, getmore, command), summed."""

    def __init__(self, url: str) -> None:
        self.client: MongoClient = MongoClient(url, **QUIET_CLIENT)

    def total(self) -> int:
        status = self.client.admin.command("serverStatus")
        self.requests = status.get("network", {}).get("numRequests")
        return sum(int(v) for v in status["opcounters"].values())

    def close(self) -> None:
        self.client.close()


class RedisOps(Counter):
    """INFO stats total_commands_processed."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)

    def total(self) -> int:
        return int(self.client.info("stats")["total_commands_processed"])

    def close(self) -> None:
        self.client.close()


@dataclass
class Broker:
    name: str
    server: str
    counter: Counter
    worker_url: Callable[[int], str]
    producer_url: Callable[[int], str]
    reset: Callable[[int], None]
    server_pid: Callable[[], int]
    check: Callable[[int, int], dict[str, Any]] = field(default=lambda rep, expected: {})
    #: The workers' result_backend for a round, or None: results ignored (the bench app's default).
    result_backend: Callable[[int], str] | None = None
    #: Whether the round pings a saturated worker (the rounds with results on skip it: nothing there differs).
    ping: bool = True
    #: Whether the round drains with task events on (the rounds with results on skip it, as the ping).
    events: bool = True
    #: Options every task of the round is sent with (the flow-control rounds: `unique=True`).
    send_options: dict[str, Any] = field(default_factory=dict)
    #: What the round sets up after its reset, before anything is published (a queue's limit).
    prepare: Callable[[int], None] = field(default=lambda rep: None)
    #: The workers' transport options for the round (BENCH_TRANSPORT_OPTIONS), beside the defaults.
    transport_options: dict[str, Any] = field(default_factory=dict)
    #: How many of the round's jobs are not settled yet, where a settle can land after the task's stamp (bbmongo://
    #: group-commits them); None where nothing settles after the stamp.
    unsettled: Callable[[int], int] | None = None


def mongo_broker(
    name: str,
    scheme: str,
    url: str,
    server: Server,
    counter: MongoOps,
    *,
    results: bool = False,
    send_options: dict[str, Any] | None = None,
    concurrency_limit: int | None = None,
    transport_options: dict[str, Any] | None = None,
) -> Broker:
    """A MongoDB broker; with `results`, the same URL is also the result backend: bb_broker.results.backend for bbmongo://,
    Celery's own MongoDB backend (a `celery_taskmeta` document per task) for mongodb://. The flow-control rounds of
    bbmongo:// send every task with `send_options`, or limit the task queue to `concurrency_limit` running jobs."""

    def database(rep: int) -> str:
        return f"bench_{name}_{rep}"

    def reset(rep: int) -> None:
        # A fresh database per round: SecantusDB's Python server slows as a collection grows.
        counter.client.drop_database(database(rep))
        if rep > 0:
            counter.client.drop_database(database(rep - 1))

    flow_control = bool(send_options) or concurrency_limit is not None

    def prepare(rep: int) -> None:
        if concurrency_limit is not None:
            operations = Operations(JobStore(counter.client[database(rep)]))
            operations.set_limits(QUEUE, concurrency=concurrency_limit, by="bench")

    quiet = "&".join(f"{k}={v}" for k, v in QUIET_CLIENT.items())

    def check(rep: int, expected: int) -> dict[str, Any]:
        if scheme != "bbmongo":
            return {}
        statuses = list(
            counter.client[database(rep)]["jobs"].aggregate([{"$group": {"_id": "$status", "n": {"$sum": 1}}}])
        )
        counts = {row["_id"]: row["n"] for row in statuses}
        # Every task succeeded and is still there; the warm-up job waits in a queue nobody consumes.
        if counts != {"succeeded": expected, "queued": 1}:
            raise AssertionError(f"bbmongo:// statuses after the round: {counts}, expected {expected} succeeded")
        if results:
            db = counter.client[database(rep)]
            stored = db["jobs"].count_documents({"status": "succeeded", "state": "SUCCESS"})
            if stored != expected or "celery_taskmeta" in db.list_collection_names():
                raise AssertionError(f"results on the jobs: {stored} of {expected}, or a celery_taskmeta appeared")
        return {"statuses": counts}

    def unsettled(rep: int) -> int:
        return counter.client[database(rep)]["jobs"].count_documents({"status": "running"})

    return Broker(
        name=name,
        server=server.label,
        server_pid=lambda: server.pid,
        counter=counter,
        worker_url=lambda rep: with_database(url, database(rep), scheme),
        producer_url=lambda rep: with_database(url, database(rep), scheme) + f"?{quiet}",
        reset=reset,
        check=check,
        result_backend=(lambda rep: with_database(url, database(rep), scheme)) if results else None,
        # The flow-control rounds differ from bbmongo:// only in the drains and the operations they cost.
        ping=not results and not flow_control,
        events=not results and not flow_control,
        send_options=send_options or {},
        prepare=prepare,
        unsettled=unsettled if scheme == "bbmongo" else None,
        transport_options=transport_options or {},
    )


def redis_broker(server: Server, counter: RedisOps) -> Broker:
    return Broker(
        name="redis",
        server=server.label,
        server_pid=lambda: server.pid,
        counter=counter,
        worker_url=lambda rep: server.url,
        producer_url=lambda rep: server.url,
        reset=lambda rep: counter.client.flushdb(),
    )


class Stamps:
    """The lines the tasks append (tag, sent, started, finished), read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[tuple[str, float, float, float]] = []
        self._offset = 0
        self._partial = b""

    def refresh(self) -> list[tuple[str, float, float, float]]:
        if not self.path.exists():
            return self.rows
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            tag, sent, started, finished = line.decode().split()
            self.rows.append((tag, float(sent), float(started), float(finished)))
        return self.rows

    def of(self, tag: str) -> list[tuple[str, float, float, float]]:
        return [row for row in self.refresh() if row[0] == tag]

    def wait(
        self, tag: str, count: int, timeout: float, stall: float | None = None
    ) -> list[tuple[str, float, float, float]]:
        """Until `count` tasks of `tag` ran; given up after `timeout`, or after `stall` seconds with none more."""
        deadline = time.monotonic() + timeout
        progress, progressed_at = -1, time.monotonic()
        while True:
            rows = self.of(tag)
            if len(rows) >= count:
                return rows
            if len(rows) != progress:
                progress, progressed_at = len(rows), time.monotonic()
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(rows)} of {count} '{tag}' tasks ran within {timeout:.0f}s")
            if stall is not None and time.monotonic() - progressed_at > stall:
                raise AssertionError(f"{len(rows)} of {count} '{tag}' tasks ran, then none for {stall:.0f}s")
            time.sleep(0.002)


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU of a worker's main process, and of its pool processes summed (its children)."""
    pool = 0.0
    for child in _children(pid):
        with contextlib.suppress(OSError):  # a pool process that has just exited
            pool += cpu_seconds(child)
    return cpu_seconds(pid), pool


def drain_cpu(worker: Worker, stamps: Stamps, tag: str, n: int, suffix: str) -> dict[str, float]:
    """What the worker's own processes spend per task while it drains a backlog of `n` tasks tagged `tag`, from the
    first task's finish (start-up left out) to the last's: the main process, the pool's processes, and both."""
    pid = worker.process.pid
    stamps.wait(tag, 1, timeout=120)
    (main, pool), done = worker_cpu_seconds(pid), len(stamps.of(tag))
    stamps.wait(tag, n, timeout=120 + n / 2)
    main_end, pool_end = worker_cpu_seconds(pid)
    counted = max(1, n - done)
    return {
        f"worker_main_cpu_ms_per_task{suffix}": (main_end - main) * 1000 / counted,
        f"worker_pool_cpu_ms_per_task{suffix}": (pool_end - pool) * 1000 / counted,
        f"worker_cpu_ms_per_task{suffix}": (main_end - main + pool_end - pool) * 1000 / counted,
    }


#: The paced window's tasks a second: well below what every broker drains at prefetch 1 on this machine.
PACE = 100.0


def paced_cpu(worker: Worker, stamps: Stamps, publish: Callable[[str], None], tag: str, count: int) -> dict[str, float]:
    """What the worker's own processes spend per task when `count` tasks tagged `tag` come one by one, PACE a
    second, to an idle worker: the same work at the same rate whatever the broker. A backlog's drain runs at each
    broker's own speed, and the slower it goes, the more CPU each task costs (the event loop's turns and the
    processes' cold caches are shared by fewer tasks), so there a broker whose server is slower looks dearer."""
    pid = worker.process.pid
    main, pool = worker_cpu_seconds(pid)
    began = time.monotonic()
    for k in range(count):
        publish(tag)
        time.sleep(max(0.0, began + (k + 1) / PACE - time.monotonic()))
    stamps.wait(tag, count, timeout=120 + count / 2)
    main_end, pool_end = worker_cpu_seconds(pid)
    return {
        "worker_cpu_ms_per_task_paced": (main_end - main + pool_end - pool) * 1000 / count,
        "worker_pool_cpu_ms_per_task_paced": (pool_end - pool) * 1000 / count,
        "paced_tps": count / (time.monotonic() - began),
        # The CPU figures of a loaded machine are noisy: said beside them.
        "paced_load_average": os.getloadavg()[0],
    }


def window_costs(broker: Broker, rep: int, before: tuple[int, int | None], tasks: int, suffix: str) -> dict[str, float]:
    """The server operations (and round trips, where the server counts them) per task since `before`, once every
    job of the window is settled: a settle may land just after its task's stamp. Each look at the jobs is a
    command of its own, taken off the count."""
    looks = 0
    if broker.unsettled is not None:
        looks = 1
        while broker.unsettled(rep):
            looks += 1
            time.sleep(0.02)
    counter = broker.counter
    ops = counter.delta(before[0], counter.total()) - looks
    out = {f"ops_per_task{suffix}": ops / tasks}
    requests = counter.requests_since(before[1])
    if requests is not None:
        out[f"round_trips_per_task{suffix}"] = (requests - looks) / tasks
    return out


def loaded_window(
    broker: Broker,
    rep: int,
    publish: Callable[..., None],
    stamps: Stamps,
    tag: str,
    n: int,
    suffix: str,
    commands: Path | None,
) -> dict[str, Any]:
    """A backlog of `n` tasks tagged `tag` published to a running worker: what each costs the server, and with a
    command log (BENCH_DIAGNOSE), which commands the worker's processes sent for it."""
    before, started = reading(broker.counter), time.time()
    for _ in range(n):
        publish(tag)
    stamps.wait(tag, n, timeout=120 + n / 2)
    out: dict[str, Any] = dict(window_costs(broker, rep, before, n, suffix))
    if commands is not None and commands.exists():
        out[f"worker_commands_per_task_window{suffix}"] = per_task(commands, started, time.time(), n)
    return out


def reading(counter: Counter) -> tuple[int, int | None]:
    """The counter's operations and requests now, for window_costs."""
    return counter.total(), counter.requests


def percentile(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def rss_bytes(pid: int) -> tuple[int, int]:
    """Resident memory of a process and its children (a prefork pool), and how many processes that is."""
    pids = [pid, *_children(pid)]
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total, len(pids)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found + [g for c in found for g in _children(c)]


def per_task(log: Path, start: float, end: float, tasks: int) -> dict[str, float]:
    """The commands the worker's processes sent in a window, by name and collection, per task."""
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines():
        at, _pid, name, target = line.split()
        if start <= float(at) <= end:
            counts[f"{name} {target}"] = counts.get(f"{name} {target}", 0) + 1
    return {key: round(count / tasks, 3) for key, count in sorted(counts.items(), key=lambda kv: -kv[1])}


def producer(url: str) -> Celery:
    app = Celery("bench-producer", broker=url, set_as_current=False)
    app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)
    return app


def send(app: Celery, tag: str, queue: str = QUEUE, options: dict[str, Any] | None = None) -> None:
    app.send_task(TASK, args=[time.time(), tag], queue=queue, **(options or {}))


def saturated_ping(app: Celery, worker: Worker, stamps: Stamps, settings: Settings, flag: Path) -> dict[str, Any]:
    """`ping` round trips to a worker whose every pool process runs a held task, with more queued behind them.

    Only Celery's API is used (`app.control.ping` to that one worker, which returns at its reply): the figure means
    the same whichever loop the worker runs. A probe unanswered within the timeout counts as the timeout.
    """
    destination = [host_format(f"{worker.name}@%h")]
    # Idle first (this also sets up the reply queue): a worker that never answers is said so, not pinged busy.
    if not any(app.control.ping(destination=destination, timeout=settings.ping_timeout) for _ in range(IDLE_PINGS)):
        return {"ping_idle_unanswered": 1}
    held = settings.concurrency + QUEUED_BEHIND
    flag.touch()
    try:
        for _ in range(held):
            app.send_task(HOLD_TASK, args=[str(flag)], queue=QUEUE)
        stamps.wait("h", settings.concurrency, timeout=60)
        rounds: list[float] = []
        unanswered = 0
        for _ in range(settings.ping_probes):
            time.sleep(random.uniform(0.05, 0.2))
            started = time.perf_counter()
            answered = app.control.ping(destination=destination, timeout=settings.ping_timeout)
            rounds.append(time.perf_counter() - started if answered else settings.ping_timeout)
            unanswered += not answered
        busy = len(stamps.of("h"))
    finally:
        flag.unlink()
    if busy != settings.concurrency:
        raise AssertionError(f"{busy} held tasks had started while pinging: the pool was not saturated throughout")
    stamps.wait("h", held, timeout=60)  # the queued ones start and end at once now
    return {
        "ping_saturated_p50_ms": percentile(rounds, 50) * 1000,
        "ping_saturated_p95_ms": percentile(rounds, 95) * 1000,
        "ping_saturated_unanswered": unanswered,
        "ping_idle_unanswered": 0,
        "held_tasks": held,
    }


class EventMonitor:
    """tools/bench/monitor.py in a process of its own: Celery's event Receiver consuming every event, as Flower."""

    def __init__(self, url: str, workdir: Path, name: str, env: dict[str, str] | None = None) -> None:
        self.url = url
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.counts_path = workdir / f"{name}.events.json"
        self.log_path = workdir / f"monitor-{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        """Returns once the receiver consumes (its counts file exists), so a worker started next is watched."""
        self.counts_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tools.bench.monitor", self.url, str(self.counts_path)],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(lambda: self.exited() or self.counts_path.exists(), timeout, "the event monitor to consume")
        if self.exited():
            raise AssertionError(f"the event monitor exited with {self.process.returncode}: {self.log_tail()}")

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def counts(self) -> dict[str, int]:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads(self.counts_path.read_text())
        return {}

    def task_events(self) -> int:
        return sum(count for kind, count in self.counts().items() if kind.startswith("task-"))

    def has_read(self, task_events: int) -> Callable[[], bool]:
        """A wait_for condition: the monitor has read that many task events."""
        return lambda: self.task_events() >= task_events

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:] if self.log_path.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM (the receiver stops within a second and writes its counts), SIGKILL if it lingers."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        return self.process.returncode


def stop_worker(worker: Worker) -> None:
    """A warm shutdown, then SIGKILL to the whole group if it lingers."""
    process = worker.process
    if process is None or process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(30)
    worker.kill()


def one_round(broker: Broker, settings: Settings, rep: int, workdir: Path) -> dict[str, Any]:
    """Every figure of one broker, measured once; the caller repeats rounds and interleaves brokers."""
    n, counter = settings.n, broker.counter
    broker.reset(rep)
    broker.prepare(rep)
    stamps_path = workdir / f"{broker.name}-{rep}.stamps"
    stamps_path.unlink(missing_ok=True)
    stamps = Stamps(stamps_path)
    app = producer(broker.producer_url(rep))

    def publish(tag: str, queue: str = QUEUE) -> None:
        send(app, tag, queue, broker.send_options)

    commands = workdir / f"{broker.name}-{rep}.commands"
    diagnosis = {"BENCH_COMMANDS": str(commands)} if settings.diagnose else {}
    results = {"BENCH_RESULT_BACKEND": broker.result_backend(rep)} if broker.result_backend else {}
    if broker.transport_options:
        results["BENCH_TRANSPORT_OPTIONS"] = json.dumps(broker.transport_options)

    def worker_with(prefetch: int, name: str, events: bool = False) -> Worker:
        return Worker(
            broker.worker_url(rep),
            log_dir=workdir,
            name=name,
            concurrency=settings.concurrency,
            app="tools.bench.app",
            extra_args=("-Q", f"{QUEUE},{PROBE_QUEUE}", *(("-E",) if events else ())),
            env={"BENCH_STAMPS": str(stamps_path), "BENCH_PREFETCH": str(prefetch), **diagnosis, **results},
        )

    worker = worker_with(settings.prefetch, f"{broker.name}-{rep}")
    result: dict[str, Any] = {"round": rep}
    try:
        publish("w", queue="warmup")  # connect, declare and index outside the timed loop (nobody consumes it)
        before = counter.total()
        started = time.perf_counter()
        for _ in range(n):
            publish("d")
        elapsed = time.perf_counter() - started
        result["publish_tps"] = n / elapsed
        result["publish_ops_per_task"] = counter.delta(before, counter.total()) / n

        worker.start()
        result |= drain_cpu(worker, stamps, "d", n, "")
        drained = stamps.wait("d", n, timeout=120 + n / 2)
        first_start = min(row[2] for row in drained)
        last_finish = max(row[3] for row in drained)
        result["drain_tps"] = n / (last_finish - first_start)

        # Idle: the worker has nothing to do; what it costs the server is its steady cost.
        time.sleep(2.0)
        before, idle_start = counter.total(), time.time()
        time.sleep(settings.idle_window / 2)
        result["worker_rss_bytes"], result["worker_processes"] = rss_bytes(worker.process.pid)
        time.sleep(settings.idle_window / 2)
        result["idle_ops_per_s"] = counter.delta(before, counter.total()) / settings.idle_window
        if settings.diagnose and commands.exists():
            # Per second, not per task. pymongo's monitors' `hello`s are no command events: the rest of the figure.
            sent = per_task(commands, idle_start, time.time(), 1)
            result["worker_idle_commands_per_s"] = {key: count / settings.idle_window for key, count in sent.items()}

        # Enqueue→start when idle: one probe at a time, at a random moment (a poller's phase is random too).
        for k in range(settings.probes):
            time.sleep(random.uniform(0.2, 0.6))
            publish("i", queue=PROBE_QUEUE)
            stamps.wait("i", k + 1, timeout=60)
        idle = [row[2] - row[1] for row in stamps.of("i")]
        result["idle_latency_p50_ms"] = percentile(idle, 50) * 1000
        result["idle_latency_p95_ms"] = percentile(idle, 95) * 1000

        if broker.ping and settings.ping_probes:
            result |= saturated_ping(app, worker, stamps, settings, workdir / f"{broker.name}-{rep}.hold")

        # Under load: a backlog of n in the task queue, probes on the probe queue while it drains.
        before, window_start = counter.total(), time.time()
        server_cpu = cpu_seconds(broker.server_pid())
        for _ in range(n):
            publish("l")
        probes = 0
        while len(stamps.of("l")) < n:
            publish("p", queue=PROBE_QUEUE)
            probes += 1
            stamps.wait("p", probes, timeout=120)
            time.sleep(random.uniform(0.01, 0.05))
        stamps.wait("l", n, timeout=120 + n / 2)
        # Every task of the window has finished (its stamp is written after bbmongo:// settles it).
        result["ops_per_task_with_probes"] = counter.delta(before, counter.total()) / (n + probes)
        result["server_cpu_ms_per_task"] = (cpu_seconds(broker.server_pid()) - server_cpu) * 1000 / (n + probes)
        if settings.diagnose and commands.exists():
            result["worker_commands_per_task"] = per_task(commands, window_start, time.time(), n + probes)
        loaded = [row[2] - row[1] for row in stamps.of("p")]
        result["load_probes"] = probes
        if loaded:
            result["load_latency_p50_ms"] = percentile(loaded, 50) * 1000
            result["load_latency_p95_ms"] = percentile(loaded, 95) * 1000

        # The loaded window again without the probes, as at Celery's prefetch below: what a task of a backlog
        # costs. Each probe is a lone task on an idle queue, whose wake-up is a change-stream getMore of its own.
        result |= loaded_window(broker, rep, publish, stamps, "z", n, "", commands if settings.diagnose else None)
        # Tasks at a pace every broker keeps up with: the worker's CPU per task at the same rate (paced_cpu).
        paced = max(1, n // 2)
        result |= paced_cpu(worker, stamps, publish, "q", paced)
        stop_worker(worker)

        # The same drain with Celery's default prefetch (4 per process), what users of the others run.
        for _ in range(n):
            publish("x")
        worker = worker_with(DEFAULT_PREFETCH, f"{broker.name}-{rep}-prefetch{DEFAULT_PREFETCH}")
        worker.start()
        result |= drain_cpu(worker, stamps, "x", n, "_celery_prefetch")
        drained = stamps.wait("x", n, timeout=120 + n / 2)
        result["drain_tps_celery_prefetch"] = n / (max(row[3] for row in drained) - min(row[2] for row in drained))

        # The loaded window again at that prefetch, where a worker may take several jobs in one claim.
        result |= loaded_window(
            broker, rep, publish, stamps, "y", n, "_celery_prefetch", commands if settings.diagnose else None
        )
        stop_worker(worker)

        ran_with_events = 0
        if settings.events and broker.events:
            ran_with_events = events_drains(broker, settings, rep, workdir, publish, stamps, worker_with, result)
        if "events_error" not in result:  # a stalled events-on drain leaves its backlog queued: nothing to check
            expected = 5 * n + paced + settings.probes + probes + result.get("held_tasks", 0) + ran_with_events
            result.update(broker.check(rep, expected))
    finally:
        stop_worker(worker)
        app.close()
    return result


def events_drains(
    broker: Broker,
    settings: Settings,
    rep: int,
    workdir: Path,
    publish: Callable[..., None],
    stamps: Stamps,
    worker_with: Callable[..., Worker],
    result: dict[str, Any],
) -> int:
    """The drain again with task events on (`-E`) and a monitor reading them, at the bench's prefetch and at
    Celery's: events are routed, stored and read on every broker, as where an operator runs Flower.

    Fills `result` with the drain figures, the task events the monitor read per task, and `events_error` when a
    drain stalls or the monitor fails (reported, not waited on). Returns how many tasks ran.
    """
    n, started = settings.n, time.monotonic()
    commands = workdir / f"{broker.name}-{rep}.commands"
    diagnosis = {"BENCH_COMMANDS": str(commands)} if settings.diagnose else {}
    monitor = EventMonitor(broker.worker_url(rep), workdir, f"{broker.name}-{rep}", diagnosis)
    ran = 0
    try:
        monitor.start()
        for prefetch, tag, suffix in ((settings.prefetch, "e", ""), (DEFAULT_PREFETCH, "f", "_celery_prefetch")):
            for _ in range(n):
                publish(tag)
            worker = worker_with(prefetch, f"{broker.name}-{rep}-events-prefetch{prefetch}", events=True)
            try:
                # What the server serves from the worker's start until the monitor has read the drain's events:
                # claims, settles, the events' writes and the monitor's reads (and the worker's start-up).
                before, server_cpu = broker.counter.total(), cpu_seconds(broker.server_pid())
                window_start = time.time()
                worker.start()
                drained = stamps.wait(tag, n, timeout=120 + n / 2, stall=EVENTS_STALL_SECONDS)
                # Each task sends task-received, -started and -succeeded; the monitor reads those on their way.
                with contextlib.suppress(AssertionError):
                    wait_for(monitor.has_read(3 * (ran + n)), EVENTS_CATCH_UP_SECONDS, "the monitor's events")
                result[f"ops_per_task_events{suffix}"] = broker.counter.delta(before, broker.counter.total()) / n
                result[f"server_cpu_ms_per_task_events{suffix}"] = (
                    (cpu_seconds(broker.server_pid()) - server_cpu) * 1000 / n
                )
                if settings.diagnose and commands.exists():  # the worker's and the monitor's, start-up included
                    sent = per_task(commands, window_start, time.time(), n)
                    result[f"worker_commands_per_task_events{suffix}"] = sent
            finally:
                stop_worker(worker)
            result[f"drain_tps_events{suffix}"] = n / (max(row[3] for row in drained) - min(row[2] for row in drained))
            ran += n
            if monitor.exited():
                raise AssertionError(f"the event monitor exited with {monitor.process.returncode}")
    except AssertionError as error:
        result["events_error"] = f"{error}; monitor: {monitor.log_tail()[-500:]}"
    finally:
        exit_code = monitor.stop()
        if ran:
            result["events_read_per_task"] = monitor.task_events() / ran
        result["events_read"] = monitor.counts()
        if exit_code not in (0, None) and "events_error" not in result:
            result["events_error"] = f"the event monitor exited with {exit_code}: {monitor.log_tail()[-500:]}"
        result["events_seconds"] = round(time.monotonic() - started, 1)
    return ran


def run_rounds(brokers: list[Broker], settings: Settings, workdir: Path, log: Callable[[str], None]) -> dict:
    """Round r runs every broker once, in a rotated order, so drift on a shared machine hits each alike."""
    rounds: dict[str, list[dict[str, Any]]] = {b.name: [] for b in brokers}
    for broker in brokers:
        broker.counter.calibrate()
    for rep in range(settings.repeat):
        order = brokers[rep % len(brokers) :] + brokers[: rep % len(brokers)]
        for broker in order:
            started = time.monotonic()
            figures = one_round(broker, settings, rep, workdir)
            rounds[broker.name].append(figures)
            log(f"round {rep + 1}/{settings.repeat} {broker.name}: {time.monotonic() - started:.0f}s {figures}")
    return rounds
