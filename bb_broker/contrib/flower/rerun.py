"""The Jobs tab's retry with changed arguments (bb_broker.ops.rerun), for those who may act: `POST .../preview` answers
the checked arguments and the message that would be published, writing nothing; `POST` without it sends the new
job. The form: `id` (the job id or task id), `args` (a JSON list) and `kwargs` (a JSON object), each left out to keep
the original's. Read-only users get the 403 every action gets, the preview included."""

from __future__ import annotations

from typing import Any

import tornado.web

from bb_broker.contrib.flower.access import refuse_unless_allowed, user_name
from bb_broker.contrib.flower.handlers import ApiHandler, JobsHandler, job_json, jsonable
from bb_broker.contrib.flower.tab import operations_of
from bb_broker.ops.rerun import ACTION, Rerun, RerunRefused, parse_arguments, plan, send

#: The HTTP status of each reason a retry with changed arguments is refused.
STATUS = {"bad input": 400, "not found": 404, "conflict": 409}


class RerunAction(JobsHandler):
    @tornado.web.authenticated
    async def post(self, preview: str | None = None) -> None:
        refuse_unless_allowed(self)
        identifier = self.job_id()
        texts = [self.plain_argument(name, default=None, strip=False) for name in ("args", "kwargs")]
        capp = self.application.capp
        operations = operations_of(self)
        try:
            args, kwargs = parse_arguments(*texts)
            rerun = await self.run_query(plan, operations, identifier, args, kwargs, task_of=capp.tasks.get)
            if preview:
                self.write({"preview": jsonable(rerun.preview())})
                return
            doc = await self.run_query(self._send, rerun, user_name(self))
        except RerunRefused as exc:
            raise tornado.web.HTTPError(STATUS[exc.reason], "%s", f"{ACTION}: {exc}") from None
        self.write({"message": f"{ACTION}: sent as job {doc['_id']}", "job": job_json(doc)})

    def _send(self, rerun: Rerun, by: str) -> dict[str, Any]:
        with self.application.capp.connection_for_write() as connection:
            return send(operations_of(self), rerun, connection, by=by)


class RerunApi(RerunAction, ApiHandler):
    pass


HANDLERS = [
    (rf"/jobs/job/{ACTION}(/preview)?", RerunAction),
    (rf"/api/jobs/job/{ACTION}(/preview)?", RerunApi),
]
