"""Flower's Schedules view beside the Jobs tab: bb_broker.beat's entries, with run now, enable and disable.

Its handlers are the Jobs tab's (bb_broker.contrib.flower.handlers): the same login, XSRF protection, per-user share
of queries, and read-only rule (`--read_only`, `--jobs_admins`): a user who may not act gets a 403 and nothing runs.
"""

from __future__ import annotations

from typing import Any

import tornado.web
from tornado.web import url

from bb_broker.beat.entries import EntryError, ScheduleStore
from bb_broker.beat.overview import describe
from bb_broker.beat.scheduler import run_now
from bb_broker.contrib.flower.access import can_act, refuse_unless_allowed, user_name
from bb_broker.contrib.flower.handlers import ApiHandler, JobsHandler, jsonable
from bb_broker.contrib.flower.tab import operations_of

SCHEDULE_ACTIONS = ("run-now", "enable", "disable")
ACTION_PATTERN = "(" + "|".join(SCHEDULE_ACTIONS) + ")"


class _SchedulesHandler(JobsHandler):
    def schedule_store(self) -> ScheduleStore:
        store = operations_of(self).store
        return ScheduleStore(store.coll.database, store.now)

    async def entries(self) -> list[dict[str, Any]]:
        store = operations_of(self).store

        def read() -> list[dict[str, Any]]:
            db = store.coll.database
            return [describe(doc, db, jobs_collection=store.coll.name) for doc in self.schedule_store().load()]

        return await self.run_query(read)

    async def act(self, action: str) -> dict[str, Any]:
        refuse_unless_allowed(self)
        name = self.plain_argument("name", default="", strip=False)
        if not name:
            raise tornado.web.HTTPError(400, "name is required: the entry's name")
        schedules = self.schedule_store()

        def apply() -> dict[str, Any]:
            if action == "run-now":
                return {"message": f"{name}: sent now", "taskId": run_now(self.application.capp, schedules, name)}
            schedules.set_enabled(name, action == "enable", by=user_name(self))
            return {"message": f"{name}: {action}d"}

        try:
            return await self.run_query(apply)
        except EntryError as exc:
            raise tornado.web.HTTPError(404, str(exc)) from None


class SchedulesPage(_SchedulesHandler):
    json_errors = False

    @tornado.web.authenticated
    async def get(self) -> None:
        self.render("bb_schedules.html", entries=await self.entries(), can_act=can_act(self), jsonable=jsonable)


class ScheduleAction(_SchedulesHandler):
    @tornado.web.authenticated
    async def post(self, action: str) -> None:
        self.write(await self.act(action))


class SchedulesApi(_SchedulesHandler, ApiHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.write({"entries": jsonable(await self.entries())})


class ScheduleActionApi(ScheduleAction, ApiHandler):
    pass


HANDLERS = [
    url(r"/jobs/schedules", SchedulesPage, name="schedules"),
    (r"/jobs/schedules/" + ACTION_PATTERN, ScheduleAction),
    (r"/api/schedules", SchedulesApi),
    (r"/api/schedules/" + ACTION_PATTERN, ScheduleActionApi),
]
