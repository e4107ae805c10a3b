"""Flower's Jobs tab and its JSON API: the `jobs` collection listed, counted, looked up and acted on, in Flower's app.

The handlers join Flower's own Tornado application (so Flower's `--basic-auth`, OAuth and `--url_prefix` apply to
them) by being inserted into `flower.urls.handlers` before Flower's catch-all (plugin.install()). Who may act is
bb_broker.contrib.flower.access's; the threads the queries run in and each user's share of them,
bb_broker.contrib.flower.tab's. A job is named by the `id` argument, never by a segment of the path (see HANDLERS).
"""

from __future__ import annotations

import base64
import reprlib
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import tornado.web
from flower.api import BaseApiHandler
from flower.views import BaseHandler
from tornado import httputil
from tornado.web import url

from bb_broker.contrib.flower.access import (
    can_act,
    checks_each_change,
    read_only,
    refuse_cross_site,
    refuse_unless_allowed,
    user_name,
)
from bb_broker.contrib.flower.tab import operations_of, tab_of
from bb_broker.contrib.flower.templates import STATIC, static_version
from bb_broker.jobs.checkpoints import progress_of
from bb_broker.jobs.lifecycle import STATUSES, parse_duration
from bb_broker.jobs.queues import LimitError
from bb_broker.ops.canvas import canvas_of
from bb_broker.ops.filters import ARGUMENT_FIELDS, FILTER_NAMES, FilterError, JobFilter
from bb_broker.ops.operations import ACTIONS, ActionRefused, Operations
from bb_broker.ops.present import actions_of, arguments, as_json, as_text, attempts_of, describe_job
from bb_broker.ops.queries import MAX_PAGE, no_job_has
from bb_broker.ops.rerun import ACTION as RERUN
from bb_broker.ops.rerun import offered
from bb_broker.ops.stats import job_stats
from bb_broker.upstream import flower as upstream_flower

#: What an action's button says, where its name alone is not it.
ACTION_LABELS = {"run-now": "Run now"}
#: The longest job id or task id looked up (a job id is 26 characters; Celery's task ids are 36).
MAX_ID_LENGTH = 512
#: How long a chart's reading of the jobs may keep the server busy for one request (its summaries aside): a filter
#: no summary serves (a status, an error) over a month of jobs would read every one of them.
CHART_MAX_MS = 10_000

T = TypeVar("T")


def jsonable(value: Any) -> Any:
    """A document as the API and the pages carry it: present.as_json's, with bytes as base64."""
    return as_json(value, binary=lambda data: base64.b64encode(data).decode("ascii"))


def job_json(doc: dict[str, Any]) -> dict[str, Any]:
    """A job for the API: the document, `id` for `_id`, its readable arguments and attempts."""
    body = jsonable(doc)
    body["id"] = body.pop("_id")
    body["arguments"] = jsonable(arguments(doc))
    body["attemptHistory"] = jsonable(attempts_of(doc))
    body["progress"] = progress_of(doc)
    return body


#: How many of the jobs a bulk retry left failed its message names (its answer's `held` has them all).
HELD_SAID = 5


class JobsHandler(BaseHandler):
    """What the page, its data and its actions share: filters from the query string, errors as JSON, queries in the
    tab's threads, the user's share of them."""

    #: Whether the handler queries the server (the Jobs page does not: its data comes from /jobs/data).
    queries = True
    #: The user whose share of PER_USER_REQUESTS this request holds, until it finishes.
    _admitted: str | None = None

    def prepare(self) -> None:
        if self.request.method not in ("GET", "HEAD", "OPTIONS") and not checks_each_change(self):
            self.check_xsrf_cookie()  # here, first, as Tornado runs it under `xsrf_cookies` (Flower 2.2 on)
        super().prepare()
        if self.request.method == "OPTIONS" or not self.current_user:
            return  # no query to bound; or Flower's authentication answers (401, or its login page)
        tab = tab_of(self)  # a 404 for a broker that is not bbmongo://
        if not self.queries:
            return
        tab.refuse_while_failing()
        user = user_name(self)
        tab.admit(user)
        self._admitted = user

    def on_finish(self) -> None:
        if self._admitted is not None:
            tab_of(self).done(self._admitted)
            self._admitted = None
        super().on_finish()

    async def run_query(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call(*args, **kwargs)` in the Jobs tab's threads: Flower's event loop keeps serving pages meanwhile."""
        return await tab_of(self).run(call, *args, **kwargs)

    def plain_argument(self, name: str, default: Any = None, strip: bool = True) -> Any:
        """A request argument as sent, not HTML-escaped, on every Flower release (upstream.flower.plain_argument). The
        tab's values are parsed, never written into a page as they came (the templates escape what they show)."""
        return upstream_flower.plain_argument(self, name, default, strip)

    def filter_arguments(self, default: str | None) -> dict[str, str | None]:
        """The request's filter values by name; an entry's name (`schedule`) whole, spaces included, as
        JobFilter.parse takes it (Tornado strips arguments unless told)."""
        return {name: self.plain_argument(name, default=default, strip=name != "schedule") for name in FILTER_NAMES}

    def parse_filter(self, now: datetime) -> JobFilter:
        values = self.filter_arguments(None)
        values |= self.argument_filters()
        try:
            job_filter = JobFilter.parse(values, now, stale_after=operations_of(self).store.policy.stale_after)
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

    async def found_job(self) -> dict[str, Any]:
        """The job of the `id` argument (job_id), read; 404 when no job has that id or task id."""
        identifier = self.job_id()
        doc = await self.run_query(operations_of(self).find, identifier)
        if doc is None:
            raise tornado.web.HTTPError(404, "%s", no_job_has(identifier))
        return doc

    async def job_filter(self) -> JobFilter:
        """The request's filter, its ages (`since=1h`) on the server's clock, an argument search bounded to its
        window (the request's `searchFrom`, the one its count or list answered, else the newest jobs now)."""
        job_filter = self.parse_filter(await self.run_query(operations_of(self).now))
        return await self.run_query(operations_of(self).bounded, job_filter)

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
            raise tornado.web.HTTPError(400, f"bad filter: limit {reprlib.repr(limit_text)} is not a number") from None
        if not 1 <= limit <= MAX_PAGE:
            raise tornado.web.HTTPError(400, f"bad filter: limit must be between 1 and {MAX_PAGE}")
        return after, limit

    #: Errors as JSON {"error": message}; the two pages answer with Flower's own error pages instead.
    json_errors = True
    #: The page's own actions carry the page's XSRF token (bb_post.html); the JSON API's clients have none (Flower's
    #: API rules).
    form_token = True

    def check_xsrf_cookie(self) -> None:
        # Run by Tornado before a request that changes something, or by prepare on a Flower before 2.2. Flower 2.2
        # refuses cross-site requests when it has users, and checks nothing when it has none (--no-auth): then any
        # other site open in the operator's browser could post to an action, so the page's token is checked.
        options = self.application.options
        if checks_each_change(self):
            super().check_xsrf_cookie()  # Flower's rules (2.2 on), after bb_broker's cross-site check (plugin.py)
        else:
            # Flower before 2.2 has no rules here (its BaseHandler's method is Tornado's token check, which it never
            # asks for): Flower 2.2's, made here. Another site's request is refused whatever the login, and an OAuth
            # login's session cookie, which a browser sends with another site's form too, needs the page's token.
            refuse_cross_site(self)
            if options.auth and not self.request.headers.get("Authorization"):
                tornado.web.RequestHandler.check_xsrf_cookie(self)
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
            message = upstream_flower.http_error_message(exc)
            # The reason phrase Tornado's send_error set (the error's own, else the status code's).
            self.finish({"error": message or exc.reason or httputil.responses.get(status_code, "Unknown")})
            return
        if isinstance(exc, tornado.web.HTTPError) and exc.log_message and exc.args:
            # Flower's page shows an error's log_message as it is (before 2.2, unformatted: "%s"): its arguments in.
            shown = tornado.web.HTTPError(exc.status_code, exc.log_message % exc.args, reason=exc.reason)
            kwargs["exc_info"] = (tornado.web.HTTPError, shown, kwargs["exc_info"][2])
        super().write_error(status_code, **kwargs)

    async def list_body(self) -> dict[str, Any]:
        job_filter = await self.job_filter()
        after, limit = self.page_args()
        operations = operations_of(self)
        try:
            page = await self.run_query(operations.list_jobs, job_filter, after=after, limit=limit)
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None
        return {
            "filter": job_filter.as_dict(),
            "jobs": [jsonable({"id": doc.pop("_id"), **doc}) for doc in page.jobs],
            "next": page.next,
            "stoppedEarly": page.stopped_early,
            **search_window(job_filter, operations_of(self)),
        }

    async def count(self, job_filter: JobFilter, action: str, unchanged_since: datetime | None = None) -> int:
        try:
            return await self.run_query(operations_of(self).count, job_filter, action, unchanged_since=unchanged_since)
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None

    async def bulk_count(self, action: str) -> dict[str, Any]:
        """What a bulk action would change now, and `asOf`: the time of the count, which the action is bounded by."""
        job_filter = await self.bulk_filter(action)
        as_of = await self.run_query(operations_of(self).now)
        count = await self.count(job_filter, action, as_of)  # exactly the jobs the action, bounded by as_of, takes
        return {
            "action": action,
            "count": count,
            "asOf": as_of.isoformat(),
            "filter": job_filter.as_dict(),
            **search_window(job_filter, operations_of(self)),
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
        refuse_unless_allowed(self)
        try:
            # `fresh`: a retry that clears the job's checkpoint (the job page's "Retry from the start").
            fresh = self.plain_argument("fresh", default="") in ("1", "true")
            doc = await self.run_query(operations_of(self).act, action, identifier, by=user_name(self), fresh=fresh)
        except ActionRefused as exc:
            raise tornado.web.HTTPError(404 if exc.reason == "not found" else 409, str(exc)) from None
        job = {"id": doc["_id"], "deleted": True} if doc.get("deleted") else job_json(doc)
        return {"message": f"{action}: done", "job": job}

    async def act_on_filter(self, action: str) -> dict[str, Any]:
        """A bulk action on the current filter; `expected` (the count the operator confirmed) must still hold, and
        with `asOf` (the time of that count) it acts only on jobs unchanged since: not on one that arrived later."""
        if action not in ACTIONS:
            raise tornado.web.HTTPError(404, f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        refuse_unless_allowed(self)
        job_filter = await self.bulk_filter(action)
        as_of = self.as_of()
        operations = operations_of(self)
        expected = self.expected(action)
        count = await self.count(job_filter, action, as_of)
        if count != expected:
            raise tornado.web.HTTPError(409, f"{count} jobs match now, not {expected}: confirm again")
        held: dict[str, str] = {}
        changed = await self.run_query(
            operations.act_on_filter, action, job_filter, by=user_name(self), unchanged_since=as_of, held=held
        )
        said = list(held.values())[:HELD_SAID]  # the message is one line: the rest are in `held`
        if len(held) > HELD_SAID:
            said.append(f"and {len(held) - HELD_SAID} more left failed (see held)")
        message = "; ".join([f"{action}: {changed} job{'' if changed == 1 else 's'}", *said])
        return {"message": message, "count": changed, **({"held": held} if held else {})}

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
        refuse_unless_allowed(self)
        operations = operations_of(self)
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
        """Set a queue's limits: `concurrency=N`, `rate=10/m` or `rate=10/m per key` (each `none` removes it),
        `fair=true` or `fair=false`, or `clear=1` (all); a value that cannot be a limit is a 400, and nothing
        changes."""
        refuse_unless_allowed(self)
        concurrency = self.plain_argument("concurrency", default=None)
        rate = self.plain_argument("rate", default=None)
        fair = self.plain_argument("fair", default=None)
        clear = self.plain_argument("clear", default="") in ("1", "true")
        operations = operations_of(self)
        try:
            limits = await self.run_query(
                operations.set_limits,
                queue,
                concurrency=concurrency,
                rate=rate,
                fair=fair,
                clear=clear,
                by=user_name(self),
            )
        except (FilterError, LimitError) as exc:
            raise tornado.web.HTTPError(400, str(exc)) from None
        return {
            "message": f"queue {queue}: {limits.described()}",
            "queue": queue,
            "concurrency": limits.concurrency,
            "rate": None if limits.rate is None else str(limits.rate),
            "fair": limits.fair,
        }

    async def summary(self, *, breakdowns: bool = True) -> dict[str, Any]:
        """Counts per status and each queue's depths; per queue and per kind too unless `breakdowns` is False (the
        page asks for those only while they are shown: on a large collection they cost a scan of an index)."""
        operations = operations_of(self)
        consumed = self.get_active_queue_names()

        workers = upstream_flower.known_workers(self.application)

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


class JobsPage(JobsHandler):
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
            script_version=static_version("bb_jobs.js"),
        )


class JobsData(JobsHandler):
    """The page's live data: counts, queues and the current page of the list."""

    @tornado.web.authenticated
    async def get(self) -> None:
        body = await self.list_body()
        body.update(await self.summary(breakdowns=self.plain_argument("breakdowns", "") == "1"))
        body["canAct"] = can_act(self)
        self.write(body)


class JobsStats(JobsHandler):
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
                operations_of(self),
                job_filter,
                length,
                by,
                keep_summaries=not read_only(self),
                leave_to_holder=True,
                max_ms=CHART_MAX_MS,
            )
        except (FilterError, ValueError) as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None
        self.write(body)


class JobsBulkCount(JobsHandler):
    @tornado.web.authenticated
    async def get(self, action: str) -> None:
        self.write(await self.bulk_count(action))


class JobsBulkAction(JobsHandler):
    @tornado.web.authenticated
    async def post(self, action: str) -> None:
        self.write(await self.act_on_filter(action))


class JobAction(JobsHandler):
    @tornado.web.authenticated
    async def post(self, action: str) -> None:
        self.write(await self.act_on(action, self.job_id()))


class QueueAction(JobsHandler):
    @tornado.web.authenticated
    async def post(self, queue: str, change: str) -> None:
        self.write(await self.queue_control(queue, change))


class QueueLimitAction(JobsHandler):
    @tornado.web.authenticated
    async def post(self, queue: str) -> None:
        self.write(await self.queue_limits(queue))


class JobPage(JobsHandler):
    json_errors = False

    @tornado.web.authenticated
    async def get(self) -> None:
        doc = await self.found_job()
        self.render(
            "bb_job.html",
            job=doc,
            lines=describe_job(doc),
            attempts=attempts_of(doc),
            action_log=actions_of(doc),
            # Linked to Flower's task page only when it is a task id (a hand-written one may be anything).
            task_id=doc.get("taskId") if isinstance(doc.get("taskId"), str) else None,
            arguments=jsonable(arguments(doc)),
            actions=await self.run_query(operations_of(self).applicable, doc),
            rerun=RERUN if can_act(self) and offered(doc) else None,
            orphaned=await self.run_query(operations_of(self).orphaned, doc),
            stale_after=operations_of(self).store.policy.stale_after,
            action_labels=ACTION_LABELS,
            can_act=can_act(self),
            progress=progress_of(doc),
            jsonable=jsonable,
            as_text=as_text,
            canvas_script=static_version("bb_canvas.js"),
        )


class JobCanvas(JobsHandler):
    """The job's canvas (bb_broker.ops.canvas) as JSON: what the job page draws; read-only users may read it."""

    @tornado.web.authenticated
    async def get(self) -> None:
        identifier = self.job_id()
        body = await self.run_query(canvas_of, operations_of(self), identifier)
        if body is None:
            raise tornado.web.HTTPError(404, "%s", no_job_has(identifier))
        self.write(body)


# --- the JSON API (Flower's API authentication: its handlers refuse unauthenticated use unless allowed) ------------


class ApiHandler(JobsHandler, BaseApiHandler):
    """Flower's API handlers' rules (BaseApiHandler.prepare refuses an API without authentication unless
    FLOWER_UNAUTHENTICATED_API is set), our errors."""

    form_token = False


class JobsApi(ApiHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        body = await self.list_body()
        if self.plain_argument("counts", default="") in ("1", "true"):
            body.update(await self.summary())
        self.write(body)


class JobApi(ApiHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        doc = await self.found_job()
        self.write(job_json(doc))


# The API's actions are the page's, under the API's authentication rules.


class JobActionApi(JobAction, ApiHandler):
    pass


class JobCanvasApi(JobCanvas, ApiHandler):
    pass


class JobsStatsApi(JobsStats, ApiHandler):
    pass


class BulkApi(JobsBulkAction, ApiHandler):
    @tornado.web.authenticated
    async def get(self, action: str) -> None:
        body = await self.bulk_count(action)
        del body["filter"]
        self.write(body)


class QueueActionApi(QueueAction, ApiHandler):
    pass


class QueueLimitApi(QueueLimitAction, ApiHandler):
    pass


ACTION_PATTERN = "(" + "|".join(ACTIONS) + ")"
#: The files the Jobs page loads from STATIC: its script and the chart library.
STATIC_FILES = r"(bb_jobs\.js|bb_canvas\.js|uPlot\.iife\.min\.js|uPlot\.min\.css)"

# No job id or task id is ever part of a path: one job is `job?id=<id>` (its actions `job/<action>` with `id`), so
# whatever a task id is (`bulk`, `data`, `queue`, `..`, `a/b`), it cannot reach another route. Every path under
# /jobs/ and /api/jobs/ starts with a fixed word.
HANDLERS = [
    url(r"/jobs", JobsPage, name="jobs"),
    (r"/jobs/data", JobsData),
    (r"/jobs/stats", JobsStats),
    (r"/jobs/static/" + STATIC_FILES, tornado.web.StaticFileHandler, {"path": str(STATIC)}),
    url(r"/jobs/job", JobPage, name="job"),
    (r"/jobs/canvas", JobCanvas),
    (r"/jobs/job/" + ACTION_PATTERN, JobAction),
    (r"/jobs/bulk/" + ACTION_PATTERN + r"/count", JobsBulkCount),
    (r"/jobs/bulk/" + ACTION_PATTERN, JobsBulkAction),
    (r"/jobs/queue/([^/]+)/(pause|resume)", QueueAction),
    (r"/jobs/queue/([^/]+)/limit", QueueLimitAction),
    (r"/api/jobs", JobsApi),
    (r"/api/jobs/job", JobApi),
    (r"/api/jobs/canvas", JobCanvasApi),
    (r"/api/jobs/stats", JobsStatsApi),
    (r"/api/jobs/job/" + ACTION_PATTERN, JobActionApi),
    (r"/api/jobs/bulk/" + ACTION_PATTERN, BulkApi),
    (r"/api/queues/([^/]+)/(pause|resume)", QueueActionApi),
    (r"/api/queues/([^/]+)/limit", QueueLimitApi),
]
