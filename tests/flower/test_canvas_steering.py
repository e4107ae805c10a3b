"""Cancelling a whole canvas through the Jobs tab's API and its job page (Chromium) in a real Flower: for admins only;
a user who may only read changes nothing."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from celery import Celery, chord, group
from playwright.sync_api import expect
from pymongo.database import Database

from bb_broker.ops.operations import CHORD_FAILED_NOTE
from tests.support.flower_process import FlowerProcess
from tests.support.workers import settled, wait_for

T = "tests.support.e2e_app."
USERS = "admin:s3cret,viewer:peek"
VIEWER = "viewer:peek"


def post(flower: FlowerProcess, path: str, form: dict[str, Any], **options: Any) -> tuple[int, Any]:
    status, body = flower.request("POST", path, form, **options)
    return status, json.loads(body) if body.startswith("{") else body


def test_cancel_canvas_is_for_admins_and_answers_each_step(results_app: Celery, db: Database, flower_factory) -> None:
    flower = flower_factory(basic_auth=USERS, extra_args=("--jobs_admins=admin",))
    steps = [results_app.signature(T + "add", args=(i, i), immutable=True).set(countdown=600) for i in range(3)]
    group(steps).apply_async()
    queued = list(db.jobs.find({}).sort("_id", 1))
    assert [doc["status"] for doc in queued] == ["queued"] * 3
    one = queued[1]["taskId"]

    # The job page offers the button to an admin only.
    page = f"/jobs/job?id={queued[0]['_id']}"
    assert 'id="canvas-cancel"' in flower.request("GET", page)[1]
    assert 'id="canvas-cancel"' not in flower.request("GET", page, user=VIEWER)[1]

    status, body = post(flower, "/api/jobs/canvas/cancel", {"id": one}, user=VIEWER)
    assert status == 403 and "viewer may read the jobs but not act on them" in body["error"], body
    status, body = post(flower, "/jobs/canvas/cancel", {"id": one}, user=VIEWER)  # the page's, without its token
    assert status == 403, body
    assert list(db.jobs.find({}).sort("_id", 1)) == queued  # nothing changed

    status, body = post(flower, "/api/jobs/canvas/cancel", {"id": one})
    assert status == 200, body
    assert body["message"] == "cancel canvas: 3 queued steps cancelled"
    assert sorted(step["id"] for step in body["cancelled"]) == sorted(doc["taskId"] for doc in queued)
    assert body["running"] == [] and body["finished"] == [] and body["pending"] == []
    after = list(db.jobs.find({}))
    assert {doc["status"] for doc in after} == {"failed"}
    assert all(doc["lastError"] == "cancelled by admin" for doc in after)

    status, body = post(flower, "/api/jobs/canvas/cancel", {"id": "no-such-task"})
    assert status == 404 and "no job has the id or task id 'no-such-task'" in body["error"], body
    status, body = post(flower, "/api/jobs/canvas/cancel", {})
    assert status == 400, body


def test_an_admin_cancels_a_canvas_from_its_job_page(
    results_app: Celery, db: Database, flower_factory, browser
) -> None:
    flower = flower_factory(basic_auth=USERS, extra_args=("--jobs_admins=admin",))
    steps = [results_app.signature(T + "add", args=(i, i), immutable=True).set(countdown=600) for i in range(2)]
    group(steps).apply_async()
    first = db.jobs.find_one({}, sort=[("_id", 1)])
    page = browser.new_context(http_credentials={"username": "admin", "password": "s3cret"}).new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # the confirmation: yes
    page.goto(f"{flower.url}/jobs/job?id={first['_id']}")
    expect(page.locator("#canvas-summary")).to_contain_text("2 steps (2 queued)")
    page.click("#canvas-cancel")
    expect(page.locator("#canvas-cancelled")).to_have_text("cancel canvas: 2 queued steps cancelled")
    assert {doc["status"] for doc in db.jobs.find({})} == {"failed"}


def test_a_revoked_chord_header_step_retried_through_the_api_completes_its_chord_once(
    results_app: Celery, worker_factory, broker_url: str, db: Database, flower_factory, tmp_path: Path
) -> None:
    """The Jobs tab's retry (its API) of a header step revoked while it ran: its chord, failed by the revoke, is
    completed once by the retry, under the new task id, and the job page says what the retry meant."""
    worker_factory(env={"BB_RESULT_BACKEND": broker_url}, options={"max_attempts": 1}, concurrency=2)
    flower = flower_factory(basic_auth=USERS, extra_args=("--jobs_admins=admin",))
    gate = tmp_path / "gate"
    header = [sig(results_app, "add", 1, 1), sig(results_app, "hold_until", str(gate))]
    result = chord(header)(results_app.signature(T + "echo"))
    held = wait_for(lambda: db.runs.find_one({"name": T + "hold_until"}), message="the header step running")
    results_app.control.revoke(held["taskId"], terminate=True)
    revoked = wait_for(settled(db, held["taskId"], "failed"), timeout=120, message="the step revoked")
    wait_for(lambda: db.bb_results.find_one({"_id": f"chord:{revoked['groupId']}", "failed": True}), message="failed")
    gate.touch()

    status, body = post(flower, f"/api/jobs/job/retry?id={held['taskId']}", {})
    assert status == 200, body
    new_id = body["job"]["taskId"]
    assert new_id != held["taskId"] and body["job"]["actions"][-1]["note"] == CHORD_FAILED_NOTE
    done = wait_for(settled(db, result.id, "succeeded"), timeout=120, message="the chord's body ran")
    assert done["result"] == [2, str(gate)] and result.get(timeout=10) == [2, str(gate)]
    assert db.jobs.count_documents({"kind": T + "echo"}) == 1
    page = flower.page(f"/jobs/job?id={revoked['_id']}")
    assert html.escape(CHORD_FAILED_NOTE) in page and new_id in page


def sig(app: Celery, name: str, *args: Any) -> Any:
    return app.signature(T + name, args=args, immutable=True)
