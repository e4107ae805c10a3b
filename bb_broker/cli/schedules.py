"""`bb-broker schedules`: the periodic entries of bb_broker.beat, listed, added, run now, disabled, removed."""

from __future__ import annotations

import functools
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from bb_broker.cli.common import Group, broker_option, collection_option, fail, job_store, operator_name, tasks_of

# pymongo and Celery are imported by the commands that use them: `--help` answers at once.


@dataclass(frozen=True)
class Where:
    """The server and jobs collection a `schedules` command works on."""

    broker: str
    collection: str


def where(command: Callable[..., None]) -> Callable[..., None]:
    """A `schedules` sub-command with `--broker` and `--collection` of its own, given to it as one Where: its own
    where given, else the group's (`schedules --broker URL run-now NAME`)."""

    @click.option("--broker", metavar="URL", help="As `schedules --broker`, which it overrides.")
    @click.option("--collection", metavar="TEXT", help="As `schedules --collection`, which it overrides.")
    @click.pass_obj
    @functools.wraps(command)
    def with_where(group: Where, broker: str | None, collection: str | None, **kwargs: Any) -> None:
        broker = group.broker if broker is None else broker
        command(Where(broker, group.collection if collection is None else collection), **kwargs)

    return with_where


@click.group(cls=Group, invoke_without_command=True)
@broker_option
@collection_option
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
@click.pass_context
def schedules(ctx: click.Context, broker: str, collection: str, as_json: bool) -> None:
    """The periodic entries (celery beat -S bb_broker.beat:JobScheduler): schedule, next slot, last job."""
    ctx.obj = Where(broker, collection)
    if ctx.invoked_subcommand is not None:
        return
    from bb_broker.beat.overview import describe

    with job_store(broker, collection) as store:
        db = store.coll.database
        rows = [describe(doc, db, jobs_collection=collection) for doc in db.bb_schedules.find({}).sort("_id", 1)]
    _print_entries(rows, as_json=as_json)


@schedules.command(name="run-now")
@click.argument("name")
@where
def run_now(where: Where, name: str) -> None:
    """Send one extra job of the entry now (marked "run now"; no slot is used up)."""
    from celery import Celery

    from bb_broker.beat.entries import EntryError, ScheduleStore
    from bb_broker.beat.scheduler import run_now as send_now
    from bb_broker.clock import ServerClock
    from bb_broker.connection import transport_url

    with job_store(where.broker, where.collection) as store:
        db = store.coll.database
        app = Celery("bb-broker", broker=transport_url(where.broker), set_as_current=False)
        app.conf.broker_transport_options = {"jobs_collection": where.collection}  # where its job goes
        try:
            task_id = send_now(app, ScheduleStore(db, ServerClock.of(db)), name)
        except EntryError as exc:
            fail(f"run-now: {exc}")
        finally:
            app.close()
    click.echo(f"sent {name} now: task id {task_id}")


def _set_enabled(where: Where, name: str, enabled: bool) -> None:
    from bb_broker.beat.entries import EntryError, ScheduleStore
    from bb_broker.clock import ServerClock

    command = "enable" if enabled else "disable"
    with job_store(where.broker, where.collection) as store:
        db = store.coll.database
        try:
            ScheduleStore(db, ServerClock.of(db)).set_enabled(name, enabled, by=operator_name())
        except EntryError as exc:
            fail(f"{command}: {exc}")
    click.echo(f"{command}d {name}")


@schedules.command()
@click.argument("name")
@where
def disable(where: Where, name: str) -> None:
    """Stop sending the entry's slots (every beat, without a restart)."""
    _set_enabled(where, name, False)


@schedules.command()
@click.argument("name")
@where
def enable(where: Where, name: str) -> None:
    """Send the entry's slots again, from now on (the slots it skipped are not caught up)."""
    _set_enabled(where, name, True)


@schedules.command()
@click.argument("name")
@click.argument("task")
@click.option("--every", type=float, help="Seconds between slots.")
@click.option("--crontab", "cron", help='Five crontab fields, e.g. "0 3 * * *" (minute hour dom month dow).')
@click.option("--timezone", default="UTC", show_default=True, help="Where the crontab's fields are read (IANA).")
@click.option("--catch-up", type=click.Choice(["once", "all", "none"]), default="once", show_default=True)
@click.option("--args", "args_json", default="[]", help="The task's args, as a JSON list.")
@click.option("--kwargs", "kwargs_json", default="{}", help="The task's kwargs, as a JSON object.")
@click.option("--queue", help="The queue its jobs go to.")
@click.option("-A", "--app", "app_name", help="A Celery app whose tasks the task name is checked against.")
@where
def add(
    where: Where,
    name: str,
    task: str,
    every: float | None,
    cron: str | None,
    timezone: str,
    catch_up: str,
    args_json: str,
    kwargs_json: str,
    queue: str | None,
    app_name: str | None,
) -> None:
    """Add an entry at run time (every beat picks it up without a restart)."""
    from bb_broker.beat.entries import EntryError, ScheduleStore, entry_fields
    from bb_broker.clock import ServerClock

    schedule = _schedule_of(every, cron)
    args, kwargs = _json_arguments(args_json, kwargs_json)
    how = {
        "timezone": timezone,
        "catch_up": catch_up,
        "args": args,
        "kwargs": kwargs,
        "options": {"queue": queue} if queue else {},
        "known_tasks": tasks_of(app_name) if app_name else None,
    }
    try:
        entry_fields(name, task, schedule, **how)  # checked before the server is asked: a bad argument's exit
    except EntryError as exc:
        fail(f"add: {exc}", 2)
    with job_store(where.broker, where.collection) as store:
        db = store.coll.database
        try:
            ScheduleStore(db, ServerClock.of(db)).add(name, task, schedule, **how)
        except EntryError as exc:  # the name is taken
            fail(f"add: {exc}")
    click.echo(f"added {name}")


@schedules.command()
@click.argument("name")
@where
def remove(where: Where, name: str) -> None:
    """Remove an entry (one from beat_schedule comes back at the next beat's start)."""
    from bb_broker.beat.entries import EntryError, ScheduleStore
    from bb_broker.clock import ServerClock

    with job_store(where.broker, where.collection) as store:
        db = store.coll.database
        try:
            ScheduleStore(db, ServerClock.of(db)).remove(name)
        except EntryError as exc:
            fail(f"remove: {exc}")
    click.echo(f"removed {name}")


def _print_entries(rows: list[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        from bb_broker.ops.present import as_json as as_json_value

        click.echo(json.dumps(as_json_value(rows)))
        return
    if not rows:
        click.echo("no periodic entries")
    for row in rows:
        click.echo("\n".join(_entry_lines(row)))


def _entry_lines(row: dict[str, Any]) -> list[str]:
    """One entry as `bb-broker schedules` prints it: a line, a second when beat skips it, and where its jobs are."""
    state = "enabled" if row["enabled"] else "disabled"
    next_slot = row["nextSlot"].isoformat(timespec="seconds") if row["nextSlot"] else "-"
    last = "-"
    if row["lastTaskId"]:
        marked = " (run now)" if row["lastRunNow"] else ""
        last = f"{row['lastTaskId']} {row['lastStatus']}{marked}"
    lines = [
        f"{row['name']}: {row['task']} {row['schedule']} [{row['timezone']}] {state}, "
        f"catch-up {row['catchUp']}, runs {row['runCount']}, next {next_slot}, last {last}"
    ]
    if row["problem"]:
        lines.append(f"  skipped by beat: {row['problem']}")
    name = shlex.quote(str(row["name"]))
    lines.append(f"  jobs: Flower /jobs?{row['jobsQuery']}; failed ones: bb-broker failed --schedule {name}")
    return lines


def _schedule_of(every: float | None, cron: str | None) -> dict[str, Any]:
    """The entry's schedule from `add`'s options: exactly one of --every and --crontab."""
    if (every is None) == (cron is None):
        fail("add: give one of --every or --crontab", 2)
    return {"every": every} if every is not None else {"crontab": cron}


def _json_arguments(args_json: str, kwargs_json: str) -> tuple[Any, Any]:
    from bb_broker.jobs.payloads import unencodable_text

    try:
        args, kwargs = json.loads(args_json), json.loads(kwargs_json)
    except ValueError as exc:
        fail(f"add: --args and --kwargs are JSON: {exc}", 2)
    except RecursionError:
        fail("add: --args or --kwargs is nested deeper than JSON can be read here", 2)
    # JSON's escapes can write a lone surrogate ("\udce9"): no job could store it.
    for option, value in (("--args", args), ("--kwargs", kwargs)):
        if (found := unencodable_text(value)) is not None:
            fail(f"add: {option}{found[0]} holds a lone surrogate {ascii(found[1])}: not text UTF-8 can encode", 2)
    return args, kwargs
