"""One convention over the whole `bb-broker` command tree: every command that talks to the server takes `--broker` and
`--collection`, every command that acts on jobs takes them as its arguments (`ID...`); and the forms that broke it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import click
import pytest
from click.testing import CliRunner
from pymongo.database import Database

from bb_broker.beat import ScheduleStore
from bb_broker.cli import main
from bb_broker.cli.common import JobId
from bb_broker.clock import ServerClock
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore

#: The commands that do not talk to the server through --broker: `serve` is the server; `flower` reads the broker
#: of the Celery app its -A names, as `celery flower` does (docs/guides/operating.md says so).
NOT_THROUGH_BROKER = {("serve",), ("flower",)}
#: Words an option naming a job would have (--id, --ids, --job, --job-id, --task-id).
JOB_WORDS = ("id", "ids", "job", "jobs", "job-id", "task-id", "job-ids", "task-ids")


def commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command under `group` with its path: the groups that run alone too (`schedules` lists the entries)."""
    for name, command in sorted(group.commands.items()):
        if not isinstance(command, click.Group) or command.invoke_without_command:
            yield (*path, name), command
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))


def options_of(command: click.Command) -> set[str]:
    return {name for param in command.params if isinstance(param, click.Option) for name in param.opts}


COMMANDS = list(commands(main))


def test_the_walk_finds_every_command() -> None:
    found = {" ".join(path) for path, _ in commands(main)}
    assert {"status", "retry", "show", "cancel", "run-now", "schedules", "schedules run-now", "schedules add"} <= found
    assert len(found) >= 22, sorted(found)


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(path) for path, _ in COMMANDS])
def test_each_command_that_talks_to_the_server_takes_broker_and_collection(path, command: click.Command) -> None:
    if path in NOT_THROUGH_BROKER:
        assert "--broker" not in options_of(command)
        return
    assert {"--broker", "--collection"} <= options_of(command), f"bb-broker {' '.join(path)}"


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(path) for path, _ in COMMANDS])
def test_each_command_that_takes_jobs_takes_them_as_arguments(path, command: click.Command) -> None:
    for param in command.params:
        named_a_job = isinstance(param, click.Option) and any(
            opt.lstrip("-") in JOB_WORDS for opt in (*param.opts, *param.secondary_opts)
        )
        if named_a_job or isinstance(param.type, JobId):
            if isinstance(param, click.Argument):
                assert param.metavar in ("ID", "ID...", "[ID]...") and isinstance(param.type, JobId), param
                continue
            # The one option left: retry's --id, from before the ids were arguments, kept working and out of --help.
            assert (path, param.opts, param.hidden) == (("retry",), ["--id"], True), (path, param.opts)


@pytest.fixture
def store(db: Database) -> JobStore:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    return store


def failed_job(store: JobStore, task_id: str) -> str:
    job_id = store.publish(queue="celery", kind="app.a", task_id=task_id, payload={"args": []}, priority=0,
                           run_after=datetime(2000, 1, 1, tzinfo=UTC), is_retry=False)  # fmt: skip
    job = store.claim("celery", "worker-1")
    assert job is not None and job.id == job_id and store.fail(job.id, job.attempts, "broke")
    return job_id


def test_retry_takes_the_ids_as_arguments_as_show_cancel_and_run_now_do(store: JobStore, db: Database, broker_url):
    first, second, kept = (failed_job(store, f"task-{n}") for n in range(3))
    result = CliRunner().invoke(main, ["retry", first, "task-1", "--broker", broker_url])
    assert (result.exit_code, result.stdout, result.stderr) == (0, "retried 2 failed jobs\n", "")
    assert [db.jobs.find_one({"_id": job})["status"] for job in (first, second, kept)] == ["queued", "queued", "failed"]
    assert "[ID]..." in CliRunner().invoke(main, ["retry", "--help"]).stdout


def test_retry_still_takes_the_deprecated_id_option_and_says_so(store: JobStore, db: Database, broker_url):
    job = failed_job(store, "task-0")
    result = CliRunner().invoke(main, ["retry", "--id", job, "--broker", broker_url])
    assert (result.exit_code, result.stdout) == (0, "retried 1 failed job\n")
    assert result.stderr == (
        "bb-broker: warning: retry --id is deprecated: give the ids as arguments (bb-broker retry ID...)\n"
    )
    assert db.jobs.find_one({"_id": job})["status"] == "queued"
    both = CliRunner().invoke(main, ["retry", job, "--all", "--broker", broker_url])
    assert (both.exit_code, both.stderr) == (2, "bb-broker: retry: --all cannot be combined with IDs or --kind\n")


def test_schedules_sub_commands_take_broker_after_their_name(db: Database, broker_url: str) -> None:
    ScheduleStore(db, ServerClock(db)).add("nightly", "reports.nightly", {"every": 3600})
    ran = CliRunner().invoke(main, ["schedules", "run-now", "nightly", "--broker", broker_url])
    assert ran.exit_code == 0, ran.output
    task_id = ran.stdout.strip().rpartition(" ")[2]
    assert db.jobs.find_one({"taskId": task_id})["payload"]["headers"]["bb_beat_run_now"] is True
    # The sub-command's own --broker wins over the group's (a server that is not there: it would fail on it).
    elsewhere = "bbmongo://127.0.0.1:1/nowhere?serverSelectionTimeoutMS=200"
    disabled = CliRunner().invoke(
        main, ["schedules", "--broker", elsewhere, "disable", "nightly", "--broker", broker_url]
    )
    assert (disabled.exit_code, disabled.stdout) == (0, "disabled nightly\n")
    assert db.bb_schedules.find_one({"_id": "nightly"})["enabled"] is False
    # --collection sends the run-now job where the workers of that jobs_collection take it.
    ran = CliRunner().invoke(main, ["schedules", "run-now", "nightly", "--broker", broker_url, "--collection", "tasks"])
    assert ran.exit_code == 0, ran.output
    assert db.tasks.count_documents({}) == 1 and db.jobs.count_documents({}) == 1
