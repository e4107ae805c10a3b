"""Helpers for the store's and the operator's tests: a clock the test moves, the commands sent, index checks."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

from pymongo import monitoring
from pymongo.database import Database

from bb_broker.jobs.settles import Settle, SettleRelay
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import JobFilter
from bb_broker.ops.operations import Operations
from tests.support.workers import wait_for


class FakeClock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class CommandLog(monitoring.CommandListener):
    def __init__(self) -> None:
        self.commands: list[dict] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in ("findAndModify", "find", "update", "aggregate", "distinct"):
            command = dict(event.command)
            for key in ("lsid", "$db", "$clusterTime", "txnNumber", "$readPreference"):
                command.pop(key, None)
            self.commands.append(command)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def assert_each_reads_through_an_index(db: Database, commands: list[dict]) -> None:
    """Explain each captured command: an index scan, no collection scan, no in-memory sort."""
    for command in commands:
        if "updates" in command:  # the update's own selection, as a find with the same filter (and hint)
            update = command["updates"][0]
            command = {"find": "jobs", "filter": update["q"], **({"hint": update["hint"]} if "hint" in update else {})}
        explained = db.command("explain", command)
        plan = str(explained)
        assert "IXSCAN" in plan and "COLLSCAN" not in plan, plan
        if "find" in command and "sort" in command:
            # The stand-in's planner names a SORT stage for every sorted find, even one its index orders; the
            # stages it executed show whether it sorted in memory, as mongod's do.
            plan = str(explained["executionStats"]["executionStages"])
        assert "'stage': 'SORT'" not in plan, plan


def assert_lists_read_through_an_index(ops: Operations, db: Database, log: CommandLog) -> None:
    """Every list shape, the look-ups and the counts: through an index, no collection scan, no in-memory sort."""
    some = ops.list_jobs(JobFilter(), limit=2)
    log.commands.clear()
    for job_filter in (
        JobFilter(status="queued"),
        JobFilter(queue="mail"),
        JobFilter(queue="mail", status="queued"),
        JobFilter(kind="k1"),
        JobFilter(kind="k1", status="queued", queue="mail"),
        JobFilter(status="queued", since=ops.now() - timedelta(days=1)),
    ):
        ops.list_jobs(job_filter, after=some.jobs[-1]["_id"], limit=3)
    ops.find(some.jobs[0]["_id"])
    ops.find(some.jobs[0]["taskId"])
    ops.find("nothing")  # by job id, task id, then an old task id a retry of a revoked task replaced (bb_results)
    ops.statuses()
    ops.count(JobFilter(queue="mail", status="failed"), "retry")
    ops.breakdown("queue")
    ops.queue_depths()
    assert [next(iter(c)) for c in log.commands] == ["find"] * 12 + ["aggregate"] * 4
    assert_each_reads_through_an_index(db, log.commands)


def wait_past(store: JobStore, moment: datetime) -> None:
    """Wait until this process's reading of the server's clock is a second past `moment` (a count's `asOf`): two
    processes read that clock milliseconds apart, so a job written from then on is one written after the count."""
    wait_for(lambda: store.now() > moment + timedelta(seconds=1), message="the server's clock passed the count")


def held_jobs(store: JobStore, count: int, payload: dict | None = None) -> list[str]:
    """`count` jobs claimed by worker `w`, at their first attempt."""
    for n in range(count):
        store.publish(queue="celery", kind="k", task_id=f"t{n}", payload=payload or {"args": [n]}, priority=0,
                      run_after=None, is_retry=False)  # fmt: skip
    return [job.id for job in store.claim_many("celery", "w", count)]


def settles_sent(log: CommandLog) -> list[int]:
    """The statements of each settling `update` sent (their fence names the attempt)."""
    return [len(c["updates"]) for c in log.commands if "update" in c and "attempts" in c["updates"][0]["q"]]


def send_from_children_at_once(relay: SettleRelay, settles: list[Settle]) -> None:
    """Send each of `settles` from a forked child of its own, as pool processes whose tasks end together do: every
    child is forked first and waits on a pipe, then all are let go at once (forked one after the other, on a loaded
    machine the forks alone came further apart than a relay's wait)."""
    ready, go = os.pipe()
    children = []
    for settle in settles:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:  # whatever happens, the child ends here: never back into the test runner's code
                os.close(go)
                os.read(ready, 1)  # the parent closing its end lets every child go
                code = 0 if relay.send(settle) else 1
            finally:
                os._exit(code)
        children.append(pid)
    os.close(ready)
    os.close(go)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the relay refused a settle"


def send_from_a_child(relay: SettleRelay, settles: list[Settle]) -> None:
    """Send `settles` as a pool process does: from a forked child, which exits 0 when the relay took each."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if all(relay.send(settle) for settle in settles) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the relay refused a settle"
