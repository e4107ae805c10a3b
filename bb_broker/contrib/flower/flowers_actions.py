"""Flower's own actions, for --jobs_admins only.

Flower checks who may act nowhere (its --read_only is for everyone), so `--jobs_admins` would make nobody read-only
while Flower's API lets them revoke, shut workers down or stop a queue's consumer. upstream_flower.guard_prepare
wraps the `prepare` (which Tornado runs before every method, after the XSRF check) of each of Flower's handlers that
has a method other than GET, HEAD and OPTIONS: a user --jobs_admins does not name gets a 403 before the method runs.
A handler Flower adds later is guarded too unless it is listed in READING_POSTS. On a Flower before 2.2, which checks
no request's site (no `xsrf_cookies`), the guard refuses another site's request too, as Flower 2.2 and bb_broker's
check (access.refuse_cross_site_without_login) refuse it there. Checked against Flower 2.0.0,
2.0.1, 2.1.0 and 2.2.0: the same handlers in flower.urls (tests/unit/test_upstream_flower.py lists them and fails
when that changes), BaseApiHandler.prepare the only `prepare`, TaskRevoke's task id its one path argument.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tornado.web
from flower.api.control import TaskRevoke
from flower.utils import strtobool
from flower.views import BaseHandler
from flower.views.error import NotFoundErrorHandler
from flower.views.tasks import TasksDataTable

from bb_broker.contrib.flower.access import can_act, checks_each_change, cross_site_refusal, read_only, user_name
from bb_broker.contrib.flower.handlers import JobsHandler
from bb_broker.contrib.flower.tab import operations_of, tab_of
from bb_broker.upstream import flower as upstream_flower

#: Flower's handlers whose POST only reads: the Tasks page's table posts its query; the catch-all answers 404.
READING_POSTS = (TasksDataTable, NotFoundErrorHandler)
#: The methods that can change something (Tornado's RequestHandler answers 405 for each a handler lacks).
WRITE_METHODS = ("post", "put", "delete", "patch")


def flowers_actions(handlers: Iterable[Any]) -> list[type[tornado.web.RequestHandler]]:
    """The handler classes of a Flower URL table that can change something: each with a write method, except the
    Jobs tab's own (they check who may act themselves) and READING_POSTS."""
    found: list[type[tornado.web.RequestHandler]] = []
    for spec in handlers:
        handler_class = upstream_flower.handler_class_of(spec)
        if handler_class in found or issubclass(handler_class, (JobsHandler, *READING_POSTS)):
            continue
        base = tornado.web.RequestHandler
        if any(getattr(handler_class, name) is not getattr(base, name) for name in WRITE_METHODS):
            found.append(handler_class)
    return found


async def refuse_flowers_action_unless_allowed(handler: BaseHandler) -> None:
    """What runs after the `prepare` of each of Flower's actions (upstream_flower.guard_prepare): a user --jobs_admins
    does not name gets a 403, and an admin's revoke is recorded on the task's jobs. On a Flower before 2.2, which
    checks no request's site, another site's request is refused first (access.refuse_cross_site)."""
    if handler.request.method in ("GET", "HEAD", "OPTIONS"):
        return
    refusal = None if checks_each_change(handler) else cross_site_refusal(handler)
    if refusal is not None:
        _refuse(handler, refusal)
        return
    if not handler.current_user:
        return  # nobody logged in, which the method's @authenticated answers (401, or the login)
    if not can_act(handler) and not read_only(handler):  # read-only Flower: its handlers say so themselves
        _refuse(handler, f"{user_name(handler)} may look but not act: only --jobs_admins may use Flower's actions")
        return
    if isinstance(handler, TaskRevoke) and can_act(handler):
        await _record_revoke(handler)


def _refuse(handler: BaseHandler, message: str) -> None:
    # Answered here, not raised: Flower 2.0's task API writes no words for an error (its write_error sets the status
    # only). Tornado runs no method of a handler its prepare finished.
    handler.set_status(403)
    handler.set_header("Content-Type", "text/plain")
    handler.finish(message)


async def _record_revoke(handler: TaskRevoke) -> None:
    """Flower's revoke, recorded on the task's jobs with the user's name before Flower broadcasts it: a queued job
    ends failed ("revoked before it ran") by this user, not by the anonymous broadcast the transport sees."""
    terminate_text = upstream_flower.plain_argument(handler, "terminate", "") or "false"
    try:
        terminate = bool(strtobool(terminate_text))
    except ValueError:
        return  # Flower answers 400 for it, and revokes nothing
    try:
        operations = operations_of(handler)
    except tornado.web.HTTPError:
        return  # a Flower on another broker: no jobs collection to record on
    task_id = handler.path_args[0]
    await tab_of(handler).run(operations.revoke, [task_id], by=user_name(handler), terminate=terminate)
