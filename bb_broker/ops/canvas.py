"""A job's whole canvas (its chains, groups and chord bodies) as a graph, built from the job documents alone.

The published steps are the jobs sharing the canvas's root or a group with a step already found (see
bb_broker.jobs.canvas: a chord's header tasks are each their own root, joined by their group), read in a few bounded
rounds through the bb_canvas_root and bb_canvas_group indexes, at most MAX_STEPS jobs in all. The steps not published
yet are read from the published steps' messages: the embed's `chain` (the rest of a chain, last step first, as Celery
keeps it), `callbacks`, `errbacks` and `chord` (a chord's body), as stored JSON; a message whose body is not stored
as JSON shows no pending steps, and nothing is ever unpickled.

Every value comes from documents anyone with write access may have edited: ids that are not canvas ids are ignored,
signatures are walked to MAX_SIGNATURE_DEPTH and at most MAX_STEPS steps, and a cycle (a job that is its own
grandparent) is drawn, never followed forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from bb_broker.clock import aware
from bb_broker.jobs.canvas import CANVAS_INDEXES, GROUP_INDEX, ROOT_INDEX, is_canvas_id
from bb_broker.jobs.indexes import hint_if_indexed
from bb_broker.jobs.lifecycle import FAILED, QUEUED
from bb_broker.ops.queries import Queries

#: The most steps (published and pending) one canvas shows; past it the answer says `truncated`.
MAX_STEPS = 1000
#: The most rounds of reads that follow roots and groups to new roots and groups (a canvas of groups of groups).
MAX_ROUNDS = 8
#: The most edges one canvas shows (a chord of 100 header steps into a group of 100 is 10,000 of them); past it the
#: answer says `edgesTruncated`. Also what bounds the walk of the messages, whose size alone does not.
MAX_EDGES = 10 * MAX_STEPS
#: How deep a signature nested in a message is walked (a chain in a chord in a group ...).
MAX_SIGNATURE_DEPTH = 16
#: A queued step due this long ago and not started is stuck (no worker consumes its queue, or it is paused).
QUEUED_TOO_LONG = timedelta(minutes=10)
#: The longest error text a step carries (its job page has it whole).
MAX_STEP_ERROR = 300
#: What a step not published yet has for a status.
PENDING = "pending"

#: What a step's read needs of a job: its message's embed, not its arguments; of the rest of its chain only the next
#: step (Celery keeps it last). Each message of a chain holds all the steps after it, so the whole chains of a
#: 1,000-step chain are half a million signatures: only the steps whose next step is not published have theirs read
#: whole (WHOLE_CHAINS_READ), which is where the pending steps are.
STEP_FIELDS = {
    "_id": 1, "taskId": 1, "kind": 1, "queue": 1, "status": 1, "attempts": 1, "createdAt": 1, "startedAt": 1,
    "updatedAt": 1, "runAfter": 1, "lastError": 1, "rootId": 1, "parentId": 1, "groupId": 1, "groupIndex": 1,
    "payload.options.chain": {"$slice": -1}, "payload.options.callbacks": 1, "payload.options.errbacks": 1,
    "payload.options.chord": 1, "history.finishedAt": 1, "renamedFrom": 1,
}  # fmt: skip
#: The most steps whose chain is read whole: a chain stops at its first unpublished step (a failed step, the one
#: queued or running); a group of chains has one such step per chain.
WHOLE_CHAINS_READ = 20


@dataclass
class Canvas:
    """The graph: `steps` by id (a task id, or `pending:<n>` for a pending signature without one), `edges` as
    (from, to, kind) with kind `chain` (the parent that sent it, or the next step of a chain), `link`, `errback` or
    `chord` (a header step to its chord's body)."""

    job_id: str
    root: str | None
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    edges: dict[tuple[str, str], str] = field(default_factory=dict)
    truncated: bool = False
    #: More edges than MAX_EDGES: a chord whose header and body are both large groups links every pair.
    edges_truncated: bool = False

    def full(self) -> bool:
        if len(self.steps) >= MAX_STEPS:
            self.truncated = True
            return True
        return False

    def link(self, source: str, target: str, kind: str) -> None:
        if source == target or (source, target) in self.edges:
            return
        if len(self.edges) >= MAX_EDGES:
            self.edges_truncated = True
            return
        self.edges[source, target] = kind

    def as_json(self) -> dict[str, Any]:
        depths = _depths(list(self.steps), list(self.edges))
        rows: dict[int, int] = {}
        steps = []
        for step_id, step in self.steps.items():
            depth = depths[step_id]
            rows[depth] = rows.get(depth, -1) + 1
            steps.append({"id": step_id, **step, "depth": depth, "row": rows[depth]})
        edges = [{"from": source, "to": target, "kind": kind} for (source, target), kind in self.edges.items()]
        counts: dict[str, int] = {}
        for step in self.steps.values():
            counts[step["status"]] = counts.get(step["status"], 0) + 1
        return {
            "job": self.job_id,
            "root": self.root,
            "steps": steps,
            "edges": edges,
            "counts": counts,
            "truncated": self.truncated,
            "limit": MAX_STEPS,
            "edgesTruncated": self.edges_truncated,
            "edgeLimit": MAX_EDGES,
        }


def canvas_of(operations: Queries, identifier: str) -> dict[str, Any] | None:
    """The canvas of the job with this job id or task id, as JSON (Canvas.as_json); None when no job has it."""
    doc = operations.find(identifier)
    if doc is None:
        return None
    own_id = doc.get("taskId") if is_canvas_id(doc.get("taskId")) else None
    root = doc.get("rootId") if is_canvas_id(doc.get("rootId")) else own_id
    canvas = Canvas(job_id=str(doc["_id"]), root=root)
    docs = _published(operations, doc, canvas)
    now = operations.now()
    cutoff = operations.lease_cutoff()
    for found in docs:  # oldest first: a task id sent twice (a job per send) is its newest job's step
        step_id, step = _step_id(found), _step(operations, found, now, cutoff)
        if (earlier := canvas.steps.get(step_id)) is not None:
            step["earlierJobs"] = [*earlier.pop("earlierJobs", []), _job_of(earlier)]
        canvas.steps[step_id] = step
    by_task = {found["taskId"]: found for found in docs if is_canvas_id(found.get("taskId"))}
    # A revoked step an operator retried runs under a new task id: the canvas's messages name it by the id it first
    # ran under (renamedFrom), which is that step, not one still to be published.
    renamed = {
        found["renamedFrom"]: found["taskId"]
        for found in by_task.values()
        if is_canvas_id(found.get("renamedFrom")) and found["renamedFrom"] not in by_task
    }
    _read_whole_chains(operations, docs, set(by_task) | set(renamed))
    pending = _Pending(canvas, set(by_task), renamed)
    for found in docs:
        pending.add_from(_step_id(found), _embed(found))
    for found in docs:  # after the messages' links, whose kind (a chord's body, a link) says more than a parent does
        parent = found.get("parentId")
        if is_canvas_id(parent) and (parent := renamed.get(parent, parent)) in by_task:
            canvas.link(parent, _step_id(found), "chain")
    return canvas.as_json()


def _published(operations: Queries, doc: dict[str, Any], canvas: Canvas) -> list[dict[str, Any]]:
    """The jobs of the canvas: `doc`, those of its root, and of each root and group found among them, in rounds; at
    most MAX_STEPS (oldest first), `canvas.truncated` set when there were more."""
    found: dict[Any, dict[str, Any]] = {_key(doc["_id"]): doc}
    roots = {canvas.root} if canvas.root else set()
    groups = {doc["groupId"]} if _sent_alone_in_group(doc) else set()
    asked_roots: set[str] = set()
    asked_groups: set[str] = set()
    hints = {
        index.document["name"]: hint_if_indexed(operations.store, index.document["name"]) for index in CANVAS_INDEXES
    }
    for _ in range(MAX_ROUNDS):
        new_roots, new_groups = sorted(roots - asked_roots), sorted(groups - asked_groups)
        if canvas.truncated or not new_roots and not new_groups:
            break
        asked_roots.update(new_roots)
        asked_groups.update(new_groups)
        for name, keys, index in (("rootId", new_roots, ROOT_INDEX), ("groupId", new_groups, GROUP_INDEX)):
            if not keys:
                continue
            # The ids first (the index holds them: no document read), as many as could be new beyond those found
            # already, one more than there is room for: whether the canvas has more than MAX_STEPS is known, never
            # guessed. No sort: through the index a key's jobs come in id order, and a sort of several keys' jobs may
            # be one in memory of all of them, where the limit bounds this read. Then, only when some are new, the
            # same read of their fields (a thousand ids in an `$in` of `_id` cost the stand-in seconds).
            room = max(MAX_STEPS - len(found), 0)
            query, hint, limit = {name: {"$in": keys}}, hints[index.document["name"]], room + 1 + len(found)
            new = {_key(job["_id"]) for job in operations.coll.find(query, {"_id": 1}, **hint).limit(limit)}
            new -= found.keys()
            if len(new) > room:
                canvas.truncated = True
            for job in operations.coll.find(query, STEP_FIELDS, **hint).limit(limit) if new else ():
                if _key(job["_id"]) not in new or len(found) >= MAX_STEPS:
                    continue
                found[_key(job["_id"])] = job
                if is_canvas_id(job.get("rootId")):
                    roots.add(job["rootId"])
                if _sent_alone_in_group(job):
                    groups.add(job["groupId"])
    else:
        canvas.truncated = canvas.truncated or bool(roots - asked_roots or groups - asked_groups)
    return sorted(found.values(), key=lambda job: str(job["_id"]))


def _sent_alone_in_group(job: dict[str, Any]) -> bool:
    """Whether the job is in a group sent on its own (its own root, or no root): such a group's other tasks are each
    their own root too, found only through the group. A group a task sent shares that task's root, read already."""
    root = job.get("rootId")
    return is_canvas_id(job.get("groupId")) and (not is_canvas_id(root) or root == job.get("taskId"))


def _key(job_id: Any) -> Any:
    """A job id as a key of a dict: a hand-written one may be a document or an array, which are not."""
    return job_id if isinstance(job_id, Hashable) else repr(job_id)


def _read_whole_chains(operations: Queries, docs: list[dict[str, Any]], published: set[str]) -> None:
    """Put the whole rest of its chain into each step (at most WHOLE_CHAINS_READ) read with only the next step of it
    where that step is not published: the steps after it are pending."""
    ends = []
    for doc in docs:
        chain = _embed(doc).get("chain")
        if isinstance(chain, list) and len(chain) == 1:
            next_id = _document(_document(chain[0]).get("options")).get("task_id")
            if not (is_canvas_id(next_id) and next_id in published):
                ends.append(doc)
    ends = ends[:WHOLE_CHAINS_READ]
    if not ends:
        return
    query = {"_id": {"$in": [doc["_id"] for doc in ends]}}
    projection = {"payload.options.chain": 1}
    chains = {_key(job["_id"]): _embed(job).get("chain") for job in operations.coll.find(query, projection)}
    for doc in ends:
        if _key(doc["_id"]) in chains:
            doc["payload"]["options"]["chain"] = chains[_key(doc["_id"])]


def _step_id(doc: dict[str, Any]) -> str:
    """A published step's id in the graph: its task id (what parents and signatures name), else its job id."""
    return doc["taskId"] if is_canvas_id(doc.get("taskId")) else f"job:{doc['_id']}"


def _step(operations: Queries, doc: dict[str, Any], now: datetime, cutoff: datetime) -> dict[str, Any]:
    """What the graph shows of a published step; `marks` says why it needs a look (failed, stuck)."""
    status = doc.get("status") if isinstance(doc.get("status"), str) else "unknown"
    history = doc.get("history")
    entries = history if isinstance(history, list) else []
    finishes = [entry.get("finishedAt") for entry in entries if isinstance(entry, dict)]
    finished = next((moment for moment in reversed(finishes) if isinstance(moment, datetime)), None)
    error = doc.get("lastError")
    step: dict[str, Any] = {
        "jobId": str(doc["_id"]),
        "name": _text(doc.get("kind")),
        "status": status,
        "attempts": doc.get("attempts") if isinstance(doc.get("attempts"), int) else None,
        "queue": _text(doc.get("queue")),
        "createdAt": _moment(doc.get("createdAt")),
        "startedAt": _moment(doc.get("startedAt")),
        "finishedAt": _moment(finished) if status not in (QUEUED, "running") else None,
        "runAfter": _moment(doc.get("runAfter")),
        "error": error[:MAX_STEP_ERROR] if isinstance(error, str) else None,
        "marks": [],
    }
    if status == FAILED:
        step["marks"].append("failed")
    if operations.orphaned(doc, cutoff):
        step["marks"].append("stuck: running past its lease")
    run_after = doc.get("runAfter")
    if status == QUEUED and isinstance(run_after, datetime) and aware(run_after) < now - QUEUED_TOO_LONG:
        step["marks"].append(f"stuck: queued and due for over {int(QUEUED_TOO_LONG.total_seconds() // 60)} minutes")
    return step


def _job_of(step: dict[str, Any]) -> dict[str, Any]:
    """An earlier job of a step's task id: its id and status (a cancel of the canvas cancels it too)."""
    return {"jobId": step["jobId"], "status": step["status"]}


def _embed(doc: dict[str, Any]) -> dict[str, Any]:
    return _document(_document(doc.get("payload")).get("options"))


class _Pending:
    """The signatures of the published steps' messages as steps and edges; a signature whose task id is published
    already is that step (its own message says what follows it)."""

    def __init__(self, canvas: Canvas, published: set[str], renamed: dict[str, str]) -> None:
        self.canvas, self.published, self.unnamed = canvas, published, 0
        #: A retried revoked step's first task id -> the one it runs under now (a published step).
        self.renamed = renamed

    def add_from(self, step_id: str, embed: dict[str, Any]) -> None:
        chain = embed.get("chain")
        if isinstance(chain, list):  # the rest of the chain, its next step last
            self.follow(step_id, {"subtask_type": "chain", "kwargs": {"tasks": list(reversed(chain))}}, "chain")
        for name, kind in (("callbacks", "link"), ("errbacks", "errback")):
            signatures = embed.get(name)
            for signature in signatures if isinstance(signatures, list) else ():
                self.follow(step_id, signature, kind)
        if embed.get("chord") is not None:
            self.follow(step_id, embed["chord"], "chord")

    def follow(self, source: str, signature: Any, kind: str) -> None:
        for entry in self.expand(signature, 0)[0]:
            self.canvas.link(source, entry, kind)

    def expand(self, signature: Any, depth: int) -> tuple[list[str], list[str]]:
        """The steps a signature starts with and ends with, its own steps and edges added to the canvas."""
        if not isinstance(signature, dict) or depth > MAX_SIGNATURE_DEPTH:
            return [], []
        kind = signature.get("subtask_type")
        kwargs = _document(signature.get("kwargs"))
        if kind in ("chain", "group"):
            parts = kwargs.get("tasks")
            if isinstance(parts, dict):  # a group's tasks may be one signature
                parts = [parts]
            expanded = [self.expand(part, depth + 1) for part in (parts if isinstance(parts, list) else ())]
            expanded = [(entries, exits) for entries, exits in expanded if entries]
            if not expanded:
                return [], []
            if kind == "group":  # a step named twice (a task id repeated) is one step, entered and left once
                entries = list(dict.fromkeys(e for entries, _ in expanded for e in entries))
                return entries, list(dict.fromkeys(e for _, exits in expanded for e in exits))
            for (_, exits), (entries, _) in zip(expanded, expanded[1:], strict=False):
                self.connect(exits, entries, "chain")
            return expanded[0][0], expanded[-1][1]
        if kind == "chord":
            header = kwargs.get("header")
            if isinstance(header, list):
                header = {"subtask_type": "group", "kwargs": {"tasks": header}}
            head_entries, head_exits = self.expand(header, depth + 1)
            body_entries, body_exits = self.expand(kwargs.get("body"), depth + 1)
            self.connect(head_exits, body_entries, "chord")
            return (head_entries or body_entries), (body_exits or head_exits)
        step_id = self.step(signature)
        return ([step_id], [step_id]) if step_id else ([], [])

    def connect(self, sources: list[str], targets: list[str], kind: str) -> None:
        for source in sources:
            if self.canvas.edges_truncated:  # every pair of two long lists is the walk's cost: it ends at the limit
                return
            for target in targets:
                self.canvas.link(source, target, kind)

    def step(self, signature: dict[str, Any]) -> str | None:
        """The step of one task's signature: the published one of its task id, else a pending step (made once per
        task id); None once the canvas is full."""
        options = _document(signature.get("options"))
        task_id = options.get("task_id")
        if is_canvas_id(task_id):
            task_id = self.renamed.get(task_id, task_id)
        if is_canvas_id(task_id) and (task_id in self.published or task_id in self.canvas.steps):
            return task_id
        if self.canvas.full():
            return None
        while not is_canvas_id(task_id) or task_id in self.canvas.steps:  # never a published step's id
            self.unnamed += 1
            task_id = f"pending:{self.unnamed}"
        self.canvas.steps[str(task_id)] = {
            "jobId": None,
            "name": _text(signature.get("task")),
            "status": PENDING,
            "attempts": 0,
            "queue": _text(options.get("queue")),
            "marks": [],
        }
        return str(task_id)


def _depths(steps: list[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    """Each step's column: the longest path to it from a step nothing leads to (Kahn's order); the steps of a cycle,
    which no order reaches, in the column after the rest."""
    incoming = dict.fromkeys(steps, 0)
    outgoing: dict[str, list[str]] = {step: [] for step in steps}
    for source, target in edges:
        if source in incoming and target in incoming:
            outgoing[source].append(target)
            incoming[target] += 1
    depths = dict.fromkeys(steps, 0)
    ready = deque(step for step, count in incoming.items() if count == 0)
    placed: set[str] = set()
    while ready:
        step = ready.popleft()
        placed.add(step)
        for target in outgoing[step]:
            depths[target] = max(depths[target], depths[step] + 1)
            incoming[target] -= 1
            if incoming[target] == 0:
                ready.append(target)
    beyond = max((depths[step] for step in placed), default=-1) + 1
    for step in steps:
        if step not in placed:
            depths[step] = beyond
    return depths


def _document(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any, limit: int = 200) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def _moment(value: Any) -> str | None:
    return aware(value).isoformat() if isinstance(value, datetime) else None


def tree_lines(canvas: dict[str, Any]) -> list[str]:
    """The canvas as an indented text tree: each step under each step that leads to it, with its status, attempts,
    queue and marks; a step reached again is named, not repeated; a cycle nothing leads into starts where it may."""
    steps = {step["id"]: step for step in canvas["steps"]}
    children: dict[str, list[tuple[str, str]]] = {step_id: [] for step_id in steps}
    led_to: set[str] = set()
    for edge in canvas["edges"]:
        if edge["from"] in steps and edge["to"] in steps:
            children[edge["from"]].append((edge["to"], edge["kind"]))
            led_to.add(edge["to"])
    lines = [f"canvas of job {canvas['job']} (root {canvas['root'] or '-'}): {len(steps)} steps"]
    shown: set[str] = set()
    starts = [step_id for step_id in steps if step_id not in led_to] + list(steps)
    for start in starts:
        if start in shown:
            continue
        stack: list[tuple[str, int, str]] = [(start, 0, "")]
        while stack:
            step_id, level, kind = stack.pop()
            via = f"[{kind}] " if kind and kind != "chain" else ""
            if step_id in shown:
                lines.append(f"{'  ' * level}{via}{step_id} (shown above)")
                continue
            shown.add(step_id)
            lines.append(f"{'  ' * level}{via}{step_line(steps[step_id])}")
            stack.extend((child, level + 1, child_kind) for child, child_kind in reversed(children[step_id]))
    if canvas["truncated"]:
        lines.append(f"... truncated: the canvas has more than {canvas['limit']} steps")
    if canvas["edgesTruncated"]:
        lines.append(f"... truncated: the canvas has more than {canvas['edgeLimit']} links between its steps")
    # A control character a hand-written name or id holds (a newline, a terminal's escape) shown as `?`.
    return ["".join(char if char.isprintable() else "?" for char in line) for line in lines]


def step_line(step: dict[str, Any]) -> str:
    attempts = f", {step['attempts']} attempts" if step.get("attempts") else ""
    job = f" job {step['jobId']}" if step.get("jobId") else ""
    marks = f" !! {'; '.join(step['marks'])}" if step.get("marks") else ""
    queue = step.get("queue") or "-"
    earlier = step.get("earlierJobs") or []
    sent = f" (sent {len(earlier) + 1} times: the newest job shown)" if earlier else ""
    return f"{step.get('name') or '?'} {step['id']}{job}: {step['status']}{attempts}, queue {queue}{marks}{sent}"
