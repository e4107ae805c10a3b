"""Flower's Jobs tab and its JSON API: the `jobs` collection listed, counted, looked up and acted on, in Flower's app.

The handlers join Flower's own Tornado application (so Flower's `--basic-auth`, OAuth and `--url_prefix` apply to
them) by being inserted into `flower.urls.handlers` before Flower's catch-all (`install()`, which bb_broker.flower
calls); bb_broker.flower's template loader serves our templates and, through `template_source()`, adds the Jobs
link to Flower's navigation bar and a Paused column to its Broker tab. Who may act: Flower's `--read_only` stops
every action; `--jobs_admins=alice,bob` (or FLOWER_JOBS_ADMINS) lets only those users act (basic-auth user names or
OAuth e-mail addresses); everyone else reads, and gets a 403 to act.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import tornado.web
from flower import urls as flower_urls
from flower.api import BaseApiHandler
from flower.views import BaseHandler
from tornado.ioloop import IOLoop
from tornado.options import options as tornado_options
from tornado.web import url

from .lifecycle import STATUSES
from .operations import (
    ACTIONS,
    MAX_PAGE,
    ActionRefused,
    FilterError,
    JobFilter,
    Operations,
    actions_of,
    arguments,
    as_text,
    attempts_of,
    describe_job,
)
from .pauses import QueueControls

logger = logging.getLogger(__name__)

T = TypeVar("T")

TEMPLATES = Path(__file__).resolve().parent / "templates"
OUR_TEMPLATES = ("bb_jobs.html", "bb_job.html", "bb_post.html")
FILTERS = ("status", "queue", "kind", "since", "until", "error")

#: Where the Jobs link goes in Flower's navbar.html, and the Broker tab's row and header ends in broker.html.
NAVBAR_ANCHOR = "Broker</a>\n        </li>"
NAVBAR_LINK = """
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'jobs' %} active{% end %}" href="{{ reverse_url('jobs') }}"
            {% if active_tab == 'jobs' %}aria-current="page"{% end %}>Jobs</a>
        </li>"""
BROKER_HEADER_ANCHOR = '<th class="broker-secondary-column">Idle since</th>'
BROKER_CELL_ANCHOR = "{% raw format_value(queue.get('idle_since')) %}</td>"
BROKER_HEADER = "\n          <th>Paused</th>"
BROKER_CELL = "\n          <td>{{ ('paused by ' + str(queue.get('pausedBy'))) if queue.get('paused') else '—' }}</td>"


def _operations(handler: tornado.web.RequestHandler) -> Operations:
    """One Operations per Flower app, on the broker Flower was started with."""
    app = handler.application
    operations = getattr(app, "_bb_operations", None)
    if operations is None:
        from .celery_hooks import store_for

        store = store_for(app.capp)
        if store is None:
            raise tornado.web.HTTPError(404, "the Jobs tab needs a bbmongo:// broker")
        operations = app._bb_operations = Operations(store, QueueControls(store.coll.database))
    return operations


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


def can_act(handler: BaseHandler) -> bool:
    """Actions are for everyone Flower lets in, unless Flower is read-only or --jobs_admins names the few."""
    if handler.application.options.read_only:
        return False
    allowed = admins(handler)
    return not allowed or user_name(handler) in allowed


def _refuse_unless_allowed(handler: BaseHandler) -> None:
    if handler.application.options.read_only:
        raise tornado.web.HTTPError(403, "Flower is read-only (--read_only): no job or queue can be changed")
    if not can_act(handler):
        who = user_name(handler)
        raise tornado.web.HTTPError(403, f"{who} may read the jobs but not act on them (see --jobs_admins)")


async def _run(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    # Every query runs in Flower's executor: its event loop keeps serving pages meanwhile.
    return await IOLoop.current().run_in_executor(None, lambda: call(*args, **kwargs))


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
    """What the page, its data and its actions share: filters from the query string, errors as JSON."""

    def job_filter(self) -> JobFilter:
        values = {name: self.get_argument(name, default=None, escape=False) for name in FILTERS}
        try:
            return JobFilter.parse(values, _operations(self).now())
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None

    def page_args(self) -> tuple[str | None, int]:
        after = self.get_argument("after", default=None, escape=False) or None
        if after is not None and len(after) > 64:
            raise tornado.web.HTTPError(400, "bad filter: after must be a job id (the `next` of the previous page)")
        limit_text = self.get_argument("limit", default="50", escape=False)
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
            self.finish({"error": exc.log_message or self._reason})
            return
        super().write_error(status_code, **kwargs)

    async def list_body(self) -> dict[str, Any]:
        job_filter = self.job_filter()
        after, limit = self.page_args()
        operations = _operations(self)
        try:
            page = await _run(operations.list_jobs, job_filter, after=after, limit=limit)
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None
        return {
            "filter": job_filter.as_dict(),
            "jobs": [jsonable({"id": doc.pop("_id"), **doc}) for doc in page.jobs],
            "next": page.next,
            "stoppedEarly": page.stopped_early,
        }

    async def count(self, job_filter: JobFilter, action: str, unchanged_since: datetime | None = None) -> int:
        try:
            return await _run(_operations(self).count, job_filter, action, unchanged_since=unchanged_since)
        except FilterError as exc:
            raise tornado.web.HTTPError(400, f"bad filter: {exc}") from None

    async def bulk_count(self, action: str) -> dict[str, Any]:
        """What a bulk action would change now, and `asOf`: the time of the count, which the action is bounded by."""
        job_filter = self.job_filter()
        as_of = await _run(_operations(self).now)
        count = await self.count(job_filter, action, as_of)  # exactly the jobs the action, bounded by as_of, takes
        return {"action": action, "count": count, "asOf": as_of.isoformat(), "filter": job_filter.as_dict()}

    def as_of(self) -> datetime | None:
        text = self.get_argument("asOf", default=None, escape=False)
        if not text:
            return None
        try:
            moment = datetime.fromisoformat(text.strip())
        except ValueError:
            raise tornado.web.HTTPError(400, f"bad filter: asOf {text!r} is not the asOf of a count") from None
        return moment if moment.tzinfo else moment.replace(tzinfo=UTC)

    async def act_on(self, action: str, identifier: str) -> dict[str, Any]:
        _refuse_unless_allowed(self)
        try:
            doc = await _run(_operations(self).act, action, identifier, by=user_name(self))
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
        job_filter = self.job_filter()
        as_of = self.as_of()
        operations = _operations(self)
        expected_text = self.get_argument("expected", default=None, escape=False)
        if expected_text is not None:
            count = await self.count(job_filter, action, as_of)
            if str(count) != expected_text.strip():
                raise tornado.web.HTTPError(409, f"{count} jobs match now, not {expected_text}: confirm again")
        changed = await _run(operations.act_on_filter, action, job_filter, by=user_name(self), unchanged_since=as_of)
        return {"message": f"{action}: {changed} job{'' if changed == 1 else 's'}", "count": changed}

    async def queue_control(self, queue: str, change: str) -> dict[str, Any]:
        _refuse_unless_allowed(self)
        operations = _operations(self)
        try:
            changed = await _run(getattr(operations, change), queue, by=user_name(self))
        except FilterError as exc:
            raise tornado.web.HTTPError(400, str(exc)) from None
        state = "paused" if change == "pause" else "resumed"
        message = f"queue {queue} {state}" if changed else f"queue {queue} was already {state}"
        if not changed and change == "resume":
            message = f"queue {queue} was not paused"
        return {"message": message, "queue": queue, "changed": changed}

    async def summary(self, *, breakdowns: bool = True) -> dict[str, Any]:
        """Counts per status and each queue's depths; per queue and per kind too unless `breakdowns` is False (the
        page asks for those only while they are shown: on a large collection they cost a scan of an index)."""
        operations = _operations(self)
        consumed = self.get_active_queue_names()

        def read() -> dict[str, Any]:
            body = {"statuses": operations.statuses(), "queues": jsonable(operations.queues(consumed))}
            if breakdowns:
                body |= {"byQueue": operations.breakdown("queue"), "byKind": operations.breakdown("kind")}
            return body

        return await _run(read)


# --- the pages -----------------------------------------------------------------------------------------------------


class JobsPage(_JobsHandler):
    json_errors = False

    @tornado.web.authenticated
    async def get(self) -> None:
        job_filter = self.job_filter()
        self.page_args()
        self.render(
            "bb_jobs.html",
            filters=job_filter.as_dict(),
            raw_filters={name: self.get_argument(name, default="", escape=False) for name in FILTERS},
            statuses=list(STATUSES),
            can_act=can_act(self),
            user=user_name(self),
        )


class JobsData(_JobsHandler):
    """The page's live data: counts, queues and the current page of the list."""

    @tornado.web.authenticated
    async def get(self) -> None:
        body = await self.list_body()
        body.update(await self.summary(breakdowns=self.get_argument("breakdowns", "", escape=False) == "1"))
        body["canAct"] = can_act(self)
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
    async def post(self, identifier: str, action: str) -> None:
        self.write(await self.act_on(action, identifier))


class QueueAction(_JobsHandler):
    @tornado.web.authenticated
    async def post(self, queue: str, change: str) -> None:
        self.write(await self.queue_control(queue, change))


class JobPage(_JobsHandler):
    json_errors = False

    @tornado.web.authenticated
    async def get(self, identifier: str) -> None:
        doc = await _run(_operations(self).find, identifier)
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
            actions=[name for name, statuses in ACTIONS.items() if doc.get("status") in statuses],
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
        if self.get_argument("counts", default="", escape=False) in ("1", "true"):
            body.update(await self.summary())
        self.write(body)


class JobApi(_ApiHandler):
    @tornado.web.authenticated
    async def get(self, identifier: str) -> None:
        doc = await _run(_operations(self).find, identifier)
        if doc is None:
            raise tornado.web.HTTPError(404, f"no job has the id or task id {identifier!r}")
        self.write(job_json(doc))


# The API's actions are the page's, under the API's authentication rules.


class JobActionApi(JobAction, _ApiHandler):
    pass


class BulkApi(JobsBulkAction, _ApiHandler):
    @tornado.web.authenticated
    async def get(self, action: str) -> None:
        body = await self.bulk_count(action)
        del body["filter"]
        self.write(body)


class QueueActionApi(QueueAction, _ApiHandler):
    pass


ACTION_PATTERN = "(" + "|".join(ACTIONS) + ")"

HANDLERS = [
    url(r"/jobs", JobsPage, name="jobs"),
    (r"/jobs/data", JobsData),
    (r"/jobs/bulk/" + ACTION_PATTERN + r"/count", JobsBulkCount),
    (r"/jobs/bulk/" + ACTION_PATTERN, JobsBulkAction),
    (r"/jobs/queue/([^/]+)/(pause|resume)", QueueAction),
    (r"/jobs/([^/]+)/" + ACTION_PATTERN, JobAction),
    url(r"/jobs/([^/]+)", JobPage, name="job"),
    (r"/api/jobs", JobsApi),
    (r"/api/jobs/bulk/" + ACTION_PATTERN, BulkApi),
    (r"/api/jobs/([^/]+)/" + ACTION_PATTERN, JobActionApi),
    (r"/api/jobs/([^/]+)", JobApi),
    (r"/api/queues/([^/]+)/(pause|resume)", QueueActionApi),
]


def template_source(root: str, name: str) -> bytes | None:
    """The source of one of our templates, or of Flower's navigation bar with the Jobs link and its Broker tab with
    the Paused column (from Flower's template directory `root`); None for any other template."""
    if name in OUR_TEMPLATES:
        return (TEMPLATES / name).read_bytes()
    if name == "navbar.html":
        text = (Path(root) / name).read_text()
        return text.replace(NAVBAR_ANCHOR, NAVBAR_ANCHOR + NAVBAR_LINK, 1).encode()
    if name == "broker.html":
        text = (Path(root) / name).read_text()
        text = text.replace(BROKER_HEADER_ANCHOR, BROKER_HEADER_ANCHOR + BROKER_HEADER, 1)
        return text.replace(BROKER_CELL_ANCHOR, BROKER_CELL_ANCHOR + BROKER_CELL, 1).encode()
    return None


def install() -> None:
    """Add the Jobs tab's handlers and its `jobs_admins` option to Flower (bb_broker.flower's template loader serves
    its templates); calling it twice changes nothing."""
    if "jobs_admins" not in tornado_options:
        tornado_options.define(
            "jobs_admins",
            type=str,
            multiple=True,
            default=[],
            help="bb_broker Jobs tab: the users who may act on jobs and queues (everyone else reads only)",
        )
    handlers = flower_urls.handlers
    if any(getattr(handler, "name", None) == "jobs" for handler in handlers):
        return
    catch_all = next(i for i, h in enumerate(handlers) if isinstance(h, tuple) and h[0] == r".*")
    handlers[catch_all:catch_all] = HANDLERS
