"""Periodic tasks on the broker's database: `celery beat -S bb_broker.beat:JobScheduler`, exactly one job per slot."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bb_broker.beat.entries import EntryError, ScheduleStore
    from bb_broker.beat.scheduler import JobScheduler, run_now

__all__ = ["EntryError", "JobScheduler", "ScheduleStore", "run_now"]

#: Served on first use (PEP 562): `bb-broker schedules` reads entries without importing Celery's beat.
_LAZY = {"EntryError": "entries", "ScheduleStore": "entries", "JobScheduler": "scheduler", "run_now": "scheduler"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
