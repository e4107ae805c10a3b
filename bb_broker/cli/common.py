"""What every `bb-broker` command shares: `--broker` and `--collection`, the job store they name (a bad URL or
server in one line), the one-line error exit, the duration and job id arguments, who an action is recorded as, and
the command classes that refuse, in one line and before the command runs, a text argument that is not UTF-8 (what
the database and every message store), wherever it comes from: an argument, an option, a variable."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import click

from bb_broker.jobs.lifecycle import Policy, parse_duration
from bb_broker.options import DEFAULTS, BrokerOptions, open_store

if TYPE_CHECKING:
    from bb_broker.jobs.store import JobStore

# pymongo, Celery, Kombu and Flower are imported by the commands that use them: `--help` answers at once.

#: The exit status of a command refused for its arguments (click's own for a usage error).
BAD_ARGUMENT = 2


def _not_utf8(value: Any) -> str | None:
    """Where a text of `value` (a parameter's: a text, or a tuple of them) is not UTF-8, in words; None when none is.

    Python reads each argument and variable as UTF-8, turning the bytes that are not into lone surrogates
    (surrogateescape); such a text cannot be stored (BSON), sent (JSON) or printed as UTF-8. The value itself is
    not shown: it may be a URL or a password."""
    texts = value if isinstance(value, tuple | list) else (value,)
    for number, text in enumerate(texts, 1):
        if not isinstance(text, str) or text.isascii():
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = text[exc.start]
            byte = f"byte {ord(bad) - 0xDC00:#04x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character {ascii(bad)}"
            which = f" (the value number {number})" if len(texts) > 1 else ""
            return f"{which} is not UTF-8 text: {byte} at character {exc.start + 1}"
    return None


def _refuse_text_not_utf8(ctx: click.Context) -> None:
    for param in ctx.command.params:
        if isinstance(param.type, click.Path):
            continue  # a file's name is bytes: any the system takes will do
        problem = _not_utf8(ctx.params.get(param.name or ""))
        if problem is not None:
            name = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name.strip("[].")
            names = []
            while ctx.parent is not None:
                names.append(ctx.info_name or "")
                ctx = ctx.parent
            command = " ".join(reversed(names)) or "bb-broker"
            click.echo(f"bb-broker: {command}: {name}{problem} (names, ids and URLs must be)", err=True)
            ctx.exit(BAD_ARGUMENT)


class Command(click.Command):
    """A command that refuses a text parameter that is not UTF-8 (see _not_utf8) before it runs."""

    def invoke(self, ctx: click.Context) -> Any:
        _refuse_text_not_utf8(ctx)
        return super().invoke(ctx)


class Group(click.Group):
    """A group whose own parameters, and its commands' (made with `@group.command()`/`@group.group()`), refuse a
    text that is not UTF-8."""

    command_class = Command
    group_class = type  # a subgroup is a Group too

    def invoke(self, ctx: click.Context) -> Any:
        _refuse_text_not_utf8(ctx)
        return super().invoke(ctx)


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
def job_store(
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
            fail(f"--collection {collection!r}: {exc}", BAD_ARGUMENT)
        store.coll.database.client.admin.command("ping")  # one timeout, not one per query
        _warn_if_missing(store)
        yield store
    except connection.BrokerURLError as exc:
        fail(str(exc))
    except PyMongoError as exc:
        fail(server.describe_failure(exc, broker))
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
        warn(
            f"database {db.name} has no collection {name!r}: no job was ever published there "
            "(check the database in --broker and --collection)"
        )


def warn(message: str) -> None:
    click.echo(f"bb-broker: warning: {message}", err=True)


def tasks_of(app_name: str) -> Any:
    """The registered tasks of the Celery app `-A` names, its task modules imported."""
    from celery.app.utils import find_app

    try:
        app = find_app(app_name)
        app.loader.import_default_modules()
    except Exception as exc:  # the user's module: anything it raises on import is theirs to read, in one line
        fail(f"-A {app_name}: cannot load its Celery app: {type(exc).__name__}: {exc}", 2)
    return app.tasks


def fail(message: str, code: int = 1) -> NoReturn:
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


def operator_name() -> str:
    """Who an action from this command is recorded as: the local user at this host."""
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container, say)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} (bb-broker)"
