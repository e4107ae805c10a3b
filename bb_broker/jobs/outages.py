"""Which server errors pass with time, and retrying a write on a held job through a failover or a restart."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

from bb_broker.connection import out_of_patience

logger = logging.getLogger(__name__)

#: The server errors after which the drivers' retryable reads try a read again (a restart, a failover, a router
#: that lost a shard): the server labels a write's, not a read's.
RETRYABLE_READ_CODES = frozenset({6, 7, 63, 89, 91, 134, 150, 189, 262, 9001, 10107, 11600, 11602, 13388, 13435, 13436})


def is_transient(exc: ConnectionFailure | OperationFailure) -> bool:
    """A failover, a restart or a dropped connection: the same write may be tried again."""
    return isinstance(exc, ConnectionFailure) or exc.has_error_label("RetryableWriteError")


def passes_with_time(exc: PyMongoError) -> bool:
    """An error the same command may not meet again soon: a lost connection, or a server's transient answer."""
    if isinstance(exc, ConnectionFailure):
        return True
    return isinstance(exc, OperationFailure) and (is_transient(exc) or exc.code in RETRYABLE_READ_CODES)


def through_outages(write: Callable[[], Any], *, patience: float) -> Any:
    """Retry a write on a held job through a failover or a restart, for `patience` seconds: losing a settle would
    run the task again."""
    deadline = time.monotonic() + patience
    delay = 0.1
    while True:
        try:
            return write()
        except (ConnectionFailure, OperationFailure) as exc:
            # Inside a stopping worker's patience (connection.shutdown_patience), once it ran out, the stale
            # sweep takes over: a held job's release tried for a minute held the worker's stop as long, each.
            if not is_transient(exc) or time.monotonic() > deadline or out_of_patience():
                raise
            logger.warning("a write on a held job failed (%s), retrying in %.1fs", type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
