"""Flower's Broker tab and `/api/queues/length` for `bbmongo://`: each queue's depth, read from the `jobs` collection.

Flower 2 has no extension point for brokers: `flower.utils.broker.Broker` is a factory that picks a class by URL
scheme and raises NotImplementedError for any other, which the Broker tab shows as "'mongodb' broker is not
supported". bb_broker.contrib.flower.plugin's `install()` (through bb_broker.upstream.flower, where every patch of
Flower's is) wraps that factory's `__new__` so `bbmongo://` and `bbmongo+srv://` get `JobQueues`, and every other
scheme still reaches Flower's own code. Importing bb_broker.contrib.flower installs it, so either of these is enough:

* `bb-broker flower -A myapp [flower options]`, or
* `import bb_broker.contrib.flower` in the `flowerconfig.py` Flower reads (or the file `--conf` names).

The queues listed are those of the collection (every queue holding queued, running or failed jobs, and every paused
one) together with those Flower's workers consume, so none is missing however Flower was started.

`authentication()` tells `bb-broker flower` whether Flower will ask for credentials, by Flower's own option parsing.

`tests/unit/test_upstream_flower.py` fails when the Flower internals this relies on move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from bb_broker.connection import parse_broker_url
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING
from bb_broker.ops.operations import Operations
from bb_broker.options import BrokerOptions, open_store


class JobQueues:
    """Answers Flower's `await broker.queues(names)` with one row per queue, shaped like the RabbitMQ rows it shows.

    Messages is queued + running, Ready is queued (including jobs waiting for their ETA or backoff), Unacked is
    running (claimed by a worker, whether executing or reserved). Flower's table has no column for failed jobs;
    the row carries `queued`, `running` and `failed` as well, which `/api/queues/length` returns.
    """

    def __init__(self, broker_url: str, *_: Any, broker_options: dict[str, Any] | None = None, **__: Any) -> None:
        # Its queries hold threads of Flower's own executor, which Flower's pages need too: seconds, not 30 s.
        self.store = open_store(parse_broker_url(broker_url), BrokerOptions.parse(broker_options), quick=True)
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
        row["pausedAt"] = at.isoformat() if isinstance(at, datetime) else at
    return row


def _is_login(entry: Any) -> bool:
    user, colon, password = str(entry).partition(":")
    return bool(colon and user.strip() and password)


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
        # Flower checks a login against each entry as given: an empty one (`--basic-auth=$UNSET`), or one without a
        # user or a password, lets in whoever sends that much, or nothing at all.
        unusable = [entry for entry in options.basic_auth if not _is_login(entry)]
        if unusable:
            raise ValueError(
                f"--basic-auth holds {len(unusable)} entr{'y' if len(unusable) == 1 else 'ies'} that is no "
                "USER:PASSWORD with both parts given (an empty value, or a variable that is not set?)"
            )
        return "basic"
    if options.auth:
        return "oauth"
    return None
