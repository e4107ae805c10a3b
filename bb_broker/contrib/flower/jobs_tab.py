"""Flower's Jobs tab and its JSON API: the `jobs` collection listed, counted, looked up and acted on, in Flower's app.

The handlers join Flower's own Tornado application (so Flower's `--basic-auth`, OAuth and `--url_prefix` apply to
them) by being inserted into `flower.urls.handlers` before Flower's catch-all (patches.install_handlers, from
patches.install()); broker.py's template loader serves our templates and, through `template_source()`, adds the Jobs
link to Flower's navigation bar and a Paused column to its Broker tab. Who may act: Flower's `--read_only` stops
every action; `--jobs_admins=alice,bob` (or FLOWER_JOBS_ADMINS) lets only those users act (basic-auth user names or
OAuth e-mail addresses); everyone else reads, and gets a 403 to act, here and from Flower's own actions
(`refuse_flowers_action_unless_allowed()`). A job is named by the `id` argument, never by a segment of the path (see
HANDLERS).

The queries run in threads of the tab's own (`JobsTab`), on a client with quick timeouts, never on Flower's event
loop: a server that is down, slow or swamped leaves Flower's other pages answering, and the tab answers 503 with the
reason. Each user has at most PER_USER_REQUESTS requests running; more are answered 429 at once.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import re
import reprlib
import socket
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import tornado.web
from flower.api import BaseApiHandler
from flower.api.control import TaskRevoke
from flower.utils import strtobool
from flower.views import BaseHandler
from flower.views.error import NotFoundErrorHandler
from flower.views.tasks import TasksDataTable
from pymongo.errors import ConnectionFailure, OperationFailure
from tornado import httputil
from tornado.ioloop import IOLoop
from tornado.options import options as tornado_options
from tornado.web import url

from bb_broker.connection import parse_broker_url, quick_timeouts
from bb_broker.contrib.flower import patches
from bb_broker.jobs.lifecycle import STATUSES, parse_duration
from bb_broker.jobs.queues import LimitError, QueueControls
from bb_broker.ops.operations import (
    ACTIONS,
    ARGUMENT_FIELDS,
    ARGUMENT_SEARCH_WINDOW,
    FILTER_NAMES,
    MAX_PAGE,
    ActionRefused,
    FilterError,
    JobFilter,
    Operations,
)
from bb_broker.ops.present import actions_of, arguments, as_text, attempts_of, describe_job
from bb_broker.ops.stats import SummarizingAhead, job_stats
from bb_broker.server import is_authentication_failure

logger = logging.getLogger(__name__)
#: The largest --jobs_search_window taken: past it a search inside arguments would read most of a big collection.
MAX_SEARCH_WINDOW = 1_000_000

T = TypeVar("T")

TEMPLATES = Path(__file__).resolve().parent / "templates"
#: The chart library served with the page (uPlot, vendored: operators' networks often have no way to a CDN).
STATIC = Path(__file__).resolve().parent / "static"
OUR_TEMPLATES = ("bb_jobs.html", "bb_job.html", "bb_post.html", "bb_schedules.html")
#: What an action's button says, where its name alone is not it.
ACTION_LABELS = {"run-now": "Run now"}
#: The longest job id or task id looked up (a job id is 26 characters; Celery's task ids are 36).
MAX_ID_LENGTH = 512

#: Where the Jobs link goes in Flower's navbar.html, and the Broker tab's row and header ends in broker.html: each
#: found as Flower 2.0, 2.1 and 2.2 write them (indentation, a class, the cell's formatting differ).
NAVBAR_ANCHOR = re.compile(r"Broker</a>\s*</li>")
NAVBAR_LINK = """
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'jobs' %} active{% end %}" href="{{ reverse_url('jobs') }}"
            {% if active_tab == 'jobs' %}aria-current="page"{% end %}>Jobs</a>
        </li>
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'schedules' %} active{% end %}" href="{{ reverse_url('schedules') }}"
            {% if active_tab == 'schedules' %}aria-current="page"{% end %}>Schedules</a>
        </li>"""
BROKER_HEADER_ANCHOR = re.compile(r"<th[^>]*>Idle since</th>")
BROKER_CELL_ANCHOR = re.compile(r"[^\n]*queue\.get\('idle_since'[^\n]*?</td>")
BROKER_HEADER = "\n          <th>Paused</th>"
BROKER_CELL = "\n          <td>{{ ('paused by ' + str(queue.get('pausedBy'))) if queue.get('paused') else '—' }}</td>"

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
        from bb_broker.contrib.flower.broker import BrokerHealth  # bb_broker.contrib.flower.broker imports this module
        from bb_broker.worker.hooks import broker_url, store_for

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
        self.health = BrokerHealth.of(patches.broker_url_with_password(app))
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
        from bb_broker.contrib.flower.broker import describe

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
    from bb_broker.worker.hooks import store_for

    # A client of its own, named apart: its passes' reads are told from the tab's in the server's logs and
    # currentOp, and a slow pass queues behind none of the tab's requests.
    store = store_for(app, appname=SUMMARIES_APPNAME, **quick_timeouts(parse_broker_url(broker_url)))
    if store is not None:
        SummarizingAhead.start(Operations(store), owner=f"flower@{socket.gethostname()}:{os.getpid()}")


def _tab(handler: BaseHandler) -> JobsTab:
    """The Flower app's JobsTab, made on first use."""
    app = handler.application
    tab = getattr(app, "_bb_jobs_tab", None)
    if tab is None:
        tab = app._bb_jobs_tab = JobsTab(app)
    return tab


def _operations(handler: tornado.web.RequestHandler) -> Operations:
    """One Operations per Flower app, on the broker Flower was started with."""
    return _tab(handler).operations


def user_name(handler: BaseHandler) -> str:
    """Who is asking: the basic-auth user name, the OAuth user, or "anonymous" when Flower asks nobody."""
    options = handler.application.options
    if options.basic_auth:
        header = handler.request.headers.get("Authorization", "")
        try:
            scheme, encoded = header.split(None, 1)
            if scheme == "Basic":
                return base64.b64decode(encoded).decode().partition(":")[0]
        except (ValueError, UnicodeDecodeError):
            pass
    user = handler.current_user
    return user if isinstance(user, str) else "anonymous"


def admins(handler: BaseHandler) -> list[str]:
    names = getattr(handler.application.options, "jobs_admins", None) or []
    return [name.strip() for entry in names for name in str(entry).split(",") if name.strip()]


def read_only(handler: BaseHandler) -> bool:
    # Flower has had --read_only since 2.1; before, there is no such option (and nothing is read-only).
    return bool(getattr(handler.application.options, "read_only", False))


def can_act(handler: BaseHandler) -> bool:
    """Actions are for everyone Flower lets in, unless Flower is read-only or --jobs_admins names the few."""
    if read_only(handler):
        return False
    allowed = admins(handler)
    return not allowed or user_name(handler) in allowed


def _refuse_unless_allowed(handler: BaseHandler) -> None:
    if read_only(handler):
        raise tornado.web.HTTPError(403, "Flower is read-only (--read_only): no job or queue can be changed")
    if not can_act(handler):
        who = user_name(handler)
        raise tornado.web.HTTPError(403, f"{who} may read the jobs but not act on them (see --jobs_admins)")


def refuse_cross_site_without_login(handler: BaseHandler) -> None:
    """Flower checks where a request that changes something comes from only when it has users. Without (--no-auth),
    a page of another site open in the operator's browser could post to it: to the Jobs tab's API and Flower's own
    when FLOWER_UNAUTHENTICATED_API opens them (Flower then even answers every origin). So a request that says it
    comes from another site (Sec-Fetch-Site, Origin, else Referer) is refused; a script's, which says nothing, is not.
    """
    options = handler.application.options
    if options.basic_auth or options.auth:
        return  # Flower's own check (and its users' credentials) apply
    headers, host = handler.request.headers, handler.request.host
    site, origin, referer = headers.get("Sec-Fetch-Site"), headers.get("Origin"), headers.get("Referer")
    if site is not None and site != "same-origin":
        source = f"Sec-Fetch-Site {site}"
    elif origin is not None and urlparse(origin).netloc != host:
        source = f"Origin {origin}"
    elif origin is None and referer is not None and urlparse(referer).netloc != host:
        source = f"Referer {referer}"
    else:
        return
    raise tornado.web.HTTPError(
        403,
        "%s",
        f"cross-site request refused: Flower runs without login (--no-auth) and this request's {source[:200]} is not "
        f"a page of this Flower ({host})",
    )


def jsonable(value: Any) -> Any:
    """A document as JSON can carry it: dates as ISO 8601 (UTC), bytes as base64."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def job_json(doc: dict[str, Any]) -> dict[str, Any]:
    """A job for the API: the document, `id` for `_id`, its readable arguments and attempts."""
    body = jsonable(doc)
    body["id"] = body.pop("_id")
    body["arguments"] = jsonable(arguments(doc))
    body["attemptHistory"] = jsonable(attempts_of(doc))
    return body


class _JobsHandler(BaseHandler):
    """What the page, its data and its actions share: filters from the query string, errors as JSON, queries in the
    tab's threads, the user's share of them."""

    #: Whether the handler queries the server (the Jobs page does not: its data comes from /jobs/data).
    queries = True
    #: The user whose share of PER_USER_REQUESTS this request holds, until it finishes.
    _admitted: str | None = None

    def prepare(self) -> None:
        super().prepare()
        if self.request.method not in ("GET", "HEAD", "OPTIONS"):
            refuse_cross_site_without_login(self)  # Flower older than 2.2 does not call check_xsrf_cookie
        if self.request.method == "OPTIONS" or not self.current_user:
            return  # no query to bound; or Flower's authentication answers (401, or its login page)
        tab = _tab(self)  # a 404 for a broker that is not bbmongo://
        if not self.queries:
            return
        tab.refuse_while_failing()
        user = user_name(self)
        tab.admit(user)
        self._admitted = user

    def on_finish(self) -> None:
        if self._admitted is not None:
            _tab(self).done(self._admitted)
            self._admitted = None
        super().on_finish()

    async def run_query(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call(*args, **kwargs)` in the Jobs tab's threads: Flower's event loop keeps serving pages meanwhile."""
        return await _tab(self).run(call, *args, **kwargs)

    def plain_argument(self, name: str, default: Any = None, strip: bool = True) -> Any:
        """A request argument as sent, not HTML-escaped: Tornado's own get_argument, under Flower's override, which
        escapes every value before Flower 2.2 and takes `escape=False` only from 2.2 on. The tab's values are parsed,
        never written into a page as they came (the templates escape what they show)."""
        return tornado.web.RequestHandler.get_argument(self, name, default, strip)

    def filter_arguments(self, default: str | None) -> dict[str, str | None]:
        """The request's filter values by name; an entry's name (`schedule`) whole, spaces included, as
        JobFilter.parse takes it (Tornado strips arguments unless told)."""
        return {name: self.plain_argument(name, default=default, strip=name != "schedule") for name in FILTER_NAMES}

    def parse_filter(self, now: datetime) -> JobFilter:
        values = self.filter_arguments(None)
        values |= self.argument_filters()
        try:
            job_filter = JobFilter.parse(values, now, stale_after=_operations(self).store.policy.stale_after)
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None
        search_from = self.plain_argument("searchFrom", default="")
        if search_from and job_filter.arguments:
            if len(search_from) > 64:
                raise tornado.web.HTTPError(400, "bad filter: searchFrom must be the searchFrom of a list or a count")
            job_filter = replace(job_filter, search_from=search_from)
        return job_filter

    def argument_filters(self) -> dict[str, str | None]:
        """The request's searches inside arguments and headers (`kwargs.<name>=`, `args.<n>=`, `headers.<name>=`),
        their values exactly as sent; JobFilter.parse checks each name."""
        return {
            name: self.plain_argument(name, default=None, strip=False)
            for name in self.request.arguments
            if name.partition(".")[0] in ARGUMENT_FIELDS
        }

    def job_id(self) -> str:
        """The job an action or a look-up is about: its job id or Celery task id, from the `id` argument (a task id
        may be any text, `bulk`, `..` or `a/b` included, so it is never a segment of the path)."""
        identifier = self.plain_argument("id", default="", strip=False)
        if not identifier:
            raise tornado.web.HTTPError(400, "id is required: a job id or a Celery task id")
        if len(identifier) > MAX_ID_LENGTH:
            raise tornado.web.HTTPError(400, f"id is longer than {MAX_ID_LENGTH} characters: no job has it")
        return identifier

    async def job_filter(self) -> JobFilter:
        """The request's filter, its ages (`since=1h`) on the server's clock, an argument search bounded to its
        window (the request's `searchFrom`, the one its count or list answered, else the newest jobs now)."""
        job_filter = self.parse_filter(await self.run_query(_operations(self).now))
        return await self.run_query(_operations(self).bounded, job_filter)

    async def bulk_filter(self, action: str) -> JobFilter:
        """The filter of a bulk action, which must narrow it: an empty one would take every job of the collection."""
        job_filter = await self.job_filter()
        if not job_filter.as_dict():
            raise tornado.web.HTTPError(
                400, f"bulk {action} needs a filter ({', '.join(FILTER_NAMES)}): without one it would take every job"
            )
        return job_filter

    def page_args(self) -> tuple[str | None, int]:
        after = self.plain_argument("after", default=None) or None
        if after is not None and len(after) > 64:
            raise tornado.web.HTTPError(400, "bad filter: after must be a job id (the `next` of the previous page)")
        limit_text = self.plain_argument("limit", default="50")
        try:
            limit = int(limit_text)
        except ValueError:
            raise tornado.web.HTTPError(400, f"bad filter: limit {limit_text!r} is not a number") from None
        if not 1 <= limit <= MAX_PAGE:
            raise tornado.web.HTTPError(400, f"bad filter: limit must be between 1 and {MAX_PAGE}")
        return after, limit

    #: Errors as JSON {"error": message}; the two pages answer with Flower's own error pages instead.
    json_errors = True
    #: The page's own actions carry Flower's XSRF token; the JSON API's clients have none (Flower's API rules).
    form_token = True

    def check_xsrf_cookie(self) -> None:
        # Flower refuses cross-site requests when it has users, and checks nothing when it has none (--no-auth):
        # then any other site open in the operator's browser could post to an action, so the token is checked.
        super().check_xsrf_cookie()
        options = self.application.options
        if self.form_token and not (options.basic_auth or options.auth):
            tornado.web.RequestHandler.check_xsrf_cookie(self)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = (kwargs.get("exc_info") or (None, None))[1]
        if status_code == 401:
            # Flower's page answer, with the basic-auth challenge (its API's answer has none, so clients cannot retry).
            BaseHandler.write_error(self, status_code, **kwargs)
            return
        if self.json_errors and isinstance(exc, tornado.web.HTTPError):
            self.set_header("Content-Type", "application/json; charset=UTF-8")
            message = exc.log_message % exc.args if exc.log_message and exc.args else exc.log_message
            # The reason phrase Tornado's send_error set (the error's own, else the status code's).
            self.finish({"error": message or exc.reason or httputil.responses.get(status_code, "Unknown")})
            return
        super().write_error(status_code, **kwargs)

    async def list_body(self) -> dict[str, Any]:
        job_filter = await self.job_filter()
        after, limit = self.page_args()
        operations = _operations(self)
        try:
            page = await self.run_query(operations.list_jobs, job_filter, after=after, limit=limit)
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None
        return {
            "filter": job_filter.as_dict(),
            "jobs": [jsonable({"id": doc.pop("_id"), **doc}) for doc in page.jobs],
            "next": page.next,
            "stoppedEarly": page.stopped_early,
            **search_window(job_filter, _operations(self)),
        }

    async def count(self, job_filter: JobFilter, action: str, unchanged_since: datetime | None = None) -> int:
        try:
            return await self.run_query(_operations(self).count, job_filter, action, unchanged_since=unchanged_since)
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None

    async def bulk_count(self, action: str) -> dict[str, Any]:
        """What a bulk action would change now, and `asOf`: the time of the count, which the action is bounded by."""
        job_filter = await self.bulk_filter(action)
        as_of = await self.run_query(_operations(self).now)
        count = await self.count(job_filter, action, as_of)  # exactly the jobs the action, bounded by as_of, takes
        return {
            "action": action,
            "count": count,
            "asOf": as_of.isoformat(),
            "filter": job_filter.as_dict(),
            **search_window(job_filter, _operations(self)),
        }

    def as_of(self) -> datetime | None:
        text = self.plain_argument("asOf", default=None)
        if not text:
            return None
        try:
            moment = datetime.fromisoformat(text.strip())
            # In UTC, as the server compares it: a time of year 1 or 9999 an offset takes out of the calendar has no
            # BSON date (OverflowError in the query's encoding, a 500).
            return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
        except (ValueError, OverflowError):
            raise tornado.web.HTTPError(
                400, f"bad filter: asOf {reprlib.repr(text)} is not the asOf of a count"
            ) from None

    async def act_on(self, action: str, identifier: str) -> dict[str, Any]:
        _refuse_unless_allowed(self)
        try:
            doc = await self.run_query(_operations(self).act, action, identifier, by=user_name(self))
        except ActionRefused as exc:
            raise tornado.web.HTTPError(404 if exc.reason == "not found" else 409, str(exc)) from None
        job = {"id": doc["_id"], "deleted": True} if doc.get("deleted") else job_json(doc)
        return {"message": f"{action}: done", "job": job}

    async def act_on_filter(self, action: str) -> dict[str, Any]:
        """A bulk action on the current filter; `expected` (the count the operator confirmed) must still hold, and
        with `asOf` (the time of that count) it acts only on jobs unchanged since: not on one that arrived later."""
        if action not in ACTIONS:
            raise tornado.web.HTTPError(404, f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        _refuse_unless_allowed(self)
        job_filter = await self.bulk_filter(action)
        as_of = self.as_of()
        operations = _operations(self)
        expected = self.expected(action)
        count = await self.count(job_filter, action, as_of)
        if count != expected:
            raise tornado.web.HTTPError(409, f"{count} jobs match now, not {expected}: confirm again")
        changed = await self.run_query(
            operations.act_on_filter, action, job_filter, by=user_name(self), unchanged_since=as_of
        )
        return {"message": f"{action}: {changed} job{'' if changed == 1 else 's'}", "count": changed}

    def expected(self, action: str) -> int:
        """The count the operator confirmed (the `count` of GET .../count): a bulk action without it is refused."""
        text = self.plain_argument("expected", default="").strip()
        # ASCII digits only, and short: str.isdigit() takes '²', which int() refuses, and int() refuses 4,300 digits
        if not (text.isascii() and text.isdigit() and len(text) <= 18):
            shown = f" ({text!r} is not a count)" if text else ""
            raise tornado.web.HTTPError(
                400, f"bulk {action} needs expected=<the count you confirmed>{shown}: count first (GET .../count)"
            )
        return int(text)

    async def queue_control(self, queue: str, change: str) -> dict[str, Any]:
        _refuse_unless_allowed(self)
        operations = _operations(self)
        try:
            changed = await self.run_query(getattr(operations, change), queue, by=user_name(self))
        except FilterError as exc:
            raise tornado.web.HTTPError(400, str(exc)) from None
        state = "paused" if change == "pause" else "resumed"
        message = f"queue {queue} {state}" if changed else f"queue {queue} was already {state}"
        if not changed and change == "resume":
            message = f"queue {queue} was not paused"
        return {"message": message, "queue": queue, "changed": changed}

    async def queue_limits(self, queue: str) -> dict[str, Any]:
        """Set a queue's limits: `concurrency=N`, `rate=10/m` or `rate=10/m per key` (each `none` removes it), or
        `clear=1` (both); a value that cannot be a limit is a 400, and nothing changes."""
        _refuse_unless_allowed(self)
        concurrency = self.plain_argument("concurrency", default=None)
        rate = self.plain_argument("rate", default=None)
        clear = self.plain_argument("clear", default="") in ("1", "true")
        operations = _operations(self)
        try:
            limits = await self.run_query(
                operations.set_limits, queue, concurrency=concurrency, rate=rate, clear=clear, by=user_name(self)
            )
        except (FilterError, LimitError) as exc:
            raise tornado.web.HTTPError(400, str(exc)) from None
        shown = []
        if limits.concurrency is not None:
            shown.append(f"at most {limits.concurrency} running at once")
        if limits.rate is not None:
            shown.append(f"at most {limits.rate} started")
        return {
            "message": f"queue {queue}: {', '.join(shown) or 'no limit'}",
            "queue": queue,
            "concurrency": limits.concurrency,
            "rate": None if limits.rate is None else str(limits.rate),
        }

    async def summary(self, *, breakdowns: bool = True) -> dict[str, Any]:
        """Counts per status and each queue's depths; per queue and per kind too unless `breakdowns` is False (the
        page asks for those only while they are shown: on a large collection they cost a scan of an index)."""
        operations = _operations(self)
        consumed = self.get_active_queue_names()

        workers = patches.known_workers(self.application)

        def read() -> dict[str, Any]:
            body = {"statuses": operations.statuses(), "queues": jsonable(operations.queues(consumed))}
            body["orphaned"] = operations.orphaned_count()
            body["holders"] = [
                jsonable(holder | {"worker": worker_of(holder, workers)}) for holder in operations.holders()
            ]
            if breakdowns:
                body |= {"byQueue": operations.breakdown("queue"), "byKind": operations.breakdown("kind")}
            return body

        return await self.run_query(read)


def search_window(job_filter: JobFilter, operations: Operations) -> dict[str, Any]:
    """What an answer says of an argument search's bounds: `searchFrom`, the oldest job it looked at when it could not
    look at them all (pass it back to page on, or to act on what was counted), and the window's size."""
    if not job_filter.arguments:
        return {}
    return {"searchFrom": job_filter.search_from, "searchWindow": operations.search_window}


def worker_of(holder: dict[str, Any], workers: dict[str, int | None]) -> str | None:
    """The node name of the Celery worker (as Flower knows it) that is the holder's process: the same process id, on
    the host its node name names (`name@host`, where the host may be the lease's or its fully qualified form)."""
    host, pid = holder.get("host"), holder.get("pid")
    if host is None or pid is None:
        return None
    for name, worker_pid in workers.items():
        node_host = name.partition("@")[2]
        if worker_pid == pid and (
            node_host == host or node_host.startswith(host + ".") or host.startswith(node_host + ".")
        ):
            return name
    return None


# --- the pages -----------------------------------------------------------------------------------------------------


class JobsPage(_JobsHandler):
    json_errors = False
    queries = False  # it answers during an outage too, with Flower's banner

    @tornado.web.authenticated
    async def get(self) -> None:
        # Only checked here (a bad one is a 400 page), on this machine's clock: /jobs/data reads on the server's.
        job_filter = self.parse_filter(datetime.now(UTC))
        self.page_args()
        self.render(
            "bb_jobs.html",
            filters=job_filter.as_dict(),
            raw_filters=self.filter_arguments(""),
            argument_filters=job_filter.arguments,
            statuses=list(STATUSES),
            filter_names=list(FILTER_NAMES),
            can_act=can_act(self),
            user=user_name(self),
        )


class JobsData(_JobsHandler):
    """The page's live data: counts, queues and the current page of the list."""

    @tornado.web.authenticated
    async def get(self) -> None:
        body = await self.list_body()
        body.update(await self.summary(breakdowns=self.plain_argument("breakdowns", "") == "1"))
        body["canAct"] = can_act(self)
        self.write(body)


class JobsStats(_JobsHandler):
    """The charts' numbers: `window` (1h, 1d, 1w or any duration up to 31 days) ending now, `by` queue or kind, the
    page's filters."""

    @tornado.web.authenticated
    async def get(self) -> None:
        job_filter = await self.job_filter()
        text = self.plain_argument("window", default="1h").strip() or "1h"
        by = self.plain_argument("by", default="").strip() or None
        try:
            length = parse_duration(text)
            # A read-only Flower reads the charts' summaries there are and writes none. No request summarizes more
            # than a quarter hour while a process summarizing ahead has the rest in hand.
            body = await self.run_query(
                job_stats,
                _operations(self),
                job_filter,
                length,
                by,
                keep_summaries=not read_only(self),
                leave_to_holder=True,
            )
        except (FilterError, ValueError) as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None
        self.write(body)


class JobsBulkCount(_JobsHandler):
    @tornado.web.authenticated
    async def get(self, action: str) -> None:
        self.write(await self.bulk_count(action))


class JobsBulkAction(_JobsHandler):
    @tornado.web.authenticated
    async def post(self, action: str) -> None:
        self.write(await self.act_on_filter(action))


class JobAction(_JobsHandler):
    @tornado.web.authenticated
    async def post(self, action: str) -> None:
        self.write(await self.act_on(action, self.job_id()))


class QueueAction(_JobsHandler):
    @tornado.web.authenticated
    async def post(self, queue: str, change: str) -> None:
        self.write(await self.queue_control(queue, change))


class QueueLimitAction(_JobsHandler):
    @tornado.web.authenticated
    async def post(self, queue: str) -> None:
        self.write(await self.queue_limits(queue))


class JobPage(_JobsHandler):
    json_errors = False

    @tornado.web.authenticated
    async def get(self) -> None:
        identifier = self.job_id()
        doc = await self.run_query(_operations(self).find, identifier)
        if doc is None:
            raise tornado.web.HTTPError(404, f"no job has the id or task id {identifier!r}")
        self.render(
            "bb_job.html",
            job=doc,
            lines=describe_job(doc),
            attempts=attempts_of(doc),
            action_log=actions_of(doc),
            # Linked to Flower's task page only when it is a task id (a hand-written one may be anything).
            task_id=doc.get("taskId") if isinstance(doc.get("taskId"), str) else None,
            arguments=jsonable(arguments(doc)),
            actions=await self.run_query(_operations(self).applicable, doc),
            orphaned=await self.run_query(_operations(self).orphaned, doc),
            stale_after=_operations(self).store.policy.stale_after,
            action_labels=ACTION_LABELS,
            can_act=can_act(self),
            jsonable=jsonable,
            as_text=as_text,
        )


# --- the JSON API (Flower's API authentication: its handlers refuse unauthenticated use unless allowed) ------------


class _ApiHandler(_JobsHandler, BaseApiHandler):
    """Flower's API handlers' rules (BaseApiHandler.prepare refuses an API without authentication unless
    FLOWER_UNAUTHENTICATED_API is set), our errors."""

    form_token = False


class JobsApi(_ApiHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        body = await self.list_body()
        if self.plain_argument("counts", default="") in ("1", "true"):
            body.update(await self.summary())
        self.write(body)


class JobApi(_ApiHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        identifier = self.job_id()
        doc = await self.run_query(_operations(self).find, identifier)
        if doc is None:
            raise tornado.web.HTTPError(404, f"no job has the id or task id {identifier!r}")
        self.write(job_json(doc))


# The API's actions are the page's, under the API's authentication rules.


class JobActionApi(JobAction, _ApiHandler):
    pass


class JobsStatsApi(JobsStats, _ApiHandler):
    pass


class BulkApi(JobsBulkAction, _ApiHandler):
    @tornado.web.authenticated
    async def get(self, action: str) -> None:
        body = await self.bulk_count(action)
        del body["filter"]
        self.write(body)


class QueueActionApi(QueueAction, _ApiHandler):
    pass


class QueueLimitApi(QueueLimitAction, _ApiHandler):
    pass


ACTION_PATTERN = "(" + "|".join(ACTIONS) + ")"

# No job id or task id is ever part of a path: one job is `job?id=<id>` (its actions `job/<action>` with `id`), so
# whatever a task id is (`bulk`, `data`, `queue`, `..`, `a/b`), it cannot reach another route. Every path under
# /jobs/ and /api/jobs/ starts with a fixed word.
HANDLERS = [
    url(r"/jobs", JobsPage, name="jobs"),
    (r"/jobs/data", JobsData),
    (r"/jobs/stats", JobsStats),
    (r"/jobs/static/(uPlot\.iife\.min\.js|uPlot\.min\.css)", tornado.web.StaticFileHandler, {"path": str(STATIC)}),
    url(r"/jobs/job", JobPage, name="job"),
    (r"/jobs/job/" + ACTION_PATTERN, JobAction),
    (r"/jobs/bulk/" + ACTION_PATTERN + r"/count", JobsBulkCount),
    (r"/jobs/bulk/" + ACTION_PATTERN, JobsBulkAction),
    (r"/jobs/queue/([^/]+)/(pause|resume)", QueueAction),
    (r"/jobs/queue/([^/]+)/limit", QueueLimitAction),
    (r"/api/jobs", JobsApi),
    (r"/api/jobs/job", JobApi),
    (r"/api/jobs/stats", JobsStatsApi),
    (r"/api/jobs/job/" + ACTION_PATTERN, JobActionApi),
    (r"/api/jobs/bulk/" + ACTION_PATTERN, BulkApi),
    (r"/api/queues/([^/]+)/(pause|resume)", QueueActionApi),
    (r"/api/queues/([^/]+)/limit", QueueLimitApi),
]


def template_source(root: str, name: str) -> bytes | None:
    """The source of one of our templates, or of Flower's navigation bar with the Jobs link and its Broker tab with
    the Paused column (from Flower's template directory `root`); None for any other template."""
    if name in OUR_TEMPLATES:
        return (TEMPLATES / name).read_bytes()
    if name == "navbar.html":
        return _after(
            NAVBAR_ANCHOR, NAVBAR_LINK, (Path(root) / name).read_text(), "the Jobs and Schedules links"
        ).encode()
    if name == "broker.html":
        text = _after(BROKER_HEADER_ANCHOR, BROKER_HEADER, (Path(root) / name).read_text(), "the Paused column")
        return _after(BROKER_CELL_ANCHOR, BROKER_CELL, text, "the Paused column").encode()
    return None


def _after(anchor: re.Pattern[str], addition: str, template: str, what: str) -> str:
    """`template` with `addition` after the first match of `anchor`; as it was, said in one line, without one."""
    found = anchor.search(template)
    if found is None:
        # Tornado loads a template once per process: said once, when Flower first shows the page.
        logger.warning("this Flower's templates have no place bb_broker knows for %s: they are not shown", what)
        return template
    return template[: found.end()] + addition + template[found.end() :]


# --- Flower's own actions, for --jobs_admins only -------------------------------------------------------------------
#
# Flower checks who may act nowhere (its --read_only is for everyone), so `--jobs_admins` would make nobody read-only
# while Flower's API lets them revoke, shut workers down or stop a queue's consumer. patches.guard_prepare wraps
# the `prepare` (which Tornado runs before every method, after the XSRF check) of each of Flower's handlers that has a
# method other than GET, HEAD and OPTIONS: a user --jobs_admins does not name gets a 403 before the method runs. A
# handler Flower adds later is guarded too unless it is listed in READING_POSTS. Checked against Flower 2.0.0, 2.0.1,
# 2.1.0 and 2.2.0: the same handlers in flower.urls (tests/unit/test_flower_contracts.py lists them and fails when
# that changes), BaseApiHandler.prepare the only `prepare`, TaskRevoke's task id its one path argument.

#: Flower's handlers whose POST only reads: the Tasks page's table posts its query; the catch-all answers 404.
READING_POSTS = (TasksDataTable, NotFoundErrorHandler)
#: The methods that can change something (Tornado's RequestHandler answers 405 for each a handler lacks).
WRITE_METHODS = ("post", "put", "delete", "patch")


def flowers_actions(handlers: Iterable[Any]) -> list[type[tornado.web.RequestHandler]]:
    """The handler classes of a Flower URL table that can change something: each with a write method, except the
    Jobs tab's own (they check who may act themselves) and READING_POSTS."""
    found: list[type[tornado.web.RequestHandler]] = []
    for spec in handlers:
        handler_class = patches.handler_class_of(spec)
        if handler_class in found or issubclass(handler_class, (_JobsHandler, *READING_POSTS)):
            continue
        base = tornado.web.RequestHandler
        if any(getattr(handler_class, name) is not getattr(base, name) for name in WRITE_METHODS):
            found.append(handler_class)
    return found


async def refuse_flowers_action_unless_allowed(handler: BaseHandler) -> None:
    """What runs after the `prepare` of each of Flower's actions (patches.guard_prepare): a user --jobs_admins does not
    name gets a 403, and an admin's revoke is recorded on the task's jobs."""
    if handler.request.method in ("GET", "HEAD", "OPTIONS") or not handler.current_user:
        return  # reading; or nobody logged in, which the method's @authenticated answers (401, or the login)
    if not can_act(handler) and not read_only(handler):  # read-only Flower: its handlers say so themselves
        who = user_name(handler)
        # Answered here, not raised: Flower 2.0's task API writes no words for an error (its write_error sets the
        # status only). Tornado runs no method of a handler its prepare finished.
        handler.set_status(403)
        handler.set_header("Content-Type", "text/plain")
        handler.finish(f"{who} may look but not act: only --jobs_admins may use Flower's actions")
        return
    if isinstance(handler, TaskRevoke) and can_act(handler):
        await _record_revoke(handler)


async def _record_revoke(handler: TaskRevoke) -> None:
    """Flower's revoke, recorded on the task's jobs with the user's name before Flower broadcasts it: a queued job
    ends failed ("revoked before it ran") by this user, not by the anonymous broadcast the transport sees."""
    terminate_text = tornado.web.RequestHandler.get_argument(handler, "terminate", "") or "false"
    try:
        terminate = bool(strtobool(terminate_text))
    except ValueError:
        return  # Flower answers 400 for it, and revokes nothing
    try:
        operations = _operations(handler)
    except tornado.web.HTTPError:
        return  # a Flower on another broker: no jobs collection to record on
    task_id = handler.path_args[0]
    await _tab(handler).run(operations.revoke, [task_id], by=user_name(handler), terminate=terminate)


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
