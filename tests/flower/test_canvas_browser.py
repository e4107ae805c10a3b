"""A canvas as one picture: real chains and chords run by a real worker, their graph from the JSON API (as a read-only
user), drawn on the job page in Chromium, listed by `root=`; and hand-written hostile canvas fields that break
neither."""

from __future__ import annotations

import json
import urllib.parse

from celery import chain, chord
from playwright.sync_api import expect
from pymongo.database import Database

from tests.support.flower_process import AUTH_ARGS, USERS, VIEWER, FlowerProcess
from tests.support.workers import ARTIFACTS, job, settled, wait_for

T = "tests.support.e2e_app."
VIEWER_LOGIN = dict(zip(("username", "password"), VIEWER.split(":"), strict=True))


def canvas(flower: FlowerProcess, identifier: str) -> dict:
    status, body = flower.request("GET", "/api/jobs/canvas?id=" + urllib.parse.quote(identifier, safe=""))
    assert status == 200, body[:500]
    return json.loads(body)


def by_id(graph: dict) -> dict[str, dict]:
    return {step["id"]: step for step in graph["steps"]}


def edges(graph: dict) -> set[tuple[str, str, str]]:
    return {(edge["from"], edge["to"], edge["kind"]) for edge in graph["edges"]}


def test_a_failed_chain_and_a_chord_as_one_picture(
    results_app, db: Database, worker_factory, flower_factory, browser, broker_url: str
) -> None:
    worker_factory(env={"BB_RESULT_BACKEND": broker_url})
    flower = flower_factory(basic_auth=USERS, extra_args=AUTH_ARGS, user=VIEWER)
    sig = results_app.signature
    failing = chain(sig(T + "add", args=(1, 2)), sig(T + "always_fails", immutable=True), sig(T + "add", args=(4,)))()
    first, middle, last = failing.parent.parent.id, failing.parent.id, failing.id
    wait_for(settled(db, middle, "failed"), timeout=120, message="the chain's middle step out of attempts")
    chorded = chord([sig(T + "add", args=(1, 1)), sig(T + "add", args=(2, 2))])(sig(T + "tsum"))
    assert chorded.get(timeout=120) == 6
    header = [result.id for result in chorded.parent.results]

    # The chain: 1 succeeded, 2 failed (marked), 3 pending (from the chain kept in 2's message); from any step.
    graph = canvas(flower, job(db, middle)["_id"])
    steps = by_id(graph)
    assert [steps[step]["status"] for step in (first, middle, last)] == ["succeeded", "failed", "pending"]
    assert steps[middle]["marks"] == ["failed"] and steps[middle]["attempts"] == job(db, middle)["attempts"]
    assert steps[last]["jobId"] is None and steps[first]["jobId"] == job(db, first)["_id"]
    assert {(first, middle, "chain"), (middle, last, "chain")} <= edges(graph)
    assert [steps[step]["depth"] for step in (first, middle, last)] == [0, 1, 2] and not graph["truncated"]
    status, body = flower.request("GET", "/api/jobs/canvas?id=" + last)
    assert (status, json.loads(body)) == (404, {"error": f"no job has the id or task id {last!r}"})

    # The chord: its header (each task its own root, joined by their group) and its body, from the body or a header.
    for asked in (chorded.id, header[0]):
        graph = canvas(flower, asked)
        steps = by_id(graph)
        assert set(steps) == {*header, chorded.id} and {s["status"] for s in steps.values()} == {"succeeded"}
        assert {(part, chorded.id, "chord") for part in header} <= edges(graph)
        assert steps[chorded.id]["depth"] == 1 and {steps[part]["depth"] for part in header} == {0}

    # The Jobs list by canvas.
    listed = flower.get("/api/jobs?root=" + first)
    assert sorted(row["taskId"] for row in listed["jobs"]) == sorted([first, middle]) and listed["filter"] == {
        "root": first
    }

    # A hand-written job with hostile canvas fields: a root that is no id, a link that is itself, a chain that loops.
    own = "hostile-task"
    loop = {"task": "app.x", "options": {"task_id": own}}
    db.jobs.insert_one(
        {"_id": "01KHOSTILE0000000000000000", "taskId": own, "kind": "app.hostile", "queue": "celery",
         "status": "failed", "attempts": 1, "rootId": {"$ne": None}, "parentId": "x" * 100_000, "groupId": [1],
         "payload": {"options": {"chain": [loop, "not a signature", {"task": "app.y", "options": {"task_id": 5}}],
                                 "callbacks": {"not": "a list"}, "chord": loop}}}
    )  # fmt: skip
    graph = canvas(flower, own)
    assert set(by_id(graph)) == {own, "pending:1"} and by_id(graph)[own]["marks"] == ["failed"]
    assert by_id(graph)["pending:1"]["name"] == "app.y"

    # In Chromium, as the read-only user: the chain's steps drawn in their states, each published one a link.
    context = browser.new_context(http_credentials=VIEWER_LOGIN, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(f"{flower.url}/jobs/job?id={middle}")
    drawn = page.locator("#canvas-graph svg")
    expect(drawn.locator(f"[data-step='{first}']")).to_have_attribute("data-status", "succeeded")
    failed = "canvas-step status-failed marked current"  # this page's job, marked
    expect(drawn.locator(f"[data-step='{middle}']")).to_have_attribute("class", failed)
    expect(drawn.locator(f"[data-step='{last}']")).to_have_attribute("data-status", "pending")
    expect(page.locator("#canvas-summary")).to_contain_text("3 steps")
    assert drawn.locator(f"[data-step='{last}']").evaluate("e => e.tagName") == "g"  # no page to link to
    assert drawn.locator("path.canvas-edge").count() == 2
    width = drawn.evaluate("svg => svg.getBoundingClientRect().width")
    assert drawn.evaluate("svg => svg.parentElement.getBoundingClientRect().width") >= width  # all of it shown
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "jobs-canvas-chain.png"), full_page=True)
    page.click("#canvas-list")  # the Jobs list of the canvas's root: the chain's two published steps
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(2)
    expect(page.locator("#f-root")).to_have_value(first)
    page.go_back()
    drawn.locator(f"[data-step='{first}']").click()  # a step is its job's page
    expect(page.locator("#job-status")).to_have_text("succeeded")
    assert job(db, first)["_id"] in page.url

    page.goto(f"{flower.url}/jobs/job?id={chorded.id}")
    expect(page.locator("#canvas-graph svg [data-step]")).to_have_count(3)
    expect(page.locator("#canvas-graph svg path.kind-chord")).to_have_count(2)

    page.goto(f"{flower.url}/jobs/job?id={own}")  # the hostile job's page draws what it can
    expect(page.locator("#canvas-summary")).to_contain_text("2 steps")
    expect(page.locator("#canvas-graph svg [data-step]")).to_have_count(2)
    context.close()
