"""A job's place in its canvas, recorded at publish from Celery's headers, and `bb-broker show --tree` of a real chain
run by a real worker."""

from __future__ import annotations

from celery import Celery, chain
from click.testing import CliRunner
from pymongo.database import Database

from bb_broker.cli import main
from tests.support.workers import job, send, settled, wait_for

T = "tests.support.e2e_app."


def test_a_publish_keeps_the_canvas_headers_that_are_ids_and_never_fails_on_the_others(
    app: Celery, db: Database
) -> None:
    alone = send(app, "add", 1, 1)
    assert {job(db, alone).get(field) for field in ("rootId", "parentId", "groupId")} == {alone, None}
    longest = "r" * 200
    kept = send(app, "add", 1, 1, root_id=longest, parent_id="p-1", group_id="g-1", group_index=3)
    doc = job(db, kept)
    assert (doc["rootId"], doc["parentId"], doc["groupId"], doc["groupIndex"]) == (longest, "p-1", "g-1", 3)
    # Too long to be an id, empty: the task is published all the same, its canvas fields left out.
    hostile = send(app, "add", 1, 1, root_id="r" * 201, parent_id="", group_id="g" * 100_000, group_index=2**40)
    doc = job(db, hostile)
    assert doc["status"] == "queued" and not {"rootId", "parentId", "groupId", "groupIndex"} & set(doc)
    assert doc["payload"]["headers"]["root_id"] == "r" * 201  # the message itself as it was sent


def test_show_tree_prints_a_chain_whose_middle_step_failed(app: Celery, db: Database, worker_factory) -> None:
    worker_factory()
    broker = app.conf.broker_url
    result = chain(
        app.signature(T + "add", args=(1, 2)),
        app.signature(T + "always_fails", immutable=True),
        app.signature(T + "add", args=(4,)),
    )()
    first, middle, last = result.parent.parent.id, result.parent.id, result.id
    failed = wait_for(settled(db, middle, "failed"), timeout=120, message="the middle step out of attempts")
    shown = CliRunner().invoke(main, ["show", "--tree", first, "--broker", broker])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0] == f"canvas of job {job(db, first)['_id']} (root {first}): 3 steps"
    assert lines[1].startswith(f"{T}add {first} job {job(db, first)['_id']}: succeeded, 1 attempts")
    assert lines[2] == (
        f"  {T}always_fails {middle} job {failed['_id']}: failed, {failed['attempts']} attempts, queue celery !! failed"
    )
    assert lines[3] == f"    {T}add {last}: pending, queue -"
    missing = CliRunner().invoke(main, ["show", "--tree", last, "--broker", broker])
    assert (missing.exit_code, missing.output) == (1, f"bb-broker: show: no job has the id or task id {last!r}\n")
