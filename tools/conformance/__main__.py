"""Fetch Kombu's and Celery's sources for the installed versions, run their integration suites, print the table.

Kombu's integration classes run against bbmongo://; Celery's test_tasks.py and test_canvas.py in three columns:
bbmongo:// as broker with a Redis result backend, Redis as both (the baseline, as Celery's CI runs them), and
bbmongo:// as both broker and result backend (`bbmongo+results`, no Redis at all; its table row says whether a
`celery_taskmeta` collection appeared, which it must not). Each suite runs in its own pytest process, bounded in
time. While iterating, CONFORMANCE_SUITES (kombu,tasks,canvas), CONFORMANCE_BROKERS (bbmongo,redis,bbmongo+results)
and CONFORMANCE_K (a -k expression for the Celery suites) narrow a run, and CONFORMANCE_SUITE_TIMEOUT (seconds)
caps each suite. CONFORMANCE_REQUIRE_PARITY=1 (the version matrix's `conformance` sessions) makes the exit status 1
when a Celery test fails on a bbmongo column and passes on Redis, or a suite was stopped before it finished.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from pymongo import MongoClient

from tests.support.servers import with_database
from tools.bench.servers import RedisServer, mongo_server

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CONFORMANCE_CACHE", ROOT / "build" / "conformance"))
HERE = Path(__file__).resolve().parent

#: Seconds one suite may run before it is stopped and counted as it stands.
SUITE_TIMEOUT = {"kombu": 900, "tasks": 1500, "canvas": 2400}
#: Seconds one test may take (pytest-timeout), so a hung test costs one test, not the suite.
TEST_TIMEOUT = {"kombu": 60, "tasks": 180, "canvas": 300}

#: Seconds an interrupted suite gets to write its report before it is killed.
INTERRUPT_GRACE = 120

#: How many of the slowest tests the report compares with the baseline.
SLOWEST = 8

#: Each column of the Celery suites, and the column it is compared with.
BASELINE = {"bbmongo": "redis", "bbmongo+results": "redis"}

#: The broker's own retries of a task that raised (3 attempts, 10 s and 20 s apart by default) done in a blink in
#: both bbmongo columns, as a user sets `broker_transport_options`: they are Celery retries, so every result backend
#: reads RETRY until the last attempt and a caller's get() waits through them, while Celery's tests wait 5-10 s
#: for a failure they expect at once.
BROKER_RETRY_OPTIONS = '{"backoff_base": 0.05}'

PYTEST_INI = """[pytest]
python_classes = test_* Test*
markers =
    env: Kombu's broker selector
    flaky: rerun marker (pytest-rerunfailures is not installed: no reruns)
    timeout: pytest-timeout
    amqp: Celery's AMQP-only tests
filterwarnings = ignore
"""


@dataclass
class Run:
    suite: str
    broker: str
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/skipped
    seconds: dict[str, float] = field(default_factory=dict)  # test id -> its duration
    skips: dict[str, str] = field(default_factory=dict)  # test id -> why it was skipped
    note: str = ""
    #: Checked once the suite has run: the note says what it found (no celery_taskmeta, for one).
    after: Callable[[], str] | None = None

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)


def fetch(package: str) -> Path:
    """The unpacked source distribution of the installed `package`, downloaded once into the cache."""
    wanted = version(package)
    tree = CACHE / f"{package}-{wanted}"
    if tree.is_dir():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"{package}-{wanted}.tar.gz"
    if not archive.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
             "-d", str(CACHE), f"{package}=={wanted}"],
            check=True, timeout=600,
        )  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    return tree


def kombu_suite(kombu_tree: Path, work: Path) -> Path:
    """Kombu's common.py and test_mongodb.py beside our wiring, as a package pytest can import."""
    package = work / "kombu_it"
    shutil.rmtree(package, ignore_errors=True)
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name in ("common.py", "test_mongodb.py"):
        shutil.copy(kombu_tree / "t" / "integration" / name, package / name)
    shutil.copy(HERE / "kombu_wiring.py", package / "test_bbmongo.py")
    return package / "test_bbmongo.py"


def run_pytest(run: Run, args: list[str], cwd: Path, env: dict[str, str], work: Path) -> Run:
    report = work / f"{run.suite}-{run.broker}.xml"
    report.unlink(missing_ok=True)
    ini = work / "pytest.ini"
    ini.write_text(PYTEST_INI)
    argv = [
        sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(cwd), "-p", "no:cacheprovider",
        "-p", "bb_broker", "-q", "-o", "junit_family=xunit2", f"--junitxml={report}",
        f"--timeout={TEST_TIMEOUT[run.suite]}", *args,
    ]  # fmt: skip
    log = work / f"{run.suite}-{run.broker}.log"
    limit = float(os.environ.get("CONFORMANCE_SUITE_TIMEOUT") or SUITE_TIMEOUT[run.suite])
    started = time.monotonic()
    # Celery's suites stop by themselves after the test that passes the limit (tools/conformance/celery_options.py);
    # the interrupt below is for the rest, and for a test that outlives its own timeout.
    env = {**env, "BB_CONFORMANCE_DEADLINE": str(time.time() + limit)}
    hard_limit = limit + (TEST_TIMEOUT[run.suite] + 30 if run.suite != "kombu" else 0)
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            process.wait(hard_limit)
        except subprocess.TimeoutExpired:
            # Interrupted, pytest still writes the report of what ran; killed, it would write nothing.
            process.send_signal(signal.SIGINT)
            try:
                process.wait(INTERRUPT_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            run.note = f"stopped after {limit:.0f} s"
    if not run.note and time.monotonic() - started > limit:
        run.note = f"stopped at the {limit:.0f} s limit, after {time.monotonic() - started:.0f} s"
    if report.exists():
        run.outcomes, run.seconds, run.skips = read_junit(report)
    elif not run.note:
        run.note = f"no report (exit {process.returncode}); see {log}"
    run.note = run.note or f"{time.monotonic() - started:.0f} s"
    if run.after is not None:
        run.note = f"{run.note}; {run.after()}"
    return run


def read_junit(report: Path) -> tuple[dict[str, str], dict[str, float], dict[str, str]]:
    outcomes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    skips: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        seconds[name] = float(case.get("time") or 0)
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif (skipped := case.find("skipped")) is not None:
            outcomes[name] = "skipped"
            skips[name] = (skipped.get("message") or "").strip()[:160]
        else:
            outcomes[name] = "passed"
    return outcomes, seconds, skips


def no_taskmeta(mongo_url: str, database: str) -> Callable[[], str]:
    """A check for after the run: Celery's MongoDB backend's collection must not appear beside the jobs."""

    def check() -> str:
        with MongoClient(mongo_url, serverSelectionTimeoutMS=10_000) as client:
            names = client[database].list_collection_names()
        return "celery_taskmeta APPEARED" if "celery_taskmeta" in names else "no celery_taskmeta"

    return check


def print_table(runs: list[Run]) -> list[str]:
    """Print the table and the comparisons; return what fails only on a bbmongo column, as `suite column: test`."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"\nkombu {version('kombu')}, celery {version('celery')}, {stamp}")
    print("\n| suite | broker | passed | failed | skipped | time |\n|---|---|---|---|---|---|")
    for run in runs:
        print(f"| {run.suite} | {run.broker} | {run.count('passed')} | {run.count('failed')} "
              f"| {run.count('skipped')} | {run.note} |")  # fmt: skip
    by_suite: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_suite.setdefault(run.suite, {})[run.broker] = run
    only_ours = []
    for suite, brokers in by_suite.items():
        for column, base in BASELINE.items():
            ours, baseline = brokers.get(column), brokers.get(base)
            if ours is None:
                continue
            only_ours += [f"{suite} {column}: {name}" for name in compare(suite, column, ours, baseline)]
    return only_ours


def compare(suite: str, column: str, ours: Run, baseline: Run | None) -> list[str]:
    """What fails in `column` but passes in the baseline (returned too); what the baseline runs that `column` skips;
    the slowest."""
    only_ours = sorted(
        name for name, outcome in ours.outcomes.items()
        if outcome == "failed" and (baseline is None or baseline.outcomes.get(name) == "passed")
    )  # fmt: skip
    print(f"\n{suite}: failing only on {column} ({len(only_ours)})")
    for name in only_ours:
        print(f"  - {name}")
    if baseline is None:
        return only_ours
    skipped_here = sorted(
        name for name, outcome in ours.outcomes.items()
        if outcome == "skipped" and baseline.outcomes.get(name) == "passed"
    )  # fmt: skip
    print(f"{suite}: skipped on {column} but passed on {baseline.broker} ({len(skipped_here)})")
    for name in skipped_here:
        print(f"  - {name}: {ours.skips.get(name, '')}")
    slowest = sorted(ours.seconds, key=lambda name: ours.seconds[name], reverse=True)[:SLOWEST]
    print(f"{suite}: the slowest on {column} (seconds, {column} / {baseline.broker})")
    for name in slowest:
        print(f"  - {name}: {ours.seconds[name]:.1f} / {baseline.seconds.get(name, float('nan')):.1f}")
    return only_ours


def main() -> int:
    suites = [s.strip() for s in os.environ.get("CONFORMANCE_SUITES", "kombu,tasks,canvas").split(",") if s.strip()]
    k = os.environ.get("CONFORMANCE_K", "")
    brokers = os.environ.get("CONFORMANCE_BROKERS", "bbmongo,redis,bbmongo+results").split(",")
    kombu_tree = fetch("kombu")
    celery_tree = fetch("celery")
    work = Path(tempfile.mkdtemp(prefix="run-", dir=CACHE))
    print(f"sources in {CACHE}; logs and reports in {work}")
    mongo, redis = mongo_server(work), RedisServer(work)
    mongo.start()
    redis.start()
    runs: list[Run] = []
    try:
        redis_env = {"REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(redis.port)}
        if "kombu" in suites:
            test_file = kombu_suite(kombu_tree, work)
            env = {"BB_CONFORMANCE_URL": with_database(mongo.url, "kombu_it")}
            runs.append(run_pytest(Run("kombu", "bbmongo"), [str(test_file)], work, env, work))
        for suite in ("tasks", "canvas"):
            if suite not in suites:
                continue
            target = f"t/integration/test_{suite}.py"
            args = ["-p", "celery.contrib.pytest", "-p", "tools.conformance.celery_options", target]
            args += ["-k", k] if k else []
            ours = with_database(mongo.url, f"celery_{suite}")
            alone = with_database(mongo.url, f"celery_{suite}_results")
            columns = (
                ("bbmongo", ours, redis.url, None, BROKER_RETRY_OPTIONS),
                ("redis", redis.url, redis.url, None, ""),
                (
                    "bbmongo+results",
                    alone,
                    alone,
                    no_taskmeta(mongo.url, f"celery_{suite}_results"),
                    BROKER_RETRY_OPTIONS,
                ),
            )
            for broker, url, backend, after, options in columns:
                if broker not in brokers:
                    continue
                env = {
                    **redis_env,
                    "TEST_BROKER": url,
                    "TEST_BACKEND": backend,
                    "PYTHONPATH": f"{celery_tree}{os.pathsep}{ROOT}",
                    "BB_CONFORMANCE_TRANSPORT_OPTIONS": options,
                }
                print(f"running {suite} on {broker} ...", flush=True)
                runs.append(run_pytest(Run(suite, broker, after=after), args, celery_tree, env, work))
                subprocess.run(["redis-cli", "-p", str(redis.port), "flushall"], capture_output=True, timeout=30)
    finally:
        redis.stop()
        mongo.stop()
    only_ours = print_table(runs)
    if os.environ.get("CONFORMANCE_REQUIRE_PARITY") != "1":
        return 0
    unfinished = [
        f"{run.suite} {run.broker}: {run.note}" for run in runs if run.note.startswith(("stopped", "no report"))
    ]
    for problem in [*only_ours, *unfinished]:
        print(f"parity: {problem}")
    return 1 if only_ours or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
