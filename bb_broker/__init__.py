"""bb_broker: Celery tasks kept as `jobs` documents in MongoDB; `import bb_broker` enables `bbmongo://`."""

from __future__ import annotations

from celery.app.backends import BACKEND_ALIASES
from kombu.transport import TRANSPORT_ALIASES
from pymongo.database import Database

from . import celery_hooks
from .celery_hooks import is_final_attempt
from .connection import BrokerURLError, get_database, parse_broker_url
from .lifecycle import FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED
from .store import JobStore, JobTooLarge, ResultTooLarge

TRANSPORT_ALIASES["bbmongo"] = "bb_broker.transport:Transport"
TRANSPORT_ALIASES["bbmongo+srv"] = "bb_broker.transport:Transport"
# The result backend: Celery splits "bbmongo+srv://" at its "+", so the one alias serves both schemes.
BACKEND_ALIASES["bbmongo"] = "bb_broker.results:JobResultBackend"

__all__ = [
    "FAILED",
    "QUEUED",
    "RUNNING",
    "STATUSES",
    "SUCCEEDED",
    "BrokerURLError",
    "JobTooLarge",
    "ResultTooLarge",
    "is_final_attempt",
    "statuses",
    "celery_hooks",
]


def statuses(target: str | Database, *, collection: str = "jobs") -> dict[str, int]:
    """Jobs per status, all four keys: `target` is a bbmongo:// or mongodb:// URL, or a pymongo Database."""
    db = target if isinstance(target, Database) else get_database(parse_broker_url(target))
    return JobStore(db, collection=collection).statuses()
