"""`bb-broker` on the jobs themselves: count them (status, stats), read them (failed, show), act on them (cancel,
retry, run-now, requeue-stale, purge)."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click

from bb_broker.cli.common import (
    DURATION,
    JOB_ID,
    WAIT,
    Command,
    Duration,
    broker_option,
    collection_option,
    fail,
    job_ids_argument,
    job_store,
    operator_name,
    tasks_of,
    warn,
)
from bb_broker.cli.queues import limits_line
from bb_broker.jobs.lifecycle import BREAKDOWNS, FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED, Policy
from bb_broker.options import DEFAULTS

if TYPE_CHECKING:
    from bb_broker.ops.operations import Operations


@click.command(cls=Command)
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

    with job_store(broker, collection) as store:
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
                click.echo(limits_line(name, row))


def _table(first: str, rows: dict[str, dict[str, int]]) -> str:
    from bb_broker.ops.present import cell

    names = [cell(name or "(none)") for name in rows]
    width = max([len(first), *map(len, names)])
    lines = [f"{first:<{width}}  " + "  ".join(f"{status:>9}" for status in STATUSES)]
    for name, counts in zip(names, rows.values(), strict=True):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{counts[status]:>9}" for status in STATUSES))
    return "\n".join(lines)


@click.command(cls=Command)
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
    from bb_broker.ops.present import as_text, cell, to_the_second

    with job_store(broker, collection) as store:
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
            cell(doc.get("_id")),
            cell(doc.get("kind")),
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


@click.command(cls=Command)
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
    from bb_broker.ops.queries import no_job_has

    if tree:
        with job_store(broker, collection) as store:
            canvas = canvas_of(Operations(store), identifier)
        if canvas is None:
            fail(f"show: {no_job_has(identifier)}")
        click.echo(json.dumps(canvas, indent=2) if as_json else "\n".join(tree_lines(canvas)))
        return
    with job_store(broker, collection) as store:
        doc = Operations(store).find(identifier)
    if doc is None:
        fail(f"show: {no_job_has(identifier)}")
    if as_json:
        click.echo(json.dumps(as_json_value(doc), indent=2))
        return
    for label, value in describe_job(doc):
        click.echo(f"{label + ':':<14}{value}" if label else f"  {value}")


@click.command(cls=Command)
@broker_option
@collection_option
@job_ids_argument(required=True)
@click.option(
    "--canvas",
    is_flag=True,
    help="Cancel every queued step of each ID's canvas (its chains, groups, chord bodies); say which were running.",
)
@click.option("--json", "as_json", is_flag=True, help="With --canvas: print each canvas's answer as JSON.")
def cancel(broker: str, collection: str, identifiers: tuple[str, ...], canvas: bool, as_json: bool) -> None:
    """Cancel queued jobs (by job id or Celery task id): each ends failed, no worker runs it, whatever restarts.

    With --canvas, each ID names a canvas by any of its steps: every queued step of it is cancelled; a running step is
    not touched (revoke it to stop it), and the steps it publishes when it finishes are not cancelled (cancel again
    then); finished steps are counted."""
    from bb_broker.ops.operations import Operations

    if as_json and not canvas:
        fail("cancel: --json goes with --canvas", 2)
    with job_store(broker, collection) as store:
        if not canvas:
            _act_on_each(Operations(store), "cancel", identifiers, "cancelled job {id} ({kind})")
            return
        _cancel_canvases(Operations(store), identifiers, as_json)


def _cancel_canvases(operations: Operations, identifiers: tuple[str, ...], as_json: bool) -> None:
    from bb_broker.ops.queries import no_job_has
    from bb_broker.ops.steering import cancel_canvas

    missing, problems = [], []
    for identifier in identifiers:
        answer = cancel_canvas(operations, identifier, by=operator_name())
        if answer is None:
            missing.append(identifier)
            continue
        click.echo(json.dumps(answer.as_json(), indent=2) if as_json else "\n".join(answer.lines()))
        problems += [f"job {step['jobId']} left queued: {step['why']}" for step in answer.refused]
    if missing:
        problems += [no_job_has(identifier) for identifier in missing]
    if problems:
        fail("cancel: " + "; ".join(problems))


def _act_on_each(operations: Operations, action: str, identifiers: tuple[str, ...], done: str) -> None:
    """`action` on each job: `done` (with {id} and {kind}) said for each one done, then one exit 1 naming every
    refusal."""
    from bb_broker.ops.operations import ActionRefused

    problems = []
    for identifier in identifiers:
        try:
            doc = operations.act(action, identifier, by=operator_name())
        except ActionRefused as exc:
            problems.append(str(exc))
        else:
            click.echo(done.format(id=doc["_id"], kind=doc.get("kind")))
    if problems:
        fail(f"{action}: " + "; ".join(problems))


@click.command(cls=Command)
@broker_option
@collection_option
@job_ids_argument(required=False)
# Before the ids were arguments, as every other command takes them, retry took them as --id: still taken.
@click.option("--id", "deprecated_ids", multiple=True, type=JOB_ID, hidden=True)
@click.option("--kind", help="Every failed job of this task name (with IDs: only those of this task name).")
@click.option("--all", "retry_all", is_flag=True, help="Every failed job.")
@click.option(
    "--fresh", is_flag=True, help="Start over: clear each job's checkpoint, which a retry otherwise resumes from."
)
@click.option(
    "--args", "args_json", help="Retry with changed arguments: a NEW job of the one ID, with these args (a JSON list)."
)
@click.option("--kwargs", "kwargs_json", help="Retry with changed arguments: with these kwargs (a JSON object).")
@click.option("--yes", is_flag=True, help="With --args/--kwargs: send the new job without asking.")
@click.option(
    "-A",
    "--app",
    "app_name",
    help="With --args/--kwargs: the Celery app whose task options (unique_on, serial_on, rate_on) make keys anew.",
)
def retry(
    broker: str,
    collection: str,
    identifiers: tuple[str, ...],
    deprecated_ids: tuple[str, ...],
    kind: str | None,
    retry_all: bool,
    fresh: bool,
    args_json: str | None,
    kwargs_json: str | None,
    yes: bool,
    app_name: str | None,
) -> None:
    """Failed jobs back to queued, due now, with their attempts reset to 0: by job id or Celery task id, or every one
    of a kind (--all: every one). Each keeps its checkpoint (bb_broker.checkpoint) to resume from, unless --fresh.
    A step of a canvas continues it when it succeeds: the rest of its chain runs, and a chord it failed completes,
    its body sent once.
    With --args and/or --kwargs, one job (not queued) is sent again as a NEW job with those arguments, shown first and
    sent once confirmed (or --yes); both jobs record the link."""
    if deprecated_ids:
        warn("retry --id is deprecated: give the ids as arguments (bb-broker retry ID...)")
    ids = identifiers + deprecated_ids
    if args_json is not None or kwargs_json is not None:
        if len(ids) != 1 or kind or retry_all:
            fail("retry: --args and --kwargs take exactly one ID (no --kind, no --all)", 2)
        _retry_with_arguments(broker, collection, ids[0], args_json, kwargs_json, yes=yes, app_name=app_name)
        return
    if yes or app_name:
        fail("retry: --yes and --app go with --args or --kwargs", 2)
    if retry_all and (ids or kind):
        fail("retry: --all cannot be combined with IDs or --kind", 2)
    if not (retry_all or ids or kind):
        fail("retry: say which failed jobs: ID... (job ids or task ids), --kind NAME, or --all", 2)
    from bb_broker.ops.operations import Operations

    with job_store(broker, collection) as store:
        operations = Operations(store)
        retried = operations.retry(
            list(dict.fromkeys(ids)) if ids else None, kind=kind, by=operator_name(), fresh=fresh
        )
        missed = {identifier: operations.why_not_retried(identifier, kind) for identifier in retried.unmatched}
        count = retried.count
    click.echo(f"retried {count} failed job{'' if count == 1 else 's'}")
    for reason in retried.held.values():
        click.echo(reason, err=True)
    if retried.held and not missed:
        fail(f"retry: {len(retried.held)} job{'' if len(retried.held) == 1 else 's'} left failed")
    if missed:
        reasons = ", ".join(f"{job_id} ({why})" for job_id, why in missed.items())
        fail(f"retry: {len(missed)} id{'' if len(missed) == 1 else 's'} matched no failed job: {reasons}")


def _retry_with_arguments(
    broker: str,
    collection: str,
    identifier: str,
    args_json: str | None,
    kwargs_json: str | None,
    *,
    yes: bool,
    app_name: str | None,
) -> None:
    """Show the new job's arguments and message, ask, send it (bb_broker.ops.rerun); a refusal in one line, exit 2 for
    bad arguments or an unknown job, 1 for a job that cannot be sent again so."""
    from celery import Celery

    from bb_broker.connection import transport_url
    from bb_broker.ops.operations import Operations
    from bb_broker.ops.present import as_json as as_json_value
    from bb_broker.ops.rerun import RerunRefused, parse_arguments, plan, send

    exits = {"bad input": 2, "not found": 2, "conflict": 1}
    task_of = tasks_of(app_name).get if app_name else (lambda name: None)
    with job_store(broker, collection) as store:
        operations = Operations(store)
        try:
            rerun = plan(operations, identifier, *parse_arguments(args_json, kwargs_json), task_of=task_of)
        except RerunRefused as exc:
            fail(f"retry: {exc}", exits[exc.reason])
        click.echo(json.dumps(as_json_value(rerun.preview()), indent=2))
        if not yes:
            click.confirm(f"send this as a new job replacing job {rerun.job_id}?", abort=True)
        app = Celery("bb-broker", broker=transport_url(broker), set_as_current=False)
        app.conf.broker_transport_options = {"jobs_collection": collection}  # where the new job goes
        try:
            with app.connection_for_write() as connection:
                doc = send(operations, rerun, connection, by=operator_name())
        except RerunRefused as exc:
            fail(f"retry: {exc}", exits[exc.reason])
        finally:
            app.close()
    click.echo(f"sent job {doc['_id']} (task {doc.get('taskId')}), replacing job {rerun.job_id}")


@click.command("run-now", cls=Command)
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
    for option, name in (("--queue", queue), ("--kind", kind)):
        if name is not None and not name.strip():  # the filter would drop it, and take every queue's jobs
            fail(f"run-now: {option} is blank: give the name of a queue or a task", 2)
    selected = bool(queue or kind)
    if identifiers and (selected or every):
        fail("run-now: give job ids, or --queue/--kind, or --all, not both", 2)
    if every and selected:
        fail("run-now: --all cannot be combined with --queue or --kind", 2)
    if not (identifiers or selected or every):
        fail("run-now: say which jobs: ID... (job ids or task ids), --queue NAME, --kind NAME, or --all", 2)
    from bb_broker.ops.filters import FilterError, JobFilter
    from bb_broker.ops.operations import RUN_NOW, Operations

    with job_store(broker, collection) as store:
        operations = Operations(store)
        if not identifiers:
            try:
                job_filter = JobFilter.parse({"status": QUEUED, "queue": queue, "kind": kind}, store.now())
            except FilterError as exc:
                fail(f"run-now: {exc}", 2)
            count = operations.act_on_filter(RUN_NOW, job_filter, by=operator_name())
            click.echo(f"{count} waiting job{'' if count == 1 else 's'} due now")
            return
        _act_on_each(operations, RUN_NOW, identifiers, "job {id} ({kind}) is due now")


@click.command("requeue-stale", cls=Command)
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
        fail(
            f"requeue-stale: --stale-after {stale:g} s is less than two heartbeat intervals of the workers "
            f"(2 x {heartbeat:g} s): jobs whose workers are alive would be re-queued. Use at least "
            f"{2 * heartbeat:g} s, or pass --heartbeat-interval (your workers' stale_after / 5)",
            2,
        )
    with job_store(broker, collection, Policy(max_attempts=max_attempts, stale_after=stale)) as store:
        sweep_log = logging.getLogger("bb_broker.jobs.sweeps")
        level = sweep_log.level
        sweep_log.setLevel(logging.ERROR)  # its "recovered lost jobs" line would repeat what is printed below
        try:
            requeued, failed_count = store.requeue_stale()
        finally:
            sweep_log.setLevel(level)
    click.echo(f"re-queued {requeued}, failed {failed_count}")


@click.command(cls=Command)
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
        fail(f"purge: say which jobs: --status {SUCCEEDED} and/or --status {FAILED}", 2)
    unfinished = sorted({QUEUED, RUNNING} & set(statuses))
    if unfinished and not force:
        fail(f"purge: refusing to delete {' and '.join(unfinished)} jobs (work not done yet) without --force", 2)
    from bb_broker.ops.operations import Operations

    with job_store(broker, collection) as store:
        count = Operations(store).purge(set(statuses), older_than=older_than)
    click.echo(f"purged {count} job{'' if count == 1 else 's'}")


@click.command(cls=Command)
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
    from bb_broker.ops.filters import FilterError, JobFilter
    from bb_broker.ops.operations import Operations
    from bb_broker.ops.stats import job_stats

    with job_store(broker, collection) as store:
        try:
            job_filter = JobFilter.parse({"queue": queue, "kind": kind}, store.now())
            numbers = job_stats(Operations(store), job_filter, window, by)
        except FilterError as exc:
            fail(f"stats: {exc}", 2)
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
