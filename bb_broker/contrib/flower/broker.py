"""Flower's Broker tab and `/api/queues/length` for `bbmongo://`: each queue's depth, read from the `jobs` collection.

Flower 2 has no extension point for brokers: `flower.utils.broker.Broker` is a factory that picks a class by URL
scheme and raises NotImplementedError for any other, which the Broker tab shows as "'mongodb' broker is not
supported". `install()` (through patches.py, where every patch of Flower's is) wraps that factory's `__new__` so
`bbmongo://` and `bbmongo+srv://` get `JobQueues`, and every other scheme still reaches Flower's own code. Importing
this module installs it, so either of these is enough:

* `bb-broker flower -A myapp [flower options]`, or
* `import bb_broker.contrib.flower` in the `flowerconfig.py` Flower reads (or the file `--conf` names).

Flower itself reports a broker it cannot use (a wrong password, a server that is down) only in its log, while its
pages say "No workers are available" under a green "Updated". So `install()` also gives Flower (through the
`template_loader` setting Tornado documents and Flower passes on) a base template with a banner naming the broker's
error, kept current by a ping every few seconds (`BrokerHealth`), and makes the Workers table's refresh fail while
the error lasts, so that its dot turns red.

The queues listed are those of the collection (every queue holding queued, running or failed jobs, and every paused
one) together with those Flower's workers consume, so none is missing however Flower was started. Importing this
module also adds the Jobs tab (bb_broker.contrib.flower.jobs_tab), whose templates the same loader serves.

`authentication()` tells `bb-broker flower` whether Flower will ask for credentials, by Flower's own option parsing.

`tests/unit/test_flower_contracts.py` fails when the Flower internals this relies on move.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import tornado.template
import tornado.web
from celery import Celery, signals
from flower.views import BaseHandler
from pymongo.errors import OperationFailure, PyMongoError, ServerSelectionTimeoutError
from pymongo.uri_parser import parse_uri
from tornado.options import options as tornado_options

from bb_broker.connection import BrokerTarget, get_database, parse_broker_url, quick_timeouts, redact_url, scrub
from bb_broker.contrib.flower import jobs_tab as jobs_view
from bb_broker.contrib.flower import patches
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING
from bb_broker.ops.operations import Operations
from bb_broker.options import BrokerOptions, open_store
from bb_broker.server import is_authentication_failure
from bb_broker.threads import start_supervised

logger = logging.getLogger(__name__)

SCHEMES = frozenset({"bbmongo", "bbmongo+srv"})


def describe(exc: PyMongoError, target: BrokerTarget) -> str:
    """The error in words an operator acts on, with no password and none of the server's raw reply."""
    if is_authentication_failure(exc):
        parsed = parse_uri(target.mongo_uri, validate=False)
        source = parsed["options"].get("authSource") or target.database
        return f"authentication failed for user {parsed['username']!r} on database {source!r}"
    if isinstance(exc, ServerSelectionTimeoutError):
        return "no server answered: " + scrub(str(exc).split(", Timeout:")[0], target.secrets)
    if isinstance(exc, OperationFailure):
        return scrub(str((exc.details or {}).get("errmsg") or exc), target.secrets)
    return scrub(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", target.secrets)


class BrokerHealth:
    """Whether Flower's broker answers: a ping every `interval` seconds, in a thread of its own, one per broker URL."""

    interval = 5.0
    _monitors: dict[str, BrokerHealth] = {}
    _lock = threading.Lock()

    def __init__(self, broker_url: str) -> None:
        self.shown_url = redact_url(broker_url)  # as the user wrote it, the password masked
        self.target = parse_broker_url(broker_url)
        self._options = quick_timeouts(self.target)  # a check answers within seconds when the server is down
        self.problem: str | None = None
        self.checked = threading.Event()
        self._wake = threading.Event()

    @classmethod
    def of(cls, broker_url: str) -> BrokerHealth:
        """The monitor of this broker, started on first use."""
        with cls._lock:
            monitor = cls._monitors.get(broker_url)
            if monitor is None:
                monitor = cls._monitors[broker_url] = cls(broker_url)
                start_supervised("bb-broker-health", monitor._run)
            return monitor

    def check(self) -> str | None:
        """Ping the broker's database now (authenticating, as every connection does); its problem, or None."""
        try:
            get_database(self.target, **self._options).command("ping")
            self.problem = None
        except PyMongoError as exc:
            self.problem = describe(exc, self.target)
        self.checked.set()
        return self.problem

    def report(self, problem: str) -> None:
        """A query of Flower's found the broker failing: its pages say so now, and a check soon confirms or clears it
        (a server back in the meantime)."""
        self.problem = problem
        self.checked.set()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self.check()
            self._wake.wait(self.interval)
            self._wake.clear()

    def banner(self) -> str | None:
        """What Flower's pages say while the broker fails; None while it answers."""
        problem = self.problem
        if problem is None:
            return None
        return (
            f"Flower cannot use the broker {self.shown_url}: {problem}. "
            "Workers, tasks and queues shown here may be missing or out of date."
        )


def is_ours(broker_url: str | None) -> bool:
    """Whether Flower's broker URL is one of ours (bbmongo://, bbmongo+srv://)."""
    return bool(broker_url and broker_url.partition("://")[0].lower() in SCHEMES)


def broker_banner(handler: BaseHandler) -> str | None:
    """The banner for the broker of the Flower app serving `handler` (the base template calls this)."""
    broker_url = patches.broker_url_with_password(handler.application)
    if not is_ours(broker_url):
        return None
    monitor = BrokerHealth.of(broker_url)
    monitor.checked.wait(1.0)  # the first page after start waits for the first verdict, briefly
    return monitor.banner()


#: Where the banner goes in Flower's base template, the first found (Flower 2.1 and 2.2's main element; 2.0's alert
#: container), and the banner (escaped, as every value the template shows).
_BANNER_ANCHORS = (b'<main class="app-content" id="main-content">', b'<div id="alert-container"></div>')
_BANNER = b"""
{% from bb_broker.contrib.flower.broker import broker_banner %}{% set bb_broker_banner = broker_banner(handler) %}
{% if bb_broker_banner %}
<div class="alert alert-danger m-3" role="alert" id="bb-broker-error">{{ bb_broker_banner }}</div>
{% end %}
"""


class BannerLoader(tornado.template.Loader):
    """Flower's templates, with the broker banner in the base template every page extends, and the Jobs tab's."""

    def _create_template(self, name: str) -> tornado.template.Template:
        jobs_tab = jobs_view.template_source(self.root, name)
        if jobs_tab is not None:
            return tornado.template.Template(jobs_tab, name, self)
        if name != "base.html":
            return super()._create_template(name)
        source = Path(self.root, name).read_bytes()
        anchor = banner_anchor(source)
        if anchor is None:
            # Tornado loads a template once per process: said once, when Flower shows its first page.
            logger.warning(
                "this Flower's base.html has no place bb_broker knows for its broker banner: no page shows it"
            )
            return super()._create_template(name)
        return tornado.template.Template(source.replace(anchor, anchor + _BANNER, 1), name, self)


def banner_anchor(base_template: bytes) -> bytes | None:
    """The first of _BANNER_ANCHORS in Flower's base.html, or None (a release that moved them)."""
    return next((anchor for anchor in _BANNER_ANCHORS if anchor in base_template), None)


def fail_workers_refresh_while_broker_fails(handler: BaseHandler) -> None:
    """The Workers table's refresh fails while the broker does: its dot turns red instead of saying "Updated".
    `handler` is Flower's (its get_argument takes a `type`, Tornado's does not)."""
    if handler.get_argument("json", default=False, type=bool) and (banner := broker_banner(handler)):
        # Answered here, not raised: Flower before 2.2 writes an HTTPError's message unformatted ("%s").
        handler.set_status(503)
        handler.set_header("Content-Type", "text/plain")
        handler.finish(banner)


@signals.import_modules.connect
def _watch_flowers_broker(sender: Celery | None = None, **_: Any) -> None:
    # Flower imports its app's modules as it starts: the check starts then, not at the first page.
    if sender is None:
        return
    with sender.connection() as conn:
        broker_url = conn.as_uri(include_password=True)
    if is_ours(broker_url):
        BrokerHealth.of(broker_url)
        if not patches.workers_refresh_shows_failures():
            logger.warning("this Flower's Workers page does not show a failed refresh (Flower 2.1 and later do)")
        if "--read_only" in sys.argv and "read_only" not in tornado_options:
            # Flower 2.0 has no read-only mode and drops the option unsaid: every user may act, in any tab.
            logger.warning("this Flower has no --read_only (Flower 2.1 and later have): it is ignored, users may act")
        if not getattr(tornado_options, "read_only", False):  # Flower's options are parsed by now
            jobs_view.start_chart_summaries(sender, broker_url)


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
    """Make Flower's Broker factory answer `bbmongo://` URLs with `JobQueues`, its pages show the broker's error, and
    add the Jobs tab (patches.install); calling it twice changes nothing."""
    patches.install()


install()
