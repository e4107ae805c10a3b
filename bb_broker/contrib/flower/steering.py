"""The Jobs tab's cancel of a whole canvas (bb_broker.ops.steering), for those who may act: `POST
/jobs/canvas/cancel?id=<job id or task id>` (and `/api/jobs/canvas/cancel`) cancels every queued step of that job's
canvas and answers which steps it cancelled, which were running (not touched), which had finished and which are not
published yet. Read-only users get the 403 every action gets, and nothing changes."""

from __future__ import annotations

import tornado.web

from bb_broker.contrib.flower.access import refuse_unless_allowed, user_name
from bb_broker.contrib.flower.handlers import ApiHandler, JobsHandler
from bb_broker.contrib.flower.tab import operations_of
from bb_broker.ops.queries import no_job_has
from bb_broker.ops.steering import cancel_canvas


class CanvasCancel(JobsHandler):
    @tornado.web.authenticated
    async def post(self) -> None:
        refuse_unless_allowed(self)
        identifier = self.job_id()
        answer = await self.run_query(cancel_canvas, operations_of(self), identifier, by=user_name(self))
        if answer is None:
            raise tornado.web.HTTPError(404, "%s", no_job_has(identifier))
        count = len(answer.cancelled)
        running = f"; {len(answer.running)} running, not touched" if answer.running else ""
        refused = "".join(f"; job {step['jobId']} left queued: {step['why']}" for step in answer.refused)
        message = f"cancel canvas: {count} queued step{'' if count == 1 else 's'} cancelled{running}{refused}"
        self.write({"message": message, **answer.as_json()})


class CanvasCancelApi(CanvasCancel, ApiHandler):
    pass


HANDLERS = [
    (r"/jobs/canvas/cancel", CanvasCancel),
    (r"/api/jobs/canvas/cancel", CanvasCancelApi),
]
