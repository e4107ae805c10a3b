"""Flower's Broker tab and `/api/queues/length` for `bbmongo://`: each queue's depth, read from the `jobs` collection.

Flower 2 has no extension point for brokers: `flower.utils.broker.Broker` is a factory that picks a class by URL
scheme and raises NotImplementedError for any other, which the Broker tab shows as "'mongodb' broker is not
supported". `install()` wraps that factory's `__new__` so `bbmongo://` and `bbmongo+srv://` get `JobQueues`, and every
other scheme still reaches Flower's own code. Importing this module installs it, so either of these is enough:

* `bb-broker flower -A myapp [flower options]`, or
* `import bb_broker.flower` in the `flowerconfig.py` Flower reads (or the file `--conf` names).

`authentication()` tells `bb-broker flower` whether Flower will ask for credentials, by Flower's own option parsing.

`tests/test_flower.py` fails when the Flower internals this relies on move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from flower.utils import broker as flower_broker

from .connection import get_database, parse_broker_url
from .lifecycle import FAILED, QUEUED, RUNNING
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

    async def queues(self, names: Iterable[str]) -> list[dict[str, Any]]:
        names = list(names)
        # Flower's handlers run on its event loop: the query goes to a thread so pages stay responsive.
        depths = await asyncio.get_running_loop().run_in_executor(None, self.store.queue_depths, names)
        return [_row(name, depths[name]) for name in names]


def _row(name: str, depth: dict[str, int]) -> dict[str, Any]:
    return {
        "name": name,
        "messages": depth[QUEUED] + depth[RUNNING],
        "messages_ready": depth[QUEUED],
        "messages_unacknowledged": depth[RUNNING],
        QUEUED: depth[QUEUED],
        RUNNING: depth[RUNNING],
        FAILED: depth[FAILED],
    }


def authentication(flower_args: Iterable[str]) -> str | None:
    """How Flower started with these arguments authenticates its users: "basic", "oauth", or None for nobody.

    Flower's own parsers read its FLOWER_* environment, its configuration file (`--conf`, or flowerconfig.py in the
    working directory) and the arguments, in its order of precedence, into Tornado's global options; Flower parses
    them again when it starts, to the same values.
    """
    from flower.command import apply_env_options, apply_options
    from tornado.options import options

    apply_env_options()
    apply_options("flower", list(flower_args))
    if options.basic_auth:
        return "basic"
    if options.auth:
        return "oauth"
    return None


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
