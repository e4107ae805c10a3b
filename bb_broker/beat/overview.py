"""What an operator sees of each periodic entry (the CLI's `bb-broker schedules`, Flower's Schedules view, its API)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from pymongo.database import Database

from bb_broker.beat.entries import DEFAULT_CATCH_UP, EntryError, parse_entry
from bb_broker.jobs.document import of_task


def schedule_text(schedule: Any) -> str:
    """A stored schedule as a person reads it: `every 10s`, `crontab 0 3 * * *`, `solar sunset (48.85, 2.35)`."""
    if not isinstance(schedule, dict):
        return repr(schedule)
    if "every" in schedule:
        return f"every {schedule['every']:g}s" if isinstance(schedule["every"], (int, float)) else repr(schedule)
    if "crontab" in schedule:
        return f"crontab {schedule['crontab']}"
    if "solar" in schedule:
        return f"solar {schedule['solar']} ({schedule.get('lat')}, {schedule.get('lon')})"
    return repr(schedule)


def _aware(moment: Any) -> Any:
    return moment.replace(tzinfo=UTC) if isinstance(moment, datetime) and moment.tzinfo is None else moment


def jobs_query(name: Any) -> str:
    """The query string of the Jobs view (Flower's /jobs, /api/jobs) that lists the jobs of the entry `name`: its
    slots' and its run-nows' (the jobs' `schedule` field)."""
    return urlencode({"schedule": str(name)})


def describe(doc: dict[str, Any], db: Database, *, jobs_collection: str = "jobs") -> dict[str, Any]:
    """One entry for an operator: its schedule, timezone, next slot, last job (id and status), state, policy;
    `problem` says why a beat skips it (a document edited into nonsense); `jobsQuery` finds its jobs in the Jobs
    view."""
    problem = None
    next_slot = None
    try:
        entry = parse_entry(doc)
        next_slot = entry.slots.next_after(entry.last_slot)
    except EntryError as exc:
        problem = str(exc)
    last_job = doc.get("lastJob") if isinstance(doc.get("lastJob"), dict) else None
    status = None
    # A task id written by hand (or copied by a beat from a hand-edited job it found under the slot's key) may be no
    # string: the page links it as one.
    last_task_id = last_job.get("taskId") if last_job and isinstance(last_job.get("taskId"), str) else None
    if last_task_id is not None:
        found = db[jobs_collection].find_one({"taskId": of_task(last_task_id)}, {"status": 1})
        status = found.get("status") if found else "(deleted)"
    return {
        "name": doc.get("_id"),
        "task": doc.get("task"),
        "schedule": schedule_text(doc.get("schedule")),
        "timezone": doc.get("timezone", "UTC"),
        "enabled": doc.get("enabled", True) is True,
        "catchUp": doc.get("catchUp", DEFAULT_CATCH_UP),
        "owner": doc.get("owner"),
        "nextSlot": next_slot if doc.get("enabled", True) is True else None,
        "lastRunAt": _aware(doc.get("lastRunAt")),
        "lastTaskId": last_task_id,
        "lastRunNow": bool(last_job.get("runNow")) if last_job else False,
        "lastStatus": status,
        "runCount": doc.get("runCount", 0),
        "catchUps": doc["catchUps"] if isinstance(doc.get("catchUps"), list) else [],
        "problem": problem,
        "jobsQuery": jobs_query(doc.get("_id")),
    }
