"""`make demo`: embedded server, a worker, Flower and sample jobs, with the statuses printed as they change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pymongo import MongoClient
from pymongo.errors import PyMongoError

import bb_broker
from bb_broker.connection import get_database, parse_broker_url

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "bbmongo://127.0.0.1:27017/bountyboard"


def _wait_for_server(mongo_uri: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with MongoClient(mongo_uri, serverSelectionTimeoutMS=500) as client:
                client.admin.command("ping")
            return
        except PyMongoError:
            if time.monotonic() > deadline:
                raise SystemExit(f"demo: no MongoDB answered at the broker URL within {timeout:.0f}s") from None
            time.sleep(0.3)


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    print(f"demo: {' '.join(argv[2:] if argv[0] == sys.executable else argv)}  (log: {log.relative_to(ROOT)})")
    return subprocess.Popen(argv, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def main() -> int:
    once = os.environ.get("BB_DEMO_ONCE") == "1"
    embedded = "BB_BROKER_URL" not in os.environ
    url = os.environ.get("BB_BROKER_URL", DEFAULT_URL)
    target = parse_broker_url(url)
    os.environ["BB_BROKER_URL"] = url
    logs = ROOT / "bb-data" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children: list[subprocess.Popen[bytes]] = []
    if embedded:
        children.append(_start([sys.executable, "-m", "bb_broker.cli", "serve", "--port", "27017",
                                "--data", str(ROOT / "bb-data" / "db")], logs / "server.log"))  # fmt: skip
    try:
        _wait_for_server(target.mongo_uri)
        celery = [sys.executable, "-m", "celery", "-A", "celery_app"]
        children.append(_start([*celery, "worker", "-c", "2", "-E", "--loglevel", "INFO"], logs / "worker.log"))
        flower = [sys.executable, "-m", "bb_broker.cli", "flower", "-A", "celery_app"]  # with the Broker tab
        children.append(_start([*flower, "--address=127.0.0.1", "--port=5555"], logs / "flower.log"))
        print("demo: Flower on http://127.0.0.1:5555")

        from celery_app.tasks import add, always_fails, flaky, long_running

        sample = [add.delay(2, 3), flaky.delay("flaky"), always_fails.delay("doomed"), long_running.delay(3)]
        ids = [result.id for result in sample]
        # The result backend is the jobs collection too: .get() reads the result off add's job document.
        print(f"demo: add.delay(2, 3).get() = {sample[0].get(timeout=300)!r}", flush=True)
        jobs = get_database(target)["jobs"]
        last = None
        while True:
            counts = bb_broker.statuses(url)
            if counts != last:
                print(f"demo: {json.dumps(counts)}", flush=True)
                last = counts
            settled = jobs.count_documents({"taskId": {"$in": ids}, "status": {"$in": ["succeeded", "failed"]}})
            if once and settled == len(ids):
                print(json.dumps(counts), flush=True)
                return 0
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    finally:
        for child in reversed(children):
            child.send_signal(signal.SIGTERM)
        for child in reversed(children):
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()


if __name__ == "__main__":
    sys.exit(main())
