"""Progress bars in the Jobs tab: from Celery's PROGRESS state or a task's checkpoint, in the list and on the job
page (kept live), for read-only users too; whatever a document holds there shows a clamped bar or none."""

from __future__ import annotations

import math
from typing import Any

from playwright.sync_api import expect
from pymongo.database import Database

from tests.support.workers import producer, send, settled, wait_for

APP = "tests.support.resume_app"
VIEWER = {"username": "viewer", "password": "peek"}


def parked(app: Any, db: Database, status: str = "queued", **fields: Any) -> str:
    """A real job on a queue no worker reads, with `fields` set as another program (or a hand edit) would."""
    task_id = send(app, "add", 1, 2, queue="parked")
    db.jobs.update_one({"taskId": task_id}, {"$set": {"status": status, **fields}})
    return db.jobs.find_one({"taskId": task_id})["_id"]


def progress(done: Any, total: Any) -> dict[str, Any]:
    return {"state": "PROGRESS", "result": {"done": done, "total": total}}


#: What a job holds, and the bar it shows (None: none).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "PROGRESS 3 of 10": (progress(3, 10), {"done": 3, "total": 10, "percent": 30}),
    "checkpoint 4 of 10": ({"checkpointCounts": {"done": 4, "total": 10}}, {"done": 4, "total": 10, "percent": 40}),
    "PROGRESS over the checkpoint": (
        {**progress(7, 10), "checkpointCounts": {"done": 1, "total": 10}},
        {"done": 7, "total": 10, "percent": 70},
    ),
    "another state: the checkpoint": (
        {"state": "STARTED", "result": {"done": 9, "total": 10}, "checkpointCounts": {"done": 1.5, "total": 6}},
        {"done": 1.5, "total": 6, "percent": 25},
    ),
    "done over total": (progress(50, 10), {"done": 10, "total": 10, "percent": 100}),
    "done negative": (progress(-5, 10), {"done": 0, "total": 10, "percent": 0}),
    "numbers as text": (progress("3", "10"), None),
    "booleans": (progress(True, 2), None),
    "total 0": (progress(0, 0), None),
    "total negative": (progress(1, -10), None),
    "huge": (progress(1e308, 1e308), None),
    "huge integers": (progress(2**62, 2**62), None),
    "not a number": (progress(math.nan, 10), None),
    "infinite": (progress(1, math.inf), None),
    "meta a long text": ({"state": "PROGRESS", "result": "x" * 100_000}, None),
    "meta a list": ({"state": "PROGRESS", "result": [{"done": 1, "total": 2}]}, None),
    "counts a text": ({"checkpointCounts": "half"}, None),
    "counts a list": ({"checkpointCounts": [1, 2]}, None),
}


def test_the_api_and_the_pages_show_a_bar_only_for_sound_counts_clamped(app, db, flower_factory) -> None:
    flower = flower_factory()
    ids = {name: parked(app, db, **fields) for name, (fields, _) in CASES.items()}
    finished = parked(app, db, status="succeeded", **progress(3, 10))
    failed = parked(app, db, status="failed", checkpointCounts={"done": 2, "total": 8})
    listed = {row["id"]: row for row in flower.get("/api/jobs?limit=50")["jobs"]}
    for name, (_, bar) in CASES.items():
        assert listed[ids[name]].get("progress") == bar, name
        assert flower.get(f"/api/jobs/job?id={ids[name]}")["progress"] == bar, name
        assert flower.get(f"/jobs/job/progress?id={ids[name]}") == {"status": "queued", "progress": bar}, name
        assert flower.request("GET", f"/jobs/job?id={ids[name]}")[0] == 200, name
    assert "progress" not in listed[finished]  # a finished job needs no bar
    assert listed[failed]["progress"] == {"done": 2, "total": 8, "percent": 25}  # where a failed one stopped
    status, body = flower.request("GET", "/jobs/job/progress?id=nope")
    assert status == 404 and "no job has the id 'nope'" in body


def test_a_read_only_user_watches_a_running_jobs_bar_move_in_the_browser(
    broker_url, db, worker_factory, flower_factory, browser
) -> None:
    # Celery's idiom with the bbmongo:// result backend, and a checkpoint's counts without one.
    worker_factory(app=APP, env={"BB_RESULT_BACKEND": "broker"})
    flower = flower_factory(basic_auth="admin:s3cret,viewer:peek", extra_args=("--jobs_admins=admin",))
    app = producer(broker_url)
    steps = [{"done": 3, "total": 10}, {"done": 8, "total": 10}]
    by_state = app.send_task(f"{APP}.show_progress", args=(steps, "s", "state")).id
    by_checkpoint = app.send_task(f"{APP}.show_progress", args=([{"done": 4, "total": 10}], "c", "checkpoint")).id
    for task_id in (by_state, by_checkpoint):
        wait_for(lambda task_id=task_id: db.runs.find_one({"taskId": task_id, "step": 0}), message="reported")
    ids = {task_id: db.jobs.find_one({"taskId": task_id})["_id"] for task_id in (by_state, by_checkpoint)}

    page = browser.new_context(http_credentials=VIEWER).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{flower.url}/jobs")
    for task_id, percent in ((by_state, "30"), (by_checkpoint, "40")):
        bar = page.locator(f"#jobs-table tr[data-job='{ids[task_id]}'] .job-progress")
        expect(bar).to_have_attribute("aria-valuenow", percent)
        expect(bar).to_have_attribute("title", f"{percent[0]} of 10 ({percent}%)")
    expect(page.locator("[data-action]")).to_have_count(0)  # read-only: no action, the bars all the same

    page.goto(f"{flower.url}/jobs/job?id={ids[by_state]}")
    expect(page.locator("#job-progress-text")).to_have_text("3 of 10 (30%)")
    db.fixes.insert_one({"_id": "s:0"})  # the task reports 8 of 10: the page follows without a reload
    expect(page.locator("#job-progress-text")).to_have_text("8 of 10 (80%)")
    expect(page.locator("#job-progress .progress")).to_have_attribute("aria-valuenow", "80")
    db.fixes.insert_many([{"_id": "s:1"}, {"_id": "c:0"}])
    wait_for(settled(db, by_state, "succeeded"), message="the task finished")
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#job-progress")).to_be_hidden()
    assert errors == []


def test_a_retry_from_the_tab_keeps_the_checkpoint_unless_told_to_start_over(app, db, flower_factory) -> None:
    flower = flower_factory(basic_auth="admin:s3cret,viewer:peek", extra_args=("--jobs_admins=admin",))
    saved = {"checkpoint": '{"done":3,"total":6}', "checkpointCounts": {"done": 3, "total": 6}}
    kept, fresh = (parked(app, db, status="failed", **saved) for _ in range(2))
    plain = parked(app, db, status="failed")
    assert 'data-fresh="1"' in flower.request("GET", f"/jobs/job?id={kept}", user="admin:s3cret")[1]
    assert 'data-fresh="1"' not in flower.request("GET", f"/jobs/job?id={kept}", user="viewer:peek")[1]
    assert 'data-fresh="1"' not in flower.request("GET", f"/jobs/job?id={plain}", user="admin:s3cret")[1]
    for job_id, form in ((kept, {}), (fresh, {"fresh": "1"})):
        status, body = flower.request("POST", f"/api/jobs/job/retry?id={job_id}", form, user="admin:s3cret")
        assert status == 200, body
    kept_doc, fresh_doc = db.jobs.find_one({"_id": kept}), db.jobs.find_one({"_id": fresh})
    assert (kept_doc["status"], kept_doc["checkpoint"], kept_doc["checkpointCounts"]) == ("queued", *saved.values())
    assert fresh_doc["status"] == "queued" and "checkpoint" not in fresh_doc and "checkpointCounts" not in fresh_doc
    assert fresh_doc["actions"][-1]["checkpoint"] == "cleared" and "checkpoint" not in kept_doc["actions"][-1]
