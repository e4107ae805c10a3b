"""Real `celery beat -S bb_broker.beat:JobScheduler` subprocesses on tests/support/beat_app.py, and the slot jobs
they made (the e2e and faults tests of bb_broker.beat)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pymongo.database import Database

from bb_broker.beat import ScheduleStore
from bb_broker.clock import ServerClock
from tests.support.workers import ROOT, STARTED, kill_group, wait_for

#: The entry most beat tests run: a job a second.
ENTRY = "every-second"
TICK = {ENTRY: {"task": "tests.support.e2e_app.add", "schedule": 1.0, "args": [1, 2]}}

#: Entries edited by hand into numbers no date can be made of (an interval past what a date holds, or a lastSlot from
#: which the next slot is past year 9999 or before year 1): each its change to a minutely crontab entry.
OUT_OF_RANGE = {
    "every-infinite": {"schedule": {"every": math.inf}},
    "every-1e12": {"schedule": {"every": 1e12}},
    "last-slot-9999": {"lastSlot": datetime(9999, 12, 31, tzinfo=UTC)},
    "last-slot-year-1": {"lastSlot": datetime(1, 1, 1, tzinfo=UTC)},
}


def add_out_of_range_entries(db: Database, task: str = "tests.support.e2e_app.add") -> None:
    """The OUT_OF_RANGE entries, added as an operator does, then edited by hand."""
    store = ScheduleStore(db, ServerClock(db))
    for name, changes in OUT_OF_RANGE.items():
        store.add(name, task, {"crontab": "* * * * *"})
        db.bb_schedules.update_one({"_id": name}, {"$set": changes})


class Beat:
    """A `celery beat -S bb_broker.beat:JobScheduler` process on tests/support/beat_app.py, with `schedule` as its
    beat_schedule."""

    def __init__(
        self, broker_url: str, log_dir: Path, name: str, schedule: dict[str, Any], env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_dir / f"beat-{name}.log"
        self.name = name
        self.argv = [
            sys.executable, "-m", "celery", "-A", "tests.support.beat_app", "beat", "-S", "bb_broker.beat:JobScheduler",
            "--loglevel", "INFO", "-s", str(log_dir / f"unused-schedule-{name}"),
        ]  # fmt: skip
        self.env = {
            **os.environ,
            "BB_BROKER_URL": broker_url,
            "BB_BEAT_SCHEDULE": json.dumps(schedule),
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Beat:
        STARTED.append(self)  # conftest kills it after the test, whatever happened
        log = open(self.log_path, "ab")  # noqa: SIM115 (the beat writes to it for its whole life)
        self.process = subprocess.Popen(
            self.argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for(
            lambda: self.process.poll() is not None or "entries synced" in self.log(), 60, f"beat {self.name} started"
        )
        assert self.process.poll() is None, f"beat {self.name} exited:\n{self.log()[-3000:]}"
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        kill_group(self.process)


def slot_jobs(db: Database, name: str = ENTRY) -> list[dict[str, Any]]:
    """The jobs the entry's slots made (not "run now"), oldest slot first, each with its `slot` as a date."""
    jobs = list(db.jobs.find({"schedule": name, "uniqueKey": {"$exists": True}}))
    for job in jobs:
        job["slot"] = datetime.fromisoformat(job["uniqueKey"].removeprefix(f"beat:{name}:"))
    return sorted(jobs, key=lambda job: job["slot"])


def recorded(db: Database, name: str = ENTRY) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The entry's record, and then the jobs of the slots it covers: a beat still running may have sent the next
    slot's job and not yet recorded it (runCount counts it a moment later)."""
    entry = db.bb_schedules.find_one({"_id": name})
    assert entry is not None, f"no entry {name!r}"
    last = entry["lastSlot"].replace(tzinfo=UTC)
    return entry, [job for job in slot_jobs(db, name) if job["slot"] <= last]


def assert_one_job_per_slot(jobs: list[dict[str, Any]], every: timedelta = timedelta(seconds=1)) -> None:
    slots = [job["slot"] for job in jobs]
    assert len(set(slots)) == len(slots), "two jobs for one slot"
    gaps = [(a, b) for a, b in zip(slots, slots[1:], strict=False) if b - a != every]
    assert not gaps, f"slots missed between {gaps}"
