"""What the Jobs tab's handlers share in one Flower app (`JobsTab`): the operations on its broker, the threads its
queries run in, each user's share of them, the broker's health; and the tab's options among Flower's.

The queries run in threads of the tab's own, on a client with quick timeouts, never on Flower's event loop: a server
that is down, slow or swamped leaves Flower's other pages answering, and the tab answers 503 with the reason. Each
user has at most PER_USER_REQUESTS requests running; more are answered 429 at once.
"""

from __future__ import annotations

import functools
import os
import socket
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import tornado.web
from flower.views import BaseHandler
from pymongo.errors import ConnectionFailure, OperationFailure
from tornado.ioloop import IOLoop
from tornado.options import options as tornado_options

from bb_broker.app_stores import broker_url, store_for
from bb_broker.connection import parse_broker_url, quick_timeouts
from bb_broker.contrib.flower.health import BrokerHealth, describe
from bb_broker.jobs.queues import QueueControls
from bb_broker.ops.filters import ARGUMENT_SEARCH_WINDOW
from bb_broker.ops.operations import Operations
from bb_broker.ops.stats import SummarizingAhead
from bb_broker.server import is_authentication_failure
from bb_broker.upstream import flower as upstream_flower

#: The largest --jobs_search_window taken: past it a search inside arguments would read most of a big collection.
MAX_SEARCH_WINDOW = 1_000_000

T = TypeVar("T")

#: The threads the Jobs tab's queries run in, for all its users together (Flower's own executor stays Flower's).
QUERY_THREADS = 8
#: How many Jobs-tab requests one user may have running at a time: a page's refresh needs one, so four leave room for
#: a few tabs; a script's forty breakdowns at once get 429s instead of the threads everyone else needs.
PER_USER_REQUESTS = 4
#: The name the tab's client gives the server: its queries are told apart from the workers' (currentOp, logs).
APPNAME = "bb_broker Jobs tab"
#: The client name of a Flower's thread summarizing the charts ahead (start_chart_summaries).
SUMMARIES_APPNAME = "bb_broker chart summaries"


class JobsTab:
    """What the Jobs tab's handlers share in one Flower app: the operations on its broker (a client with quick
    timeouts), the threads its queries run in, the requests each user has running, and the broker's health, which
    makes its requests answer 503 at once while Flower knows the server cannot be used."""

    def __init__(self, app: Any) -> None:
        url = broker_url(app.capp)
        store = store_for(app.capp, appname=APPNAME, **quick_timeouts(parse_broker_url(url))) if url else None
        if store is None:
            raise tornado.web.HTTPError(404, "the Jobs tab needs a bbmongo:// broker")
        self.operations = Operations(store, QueueControls(store.coll.database))
        window = app.options.jobs_search_window
        if not 1 <= window <= MAX_SEARCH_WINDOW:  # Flower parses its options where no callback of ours is called
            limits = f"from 1 to {MAX_SEARCH_WINDOW}"
            raise tornado.web.HTTPError(500, f"--jobs_search_window must be {limits}, not {window}")
        self.operations.search_window = window
        self.health = BrokerHealth.of(upstream_flower.broker_url_with_password(app))
        self.executor = ThreadPoolExecutor(max_workers=QUERY_THREADS, thread_name_prefix="bb-jobs-tab")
        self.running: Counter[str] = Counter()  # requests running, by user; only the event loop's thread counts

    def refuse_while_failing(self) -> None:
        if (problem := self.health.problem) is not None:
            raise tornado.web.HTTPError(503, "%s", self.unreachable(problem))

    def unreachable(self, problem: str) -> str:
        return f"cannot reach the server at {self.health.shown_url}: {problem}"

    def admit(self, user: str) -> None:
        if self.running[user] >= PER_USER_REQUESTS:
            raise tornado.web.HTTPError(
                429,
                "%s",
                f"{user} has {self.running[user]} Jobs-tab requests running already (at most {PER_USER_REQUESTS} "
                "at a time): try again when one has answered",
            )
        self.running[user] += 1

    def done(self, user: str) -> None:
        self.running[user] -= 1
        if self.running[user] <= 0:
            del self.running[user]

    async def run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call(*args, **kwargs)` in the tab's threads; a server that cannot be used is a 503 saying why."""
        try:
            return await IOLoop.current().run_in_executor(self.executor, functools.partial(call, *args, **kwargs))
        except (ConnectionFailure, OperationFailure) as exc:
            if isinstance(exc, OperationFailure) and not is_authentication_failure(
                exc
            ):  # only a wrong login is the server's state
                raise
            problem = describe(exc, self.health.target)
            self.health.report(problem)  # the next requests answer at once, and every page shows the banner
            raise tornado.web.HTTPError(503, "%s", self.unreachable(problem)) from None


def start_chart_summaries(app: Any, broker_url: str) -> None:
    """Flower's share of keeping the charts' summaries written ahead of them (bb_broker.ops.stats.SummarizingAhead),
    once per jobs collection in a process, on a client with the Jobs tab's quick timeouts. A read-only Flower starts
    none: its charts read the summaries the workers and the other Flowers keep."""
    # A client of its own, named apart: its passes' reads are told from the tab's in the server's logs and
    # currentOp, and a slow pass queues behind none of the tab's requests.
    store = store_for(app, appname=SUMMARIES_APPNAME, **quick_timeouts(parse_broker_url(broker_url)))
    if store is not None:
        SummarizingAhead.start(Operations(store), owner=f"flower@{socket.gethostname()}:{os.getpid()}")


def tab_of(handler: BaseHandler) -> JobsTab:
    """The Flower app's JobsTab, made on first use."""
    state = upstream_flower.application_state(handler.application)
    tab = state.get("jobs_tab")
    if tab is None:
        tab = state["jobs_tab"] = JobsTab(handler.application)
    return tab


def operations_of(handler: tornado.web.RequestHandler) -> Operations:
    """One Operations per Flower app, on the broker Flower was started with."""
    return tab_of(handler).operations


def define_options() -> None:
    """The Jobs tab's options (`jobs_admins`, `jobs_search_window`) among Flower's (Tornado's global options, which
    Flower parses); calling it twice changes nothing."""
    if "jobs_admins" not in tornado_options:
        tornado_options.define(
            "jobs_admins",
            type=str,
            multiple=True,
            default=[],
            help="bb_broker Jobs tab: the users who may act on jobs and queues (everyone else reads only)",
        )
    if "jobs_search_window" not in tornado_options:
        tornado_options.define(
            "jobs_search_window",
            type=int,
            default=ARGUMENT_SEARCH_WINDOW,
            help="bb_broker Jobs tab: how many of the newest jobs of a filter a search inside arguments looks among",
        )
