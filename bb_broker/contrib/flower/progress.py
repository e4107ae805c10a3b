"""The job page's live progress bar: `/jobs/job/progress?id=<job id>` answers the job's status and bar (see
bb_broker.jobs.checkpoints), read-only users included, as they see the page."""

from __future__ import annotations

import tornado.web

from bb_broker.contrib.flower.handlers import JobsHandler, jsonable
from bb_broker.contrib.flower.tab import operations_of
from bb_broker.jobs.checkpoints import progress_now


class JobProgress(JobsHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        identifier = self.job_id()
        now = await self.run_query(progress_now, operations_of(self).store.coll, identifier)
        if now is None:
            raise tornado.web.HTTPError(404, f"no job has the id {identifier!r}")
        self.write(jsonable(now))


HANDLERS = [(r"/jobs/job/progress", JobProgress)]
