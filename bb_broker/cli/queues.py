"""`bb-broker` on queues, for every worker: pause, resume, limit."""

from __future__ import annotations

from typing import Any

import click

from bb_broker.cli.common import Command, broker_option, collection_option, fail, job_store, operator_name
from bb_broker.jobs.lifecycle import QUEUED, RUNNING


@click.command(cls=Command)
@broker_option
@collection_option
@click.argument("queue")
def pause(broker: str, collection: str, queue: str) -> None:
    """Pause a queue for every worker, now and later: its jobs stay queued until `resume`."""
    _set_paused(broker, collection, queue, paused=True)


@click.command(cls=Command)
@broker_option
@collection_option
@click.argument("queue")
def resume(broker: str, collection: str, queue: str) -> None:
    """Resume a paused queue: workers claim its jobs again."""
    _set_paused(broker, collection, queue, paused=False)


def _set_paused(broker: str, collection: str, queue: str, *, paused: bool) -> None:
    command = "pause" if paused else "resume"
    if not queue.strip():
        fail(f"{command}: the queue name is empty", 2)
    from bb_broker.ops.filters import FilterError
    from bb_broker.ops.operations import Operations

    with job_store(broker, collection) as store:
        operations = Operations(store)
        try:
            changed = (operations.pause if paused else operations.resume)(queue, by=operator_name())
        except FilterError as exc:  # a name no queue can have
            fail(f"{command}: {exc}", 2)
    if paused:
        click.echo(f"paused queue {queue}" if changed else f"queue {queue} was already paused")
    else:
        click.echo(f"resumed queue {queue}" if changed else f"queue {queue} was not paused")


@click.command(cls=Command)
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
@click.option(
    "--fair/--no-fair",
    default=None,
    help="Rotate the queue's claims across its jobs' fair keys (the jobs' fair_key or fair_on), so that one key's "
    "backlog does not hold back the others; --no-fair claims in plain order again. Not beside a rate per key.",
)
@click.option("--clear", is_flag=True, help="Remove the queue's limits, its fairness with them.")
def limit(
    broker: str,
    collection: str,
    queue: str,
    concurrency: str | None,
    rate: str | None,
    fair: bool | None,
    clear: bool,
) -> None:
    """Limit a queue for every worker, now and later, or with no option show its limits and what they count."""
    from bb_broker.jobs.queues import LimitError
    from bb_broker.ops.filters import FilterError
    from bb_broker.ops.operations import Operations

    if not queue.strip():
        fail("limit: the queue name is empty", 2)
    if clear and (concurrency is not None or rate is not None or fair is not None):
        fail("limit: --clear removes every limit: give it alone", 2)
    with job_store(broker, collection) as store:
        operations = Operations(store)
        try:
            if clear or concurrency is not None or rate is not None or fair is not None:
                operations.set_limits(
                    queue, concurrency=concurrency, rate=rate, fair=fair, clear=clear, by=operator_name()
                )
            row = operations.queues([queue.strip()])[queue.strip()]
        except (LimitError, FilterError) as exc:  # nothing was changed
            fail(f"limit: {exc}", 2)
    click.echo(limits_line(queue.strip(), row))


def limits_line(queue: str, row: dict[str, Any]) -> str:
    counts = f"({row[RUNNING]} running, {row[QUEUED]} queued)"
    limits = []
    if row.get("concurrency") is not None:
        limits.append(f"at most {row['concurrency']} running at once")
    if row.get("rate") is not None:
        limits.append(f"at most {row['rate']} started")
    if row.get("fair"):
        limits.append("fair per key")
    return f"queue {queue}: {', '.join(limits) or 'no limit'} {counts}"
