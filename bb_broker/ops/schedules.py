"""`bb-broker schedules`: the periodic entries of bb_broker.beat, listed, run now, disabled, enabled."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import click

# pymongo and Celery are imported by the commands that use them: `--help` answers at once.


def schedules_commands(
    broker_option: Callable[[Any], Any],
    jobs: Callable[[str, str], AbstractContextManager[Any]],
    fail: Callable[[str], NoReturn],
    operator: Callable[[], str],
) -> click.Group:
    """The `schedules` group, made with the CLI's own `--broker` option, job store context and error exit."""

    @click.group(invoke_without_command=True)
    @broker_option
    @click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
    @click.pass_context
    def schedules(ctx: click.Context, broker: str, as_json: bool) -> None:
        """The periodic entries (celery beat -S bb_broker.beat:JobScheduler): schedule, next slot, last job."""
        ctx.obj = broker
        if ctx.invoked_subcommand is not None:
            return
        from bb_broker.beat.overview import describe

        with jobs(broker, "jobs") as store:
            db = store.coll.database
            rows = [describe(doc, db) for doc in db.bb_schedules.find({}).sort("_id", 1)]
        if as_json:
            click.echo(json.dumps(rows, default=lambda v: v.isoformat() if hasattr(v, "isoformat") else str(v)))
            return
        if not rows:
            click.echo("no periodic entries")
        for row in rows:
            state = "enabled" if row["enabled"] else "disabled"
            next_slot = row["nextSlot"].isoformat(timespec="seconds") if row["nextSlot"] else "-"
            last = "-"
            if row["lastTaskId"]:
                marked = " (run now)" if row["lastRunNow"] else ""
                last = f"{row['lastTaskId']} {row['lastStatus']}{marked}"
            click.echo(
                f"{row['name']}: {row['task']} {row['schedule']} [{row['timezone']}] {state}, "
                f"catch-up {row['catchUp']}, runs {row['runCount']}, next {next_slot}, last {last}"
            )
            if row["problem"]:
                click.echo(f"  skipped by beat: {row['problem']}")

    @schedules.command(name="run-now")
    @click.argument("name")
    @click.pass_obj
    def run_now(broker: str, name: str) -> None:
        """Send one extra job of the entry now (marked "run now"; no slot is used up)."""
        from celery import Celery

        from bb_broker.beat.entries import EntryError, ScheduleStore
        from bb_broker.beat.scheduler import run_now as send_now
        from bb_broker.clock import ServerClock

        with jobs(broker, "jobs") as store:
            db = store.coll.database
            app = Celery("bb-broker", broker=broker, set_as_current=False)
            try:
                task_id = send_now(app, ScheduleStore(db, ServerClock.of(db)), name)
            except EntryError as exc:
                fail(f"run-now: {exc}")
            finally:
                app.close()
        click.echo(f"sent {name} now: task id {task_id}")

    def _set_enabled(broker: str, name: str, enabled: bool) -> None:
        from bb_broker.beat.entries import EntryError, ScheduleStore
        from bb_broker.clock import ServerClock

        command = "enable" if enabled else "disable"
        with jobs(broker, "jobs") as store:
            db = store.coll.database
            try:
                ScheduleStore(db, ServerClock.of(db)).set_enabled(name, enabled, by=operator())
            except EntryError as exc:
                fail(f"{command}: {exc}")
        click.echo(f"{command}d {name}")

    @schedules.command()
    @click.argument("name")
    @click.pass_obj
    def disable(broker: str, name: str) -> None:
        """Stop sending the entry's slots (every beat, without a restart)."""
        _set_enabled(broker, name, False)

    @schedules.command()
    @click.argument("name")
    @click.pass_obj
    def enable(broker: str, name: str) -> None:
        """Send the entry's slots again, from now on (the slots it skipped are not caught up)."""
        _set_enabled(broker, name, True)

    return schedules
