"""Steering a whole canvas: cancel every queued step of it, and say what became of the others.

The steps are the canvas's graph (bb_broker.ops.canvas: its root's jobs, their groups' and the steps still to be
published). The queued ones are cancelled in one write fenced on their status (Operations.cancel_queued): one a
worker claimed in between is running, and reported so. A running step is not touched (its worker holds it; revoke it
to stop it): the steps after it are published when it finishes, so cancel the canvas again then. A step not published
yet after a cancelled step never is: the message that carries it is not sent on.

Retrying a failed step needs nothing here: its job keeps its message, with the rest of its chain, its links and its
chord, so the retry continues the canvas (for a chord's header, see bb_broker.results.chords).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bb_broker.jobs.document import stored_not_utf8
from bb_broker.jobs.lifecycle import FAILED, QUEUED, RUNNING
from bb_broker.ops.canvas import PENDING, canvas_of
from bb_broker.ops.operations import Operations

#: What a step of the answer says of itself.
STEP_KEYS = ("id", "jobId", "name", "status")


@dataclass
class CanvasCancel:
    """What a cancel of a canvas did: the steps it `cancelled`, those it left `running`, those `finished` before
    (succeeded or failed), those `pending` (not published yet), and the queued ones it `refused` to cancel, each with
    `why`; `truncated` when the canvas had more steps than one read takes (bb_broker.ops.canvas.MAX_STEPS): cancel
    again for the rest."""

    job: str
    root: str | None
    cancelled: list[dict[str, Any]] = field(default_factory=list)
    running: list[dict[str, Any]] = field(default_factory=list)
    finished: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "root": self.root,
            "cancelled": self.cancelled,
            "running": self.running,
            "finished": self.finished,
            "pending": self.pending,
            "refused": self.refused,
            "truncated": self.truncated,
        }

    def lines(self) -> list[str]:
        """The answer as text, a line per step that the operator must know of (the finished ones counted)."""
        count = len(self.cancelled)
        lines = [f"canvas of job {self.job} (root {self.root or '-'}): cancelled {count} queued step{_s(count)}"]
        lines += [f"  cancelled {_named(step)}" for step in self.cancelled]
        lines += [f"  running, not touched (revoke it to stop it): {_named(step)}" for step in self.running]
        lines += [f"  refused, left queued: {_named(step)}: {step['why']}" for step in self.refused]
        if self.finished:
            by_status: dict[str, int] = {}
            for step in self.finished:
                by_status[step["status"]] = by_status.get(step["status"], 0) + 1
            lines.append("  finished before: " + ", ".join(f"{n} {status}" for status, n in sorted(by_status.items())))
        if self.pending:
            lines.append(
                f"  {len(self.pending)} step{_s(len(self.pending))} not published yet: never, after a cancelled step; "
                "after a running one, when it finishes (cancel again then)"
            )
        if self.truncated:
            lines.append("  the canvas has more steps than one read takes: cancel again for the rest")
        # A control character a hand-written name or id holds (a newline, a terminal's escape) shown as `?`.
        return ["".join(char if char.isprintable() else "?" for char in line) for line in lines]


def cancel_canvas(operations: Operations, identifier: str, *, by: str) -> CanvasCancel | None:
    """Cancel every queued step of the canvas of the job with this job id or task id; None when no job has it."""
    canvas = canvas_of(operations, identifier)
    if canvas is None:
        return None
    answer = CanvasCancel(job=canvas["job"], root=canvas["root"], truncated=canvas["truncated"])
    steps = [{key: step.get(key) for key in STEP_KEYS} for step in canvas["steps"]]
    # A task id sent twice has a job per send: the graph's step is the newest, and each earlier one is cancelled too.
    steps += [
        {**{key: step.get(key) for key in STEP_KEYS}, **earlier}
        for step in canvas["steps"]
        for earlier in step.get("earlierJobs", ())
    ]
    queued = [step for step in steps if step["status"] == QUEUED and step["jobId"]]
    # A job id read with U+FFFD in place of its bytes: the cancel's write by that id would find no job.
    refused = [step for step in queued if stored_not_utf8(operations.coll, {"_id": step["jobId"]}, ["_id"])]
    answer.refused = [{**step, "why": "its _id holds text that is not UTF-8"} for step in refused]
    queued = [step for step in queued if step not in refused]
    cancelled = {step["jobId"] for step in queued}
    if queued and operations.cancel_queued(sorted(cancelled), by=by) != len(queued):
        # Some changed in between (claimed by a worker, cancelled by someone else): what each is now, the failed ones
        # cancelled (by this write or another).
        found = operations.coll.find({"_id": {"$in": sorted(cancelled)}}, {"status": 1})
        now = {str(doc["_id"]): doc.get("status") for doc in found}
        # Not found by its id: an _id written by hand as no string (the graph shows it as text; a claim fails such
        # a job), or a job deleted since. Said as not cancelled, not as finished.
        unfound = [step for step in queued if step["jobId"] not in now]
        why = "no job has this id as a string (an _id written by hand, or a job deleted since)"
        answer.refused += [{**step, "why": why} for step in unfound]
        refused += unfound
        for step in queued:
            step["status"] = now.get(step["jobId"], step["status"])
        cancelled = {step["jobId"] for step in queued if step["status"] == FAILED}
    for step in steps:
        if step in refused:
            continue
        if step["jobId"] in cancelled:
            answer.cancelled.append({**step, "status": "cancelled"})
        elif step["status"] == RUNNING:
            answer.running.append(step)
        elif step["status"] == PENDING:
            answer.pending.append(step)
        else:
            answer.finished.append(step)
    return answer


def _named(step: dict[str, Any]) -> str:
    job = f" job {step['jobId']}" if step.get("jobId") else ""
    return f"{step.get('name') or '?'} {step['id']}{job}"


def _s(count: int) -> str:
    return "" if count == 1 else "s"
