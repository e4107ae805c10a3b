"""bb_broker: Celery tasks kept as `jobs` documents in MongoDB; `import bb_broker` enables `bbmongo://`."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any

import wrapt

from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED
from bb_broker.options import DEFAULTS, BrokerOptions, open_store

if TYPE_CHECKING:
    from pymongo.database import Database

    from bb_broker.bulk import EnqueueManyError, enqueue_many
    from bb_broker.connection import BrokerURLError
    from bb_broker.jobs.checkpoints import CheckpointError
    from bb_broker.jobs.document import JobTooLarge, ResultNotStored, ResultTooLarge
    from bb_broker.jobs.payloads import MalformedTaskMessage
    from bb_broker.jobs.refusals import PublishRefused
    from bb_broker.jobs.unique import DuplicateJob, UniqueOptionError
    from bb_broker.transport.channel import ServerUnreachable
    from bb_broker.worker.checkpoints import checkpoint, last_checkpoint
    from bb_broker.worker.settle import is_final_attempt

__all__ = [
    "FAILED",
    "QUEUED",
    "RUNNING",
    "STATUSES",
    "SUCCEEDED",
    "BrokerURLError",
    "CheckpointError",
    "DuplicateJob",
    "EnqueueManyError",
    "JobTooLarge",
    "MalformedTaskMessage",
    "PublishRefused",
    "ResultNotStored",
    "ResultTooLarge",
    "ServerUnreachable",
    "UniqueOptionError",
    "enqueue_many",
    "checkpoint",
    "is_final_attempt",
    "last_checkpoint",
    "statuses",
]

#: The distribution's name, as `pip install` takes it (pyproject.toml's project.name).
DISTRIBUTION = "bb-broker"

#: Names served on first use (PEP 562), so that `bb-broker --help` need not import Celery, Kombu or pymongo.
_LAZY = {
    "BrokerURLError": "connection",
    "CheckpointError": "jobs.checkpoints",
    "DuplicateJob": "jobs.unique",
    "EnqueueManyError": "bulk",
    "JobTooLarge": "jobs.document",
    "MalformedTaskMessage": "jobs.payloads",
    "PublishRefused": "jobs.refusals",
    "ResultNotStored": "jobs.document",
    "ResultTooLarge": "jobs.document",
    "ServerUnreachable": "transport.channel",
    "UniqueOptionError": "jobs.unique",
    "enqueue_many": "bulk",
    "checkpoint": "worker.checkpoints",
    "is_final_attempt": "worker.settle",
    "last_checkpoint": "worker.checkpoints",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # written once, in pyproject.toml: the installed metadata brings it here
        return importlib.metadata.version(DISTRIBUTION)
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def statuses(target: str | Database, *, collection: str = DEFAULTS.jobs_collection) -> dict[str, int]:
    """Jobs per status, all four keys: `target` is a bbmongo:// or mongodb:// URL, or a pymongo Database."""
    from pymongo.database import Database

    from bb_broker.connection import parse_broker_url

    where = target if isinstance(target, Database) else parse_broker_url(target)
    return open_store(where, BrokerOptions(jobs_collection=collection)).statuses()


def _register_transport(kombu_transport: ModuleType) -> None:
    kombu_transport.TRANSPORT_ALIASES["bbmongo"] = "bb_broker.transport:Transport"
    kombu_transport.TRANSPORT_ALIASES["bbmongo+srv"] = "bb_broker.transport:Transport"


def _register_result_backend(celery_backends: ModuleType) -> None:
    # Celery splits "bbmongo+srv://" at its "+", so the one alias serves both schemes.
    celery_backends.BACKEND_ALIASES["bbmongo"] = "bb_broker.results.backend:JobResultBackend"


def _connect_celery_hooks(_signals: ModuleType) -> None:
    importlib.import_module(f"{__name__}.worker")  # its receivers connect as it is imported


# The aliases and the signal receivers are in place before anything can use them: a transport is resolved through
# kombu.transport, a signal is sent through celery.signals. Either is done at once when that module is already
# imported, or else right after it is; a process that never imports them (`bb-broker --help`) never pays for them.
wrapt.register_post_import_hook(_register_transport, "kombu.transport")
wrapt.register_post_import_hook(_register_result_backend, "celery.app.backends")
wrapt.register_post_import_hook(_connect_celery_hooks, "celery.signals")
