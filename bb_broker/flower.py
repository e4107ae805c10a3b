"""Flower's Broker tab and `/api/queues/length` for `bbmongo://`: each queue's depth, read from the `jobs` collection.

Flower 2 has no extension point for brokers: `flower.utils.broker.Broker` is a factory that picks a class by URL
scheme and raises NotImplementedError for any other, which the Broker tab shows as "'mongodb' broker is not
supported". `install()` wraps that factory's `__new__` so `bbmongo://` and `bbmongo+srv://` get `JobQueues`, and every
other scheme still reaches Flower's own code. Importing this module installs it, so either of these is enough:

* `bb-broker flower -A myapp [flower options]`, or
* `import bb_broker.flower` in the `flowerconfig.py` Flower reads (or the file `--conf` names).

The queues listed are those of the collection (every queue holding queued, running or failed jobs, and every paused
one) together with those Flower's workers consume, so none is missing however Flower was started. Importing this
module also adds the Jobs tab (bb_broker.jobs_view). `tests/test_flower.py` fails when the Flower internals this
relies on move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from flower.utils import broker as flower_broker

from . import jobs_view
from .connection import get_database, parse_broker_url
from .lifecycle import FAILED, QUEUED, RUNNING
from .operations import Operations
from .store import JobStore

SCHEMES = frozenset({"bbmongo", "bbmongo+srv"})

_MARK = "_bb_broker_jobs"


class JobQueues:
    """Answers Flower's `await broker.queues(names)` with one row per queue, shaped like the RabbitMQ rows it shows.

    Messages is queued + running, Ready is queued (including jobs waiting for their ETA or backoff), Unacked is
    running (claimed by a worker, whether executing or reserved). Flower's table has no column for failed jobs;
    the row carries `queued`, `running` and `failed` as well, which `/api/queues/length` returns.
    """

    def __init__(self, broker_url: str, *_: Any, broker_options: dict[str, Any] | None = None, **__: Any) -> None:
        collection = (broker_options or {}).get("jobs_collection", "jobs")
        self.store = JobStore(get_database(parse_broker_url(broker_url)), collection=collection)
        self.operations = Operations(self.store)

    async def queues(self, names: Iterable[str]) -> list[dict[str, Any]]:
        """A row for each queue the workers consume (`names`) and each queue the collection knows."""
        # Flower's handlers run on its event loop: the queries go to a thread so pages stay responsive.
        rows = await asyncio.get_running_loop().run_in_executor(None, self.operations.queues, list(names))
        return [_row(name, row) for name, row in rows.items()]


def _row(name: str, depth: dict[str, Any]) -> dict[str, Any]:
    row = {
        "name": name,
        "messages": depth[QUEUED] + depth[RUNNING],
        "messages_ready": depth[QUEUED],
        "messages_unacknowledged": depth[RUNNING],
        QUEUED: depth[QUEUED],
        RUNNING: depth[RUNNING],
        FAILED: depth[FAILED],
        "paused": depth["paused"],
    }
    if depth["paused"]:
        row["pausedBy"] = depth.get("pausedBy")
        at = depth.get("pausedAt")
        row["pausedAt"] = at.isoformat() if hasattr(at, "isoformat") else at
    return row


def install() -> None:
    """Make Flower's Broker factory answer `bbmongo://` URLs with `JobQueues`; calling it twice changes nothing."""
    factory = flower_broker.Broker
    if getattr(factory.__new__, _MARK, False):
        return
    flowers_new = factory.__new__

    def __new__(cls: type, broker_url: str, *args: Any, **kwargs: Any) -> Any:
        if broker_url.partition("://")[0].lower() in SCHEMES:
            return JobQueues(broker_url, *args, **kwargs)
        return flowers_new(cls, broker_url, *args, **kwargs)

    setattr(__new__, _MARK, True)
    __new__.flowers_new = flowers_new  # type: ignore[attr-defined]
    factory.__new__ = staticmethod(__new__)  # type: ignore[method-assign]


install()
jobs_view.install()
