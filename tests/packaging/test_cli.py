"""The `bb-broker` ops commands against a real server: status, failed, retry, requeue-stale, purge, bad URLs."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from bson import Binary, Code, Decimal128, Int64, MaxKey, MinKey, ObjectId, Regex, Timestamp
from bson.dbref import DBRef
from click.testing import CliRunner, Result
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from bb_broker import statuses
from bb_broker.cli import main
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.servers import free_port
from tests.support.workers import ROOT, Worker, wait_for


@pytest.fixture
def store(db: Database) -> JobStore:
    store = JobStore(db, Policy(max_attempts=1))  # one attempt: a failure is final at once
    store.ensure_indexes()
    return store


def add_job(store: JobStore, kind: str = "app.add", *, queue: str = "celery", outcome: str = "queued") -> str:
    """A job left queued, running, succeeded or failed (with lastError "<kind> broke")."""
    # A job to be claimed at once is due long ago, so the claim takes it before any queued one.
    due = None if outcome == "queued" else datetime(2000, 1, 1, tzinfo=UTC)
    job_id = store.publish(queue=queue, kind=kind, task_id=f"task-{kind}-{outcome}", payload={"args": []},
                           priority=0, run_after=due, is_retry=False)  # fmt: skip
    if outcome == "queued":
        return job_id
    job = store.claim(queue, "worker-1")
    assert job is not None and job.id == job_id
    if outcome == "succeeded":
        store.succeed(job.id, job.attempts)
    elif outcome == "failed":
        store.fail(job.id, job.attempts, f"{kind} broke\nTraceback line")
    return job_id


def age(db: Database, job_id: str, seconds: float) -> None:
    """Pretend the job's last change (for a finished job: when it finished) was `seconds` ago."""
    then = datetime.now(UTC) - timedelta(seconds=seconds)
    db.jobs.update_one({"_id": job_id}, {"$set": {"updatedAt": then}})


def bb(broker_url: str, *args: str) -> Result:
    result = CliRunner().invoke(main, [*args, "--broker", broker_url])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_status_totals_and_breakdowns(store: JobStore, db: Database, broker_url: str) -> None:
    add_job(store, "app.add")
    add_job(store, "app.add", outcome="succeeded")
    add_job(store, "app.mail", queue="mail", outcome="failed")

    as_json = bb(broker_url, "status", "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == statuses(db)
    assert json.loads(as_json.stdout) == {"queued": 1, "running": 0, "succeeded": 1, "failed": 1}

    by_queue = json.loads(bb(broker_url, "status", "--by", "queue", "--json").stdout)
    assert by_queue == {
        "celery": {"queued": 1, "running": 0, "succeeded": 1, "failed": 0},
        "mail": {"queued": 0, "running": 0, "succeeded": 0, "failed": 1},
    }
    by_kind = json.loads(bb(broker_url, "status", "--by", "kind", "--json").stdout)
    assert by_kind["app.add"]["succeeded"] == 1 and by_kind["app.mail"]["failed"] == 1

    text = bb(broker_url, "status").stdout.splitlines()
    assert text[:4] == ["queued     1", "running    0", "succeeded  1", "failed     1"]
    assert text[5].split() == ["queue", "queued", "running", "succeeded", "failed"]
    assert text[6].split() == ["celery", "1", "0", "1", "0"] and text[7].split() == ["mail", "0", "0", "0", "1"]
    assert ["app.mail", "0", "0", "0", "1"] in [line.split() for line in text[9:]]


def test_failed_lists_newest_first_with_filters(store: JobStore, db: Database, broker_url: str) -> None:
    old = add_job(store, "app.old", outcome="failed")
    recent = add_job(store, "app.recent", outcome="failed")
    add_job(store, "app.fine", outcome="succeeded")
    age(db, old, 3 * 86400)
    age(db, recent, 60)

    jobs = json.loads(bb(broker_url, "failed", "--json").stdout)
    assert [j["id"] for j in jobs] == [recent, old]
    assert jobs[0]["kind"] == "app.recent" and jobs[0]["attempts"] == 1 and jobs[0]["queue"] == "celery"
    assert jobs[0]["lastError"] == "app.recent broke\nTraceback line"
    assert datetime.fromisoformat(jobs[1]["failedAt"]) < datetime.now(UTC) - timedelta(days=2)

    def ids(*args: str) -> list[str]:
        return [j["id"] for j in json.loads(bb(broker_url, "failed", "--json", *args).stdout)]

    assert ids("--kind", "app.old") == [old]
    assert ids("--older-than", "2d") == [old]
    assert ids("--newer-than", "1h") == [recent]
    assert ids("--older-than", "30m", "--newer-than", "1w") == [old]
    assert ids("--limit", "1") == [recent]
    assert ids("--kind", "app.fine") == []

    text = bb(broker_url, "failed").stdout.splitlines()
    assert text[0].split()[:3] == ["ID", "KIND", "ATTEMPTS"]
    assert text[1].startswith(recent) and text[1].endswith("app.recent broke Traceback line")
    assert bb(broker_url, "failed", "--kind", "nothing").stdout == "no failed jobs\n"
    bad = bb(broker_url, "failed", "--older-than", "soon")
    assert bad.exit_code == 2 and "is not a duration" in bad.stderr


def test_retry_by_id_kind_or_all_resets_attempts(store: JobStore, db: Database, broker_url: str) -> None:
    a1 = add_job(store, "app.a", outcome="failed")
    b1 = add_job(store, "app.b", outcome="failed")
    c1 = add_job(store, "app.c", outcome="failed")
    done = add_job(store, "app.d", outcome="succeeded")

    refused = bb(broker_url, "retry")
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1 and "--all" in refused.stderr
    assert bb(broker_url, "retry", "--all", "--kind", "app.a").exit_code == 2
    assert statuses(db)["failed"] == 3

    result = bb(broker_url, "retry", a1)
    assert result.exit_code == 0 and result.stdout == "retried 1 failed job\n" and result.stderr == ""
    doc = db.jobs.find_one({"_id": a1})
    assert doc["status"] == "queued" and doc["attempts"] == 0 and "finishedAt" not in doc
    assert doc["runAfter"] <= datetime.now(UTC) + timedelta(seconds=1)
    assert doc["lastError"].startswith("app.a broke")  # why it needed the retry, until the next attempt
    assert db.jobs.find_one({"_id": done})["status"] == "succeeded"

    assert bb(broker_url, "retry", "--kind", "app.b").stdout == "retried 1 failed job\n"
    assert db.jobs.find_one({"_id": b1})["status"] == "queued"
    assert bb(broker_url, "retry", "--all").stdout == "retried 1 failed job\n"
    assert db.jobs.find_one({"_id": c1})["status"] == "queued"
    assert bb(broker_url, "retry", "--all").stdout == "retried 0 failed jobs\n"

    # A retried job is an ordinary queued job: a worker claims it with a fresh first attempt.
    claimed = {store.claim("celery", "w").id for _ in range(3)}
    assert claimed == {a1, b1, c1}
    assert {d["attempts"] for d in db.jobs.find({"_id": {"$in": [a1, b1, c1]}})} == {1}


def test_retry_by_id_names_the_ids_that_matched_no_failed_job(store: JobStore, db: Database, broker_url: str) -> None:
    broken = add_job(store, "app.a", outcome="failed")
    other_kind = add_job(store, "app.b", outcome="failed")
    done = add_job(store, "app.d", outcome="succeeded")

    result = bb(broker_url, "retry", broken, done, "no-such-id")
    assert result.exit_code == 1 and result.stdout == "retried 1 failed job\n"
    assert result.stderr == (
        f"bb-broker: retry: 2 ids matched no failed job: {done} (it is succeeded, not failed), "
        "no-such-id (no such job)\n"
    )
    assert db.jobs.find_one({"_id": broken})["status"] == "queued"

    result = bb(broker_url, "retry", other_kind, "--kind", "app.a")
    assert result.exit_code == 1 and result.stdout == "retried 0 failed jobs\n"
    assert (
        result.stderr == f"bb-broker: retry: 1 id matched no failed job: {other_kind} (its kind is app.b, not app.a)\n"
    )
    assert db.jobs.find_one({"_id": other_kind})["status"] == "failed"


def test_a_collection_that_does_not_exist_is_warned_about(store: JobStore, broker_url: str) -> None:
    add_job(store, "app.a", outcome="failed")
    assert bb(broker_url, "status").stderr == ""
    # (retry last: the stand-in server creates a collection on an update that matches nothing)
    for command in (["status"], ["failed"], ["purge", "--status", "failed"], ["retry", "--all"]):
        result = bb(broker_url, *command, "--collection", "jbos")
        assert result.exit_code == 0, result
        assert result.stderr == (
            f"bb-broker: warning: database {store.coll.database.name} has no collection 'jbos': no job was ever "
            "published there (check the database in --broker and --collection)\n"
        )
    assert statuses(store.coll.database)["failed"] == 1


def test_requeue_stale_on_demand(db: Database, broker_url: str) -> None:
    store = JobStore(db, Policy(max_attempts=2))
    store.ensure_indexes()
    lost = add_job(store, "app.lost", outcome="running")
    exhausted = add_job(store, "app.exhausted", outcome="running")
    live = add_job(store, "app.live", outcome="running")
    db.jobs.update_one({"_id": exhausted}, {"$set": {"attempts": 2}})
    age(db, lost, 600)
    age(db, exhausted, 600)

    # In a process of its own, as an operator runs it: the sweep's log line must not repeat the result on stderr.
    result = run_cli("requeue-stale", "--stale-after", "300", "--max-attempts", "2", "--broker", broker_url)
    assert result.returncode == 0 and result.stdout == "re-queued 1, failed 1\n" and result.stderr == ""
    docs = {d["_id"]: d for d in db.jobs.find()}
    assert docs[lost]["status"] == "queued" and "no heartbeat for 300 s" in docs[lost]["lastError"]
    assert docs[exhausted]["status"] == "failed" and "no attempt is left" in docs[exhausted]["lastError"]
    assert docs[live]["status"] == "running"
    assert bb(broker_url, "requeue-stale").stdout == "re-queued 0, failed 0\n"


def test_requeue_stale_refuses_a_stale_after_a_live_worker_would_miss(db: Database, broker_url: str) -> None:
    store = JobStore(db, Policy(max_attempts=2))
    store.ensure_indexes()
    live = add_job(store, "app.live", outcome="running")
    age(db, live, 45)  # a worker at the default stale_after (300 s) heartbeats every 60 s: this job is alive

    refused = bb(broker_url, "requeue-stale", "--stale-after", "30")
    assert refused.exit_code == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1
    assert "--stale-after 30 s is less than two heartbeat intervals of the workers (2 x 60 s)" in refused.stderr
    assert db.jobs.find_one({"_id": live})["status"] == "running"

    # Workers configured with stale_after 10 heartbeat every 2 s: then 30 s without one means lost.
    result = bb(broker_url, "requeue-stale", "--stale-after", "30", "--heartbeat-interval", "2")
    assert result.exit_code == 0 and result.stdout == "re-queued 1, failed 0\n"
    assert db.jobs.find_one({"_id": live})["status"] == "queued"


def test_purge_by_status_and_age_refuses_unfinished_work(store: JobStore, db: Database, broker_url: str) -> None:
    old_ok = add_job(store, "app.old-ok", outcome="succeeded")
    new_ok = add_job(store, "app.new-ok", outcome="succeeded")
    old_bad = add_job(store, "app.old-bad", outcome="failed")
    queued = add_job(store, "app.waiting")
    age(db, old_ok, 2 * 86400)
    age(db, old_bad, 2 * 86400)
    age(db, queued, 2 * 86400)

    assert bb(broker_url, "purge").exit_code == 2
    refused = bb(broker_url, "purge", "--status", "succeeded", "--status", "queued")
    assert refused.exit_code == 2 and "without --force" in refused.stderr and refused.stderr.count("\n") == 1
    assert db.jobs.count_documents({}) == 4

    result = bb(broker_url, "purge", "--status", "succeeded", "--older-than", "1d")
    assert result.exit_code == 0 and result.stdout == "purged 1 job\n"
    assert db.jobs.find_one({"_id": old_ok}) is None and db.jobs.find_one({"_id": new_ok}) is not None

    assert bb(broker_url, "purge", "--status", "failed", "--status", "succeeded").stdout == "purged 2 jobs\n"
    assert [d["_id"] for d in db.jobs.find()] == [queued]
    assert bb(broker_url, "purge", "--status", "queued", "--older-than", "1d", "--force").stdout == "purged 1 job\n"
    assert db.jobs.count_documents({}) == 0


#: Numbers click or float() take that are no length of time or count a command can use.
NOT_A_NUMBER_OF_SECONDS = ["nan", "inf", "-inf", "-1", "1e308", "1e400", "99999999999999999999", "0x10", ""]
NUMERIC_OPTIONS = [
    (["requeue-stale", "--stale-after"], [*NOT_A_NUMBER_OF_SECONDS, "0", "1e9d", "36501d"]),
    (["requeue-stale", "--heartbeat-interval"], [*NOT_A_NUMBER_OF_SECONDS, "0", "1e9d", "36501d"]),
    (["requeue-stale", "--max-attempts"], ["nan", "inf", "-1", "0", "1.5", "99999999999999999999", ""]),
    (["failed", "--older-than"], [*NOT_A_NUMBER_OF_SECONDS, "999999999999999999d"]),
    (["failed", "--newer-than"], [*NOT_A_NUMBER_OF_SECONDS, "999999999999999999d"]),
    (["failed", "--limit"], ["nan", "inf", "-1", "99999999999999999999", "1e3"]),
    (["purge", "--status", "failed", "--older-than"], [*NOT_A_NUMBER_OF_SECONDS, "999999999999999999d"]),
    (["serve-metrics", "--port"], ["nan", "inf", "-1", "65536", "99999999999999999999"]),
    (["serve", "--port"], ["nan", "inf", "0", "-1", "65536", "99999999999999999999"]),
]


@pytest.mark.parametrize(
    ("option", "value"),
    [(option, value) for option, values in NUMERIC_OPTIONS for value in values],
    ids=lambda item: item if isinstance(item, str) else " ".join(item),
)
def test_a_number_no_command_can_use_is_refused_in_one_line(db: Database, broker_url: str, option, value) -> None:
    store = JobStore(db, Policy(max_attempts=2))
    store.ensure_indexes()
    lost = add_job(store, "app.lost", outcome="running")
    age(db, lost, 10 * 86400)
    args = [*option, value] if option[0] == "serve" else [*option, value, "--broker", broker_url]
    result = CliRunner().invoke(main, args)  # a traceback would be result.exception, not SystemExit
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, (result.output, result.exception)
    said = [line for line in result.stderr.splitlines() if line.startswith(("Error", "bb-broker:"))]
    assert len(said) == 1 and option[-1] in said[0], result.stderr
    assert result.stdout == ""
    assert db.jobs.find_one({"_id": lost})["status"] == "running"  # nothing was done


def test_a_stale_after_may_be_written_as_a_duration(db: Database, broker_url: str) -> None:
    store = JobStore(db, Policy(max_attempts=2))
    store.ensure_indexes()
    lost = add_job(store, "app.lost", outcome="running")
    age(db, lost, 600)
    result = bb(broker_url, "requeue-stale", "--stale-after", "5m", "--heartbeat-interval", "1m")
    assert result.exit_code == 0 and result.stdout == "re-queued 1, failed 0\n"


COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["failed"],
    ["retry", "--all"],
    ["show", "some-id"],
    ["cancel", "some-id"],
    ["pause", "celery"],
    ["resume", "celery"],
    ["limit", "celery", "--concurrency", "2"],
    ["requeue-stale"],
    ["purge", "--status", "succeeded"],
    ["serve-metrics", "--port", "0"],
]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bb_broker.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_unreachable_server_one_line_no_password(command: list[str]) -> None:
    closed = free_port()
    url = f"bbmongo://admin:hunter2secret@127.0.0.1:{closed}/jobsdb?serverSelectionTimeoutMS=300&authSource=admin"
    result = run_cli(*command, "--broker", url)
    assert result.returncode == 1, result
    assert result.stdout == ""
    # The URL as written (scheme included), masked; the cause in words; nothing of pymongo's topology dump.
    assert result.stderr == (
        f"bb-broker: cannot reach the server at bbmongo://admin:**@127.0.0.1:{closed}/jobsdb"
        f"?serverSelectionTimeoutMS=300&authSource=admin: nothing listens at 127.0.0.1:{closed} "
        "(connection refused): is the server running? (gave up after 0.3 s)\n"
    )


def test_a_host_that_does_not_resolve_is_said_in_words() -> None:
    result = run_cli("status", "--broker", "bbmongo://no-such-host.invalid:27017/db?serverSelectionTimeoutMS=300")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        "bb-broker: cannot reach the server at bbmongo://no-such-host.invalid:27017/db?serverSelectionTimeoutMS=300: "
        "the host name no-such-host.invalid does not resolve (gave up after 0.3 s)\n"
    )


def test_help_imports_neither_celery_nor_kombu_nor_pymongo() -> None:
    # `bb-broker --help` and a subcommand's --help answer without the heavy imports (the bench times them).
    probe = (
        "import json, sys\n"
        "from bb_broker.cli import main\n"
        "for args in (['--help'], ['status', '--help'], ['flower', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = {'celery', 'kombu', 'flower', 'pymongo', 'prometheus_client'}\n"
        "print(json.dumps(sorted(name for name in sys.modules if name.split('.')[0] in heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage: " in result.stdout
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_importing_bb_broker_still_registers_the_transport_and_the_celery_hooks() -> None:
    # Either import order: bb_broker before Celery and Kombu, or after them.
    check = (
        "from celery import signals\n"
        "from kombu.transport import TRANSPORT_ALIASES\n"
        "assert TRANSPORT_ALIASES['bbmongo'] == TRANSPORT_ALIASES['bbmongo+srv']\n"
        "assert TRANSPORT_ALIASES['bbmongo'] == 'bb_broker.transport:Transport'\n"
        "from bb_broker.worker import receivers\n"
        "assert any(r[1]() is receivers._on_success for r in signals.task_success.receivers)\n"
        "assert any(r[1]() is receivers._on_failure for r in signals.task_failure.receivers)\n"
        "print('registered')\n"
    )
    for first, then in (
        ("import bb_broker", "import celery, kombu"),
        ("from celery import Celery", "import bb_broker"),
    ):
        result = subprocess.run([sys.executable, "-c", f"{first}\n{then}\n{check}"], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)  # fmt: skip
        assert result.stdout == "registered\n", (first, result.stderr)


@pytest.mark.parametrize(
    "url",
    [
        "bbmongo://admin:hunter2secret@localhost:27017",  # no database
        "redis://admin:hunter2secret@localhost:6379/0",
        "bbmongo://admin:hunter2secret@localhost:notaport/db",
    ],
)
def test_a_wrong_url_is_one_line_without_the_password(url: str) -> None:
    result = run_cli("failed", "--broker", url)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("bb-broker: broker URL")
    assert "hunter2secret" not in result.stderr and "admin:**@" in result.stderr


@pytest.mark.parametrize("command", ["failed", "doctor"])
@pytest.mark.parametrize("database", ["a%5Cb", "a%00b"])
def test_a_database_name_mongodb_refuses_is_one_line_about_the_url(command: str, database: str) -> None:
    # It was reported as a --collection error, and `doctor` answered a traceback.
    result = run_cli(command, "--broker", f"bbmongo://admin:hunter2secret@localhost:27017/{database}")
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert result.stderr.count("\n") == 1 and "a database name cannot contain" in result.stderr
    assert "hunter2secret" not in result.stderr and "--collection" not in result.stderr


class CommandLog(monitoring.CommandListener):
    def __init__(self) -> None:
        self.commands: list[dict] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in ("find", "update", "delete", "aggregate"):
            self.commands.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_operations_read_through_an_index(mongo_url: str, db: Database) -> None:
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        store = JobStore(client[db.name], Policy(max_attempts=1))
        store.ensure_indexes()
        for i in range(4):
            add_job(store, f"app.k{i}", outcome="failed")
        log.commands.clear()
        operations = Operations(store)
        operations.failed_jobs(kind="app.k1", older_than=timedelta(0), limit=10)
        operations.retry(kind="app.k2")
        operations.retry(["nope"])
        operations.purge({"failed"}, older_than=timedelta(0))
        operations.breakdown("queue")
    assert [next(iter(c)) for c in log.commands] == ["find", "find", "update", "find", "find", "delete", "aggregate"]
    listing = {k: log.commands[0][k] for k in ("find", "filter", "sort", "hint")}
    plan = str(db.command("explain", listing))
    # Newest first is the status index read backwards. (The stand-in's explain of a sorted find reports a
    # SORT stage even for the claim query's exact shape, so the scan's direction is what is checked here.)
    assert "'indexName': 'bb_status_updated'" in plan and "'direction': 'backward'" in plan, plan
    assert "COLLSCAN" not in plan, plan
    for command in log.commands[1:6]:  # each read, and each write's own selection as a find with its filter and hint
        spec = command if "find" in command else (command.get("updates") or command.get("deletes"))[0]
        query = {"find": "jobs", "filter": spec.get("filter", spec.get("q"))}
        plan = str(db.command("explain", {**query, **({"hint": spec["hint"]} if spec.get("hint") else {})}))
        assert "IXSCAN" in plan and "COLLSCAN" not in plan, plan
        assert "'stage': 'SORT'" not in plan, plan


def test_operations_work_before_any_worker_created_the_indexes(db: Database, broker_url: str) -> None:
    now = datetime.now(UTC)
    db.jobs.insert_many(
        [
            {"_id": "a", "kind": "k", "queue": "q", "status": "failed", "attempts": 3, "updatedAt": now},
            {"_id": "b", "kind": "k", "queue": "q", "status": "succeeded", "attempts": 1, "updatedAt": now},
        ]
    )
    assert bb(broker_url, "status").exit_code == 0
    assert [j["id"] for j in json.loads(bb(broker_url, "failed", "--json", "--kind", "k").stdout)] == ["a"]
    assert bb(broker_url, "retry", "a").stdout == "retried 1 failed job\n"
    assert bb(broker_url, "purge", "--status", "succeeded").stdout == "purged 1 job\n"
    assert db.jobs.index_information().keys() == {"_id_"}  # reading and operating create nothing


def test_celerys_own_commands_work_against_bbmongo(db: Database, broker_url: str, worker_factory, tmp_path) -> None:
    env = Worker(broker_url, log_dir=tmp_path, name="env-only").env

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "celery", "-A", "tests.support.e2e_app", *args]
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    waiting = celery("call", "tests.support.e2e_app.add", "--args", "[1, 1]")
    assert waiting.returncode == 0, waiting.stderr
    assert db.jobs.find_one({"taskId": waiting.stdout.strip()})["status"] == "queued"
    purged = celery("purge", "-f")
    assert purged.returncode == 0 and "Purged 1 message" in purged.stdout, purged
    assert db.jobs.count_documents({}) == 0

    worker_factory()
    task_id = celery("call", "tests.support.e2e_app.add", "--args", "[2, 3]").stdout.strip()
    wait_for(lambda: (db.jobs.find_one({"taskId": task_id}) or {}).get("status") == "succeeded", 60, "call ran")
    pong = celery("inspect", "ping", "--timeout", "10")
    assert pong.returncode == 0 and "pong" in pong.stdout, pong
    limited = celery("control", "rate_limit", "tests.support.e2e_app.add", "10/m", "--timeout", "10")
    assert limited.returncode == 0 and "new rate limit set" in limited.stdout, limited


def test_show_a_job_by_job_id_or_task_id(store: JobStore, db: Database, broker_url: str) -> None:
    job_id = add_job(store, "app.show", outcome="failed")
    task_id = db.jobs.find_one({"_id": job_id})["taskId"]
    for identifier in (job_id, task_id):
        result = bb(broker_url, "show", identifier)
        assert result.exit_code == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == f"id:           {job_id}" and f"taskId:       {task_id}" in lines
        assert "status:       failed" in lines and "lastError:    app.show broke" in lines
    whole = json.loads(bb(broker_url, "show", task_id, "--json").stdout)
    assert whole["_id"] == job_id and whole["payload"] == {"args": []}
    missing = bb(broker_url, "show", "nope")
    assert missing.exit_code == 1 and missing.stderr == "bb-broker: show: no job has the id or task id 'nope'\n"


def test_cancel_queued_jobs_and_refuse_the_rest(store: JobStore, db: Database, broker_url: str) -> None:
    waiting = add_job(store, "app.wait")
    done = add_job(store, "app.done", outcome="succeeded")
    result = bb(broker_url, "cancel", waiting, done, "nope")
    assert result.exit_code == 1 and result.stdout == f"cancelled job {waiting} (app.wait)\n"
    assert result.stderr == (
        f"bb-broker: cancel: job {done} is succeeded: cancel needs it queued; no job has the id or task id 'nope'\n"
    )
    doc = db.jobs.find_one({"_id": waiting})
    assert (
        doc["status"] == "failed" and doc["lastError"].startswith("cancelled by ") and "(bb-broker)" in doc["lastError"]
    )
    assert doc["actions"][0]["action"] == "cancel"
    assert store.claim("celery", "w") is None  # no worker takes a cancelled job


def test_pause_resume_and_status_shows_paused_queues(store: JobStore, db: Database, broker_url: str) -> None:
    add_job(store, "app.mail", queue="mail")
    assert bb(broker_url, "pause", "mail").stdout == "paused queue mail\n"
    assert bb(broker_url, "pause", "mail").stdout == "queue mail was already paused\n"
    assert db.bb_queues.find_one({"_id": "mail"})["paused"] is True
    status = bb(broker_url, "status").stdout
    assert "paused queue mail (by " in status and "its jobs wait" in status
    assert bb(broker_url, "resume", "mail").stdout == "resumed queue mail\n"
    assert bb(broker_url, "resume", "mail").stdout == "queue mail was not paused\n"
    assert "paused queue" not in bb(broker_url, "status").stdout
    assert bb(broker_url, "pause", " ").exit_code == 2
    too_long = bb(broker_url, "pause", "q" * 201)
    assert too_long.exit_code == 2 and too_long.stderr == "bb-broker: pause: a queue name must be 1 to 200 characters\n"
    assert db.bb_queues.find_one({"_id": "q" * 201}) is None


def test_limit_sets_shows_changes_and_clears_a_concurrency_limit(
    store: JobStore, db: Database, broker_url: str
) -> None:
    add_job(store, "app.mail", queue="mail")
    add_job(store, "app.mail", queue="mail", outcome="running")
    assert bb(broker_url, "limit", "mail").stdout == "queue mail: no limit (1 running, 1 queued)\n"
    result = bb(broker_url, "limit", "mail", "--concurrency", "2")
    assert result.exit_code == 0 and result.stdout == "queue mail: at most 2 running at once (1 running, 1 queued)\n"
    control = db.bb_queues.find_one({"_id": "mail"})
    assert control["concurrency"] == 2 and control["limitedBy"].endswith("(bb-broker)")
    assert "queue mail: at most 2 running at once" in bb(broker_url, "status").stdout
    assert bb(broker_url, "limit", "mail", "--concurrency", "5").stdout.startswith("queue mail: at most 5 running")
    assert bb(broker_url, "limit", "mail", "--clear").stdout == "queue mail: no limit (1 running, 1 queued)\n"
    assert "concurrency" not in db.bb_queues.find_one({"_id": "mail"})
    assert "at most" not in bb(broker_url, "status").stdout


def test_limit_sets_and_removes_a_rate_beside_the_concurrency_limit(
    store: JobStore, db: Database, broker_url: str
) -> None:
    add_job(store, "app.mail", queue="mail")
    result = bb(broker_url, "limit", "mail", "--rate", "10/m")
    assert result.exit_code == 0 and result.stdout == "queue mail: at most 10/m started (0 running, 1 queued)\n"
    assert db.bb_queues.find_one({"_id": "mail"})["rateStarts"] == 10
    both = bb(broker_url, "limit", "mail", "--concurrency", "2").stdout
    assert both == "queue mail: at most 2 running at once, at most 10/m started (0 running, 1 queued)\n"
    per_key = bb(broker_url, "limit", "mail", "--rate", "3/s per key").stdout
    assert per_key == "queue mail: at most 2 running at once, at most 3/s per key started (0 running, 1 queued)\n"
    assert db.bb_queues.find_one({"_id": "mail"})["ratePerKey"] is True
    assert bb(broker_url, "limit", "mail", "--rate", "none").stdout.startswith(
        "queue mail: at most 2 running at once ("
    )
    assert {"rateStarts", "ratePerKey"}.isdisjoint(db.bb_queues.find_one({"_id": "mail"}))


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("10/week", "a rate's period is s, m, h or d (10/m: ten starts a minute), not 'week' in '10/week'"),
        ("0/s", "a rate is N/s, N/m, N/h or N/d with N a whole number from 1 to 1000000, not '0/s'"),
        ("ten/s", "a rate is N/s, N/m, N/h or N/d with N a whole number from 1 to 1000000, not 'ten/s'"),
        ("10/s per queue", "what follows a rate is 'per key' (10/m per key) or nothing, not 'per queue'"),
    ],
)
def test_limit_refuses_a_rate_that_cannot_be_and_changes_nothing(
    store: JobStore, db: Database, broker_url: str, value: str, error: str
) -> None:
    assert bb(broker_url, "limit", "mail", "--rate", "5/s").exit_code == 0
    before = db.bb_queues.find_one({"_id": "mail"})
    result = bb(broker_url, "limit", "mail", "--rate", value, "--concurrency", "3")
    assert result.exit_code == 2 and result.stderr == f"bb-broker: limit: {error}\n"
    assert db.bb_queues.find_one({"_id": "mail"}) == before  # not even the good half of the change


def test_show_says_which_limit_a_job_was_claimed_under(store: JobStore, db: Database, broker_url: str) -> None:
    from bb_broker.jobs.queues import QueueLimits

    add_job(store, "app.mail", queue="mail")
    job = store.claim("mail", "w", QueueLimits(concurrency=2))
    shown = bb(broker_url, "show", job.id).stdout
    assert "limits:       claimed under its queue's concurrency limit 2, slot " in shown
    assert "claimLimits" not in shown


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "two", "", "10001"])
def test_limit_refuses_a_limit_that_cannot_be_and_changes_nothing(
    store: JobStore, db: Database, broker_url: str, value: str
) -> None:
    assert bb(broker_url, "limit", "mail", "--concurrency", "3").exit_code == 0
    before = db.bb_queues.find_one({"_id": "mail"})
    result = bb(broker_url, "limit", "mail", "--concurrency", value)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        f"bb-broker: limit: a concurrency limit is a whole number from 1 to 10000, not {value!r}\n"
    )
    assert db.bb_queues.find_one({"_id": "mail"}) == before


def test_limit_refuses_clear_with_a_limit_and_a_name_no_queue_has(
    store: JobStore, db: Database, broker_url: str
) -> None:
    both = bb(broker_url, "limit", "mail", "--concurrency", "3", "--clear")
    assert both.exit_code == 2 and "--clear removes every limit: give it alone" in both.stderr
    assert bb(broker_url, "limit", " ", "--concurrency", "3").exit_code == 2
    too_long = bb(broker_url, "limit", "q" * 201, "--concurrency", "3")
    assert too_long.exit_code == 2 and too_long.stderr == "bb-broker: limit: a queue name must be 1 to 200 characters\n"
    assert db.bb_queues.count_documents({}) == 0


def test_retry_accepts_celery_task_ids(store: JobStore, db: Database, broker_url: str) -> None:
    job_id = add_job(store, "app.again", outcome="failed")
    task_id = db.jobs.find_one({"_id": job_id})["taskId"]
    result = bb(broker_url, "retry", task_id)
    assert result.exit_code == 0 and result.stdout == "retried 1 failed job\n"
    assert db.jobs.find_one({"_id": job_id})["status"] == "queued"


def test_ages_and_limits_too_large_are_no_traceback(store: JobStore, db: Database, broker_url: str) -> None:
    add_job(store, "app.old", outcome="failed")
    # Older than year 1: nothing is that old; newer than that: everything is.
    assert bb(broker_url, "purge", "--status", "failed", "--older-than", "100000000d").stdout == "purged 0 jobs\n"
    assert len(json.loads(bb(broker_url, "failed", "--newer-than", "100000000d", "--json").stdout)) == 1
    result = bb(broker_url, "failed", "--older-than", "99999999999999d")
    assert result.exit_code == 2 and "'99999999999999d' is too long a duration" in result.stderr
    assert db.jobs.count_documents({"status": "failed"}) == 1
    huge = bb(broker_url, "failed", "--limit", "99999999999999999999")
    assert huge.exit_code == 2 and "--limit" in huge.stderr and "is not in the range" in huge.stderr


def test_a_task_id_sent_twice_names_its_newest_job(store: JobStore, db: Database, broker_url: str) -> None:
    # apply_async(task_id=...) with the same id twice: two jobs; the id means the newest, as for show and the Jobs tab.
    older = add_job(store, "app.twice", outcome="failed")
    newer = store.publish(queue="celery", kind="app.twice", task_id="task-app.twice-failed", payload={"args": []},
                          priority=0, run_after=None, is_retry=False)  # fmt: skip
    assert older < newer
    shown = json.loads(bb(broker_url, "show", "task-app.twice-failed", "--json").stdout)
    assert shown["_id"] == newer
    result = bb(broker_url, "cancel", "task-app.twice-failed")
    assert result.exit_code == 0 and result.stdout == f"cancelled job {newer} (app.twice)\n"
    assert db.jobs.find_one({"_id": older})["lastError"].startswith("app.twice broke")


def run_cli_bytes(*args: bytes | str) -> subprocess.CompletedProcess[bytes]:
    """The CLI run as a shell runs it, each argument bytes (a name in Latin-1 from a file, say)."""
    argv = [sys.executable.encode(), b"-m", b"bb_broker.cli"]
    argv += [arg if isinstance(arg, bytes) else arg.encode() for arg in args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=60)


def said_one_line(result: subprocess.CompletedProcess[bytes] | subprocess.CompletedProcess[str]) -> str:
    """The one line a command said on stderr (asserted to be one, without a traceback)."""
    err = result.stderr.decode() if isinstance(result.stderr, bytes) else result.stderr
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("bb-broker: "), err
    return err


def test_documents_written_by_hand_print_whatever_their_fields_hold(db: Database, broker_url: str) -> None:
    """An ObjectId _id, an updatedAt that is text, and every other BSON type in the fields the commands print."""
    oid = ObjectId()
    odd = {
        "oid": ObjectId(), "long": Int64(5), "decimal": Decimal128("1.5"), "binary": Binary(b"\x00\xff", 0),
        "regex": Regex("a.*", "i"), "timestamp": Timestamp(1, 2), "code": Code("x = 1"), "min": MinKey(),
        "max": MaxKey(), "ref": DBRef("jobs", 1), "nan": float("nan"), "inf": float("-inf"),
        "when": datetime(2020, 1, 1, tzinfo=UTC),
    }  # fmt: skip
    now = datetime.now(UTC)
    db.jobs.insert_many(
        [
            {"_id": oid, "kind": "app.add", "queue": "celery", "status": "failed", "attempts": 1, "updatedAt": now},
            {"_id": "text-date", "kind": "app.add", "queue": "celery", "status": "failed", "updatedAt": "yesterday"},
            {
                "_id": "odd",
                "status": "failed",
                "kind": odd,
                "queue": [odd],
                "taskId": Decimal128("3"),
                "attempts": float("nan"),
                "updatedAt": Timestamp(5, 1),
                "lastError": odd,
                "createdAt": Binary(b"z", 0),
                "payload": odd,
                "history": [odd, {"n": Int64(1), "startedAt": now, "finishedAt": "later", "error": odd}],
                "actions": [odd],
                "unique": {"mode": odd, "key": odd},
                "claimLimits": odd,
                **odd,
            },
        ]  # fmt: skip
    )
    listed = run_cli("failed", "--json", "--broker", broker_url)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    rows = {row["id"]: row for row in json.loads(listed.stdout)}
    stored = now.replace(microsecond=now.microsecond // 1000 * 1000)  # BSON keeps milliseconds
    assert datetime.fromisoformat(rows[str(oid)]["failedAt"]) == stored
    assert rows["text-date"]["failedAt"] == "yesterday" and rows["odd"]["failedAt"] == "Timestamp(5, 1)"
    assert rows["odd"]["lastError"]["oid"] == str(odd["oid"]) and rows["odd"]["lastError"]["nan"] == "nan"
    table = run_cli("failed", "--broker", broker_url)
    assert table.returncode == 0 and table.stderr == "", table.stderr
    assert any(line.startswith("text-date") and "yesterday" in line for line in table.stdout.splitlines())
    assert any(line.startswith(str(oid)) for line in table.stdout.splitlines())
    for identifier in ("odd", str(oid)):
        shown = run_cli("show", identifier, "--broker", broker_url)
        assert shown.returncode == 0 and shown.stderr == "" and shown.stdout.startswith("id:"), shown.stderr
        as_json = run_cli("show", identifier, "--json", "--broker", broker_url)
        assert as_json.returncode == 0 and as_json.stderr == "", as_json.stderr
        assert json.loads(as_json.stdout)["_id"] == identifier
    # No worker can run a job whose _id is not a string: retry says so, not a --kind nobody gave.
    retried = run_cli("retry", str(oid), "--broker", broker_url)
    assert retried.returncode == 1 and retried.stdout == "retried 0 failed jobs\n"
    assert said_one_line(retried) == (
        f"bb-broker: retry: 1 id matched no failed job: {oid} (its _id is objectId, not a string: no worker can run "
        "it)\n"
    )
    assert db.jobs.find_one({"_id": oid})["status"] == "failed"


NOT_UTF8 = b"caf\xe9"
#: Every command that takes a text, with the one that is not UTF-8 (`{}` for the broker URL).
TEXT_ARGUMENTS = [
    ["pause", NOT_UTF8, "--broker", "{}"],
    ["resume", NOT_UTF8, "--broker", "{}"],
    ["show", NOT_UTF8, "--broker", "{}"],
    ["cancel", "some-id", NOT_UTF8, "--broker", "{}"],
    ["run-now", NOT_UTF8, "--broker", "{}"],
    ["failed", "--kind", NOT_UTF8, "--broker", "{}"],
    ["retry", NOT_UTF8, "--broker", "{}"],
    ["limit", NOT_UTF8, "--concurrency", "2", "--broker", "{}"],
    ["stats", "--queue", NOT_UTF8, "--broker", "{}"],
    ["status", "--collection", NOT_UTF8, "--broker", "{}"],
    ["status", "--broker", b"bbmongo://127.0.0.1:1/caf\xe9"],
    ["schedules", "--broker", "{}", "add", NOT_UTF8, "app.add", "--every", "60"],
    ["schedules", "--broker", "{}", "add", "nightly", "app.add", "--every", "60", "--queue", NOT_UTF8],
    ["schedules", "run-now", "nightly", "--broker", b"bbmongo://127.0.0.1:1/caf\xe9"],
]


@pytest.mark.parametrize("command", TEXT_ARGUMENTS, ids=lambda c: " ".join(map(str, c[:2])))
def test_a_text_that_is_not_utf8_is_refused_in_one_line(db: Database, broker_url: str, command: list) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    add_job(store, "app.add", outcome="failed")
    before = list(db.jobs.find())
    result = run_cli_bytes(*(broker_url if arg == "{}" else arg for arg in command))
    assert result.returncode == 2 and result.stdout == b""
    assert "is not UTF-8 text: byte 0xe9 at character " in said_one_line(result)
    assert list(db.jobs.find()) == before and db.bb_schedules.count_documents({}) == 0  # nothing done


def test_a_lone_surrogate_in_json_arguments_of_a_schedule_is_refused(db: Database, broker_url: str) -> None:
    result = run_cli("schedules", "--broker", broker_url, "add", "nightly", "app.add", "--every", "60",
                     "--args", '["caf\\udce9"]')  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert said_one_line(result) == (
        "bb-broker: add: --args[0] holds a lone surrogate 'caf\\udce9': not text UTF-8 can encode\n"
    )
    assert db.bb_schedules.count_documents({}) == 0


@pytest.mark.parametrize("ca_file", ["/etc/passwd", "/no/such/ca.pem"])
@pytest.mark.parametrize("command", [["status"], ["doctor"], ["show", "some-id"], ["failed", "--json"]])
def test_a_tls_file_that_cannot_be_used_is_one_line(mongo_url: str, ca_file: str, command: list[str]) -> None:
    host = mongo_url.split("://")[1].rstrip("/")
    url = f"bbmongo://admin:hunter2secret@{host}/db?tls=true&tlsCAFile={ca_file}&authSource=admin"
    result = run_cli(*command, "--broker", url)
    assert result.returncode == 1 and result.stdout == ""
    why = "is not a PEM certificate of an authority" if ca_file == "/etc/passwd" else "cannot be read"
    assert said_one_line(result) == (
        f"bb-broker: broker URL 'bbmongo://admin:**@{host}/db?tls=true&tlsCAFile={ca_file}&authSource=admin': "
        f"its tlsCAFile '{ca_file}' {why}"
        + (" (NO_CERTIFICATE_OR_CRL_FOUND)\n" if ca_file == "/etc/passwd" else ": No such file or directory\n")
    )


@pytest.mark.parametrize("name", ["", "a$b", ".jobs"])
def test_a_collection_name_mongodb_cannot_have_is_a_bad_argument(db: Database, broker_url: str, name: str) -> None:
    result = run_cli("failed", "--collection", name, "--broker", broker_url)
    assert result.returncode == 2 and result.stdout == ""
    assert said_one_line(result).startswith(f"bb-broker: --collection {name!r}: collection names ")
