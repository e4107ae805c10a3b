"""The worker's start and stop: the patches a bbmongo:// worker takes, the leases of what it holds, the settle relay
of its pool processes, credentials masked in its logs, its chart summaries and metrics endpoint, its last settles."""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import celery
from celery import signals
from celery.worker import state as worker_state

from bb_broker import app_stores, connection
from bb_broker.jobs import settles
from bb_broker.jobs.leases import add_process_source, add_started_source
from bb_broker.jobs.payloads import JOB_ID_HEADER
from bb_broker.ops import metrics_endpoint
from bb_broker.options import TRANSPORT_OPTIONS, BrokerOptions, OptionError, unread_options
from bb_broker.transport.qos import mark_cut_short
from bb_broker.upstream import billiard as upstream_billiard
from bb_broker.upstream import celery as upstream_celery
from bb_broker.worker import receivers, settle

logger = logging.getLogger(__name__)

#: Celery's setting (5.1 and later; True by default from 6.0) that cancels the running acks_late tasks on a reconnect.
CANCEL_ON_CONNECTION_LOSS = "worker_cancel_long_running_tasks_on_connection_loss"


def install(app: Any) -> None:
    """Every patch a bbmongo:// worker needs, before its pool forks and its consumer builds the tasks' requests and
    tracers (its worker_init); calling it again changes nothing. The task runs' wrapper alone is installed again as
    the tasks' modules are imported (settle.retry_failed_attempts: a pool process started afresh builds its tracers
    without worker_init)."""
    upstream_billiard.install_pool_queue_guard()
    upstream_celery.wrap_task_runs(app, settle.broker_retry)
    for task in list(app.tasks.values()):
        upstream_celery.hook_requests(task, receivers.explain_lost, mark_cut_short)
    upstream_celery.install_failure_as_retry(settle.runs_again, receivers.prepare_errbacks)
    # `celery inspect conf` and Flower's worker Config tab show this worker's settings as Celery censors them.
    upstream_celery.install_url_censor(connection.redact_url)


class _HeldRequests:
    """The jobs of the requests this worker holds, as the lease keeper's thread reads them (jobs/leases.py): Celery's
    main thread changes `celery.worker.state`'s sets meanwhile, so each is copied (list()) before it is read; a copy
    torn by such a change raises RuntimeError, and the keeper reads again (leases._snapshot).
    `forks`: the worker's pool is processes forked from this one (prefork), whose ids a request's `worker_pid` holds;
    the green pools put a greenlet's id there, the threads and solo pools this process's."""

    def __init__(self, *, forks: bool) -> None:
        self.forks = forks

    def reserved(self) -> list[str]:
        # Every request the worker still holds, running or waiting in its pool: these leases stay fresh. The started
        # ones are read apart: Celery 5.4 to 5.6 empty reserved_requests on a reconnect, runs under way included
        # (5.7.0 keeps them), and a long run's job must not go stale under it.
        return self._jobs_of(list(worker_state.reserved_requests)) + self.started()

    def started(self) -> list[str]:
        # The requests its pool took. Celery keeps them through a reconnect (Consumer.on_close), and their runs go on,
        # except those it cancels then for the broker to deliver again (worker_cancel_long_running_tasks_on_connection_
        # loss: nothing settles a cancelled run, and its job goes back, as Celery means it to).
        return self._jobs_of(
            [request for request in list(worker_state.active_requests) if not _cancelled_on_reconnect(request)]
        )

    def _jobs_of(self, requests: list[Any]) -> list[str]:
        held = (
            getattr(request, "request_dict", None) or {} for request in requests if not self._run_by_the_gone(request)
        )
        return [str(headers[JOB_ID_HEADER]) for headers in held if headers.get(JOB_ID_HEADER)]

    def _run_by_the_gone(self, request: Any) -> bool:
        """Whether the pool process that took `request` has ended. Celery reports such a request at once (a
        WorkerLostError failure), except where its pool no longer knew the process ran it: on Celery 5.4 to 5.6 a
        reconnect's `AsynPool.flush` can forget the jobs under way, and the request then stays in the worker's state
        for good. Its job must not keep a lease no run will settle: left to lapse, the stale sweep runs it again."""
        pid = getattr(request, "worker_pid", None)
        if not self.forks or not isinstance(pid, int) or pid <= 0 or pid == os.getpid():  # not taken yet
            return False
        try:
            os.kill(pid, 0)  # asks whether the process exists, sends nothing
        except ProcessLookupError:
            return True
        except (OSError, OverflowError, ValueError):  # another user's (a pid taken again), or no pid at all
            return False
        return False


def _cancelled_on_reconnect(request: Any) -> bool:
    """Celery's own test (Consumer.on_connection_error_after_connected) of a request it cancels on a reconnect."""
    task = getattr(request, "task", None)
    cancels = bool(getattr(getattr(task, "app", None), "conf", {}).get(CANCEL_ON_CONNECTION_LOSS))
    return cancels and bool(getattr(task, "acks_late", False)) and not getattr(request, "acknowledged", False)


class _ScrubSecrets(logging.Filter):
    """Masks the broker's credentials in every record, tracebacks included, whoever wrote them."""

    def __init__(self, secrets: tuple[str, ...]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = connection.scrub(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info:
            trace = logging.Formatter().formatException(record.exc_info)
            if connection.scrub(trace, self.secrets) != trace:
                record.exc_text, record.exc_info = connection.scrub(trace, self.secrets), None
        return True


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _scrub_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    from celery import current_app

    url = app_stores.broker_url(current_app)
    secrets = connection.parse_broker_url(url).secrets if url else ()
    if logger is None or not secrets:
        return
    for handler in logger.handlers:
        if not any(isinstance(f, _ScrubSecrets) for f in handler.filters):
            handler.addFilter(_ScrubSecrets(secrets))


@signals.worker_shutting_down.connect
def _stopping(**_: Any) -> None:
    connection.begin_shutdown()


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _write_the_last_settles(**_: Any) -> None:
    # A pool process exits with os._exit (no atexit): the settles its writer still has go out first.
    settles.flush_all(connection.SHUTDOWN_PATIENCE)


@signals.import_modules.connect
def _tasks_imported(sender: Any = None, **_: Any) -> None:
    # A pool process started afresh (spawn, execv) imports the tasks and builds its tracers without worker_init.
    if sender is not None:
        try:
            settle.retry_failed_attempts(sender)
        except (connection.BrokerURLError, OptionError) as exc:
            # The worker cannot start: one line, not the 50-line traceback Celery re-raises a receiver's error with.
            raise SystemExit(f"bb_broker: {exc}") from None


@signals.worker_process_init.connect
def _in_a_pool_process(**_: Any) -> None:
    connection.in_a_pool_process()  # its clients' monitors look at the server once a minute (connection.py says why)


@signals.worker_init.connect
def _become_worker(sender: Any = None, **_: Any) -> None:
    # Whatever its broker: a worker of another broker in a process that imports bb_broker runs its task receivers
    # too, and each task's lookup read the app's conf to find no store (about a sixth of a Redis pool process's CPU
    # per task at 100 tasks/s, in the bench).
    app_stores.keep_task_store(sender.app)  # kept from the first task on
    if app_stores.broker_url(sender.app) is None:
        return
    # Before the pool forks and the consumer builds its tracers and request classes: `pool_shrink` must not wedge
    # a worker, a task's failed attempt the broker runs again is a Celery retry, and what the main process reports of
    # a task (its pool process died, a hard time limit) is right for the job (see bb_broker/upstream/celery.py).
    install(sender.app)
    if unread := unread_options(sender.app.conf.broker_transport_options):
        # Said, not refused: a deployment that switches brokers keeps its settings. Said once, as the worker starts.
        logger.warning(
            "bb_broker: bbmongo:// reads no transport option %s: ignored (its own: %s; a job's lease is stale_after)",
            ", ".join(map(repr, unread)),
            ", ".join(TRANSPORT_OPTIONS),
        )
    # The requests this worker holds keep their leases, and what it still holds at exit is released. A consumer
    # closed by a lost connection gives back the jobs of the others, not of those whose runs go on (Channel._restore).
    forks = _forks_its_pool(sender)
    held = _HeldRequests(forks=forks)
    add_process_source(held.reserved)
    add_started_source(held.started)
    # The pool processes it forks settle through this process: their settles go out together (settles.py).
    if forks:
        app = sender.app
        try:
            linger = BrokerOptions.parse(app.conf.broker_transport_options).settle_linger
            relay = settles.SettleRelay(
                lambda: app_stores.store_for(app), partial(settle.relayed_unwritable, app), linger=linger
            )
        except OptionError as exc:
            raise SystemExit(f"bb_broker: {exc}") from None  # one line, as for a broker URL it cannot use
        except OSError as exc:  # no SOCK_SEQPACKET socket pair here (macOS, the BSDs): each pool process writes
            logger.info("bb_broker: pool processes settle on their own (%s)", exc)
            return
        app_stores.keep_settle_relay(app, relay)
        relay.start()


def _forks_its_pool(worker: Any) -> bool:
    """Whether the worker's pool is processes forked from this one (prefork): a threads, solo, gevent or eventlet
    pool settles in this process. `pool_cls` is the `-P` choice at worker_init, resolved by Celery's own public
    `get_implementation` (checked against celery 5.5.3, 5.6.3, 5.7.0)."""
    # Imported here: billiard's pool is of no use to the command line's start.
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool as PreforkPool

    try:
        pool = get_implementation(worker.pool_cls)
    except Exception:  # an unknown pool is Celery's to refuse, a moment later
        return False
    return isinstance(pool, type) and issubclass(pool, PreforkPool)


@signals.worker_ready.connect
def _say_what_the_pool_cannot_do(sender: Any = None, **_: Any) -> None:
    """One line at start where the started pool cannot end a running task (Celery's threads and solo pools, and
    gevent's before Celery 5.5): a terminating revoke then lets the task run to its end, and its job settles as the
    task ends, on every broker; Celery itself says so only when a revoke comes. One more where the pool forgets its
    busy processes on a reconnect (prefork before Celery 5.7; worker_cancel_long_running_tasks_on_connection_loss
    cancels only the tasks acked late): Celery says nothing of it, and a task that waits behind a long one looks
    stuck."""
    pool = getattr(sender, "pool", None)
    if pool is None or app_stores.broker_url(sender.app) is None:
        return
    kind = type(pool).__module__.rsplit(".", 1)[-1]
    if not upstream_celery.pool_ends_running_tasks(pool):
        logger.warning(
            "bb_broker: Celery %s's %s pool cannot end a running task: revoke(terminate=True) lets it run to its end",
            celery.__version__,
            kind,
        )
    if not upstream_celery.pool_remembers_busy_processes_through_a_reconnect(pool):
        logger.warning(
            "bb_broker: Celery %s's %s pool may queue a task behind a running one after a lost broker connection "
            "(fixed in Celery 5.7)",
            celery.__version__,
            kind,
        )


@signals.worker_ready.connect
def _summarize_charts_ahead(sender: Any = None, **_: Any) -> None:
    """The worker's main process takes its turns at keeping the Jobs tab's chart summaries written ahead of the
    charts (one process of the fleet at a time: bb_broker.ops.stats.SummarizingAhead), so that a chart finds them
    written whether or not a Flower that may write runs."""
    store = app_stores.store_for(sender.app)
    if store is None:
        return
    # Imported here: the operator's queries are of no use to the pool processes and the command line's start.
    from bb_broker.ops.operations import Operations
    from bb_broker.ops.stats import SummarizingAhead

    SummarizingAhead.start(Operations(store), owner=f"{getattr(sender, 'hostname', None)}:{os.getpid()}")


@signals.worker_ready.connect
def _serve_metrics(sender: Any = None, **_: Any) -> None:
    """Opt-in with BB_METRICS_PORT: the worker's main process serves /metrics and /statuses."""
    port = os.environ.get("BB_METRICS_PORT", "").strip()
    if not port:
        return
    store = app_stores.store_for(sender.app)
    if store is None:
        logger.warning("BB_METRICS_PORT is set but this worker's broker is not bbmongo://: no metrics endpoint")
        return
    host = os.environ.get("BB_METRICS_HOST", "127.0.0.1")
    try:
        server = metrics_endpoint.serve_in_background(store, host, int(port))
    except (OSError, ValueError, OverflowError) as exc:
        # A busy port, or one past 65535 (OverflowError from bind), must not stop the worker from working.
        logger.error("bb_broker metrics endpoint not started on %s:%s: %s", host, port, exc)
        return
    if not metrics_endpoint.multiprocess_dir() and type(getattr(sender, "pool", None)).__module__.endswith("prefork"):
        logger.warning("PROMETHEUS_MULTIPROC_DIR is not set: the counters of the pool processes are not served")
    logger.info("bb_broker metrics on http://%s:%d/metrics and /statuses", host, server.server_port)
