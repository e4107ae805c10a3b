"""The `bb-broker` command: run the embedded server, read and operate the jobs collection, serve metrics."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from bb_broker import DISTRIBUTION
from bb_broker.jobs.lifecycle import BREAKDOWNS, FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED, Policy, parse_duration
from bb_broker.ops.arguments import BAD_ARGUMENT, Group
from bb_broker.ops.schedules import schedules_commands
from bb_broker.options import DEFAULTS, BrokerOptions, open_store

if TYPE_CHECKING:
    from bb_broker.jobs.store import JobStore
    from bb_broker.ops.operations import Operations

# pymongo, Celery, Kombu and Flower are imported by the commands that use them: `--help` answers at once.

DEFAULT_BROKER = "bbmongo://localhost:27017/bountyboard"


def _store(broker: str, collection: str = DEFAULTS.jobs_collection, policy: Policy = DEFAULTS.policy) -> JobStore:
    from bb_broker import connection

    target = connection.parse_broker_url(broker)
    timeouts: dict[str, Any] = connection.quick_timeouts(target)
    # A client of the command's own, closed when it is done: else pymongo's exit waits up to a second for its
    # monitor, blocked in an awaited `hello`.
    db = connection.new_client(target.mongo_uri, appname="bb-broker", tz_aware=True, **timeouts)[target.database]
    options = BrokerOptions(policy=policy, jobs_collection=collection)
    return open_store(db, options, secrets=target.secrets)


@contextmanager
def _jobs(
    broker: str, collection: str, policy: Policy = DEFAULTS.policy, *, keep_open: bool = False
) -> Iterator[JobStore]:
    """The job store, with a wrong URL or a server that cannot be used turned into one line on stderr and exit 1 (a
    collection name MongoDB cannot have: exit 2); its client is closed at the end of the block unless `keep_open`."""
    from pymongo.errors import InvalidName, PyMongoError

    from bb_broker import connection, server

    store = None
    try:
        try:
            store = _store(broker, collection, policy)
        except InvalidName as exc:  # the database's name was the URL's to check: this is the collection's
            _fail(f"--collection {collection!r}: {exc}", BAD_ARGUMENT)
        store.coll.database.client.admin.command("ping")  # one timeout, not one per query
        _warn_if_missing(store)
        yield store
    except connection.BrokerURLError as exc:
        _fail(str(exc))
    except PyMongoError as exc:
        _fail(server.describe_failure(exc, broker))
    finally:
        if store is not None and not keep_open:
            store.coll.database.client.close()


def _warn_if_missing(store: JobStore) -> None:
    from pymongo.errors import OperationFailure

    db, name = store.coll.database, store.coll.name
    try:
        exists = name in db.list_collection_names(filter={"name": name}, authorizedCollections=True)
    except OperationFailure:  # a user who may not list collections: nothing to say
        return
    if not exists:
        _warn(
            f"database {db.name} has no collection {name!r}: no job was ever published there "
            "(check the database in --broker and --collection)"
        )


def _warn(message: str) -> None:
    click.echo(f"bb-broker: warning: {message}", err=True)


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"bb-broker: {message}", err=True)
    sys.exit(code)


broker_option = click.option(
    "--broker",
    default=lambda: os.environ.get("BB_BROKER_URL", DEFAULT_BROKER),
    show_default="$BB_BROKER_URL or " + DEFAULT_BROKER,
    help="bbmongo:// or mongodb:// URL; its path names the database.",
)
collection_option = click.option(
    "--collection",
    default=DEFAULTS.jobs_collection,
    show_default=True,
    help="The jobs collection (the jobs_collection option).",
)


class Duration(click.ParamType):
    """30s, 30m, 2h, 7d, 1w, or a number of seconds: lifecycle.parse_duration, as the Jobs tab's filters take it;
    with `longest`, no longer than that (a time a worker waits must fit in a date and a MongoDB number)."""

    name = "duration"

    def __init__(self, *, positive: bool = False, longest: timedelta | None = None) -> None:
        self.positive = positive
        self.longest = longest

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            duration = parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if self.positive and duration <= timedelta(0):
            self.fail(f"{value!r} is no time at all: give more than 0 seconds", param, ctx)
        if self.longest is not None and duration > self.longest:
            self.fail(f"{value!r} is too long: at most {self.longest.days} days", param, ctx)
        return duration


class JobId(click.ParamType):
    """A job id or a Celery task id: how every command that acts on jobs takes them, as its arguments (`ID...`)."""

    name = "id"


JOB_ID = JobId()


def job_ids_argument(*, required: bool) -> Callable[[Any], Any]:
    """The jobs a command acts on, as every such command takes them: job ids or Celery task ids, as arguments."""
    return click.argument(
        "identifiers", metavar="ID..." if required else "[ID]...", nargs=-1, required=required, type=JOB_ID
    )


DURATION = Duration()
#: How long a worker waits for a lease (stale_after) and between heartbeats: a century is "never" already.
WAIT = Duration(positive=True, longest=timedelta(days=36500))


@click.group(name="bb-broker", cls=Group)  # its name as a `celery` subcommand too (pyproject.toml's celery.commands)
@click.version_option(package_name=DISTRIBUTION, prog_name="bb-broker", message="%(prog)s %(version)s")
def main() -> None:
    """Operate bb_broker, the Celery broker that keeps every task as a MongoDB `jobs` document."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=27017, show_default=True, type=click.IntRange(1, 65535))
@click.option("--data", default="./bb-data", show_default=True, type=click.Path(), help="Data directory, or :memory:.")
def serve(host: str, port: int, data: str) -> None:
    """Run the embedded MongoDB-compatible server (SecantusDB) for development and demos."""
    from bb_broker import embedded

    try:
        with socket.create_server((host, port)):
            pass  # free now; the server binds it next
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        _fail(f"cannot listen on {host}:{port}: {reason} (another server there? choose --port)")
    where = "in memory: gone when the server stops" if data == ":memory:" else f"in {Path(data).resolve()}"
    announce = [
        f"listening on {host}:{port}; broker URL bbmongo://{_connectable(host)}:{port}/bountyboard",
        f"data {where}",
        "stop it with Ctrl-C (or SIGTERM)",
    ]
    threading.Thread(target=_announce_when_listening, args=(host, port, announce), daemon=True).start()
    try:
        sys.exit(embedded.run_daemon(embedded.daemon_argv(host, port, data)))
    except embedded.EmbeddedServerMissing as exc:
        _fail(str(exc))


def _connectable(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)


def _announce_when_listening(host: str, port: int, lines: list[str]) -> None:
    """Say where the server is once it accepts connections (it prints nothing of its own)."""
    address = _connectable(host).strip("[]")
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                break
        except OSError:
            time.sleep(0.1)
    for line in lines:
        click.echo(f"bb-broker: {line}")


@main.command()
@broker_option
@collection_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--by",
    type=click.Choice(BREAKDOWNS),
    help="Counts per status for each queue or kind; with --json, {name: {status: count}}.",
)
def status(broker: str, collection: str, as_json: bool, by: str | None) -> None:
    """Jobs per status (with --json, the same object as bb_broker.statuses()), per queue and per kind."""
    from bb_broker.ops.operations import Operations

    with _jobs(broker, collection) as store:
        operations = Operations(store)
        if by is not None:
            rows = operations.breakdown(by)
            click.echo(json.dumps(rows) if as_json else _table(by, rows))
            return
        counts = store.statuses()
        if as_json:
            click.echo(json.dumps(counts))
            return
        for name, count in counts.items():
            click.echo(f"{name:<10} {count}")
        for breakdown in BREAKDOWNS:
            rows = operations.breakdown(breakdown)
            if rows:
                click.echo("")
                click.echo(_table(breakdown, rows))
        paused = operations.paused()
        if paused:
            from bb_broker.ops.present import as_text

            click.echo("")
            for name, control in sorted(paused.items()):
                since = control.get("pausedAt")
                when = f" since {as_text(since)}" if since else ""
                click.echo(f"paused queue {name} (by {as_text(control.get('pausedBy'))}{when}): its jobs wait")
        limited = {name: row for name, row in operations.queues().items() if "limitedBy" in row}
        if limited:
            click.echo("")
            for name, row in limited.items():
                click.echo(_limits_line(name, row))


def _table(first: str, rows: dict[str, dict[str, int]]) -> str:
    names = [name or "(none)" for name in rows]
    width = max([len(first), *map(len, names)])
    lines = [f"{first:<{width}}  " + "  ".join(f"{status:>9}" for status in STATUSES)]
    for name, counts in zip(names, rows.values(), strict=True):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{counts[status]:>9}" for status in STATUSES))
    return "\n".join(lines)


@main.command()
@broker_option
@collection_option
@click.option("--kind", help="Only this task name.")
@click.option("--schedule", help="Only the jobs of this periodic entry (bb_broker.beat): its slots' and run-nows'.")
@click.option("--older-than", type=DURATION, help="Failed more than this long ago (30m, 2h, 7d).")
@click.option("--newer-than", type=DURATION, help="Failed within this long (30m, 2h, 7d).")
@click.option(
    "--limit",
    default=50,
    show_default=True,
    type=click.IntRange(min=0, max=2**31 - 1),  # past a 64-bit int, a traceback: 32 bits is plenty
    help="At most this many; 0 = all.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
def failed(
    broker: str,
    collection: str,
    kind: str | None,
    schedule: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    limit: int,
    as_json: bool,
) -> None:
    """Failed jobs, the most recently failed first: id, kind, attempts, when, lastError."""
    from bb_broker.ops.operations import Operations
    from bb_broker.ops.present import as_json as as_json_value
    from bb_broker.ops.present import as_text, to_the_second

    with _jobs(broker, collection) as store:
        docs = Operations(store).failed_jobs(
            kind=kind, schedule=schedule, older_than=older_than, newer_than=newer_than, limit=limit
        )
    if as_json:
        rows = [
            {
                "id": doc.get("_id"),
                "kind": doc.get("kind"),
                "queue": doc.get("queue"),
                "taskId": doc.get("taskId"),
                "attempts": doc.get("attempts"),
                "failedAt": doc.get("updatedAt"),
                "lastError": doc.get("lastError", ""),
            }
            for doc in docs
        ]
        click.echo(json.dumps(as_json_value(rows)))
        return
    if not docs:
        click.echo("no failed jobs")
        return
    lines = [
        (
            as_text(doc.get("_id")),
            as_text(doc.get("kind")),
            as_text(doc.get("attempts")),
            "" if doc.get("updatedAt") is None else to_the_second(doc["updatedAt"]),
            # One line per job: a multi-line error is folded and cut; --json has it whole.
            " ".join(as_text(doc.get("lastError", "")).split())[:160],
        )
        for doc in docs
    ]
    header = ("ID", "KIND", "ATTEMPTS", "FAILED AT (UTC)", "LAST ERROR")
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(4)]
    for row in [header, *lines]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4])


@main.command()
@broker_option
@collection_option
@job_ids_argument(required=False)
# Before the ids were arguments, as every other command takes them, retry took them as --id: still taken.
@click.option("--id", "deprecated_ids", multiple=True, type=JOB_ID, hidden=True)
@click.option("--kind", help="Every failed job of this task name (with IDs: only those of this task name).")
@click.option("--all", "retry_all", is_flag=True, help="Every failed job.")
def retry(
    broker: str,
    collection: str,
    identifiers: tuple[str, ...],
    deprecated_ids: tuple[str, ...],
    kind: str | None,
    retry_all: bool,
) -> None:
    """Failed jobs back to queued, due now, with their attempts reset to 0: by job id or Celery task id, or every one
    of a kind (--all: every one)."""
    if deprecated_ids:
        _warn("retry --id is deprecated: give the ids as arguments (bb-broker retry ID...)")
    ids = identifiers + deprecated_ids
    if retry_all and (ids or kind):
        _fail("retry: --all cannot be combined with IDs or --kind", 2)
    if not (retry_all or ids or kind):
        _fail("retry: say which failed jobs: ID... (job ids or task ids), --kind NAME, or --all", 2)
    from bb_broker.ops.operations import Operations

    with _jobs(broker, collection) as store:
        operations = Operations(store)
        retried = operations.retry(list(dict.fromkeys(ids)) if ids else None, kind=kind, by=_operator())
        missed = {identifier: operations.why_not_retried(identifier, kind) for identifier in retried.unmatched}
        count = retried.count
    click.echo(f"retried {count} failed job{'' if count == 1 else 's'}")
    for reason in retried.held.values():
        click.echo(reason, err=True)
    if retried.held and not missed:
        _fail(f"retry: {len(retried.held)} job{'' if len(retried.held) == 1 else 's'} left failed")
    if missed:
        reasons = ", ".join(f"{job_id} ({why})" for job_id, why in missed.items())
        _fail(f"retry: {len(missed)} id{'' if len(missed) == 1 else 's'} matched no failed job: {reasons}")


@main.command("requeue-stale")
@broker_option
@collection_option
@click.option(
    "--stale-after",
    default=f"{DEFAULTS.policy.stale_after:g}",
    show_default=True,
    type=WAIT,
    help="Seconds (or 5m, 1h) without a heartbeat before a running job is presumed lost (the stale_after option).",
)
@click.option(
    "--max-attempts",
    default=DEFAULTS.policy.max_attempts,
    show_default=True,
    type=click.IntRange(min=1, max=2**31 - 1),  # past a 64-bit int, a traceback: 32 bits hold any attempts
    help="A lost job with this many attempts used ends failed (the max_attempts option).",
)
@click.option(
    "--heartbeat-interval",
    default=str(DEFAULTS.policy.heartbeat_interval),
    show_default=True,
    type=WAIT,
    help="How often (seconds, or 1m) the workers refresh the leases of their jobs: their stale_after / 5.",
)
def requeue_stale(
    broker: str, collection: str, stale_after: timedelta, max_attempts: int, heartbeat_interval: timedelta
) -> None:
    """Run the stale sweep now: lost running jobs back to queued, or failed when no attempt is left."""
    stale, heartbeat = stale_after.total_seconds(), heartbeat_interval.total_seconds()
    # A live job's lease is refreshed once per heartbeat interval; two of them give a late heartbeat its chance.
    if stale < 2 * heartbeat:
        _fail(
            f"requeue-stale: --stale-after {stale:g} s is less than two heartbeat intervals of the workers "
            f"(2 x {heartbeat:g} s): jobs whose workers are alive would be re-queued. Use at least "
            f"{2 * heartbeat:g} s, or pass --heartbeat-interval (your workers' stale_after / 5)",
            2,
        )
    with _jobs(broker, collection, Policy(max_attempts=max_attempts, stale_after=stale)) as store:
        sweep_log = logging.getLogger("bb_broker.jobs.sweeps")
        level = sweep_log.level
        sweep_log.setLevel(logging.ERROR)  # its "recovered lost jobs" line would repeat what is printed below
        try:
            requeued, failed_count = store.requeue_stale()
        finally:
            sweep_log.setLevel(level)
    click.echo(f"re-queued {requeued}, failed {failed_count}")


@main.command()
@broker_option
@collection_option
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(STATUSES),
    help="Delete jobs in this status (repeatable); queued and running need --force.",
)
@click.option("--older-than", type=DURATION, help="Only jobs finished (last changed) more than this long ago.")
@click.option("--force", is_flag=True, help="Allow deleting queued and running jobs.")
def purge(broker: str, collection: str, statuses: tuple[str, ...], older_than: timedelta | None, force: bool) -> None:
    """Delete finished jobs by status and age; prints how many."""
    if not statuses:
        _fail(f"purge: say which jobs: --status {SUCCEEDED} and/or --status {FAILED}", 2)
    unfinished = sorted({QUEUED, RUNNING} & set(statuses))
    if unfinished and not force:
        _fail(f"purge: refusing to delete {' and '.join(unfinished)} jobs (work not done yet) without --force", 2)
    from bb_broker.ops.operations import Operations

    with _jobs(broker, collection) as store:
        count = Operations(store).purge(set(statuses), older_than=older_than)
    click.echo(f"purged {count} job{'' if count == 1 else 's'}")


@main.command()
@broker_option
@collection_option
def doctor(broker: str, collection: str) -> None:
    """Check whether a server can carry the broker safely: one verdict per capability; exit 2 when unsafe."""
    from bb_broker.ops import doctor as checks  # imported here: the other commands do not pay for it

    sys.exit(checks.run(broker, collection, echo=click.echo, complain=lambda line: click.echo(line, err=True)))


@main.command("serve-metrics")
@broker_option
@collection_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9808, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
def serve_metrics(broker: str, collection: str, host: str, port: int) -> None:
    """Serve /metrics (Prometheus) and /statuses (the statuses() JSON) until stopped."""
    from bb_broker.ops import metrics_endpoint

    with _jobs(broker, collection, keep_open=True) as store:
        store.statuses()  # a collection that cannot be read fails here, in one line, not at each scrape
    try:
        server = metrics_endpoint.make_metrics_server(store, host, port)
    except (OSError, ValueError) as exc:  # a busy port, or a PROMETHEUS_MULTIPROC_DIR that does not exist
        _fail(f"cannot serve metrics on {host}:{port}: {exc}")
    click.echo(f"bb-broker: serving /metrics and /statuses on http://{host}:{server.server_port}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


_NO_AUTH_NOTE = (
    "bb-broker: Flower runs WITHOUT authentication (--no-auth): anyone who can reach {where} sees every task and its "
    "arguments. Its API, and the buttons that use it, answer 401 unless FLOWER_UNAUTHENTICATED_API=true is set, "
    "which also lets any web page your browser opens read it (not change anything: another site's request to do so "
    "is refused). Use --basic-auth=USER:PASSWORD for anything but a private machine."
)
#: Where `bb-broker flower` listens unless told (Flower's own default, "", is every interface, IPv4 and IPv6).
FLOWER_ADDRESS = "127.0.0.1"


@main.command("flower", context_settings={"ignore_unknown_options": True})
@click.option("-A", "--app", "celery_app", required=True, help="The Celery app, as `celery -A` takes it.")
@click.option(
    "--no-auth",
    is_flag=True,
    help="Serve Flower without authentication, for local use; without it Flower must be given --basic-auth, "
    "--auth (OAuth), or their FLOWER_* variables or flowerconfig.py settings.",
)
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower_command(celery_app: str, no_auth: bool, flower_args: tuple[str, ...]) -> None:
    """Run Flower (`celery -A APP flower FLOWER_ARGS...`) with a Broker tab showing each queue's jobs.

    Flower must authenticate its users (--basic-auth=USER:PASSWORD, or --auth with an OAuth provider), unless
    --no-auth says it is for local use. It listens on 127.0.0.1 unless --address (FLOWER_ADDRESS, flowerconfig.py's
    address) says where: --address=0.0.0.0 for every interface.
    """
    try:
        from bb_broker.contrib.flower import broker as adapter  # importing the plugin installs its tabs into Flower
        from bb_broker.contrib.flower import hosts
    except ImportError as exc:
        _fail(f"Flower is not installed ({exc}): pip install 'bb-broker[flower]'")
    from tornado.options import Error as FlowerOptionError

    try:
        scheme = adapter.authentication(flower_args)
    except (FlowerOptionError, ValueError, OSError) as exc:  # a bad value, or a --conf file that is not there
        _fail(f"flower: {exc}", 2)
    if scheme is None and not no_auth:
        _fail(
            "flower: refusing to serve Flower without authentication. Pass --basic-auth=USER:PASSWORD "
            "(or set FLOWER_BASIC_AUTH), or --auth=EMAIL_REGEX with an OAuth provider (FLOWER_AUTH, "
            "FLOWER_OAUTH2_KEY/SECRET/REDIRECT_URI), or set basic_auth/auth in flowerconfig.py; "
            "--no-auth serves it to anyone who can reach it, for local use only.",
            2,
        )
    if scheme is not None and no_auth:
        _fail(f"flower: --no-auth contradicts the {scheme} authentication Flower is configured with", 2)
    from tornado.options import options  # as authentication() left them: Flower's environment, file and arguments

    try:
        hosts.check_allowed_hosts(options.allowed_hosts)
    except ValueError as exc:
        _fail(f"flower: {exc}", 2)
    if not options.address and not options.unix_socket:
        flower_args = (*flower_args, f"--address={FLOWER_ADDRESS}")  # the arguments Flower reads last
    if no_auth:
        click.echo(_NO_AUTH_NOTE.format(where=f"{options.address or FLOWER_ADDRESS}:{options.port}"), err=True)
    from celery.bin.celery import celery

    celery.main(args=["-A", celery_app, "flower", *flower_args], prog_name="celery", auto_envvar_prefix="CELERY")


def _operator() -> str:
    """Who an action from this command is recorded as: the local user at this host."""
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container, say)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} (bb-broker)"


@main.command()
@broker_option
@collection_option
@click.argument("identifier", metavar="ID", type=JOB_ID)
@click.option("--json", "as_json", is_flag=True, help="Print the whole document (or with --tree, the canvas) as JSON.")
@click.option("--tree", is_flag=True, help="Print the job's canvas (its chains, groups, chord bodies) as a tree.")
def show(broker: str, collection: str, identifier: str, as_json: bool, tree: bool) -> None:
    """One job, by job id or Celery task id: every field, its arguments, attempts and the actions taken on it."""
    from bb_broker.ops.canvas import canvas_of, tree_lines
    from bb_broker.ops.operations import Operations
    from bb_broker.ops.present import as_json as as_json_value
    from bb_broker.ops.present import describe_job

    if tree:
        with _jobs(broker, collection) as store:
            canvas = canvas_of(Operations(store), identifier)
        if canvas is None:
            _fail(f"show: no job has the id or task id {identifier!r}")
        click.echo(json.dumps(canvas, indent=2) if as_json else "\n".join(tree_lines(canvas)))
        return
    with _jobs(broker, collection) as store:
        doc = Operations(store).find(identifier)
    if doc is None:
        _fail(f"show: no job has the id or task id {identifier!r}")
    if as_json:
        click.echo(json.dumps(as_json_value(doc), indent=2))
        return
    for label, value in describe_job(doc):
        click.echo(f"{label + ':':<14}{value}" if label else f"  {value}")


@main.command()
@broker_option
@collection_option
@job_ids_argument(required=True)
def cancel(broker: str, collection: str, identifiers: tuple[str, ...]) -> None:
    """Cancel queued jobs (by job id or Celery task id): each ends failed, no worker runs it, whatever restarts."""
    from bb_broker.ops.operations import Operations

    with _jobs(broker, collection) as store:
        _act_on_each(Operations(store), "cancel", identifiers, "cancelled job {id} ({kind})")


def _act_on_each(operations: Operations, action: str, identifiers: tuple[str, ...], done: str) -> None:
    """`action` on each job: `done` (with {id} and {kind}) said for each one done, then one exit 1 naming every
    refusal."""
    from bb_broker.ops.operations import ActionRefused

    problems = []
    for identifier in identifiers:
        try:
            doc = operations.act(action, identifier, by=_operator())
        except ActionRefused as exc:
            problems.append(str(exc))
        else:
            click.echo(done.format(id=doc["_id"], kind=doc.get("kind")))
    if problems:
        _fail(f"{action}: " + "; ".join(problems))


@main.command()
@broker_option
@collection_option
@click.option(
    "--since",
    "window",
    default="1h",
    show_default=True,
    type=Duration(positive=True, longest=timedelta(days=31)),
    help="The window, ending now: 1h (a minute per line), 1d (15 minutes), 1w (an hour); at most 31d.",
)
@click.option("--by", type=click.Choice(BREAKDOWNS), help="A table per queue or per kind.")
@click.option("--queue", help="Only this queue's jobs.")
@click.option("--kind", help="Only this task name's jobs.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the Jobs tab's chart numbers (GET /api/jobs/stats) as JSON."
)
def stats(
    broker: str, collection: str, window: timedelta, by: str | None, queue: str | None, kind: str | None, as_json: bool
) -> None:
    """What finished, waited and ran over time, per interval: attempts succeeded, jobs failed for good, attempts
    retried, and the wait (runAfter to start) and run time of the jobs that finished, p50 and p95 in seconds. The
    numbers of the Jobs tab's charts; intervals without a finished attempt are left out of the table."""
    from bb_broker.ops.operations import FilterError, JobFilter, Operations
    from bb_broker.ops.stats import job_stats

    with _jobs(broker, collection) as store:
        try:
            job_filter = JobFilter.parse({"queue": queue, "kind": kind}, store.now())
            numbers = job_stats(Operations(store), job_filter, window, by)
        except FilterError as exc:
            _fail(f"stats: {exc}", 2)
    if as_json:
        click.echo(json.dumps(numbers))
        return
    for name, series in numbers["series"].items():
        if by is not None:
            click.echo(f"{by} {name or '(none)'}:")
        click.echo(_stats_table(numbers["intervals"], series))
    if not numbers["series"]:
        click.echo(f"nothing finished since {numbers['from'][:16].replace('T', ' ')} UTC")


def _stats_table(intervals: list[str], series: dict[str, list[Any]]) -> str:
    header = ("FROM (UTC)", "SUCCEEDED", "FAILED", "RETRIED", "WAIT P50", "WAIT P95", "RUN P50", "RUN P95")
    lines = ["  ".join(f"{cell:>9}" if n else f"{cell:<16}" for n, cell in enumerate(header))]
    for n, start in enumerate(intervals):
        counts = [series[name][n] for name in ("succeeded", "failed", "retried")]
        if not any(counts):
            continue
        times = [series[name][n] for name in ("waitP50", "waitP95", "runP50", "runP95")]
        cells = [start[:16].replace("T", " "), *map(str, counts), *("" if t is None else f"{t:.3f}" for t in times)]
        lines.append("  ".join(f"{cell:>9}" if i else f"{cell:<16}" for i, cell in enumerate(cells)))
    return "\n".join(lines)


@main.command("run-now")
@broker_option
@collection_option
@job_ids_argument(required=False)
@click.option("--queue", help="Every waiting job of this queue.")
@click.option("--kind", help="Every waiting job of this task name.")
@click.option("--all", "every", is_flag=True, help="Every queued job that waits for its runAfter.")
def run_now(
    broker: str, collection: str, identifiers: tuple[str, ...], queue: str | None, kind: str | None, every: bool
) -> None:
    """Queued jobs that wait for their countdown, ETA or backoff, due now: by job id or Celery task id, or every one of
    a queue or a kind (--all: every one). A worker that consumes the queue takes each next; recorded on each job."""
    selected = bool(queue or kind)
    if identifiers and (selected or every):
        _fail("run-now: give job ids, or --queue/--kind, or --all, not both", 2)
    if every and selected:
        _fail("run-now: --all cannot be combined with --queue or --kind", 2)
    if not (identifiers or selected or every):
        _fail("run-now: say which jobs: ID... (job ids or task ids), --queue NAME, --kind NAME, or --all", 2)
    from bb_broker.ops.operations import RUN_NOW, FilterError, JobFilter, Operations

    with _jobs(broker, collection) as store:
        operations = Operations(store)
        if not identifiers:
            try:
                job_filter = JobFilter.parse({"status": QUEUED, "queue": queue, "kind": kind}, store.now())
            except FilterError as exc:
                _fail(f"run-now: {exc}", 2)
            count = operations.act_on_filter(RUN_NOW, job_filter, by=_operator())
            click.echo(f"{count} waiting job{'' if count == 1 else 's'} due now")
            return
        _act_on_each(operations, RUN_NOW, identifiers, "job {id} ({kind}) is due now")


@main.command()
@broker_option
@collection_option
@click.argument("queue")
def pause(broker: str, collection: str, queue: str) -> None:
    """Pause a queue for every worker, now and later: its jobs stay queued until `resume`."""
    _set_paused(broker, collection, queue, paused=True)


@main.command()
@broker_option
@collection_option
@click.argument("queue")
def resume(broker: str, collection: str, queue: str) -> None:
    """Resume a paused queue: workers claim its jobs again."""
    _set_paused(broker, collection, queue, paused=False)


def _set_paused(broker: str, collection: str, queue: str, *, paused: bool) -> None:
    command = "pause" if paused else "resume"
    if not queue.strip():
        _fail(f"{command}: the queue name is empty", 2)
    from bb_broker.ops.operations import FilterError, Operations

    with _jobs(broker, collection) as store:
        operations = Operations(store)
        try:
            changed = (operations.pause if paused else operations.resume)(queue, by=_operator())
        except FilterError as exc:  # a name no queue can have
            _fail(f"{command}: {exc}", 2)
    if paused:
        click.echo(f"paused queue {queue}" if changed else f"queue {queue} was already paused")
    else:
        click.echo(f"resumed queue {queue}" if changed else f"queue {queue} was not paused")


@main.command()
@broker_option
@collection_option
@click.argument("queue")
@click.option(
    "--concurrency",
    metavar="N",
    help="At most N of the queue's jobs running at once, across every worker (a whole number from 1; none removes it).",
)
@click.option(
    "--rate",
    metavar="N/PERIOD",
    help="At most N of the queue's jobs started per period, across every worker: 10/s, 10/m, 10/h, 10/d; '10/m per "
    "key' for so many of each rate key (the jobs' rate_key); none removes it.",
)
@click.option("--clear", is_flag=True, help="Remove the queue's limits.")
def limit(broker: str, collection: str, queue: str, concurrency: str | None, rate: str | None, clear: bool) -> None:
    """Limit a queue for every worker, now and later, or with no option show its limits and what they count."""
    from bb_broker.jobs.queues import LimitError
    from bb_broker.ops.operations import FilterError, Operations

    if not queue.strip():
        _fail("limit: the queue name is empty", 2)
    if clear and (concurrency is not None or rate is not None):
        _fail("limit: --clear removes every limit: give it alone", 2)
    with _jobs(broker, collection) as store:
        operations = Operations(store)
        try:
            if clear or concurrency is not None or rate is not None:
                operations.set_limits(queue, concurrency=concurrency, rate=rate, clear=clear, by=_operator())
            row = operations.queues([queue.strip()])[queue.strip()]
        except (LimitError, FilterError) as exc:  # nothing was changed
            _fail(f"limit: {exc}", 2)
    click.echo(_limits_line(queue.strip(), row))


def _limits_line(queue: str, row: dict[str, Any]) -> str:
    counts = f"({row[RUNNING]} running, {row[QUEUED]} queued)"
    limits = []
    if row.get("concurrency") is not None:
        limits.append(f"at most {row['concurrency']} running at once")
    if row.get("rate") is not None:
        limits.append(f"at most {row['rate']} started")
    return f"queue {queue}: {', '.join(limits) or 'no limit'} {counts}"


main.add_command(schedules_commands(broker_option, collection_option, _jobs, _fail, _operator), name="schedules")

if __name__ == "__main__":
    main()
