"""A job's canvas (bb_broker.ops.canvas) from documents written by hand: hostile canvas fields and links, the `root=`
filter, and the figure of a 1,000-step canvas among 100,000 jobs."""

from __future__ import annotations

import time

import pytest
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from bb_broker.jobs.store import JobStore
from bb_broker.ops.canvas import MAX_STEPS, canvas_of, tree_lines
from bb_broker.ops.filters import JobFilter
from bb_broker.ops.operations import Operations
from bb_broker.ops.steering import cancel_canvas
from tests.database.test_scale import fill
from tests.support.store import CommandLog, FakeClock, assert_each_reads_through_an_index

ROOT = "root-task"


def step(n: int, clock: FakeClock, **fields) -> dict:
    """A job of the canvas ROOT, as a publish and its settle leave it."""
    return {
        "_id": f"01K{n:023d}",
        "taskId": f"t{n}",
        "kind": "app.step",
        "queue": "celery",
        "status": "succeeded",
        "attempts": 1,
        "priority": 0,
        "createdAt": clock.now,
        "updatedAt": clock.now,
        "runAfter": clock.now,
        "rootId": ROOT,
        "payload": {"args": [], "kwargs": {}, "options": {}},
        **fields,
    }


def signature(task_id, **fields) -> dict:
    return {"task": "app.next", "args": [], "kwargs": {}, "options": {"task_id": task_id}, **fields}


@pytest.fixture
def ops(store: JobStore) -> Operations:
    return Operations(store)


def test_hostile_canvas_fields_and_links_neither_break_nor_loop(ops: Operations, db: Database, clock) -> None:
    nested: dict = signature("deepest")
    for _ in range(25):  # deeper than any walk goes (and within BSON's 100 levels of nesting)
        nested = {"subtask_type": "chain", "kwargs": {"tasks": [nested]}}
    db.jobs.insert_many(
        [
            step(0, clock, taskId=ROOT, parentId="t2"),  # a cycle: the root's parent is its grandchild
            step(1, clock, parentId=ROOT, payload={"options": {"chain": "not a list", "callbacks": [nested, 7]}}),
            step(2, clock, parentId="t1", status="failed", payload={"options": {"chain": [signature("t2")]}}),
            step(3, clock, rootId={"$gt": ""}, parentId=["t1"]),  # not ids: not in the canvas, nor an error
            step(4, clock, rootId="x" * 5_000_000, groupId=12),
            step(5, clock, payload={"options": {"callbacks": [signature(f"cb{n}") for n in range(3 * MAX_STEPS)]}}),
            step(6, clock, payload="not a document"),
            {**step(7, clock), "_id": {"a": "document"}},
            {**step(8, clock), "_id": ["an", "array"]},
        ]
    )
    canvas = canvas_of(ops, ROOT)
    assert canvas is not None
    steps = {s["id"]: s for s in canvas["steps"]}
    assert {ROOT, "t1", "t2", "t5", "t6", "t7", "t8"} <= set(steps) and "t3" not in steps and "t4" not in steps
    assert ("t2" in [e["to"] for e in canvas["edges"] if e["from"] == "t1"]) and steps["t2"]["marks"] == ["failed"]
    assert canvas["truncated"] and len(steps) == MAX_STEPS  # the 3,000 callbacks: bounded, and said so
    assert "deepest" not in steps  # nested past the walk's depth
    lines = tree_lines(canvas)
    assert len(lines) <= 2 * MAX_STEPS and lines[-1].startswith("... truncated")
    # The hostile documents' own canvases: each alone, never an error.
    for n, root in ((3, "t3"), (4, "t4"), (6, ROOT)):  # a root that is no id: the job is its own
        alone = canvas_of(ops, f"t{n}")
        assert alone is not None and alone["root"] == root and f"t{n}" in [s["id"] for s in alone["steps"]]


def test_the_root_filter_lists_a_canvas(ops: Operations, db: Database, clock) -> None:
    db.jobs.insert_many([step(n, clock) for n in range(3)] + [step(9, clock, rootId="other")])
    page = ops.list_jobs(JobFilter.parse({"root": ROOT}, ops.now()))
    assert [row["taskId"] for row in page.jobs] == ["t2", "t1", "t0"]
    assert JobFilter.parse({"root": ROOT}, ops.now()).as_dict() == {"root": ROOT}


@pytest.mark.heavy
@pytest.mark.timeout(1800)  # inserting 100k jobs into the indexes takes minutes on the Python stand-in
def test_a_1000_step_canvas_among_100k_jobs(mongo_url: str, db: Database) -> None:
    """The figure: the canvas of a 1,000-step chain of groups among 100,000 jobs, read through the canvas indexes;
    its time printed (run with -s)."""
    clock = FakeClock()
    fill(JobStore(db, clock=clock), db, clock)
    docs = []
    for n in range(MAX_STEPS):
        group = {"groupId": f"g{n // 10}", "groupIndex": n % 10}
        # Groups of 10 in a chain: each group's tasks sent by the last task of the group before (the first
        # group's sent on their own, as a group is).
        parent = {"parentId": f"t{n // 10 * 10 - 1}"} if n >= 10 else {}
        docs.append(step(n, clock, **parent, **group))
    docs[0] = step(0, clock, taskId=ROOT, groupId="g0", groupIndex=0)
    db.jobs.insert_many(docs)
    log, durations = CommandLog(), CommandDurations()
    with MongoClient(mongo_url, event_listeners=[log, durations], tz_aware=True) as client:
        operations = Operations(JobStore(client[db.name], clock=clock))
        operations.now()  # the connection made, as a Flower's is
        for attempt in ("first", "again"):
            durations.seen.clear()
            began = time.perf_counter()
            canvas = canvas_of(operations, docs[500]["_id"])  # as the job page asks, by job id
            took = time.perf_counter() - began
            assert canvas is not None and len(canvas["steps"]) == MAX_STEPS and not canvas["truncated"]
            print(f"\ncanvas of {MAX_STEPS} steps among {db.jobs.estimated_document_count()} jobs ({attempt}): "
                  f"{took:.3f} s, of which the server {sum(d for _, d in durations.seen):.3f} s: "
                  + ", ".join(f"{name} {seconds:.3f}" for name, seconds in durations.seen))  # fmt: skip
    assert max(s["depth"] for s in canvas["steps"]) == MAX_STEPS // 10 - 1
    assert_each_reads_through_an_index(db, [c for c in log.commands if "find" in c])


class CommandDurations(monitoring.CommandListener):
    """Each command's name and seconds, as the driver measured them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self.seen.append((event.command_name, event.duration_micros / 1e6))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_the_steps_still_to_come_are_read_from_the_stored_chain_links_and_chord(
    ops: Operations, db: Database, clock
) -> None:
    """A chain's first step ran; what follows it is in its message, as Celery stores a chain of a task, a chord
    (a group of two and its body) and a last task, with a link and an errback on the first step."""
    header = {"task": "celery.group", "kwargs": {"tasks": [signature("h1"), signature("h2")]}, "subtask_type": "group"}
    a_chord = {
        "task": "celery.chord",
        "kwargs": {"kwargs": {}, "header": header, "body": signature("body")},
        "options": {},
        "subtask_type": "chord",
    }
    embed = {
        "chain": [signature("last"), a_chord, signature("second")],  # Celery keeps the rest of a chain last step first
        "callbacks": [signature("linked")],
        "errbacks": [signature("on-error")],
    }
    db.jobs.insert_one(step(0, clock, taskId=ROOT, payload={"args": [], "kwargs": {}, "options": embed}))
    canvas = canvas_of(ops, ROOT)
    assert canvas is not None
    steps = {s["id"]: s for s in canvas["steps"]}
    assert steps[ROOT]["status"] == "succeeded"
    assert {s for s, step in steps.items() if step["status"] == "pending"} == {
        "second", "h1", "h2", "body", "last", "linked", "on-error",
    }  # fmt: skip
    assert {(e["from"], e["to"], e["kind"]) for e in canvas["edges"]} == {
        (ROOT, "second", "chain"), ("second", "h1", "chain"), ("second", "h2", "chain"),
        ("h1", "body", "chord"), ("h2", "body", "chord"), ("body", "last", "chain"),
        (ROOT, "linked", "link"), (ROOT, "on-error", "errback"),
    }  # fmt: skip
    depths = {s: step["depth"] for s, step in steps.items()}
    assert (depths["second"], depths["h1"], depths["h2"], depths["body"], depths["last"]) == (1, 2, 2, 3, 4)
    assert tree_lines(canvas)[1:4] == [
        f"app.step {ROOT} job {steps[ROOT]['jobId']}: succeeded, 1 attempts, queue celery",
        "  app.next second: pending, queue -",
        "    app.next h1: pending, queue -",
    ]


def test_a_long_chain_reads_only_its_end_whole(mongo_url: str, db: Database, store: JobStore, clock) -> None:
    """A chain of 300 whose step 200 failed: each message holds the rest of the chain (as Celery's do), 45,000
    signatures in all; the canvas reads each step's next step only, and the failed step's whole chain."""
    rest = [signature(f"t{n}", task=f"app.s{n}") for n in range(299, 0, -1)]  # last step first, as Celery keeps it
    docs = [step(0, clock, taskId=ROOT, payload={"options": {"chain": rest}})]
    for n in range(1, 201):
        status = "failed" if n == 200 else "succeeded"
        payload = {"options": {"chain": rest[:-n]}}
        docs.append(step(n, clock, parentId=docs[-1]["taskId"], status=status, payload=payload))
    db.jobs.insert_many(docs)
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        canvas = canvas_of(Operations(JobStore(client[db.name], clock=clock)), "t100")
    assert canvas is not None and len(canvas["steps"]) == 300 and not canvas["truncated"]
    steps = {s["id"]: s for s in canvas["steps"]}
    assert [steps[f"t{n}"]["status"] for n in (199, 200, 201, 299)] == ["succeeded", "failed", "pending", "pending"]
    assert steps["t299"]["depth"] == 299 and steps["t299"]["name"] == "app.s299"
    whole = [c for c in log.commands if c.get("projection") == {"payload.options.chain": 1}]
    assert [c["filter"] for c in whole] == [{"_id": {"$in": [docs[200]["_id"]]}}]  # the failed step's alone


def test_a_task_id_sent_twice_is_one_step_and_a_cancel_of_the_canvas_cancels_both_jobs(
    ops: Operations, db: Database, clock
) -> None:
    # apply_async(task_id=...) and enqueue_many publish a job per send: the graph kept the newest one only, and a
    # cancel of the canvas said it cancelled every queued step while the other job stayed queued.
    db.jobs.insert_many(
        [
            step(0, clock, taskId=ROOT, status="queued"),
            step(1, clock, taskId="dup", parentId=ROOT, status="queued"),
            step(2, clock, taskId="dup", parentId=ROOT, status="queued"),
        ]
    )
    canvas = canvas_of(ops, ROOT)
    assert canvas is not None
    (dup,) = [s for s in canvas["steps"] if s["id"] == "dup"]
    assert dup["jobId"] == step(2, clock)["_id"]  # the newest job is the step
    assert dup["earlierJobs"] == [{"jobId": step(1, clock)["_id"], "status": "queued"}]
    assert "sent 2 times" in "\n".join(tree_lines(canvas))
    cancel = cancel_canvas(ops, ROOT, by="ops")
    assert cancel is not None
    assert sorted(s["jobId"] for s in cancel.cancelled) == sorted(step(n, clock)["_id"] for n in range(3))
    assert db.jobs.count_documents({"status": "queued"}) == 0


def test_a_message_whose_chord_joins_two_long_lists_is_walked_to_a_bound(ops: Operations, db: Database, clock) -> None:
    # A chord's header exits each link to each body entry: 20,000 of one task id on both sides took the walk 34 s
    # (its time grows with the square of the lists); distinct ids made the same walk of every pair.
    repeated = [signature("same-id")] * 3_000
    distinct = [signature(f"h{n}") for n in range(400)]
    chord = {
        "subtask_type": "chord",
        "kwargs": {
            "header": repeated + distinct,
            "body": {"subtask_type": "group", "kwargs": {"tasks": repeated + [signature(f"b{n}") for n in range(400)]}},
        },
    }
    db.jobs.insert_one(step(0, clock, taskId=ROOT, payload={"args": [], "kwargs": {}, "options": {"chord": chord}}))
    canvas = canvas_of(ops, ROOT)
    assert canvas is not None and canvas["edgesTruncated"] and len(canvas["edges"]) == canvas["edgeLimit"]
    assert {"same-id", "h0", "b0"} <= {s["id"] for s in canvas["steps"]}
    assert tree_lines(canvas)[-1].startswith("... truncated: the canvas has more than 10000 links")
