"""Periodic tasks on the broker's database: `celery beat -S bb_broker.beat:JobScheduler`, exactly one job per slot."""

from __future__ import annotations

from bb_broker.beat.entries import EntryError, ScheduleStore
from bb_broker.beat.scheduler import JobScheduler, run_now

__all__ = ["EntryError", "JobScheduler", "ScheduleStore", "run_now"]
