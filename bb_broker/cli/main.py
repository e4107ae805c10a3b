"""The `bb-broker` command: its group, and each command of the modules beside it registered on it."""

from __future__ import annotations

import click

from bb_broker import DISTRIBUTION
from bb_broker.cli import flower, jobs, queues, schedules, serve
from bb_broker.cli.common import Group


@click.group(name="bb-broker", cls=Group)  # its name as a `celery` subcommand too (pyproject.toml's celery.commands)
@click.version_option(package_name=DISTRIBUTION, prog_name="bb-broker", message="%(prog)s %(version)s")
def main() -> None:
    """Operate bb_broker, the Celery broker that keeps every task as a MongoDB `jobs` document."""


for command in (
    serve.serve,
    serve.doctor,
    serve.serve_metrics,
    jobs.status,
    jobs.failed,
    jobs.show,
    jobs.cancel,
    jobs.retry,
    jobs.run_now,
    jobs.requeue_stale,
    jobs.purge,
    jobs.stats,
    queues.pause,
    queues.resume,
    queues.limit,
    flower.flower_command,
    schedules.schedules,
):
    main.add_command(command)
