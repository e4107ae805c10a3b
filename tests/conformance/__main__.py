"""Fetch Kombu's and Celery's sources for the installed versions, run their integration suites, print the table.

Kombu's integration classes run against bbmongo://; Celery's test_tasks.py and test_canvas.py against bbmongo://
and against Redis (the baseline, as Celery's CI runs them), with a Redis result backend for both. Each suite runs
in its own pytest process, bounded in time. While iterating, CONFORMANCE_SUITES (kombu,tasks,canvas),
CONFORMANCE_BROKERS (bbmongo,redis) and CONFORMANCE_K (a -k expression for the Celery suites) narrow a run, and
CONFORMANCE_SUITE_TIMEOUT (seconds) caps each suite.
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
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from tests.bench.servers import RedisServer, mongo_server
from tests.servers import with_database

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
    note: str = ""

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
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            process.wait(limit)
        except subprocess.TimeoutExpired:
            # Interrupted, pytest still writes the report of what ran; killed, it would write nothing.
            process.send_signal(signal.SIGINT)
            try:
                process.wait(INTERRUPT_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            run.note = f"stopped after {limit:.0f} s"
    if report.exists():
        run.outcomes, run.seconds = read_junit(report)
    elif not run.note:
        run.note = f"no report (exit {process.returncode}); see {log}"
    run.note = run.note or f"{time.monotonic() - started:.0f} s"
    return run


def read_junit(report: Path) -> tuple[dict[str, str], dict[str, float]]:
    outcomes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        seconds[name] = float(case.get("time") or 0)
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes, seconds


def print_table(runs: list[Run]) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"\nkombu {version('kombu')}, celery {version('celery')}, {stamp}")
    print("\n| suite | broker | passed | failed | skipped | time |\n|---|---|---|---|---|---|")
    for run in runs:
        print(f"| {run.suite} | {run.broker} | {run.count('passed')} | {run.count('failed')} "
              f"| {run.count('skipped')} | {run.note} |")  # fmt: skip
    by_suite: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_suite.setdefault(run.suite, {})[run.broker] = run
    for suite, brokers in by_suite.items():
        ours, baseline = brokers.get("bbmongo"), brokers.get("redis")
        if ours is None:
            continue
        only_ours = sorted(
            name for name, outcome in ours.outcomes.items()
            if outcome == "failed" and (baseline is None or baseline.outcomes.get(name) == "passed")
        )  # fmt: skip
        print(f"\n{suite}: failing only on bbmongo:// ({len(only_ours)})")
        for name in only_ours:
            print(f"  - {name}")
        if baseline is not None:
            slowest = sorted(ours.seconds, key=lambda name: ours.seconds[name], reverse=True)[:SLOWEST]
            print(f"{suite}: the slowest on bbmongo:// (seconds, bbmongo:// / redis://)")
            for name in slowest:
                print(f"  - {name}: {ours.seconds[name]:.1f} / {baseline.seconds.get(name, float('nan')):.1f}")


def main() -> int:
    suites = [s.strip() for s in os.environ.get("CONFORMANCE_SUITES", "kombu,tasks,canvas").split(",") if s.strip()]
    k = os.environ.get("CONFORMANCE_K", "")
    brokers = os.environ.get("CONFORMANCE_BROKERS", "bbmongo,redis").split(",")
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
            args = ["-p", "celery.contrib.pytest", target, *(["-k", k] if k else [])]
            for broker, url in (("bbmongo", with_database(mongo.url, f"celery_{suite}")), ("redis", redis.url)):
                if broker not in brokers:
                    continue
                env = {**redis_env, "TEST_BROKER": url, "TEST_BACKEND": redis.url, "PYTHONPATH": str(celery_tree)}
                print(f"running {suite} on {broker} ...", flush=True)
                runs.append(run_pytest(Run(suite, broker), args, celery_tree, env, work))
                subprocess.run(["redis-cli", "-p", str(redis.port), "flushall"], capture_output=True, timeout=30)
    finally:
        redis.stop()
        mongo.stop()
    print_table(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
