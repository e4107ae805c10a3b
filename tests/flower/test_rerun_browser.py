"""Retry with changed arguments in the Jobs tab, in a real browser (Playwright driving Debian's Chromium), with a real
worker: the form, its confirm step, the new job's page; nothing of it for a read-only user."""

from __future__ import annotations

from playwright.sync_api import expect
from pymongo.database import Database

from tests.flower.test_rerun import USERS, assert_linked, failed_add, snapshot
from tests.support.workers import settled, wait_for

ADMIN = {"username": "admin", "password": "s3cret"}
VIEWER = {"username": "viewer", "password": "peek"}


def test_an_admin_retries_a_failed_job_with_changed_arguments_in_the_jobs_tab(
    app, db: Database, worker_factory, flower_factory, browser
) -> None:
    worker_factory()
    flower = flower_factory(basic_auth=USERS, extra_args=("--jobs_admins=admin",))
    original = failed_add(app, db)
    before = snapshot(db)

    page = browser.new_context(http_credentials=ADMIN).new_page()
    page.goto(f"{flower.url}/jobs/job?id={original['_id']}")
    page.wait_for_load_state("load")  # the page's script, which gives its buttons their clicks, has run
    page.click("#rerun-open")
    expect(page.locator("#rerun-args")).to_have_value('[1, "x"]')  # the job's own arguments, to change

    # Hostile input: refused in one line at the preview, nothing written, the form still there to fix it.
    page.fill("#rerun-args", "[1, 2")
    page.click("#rerun-preview")
    expect(page.locator("#rerun-error")).to_contain_text("args is not JSON")
    page.fill("#rerun-args", "[1, 2]")
    page.fill("#rerun-kwargs", "[]")
    page.click("#rerun-preview")
    expect(page.locator("#rerun-error")).to_contain_text("kwargs must be a JSON object")
    assert snapshot(db) == before

    # The confirm step shows the arguments as they will be sent; Send makes the new job and opens its page.
    page.fill("#rerun-kwargs", "{}")
    page.click("#rerun-preview")
    expect(page.locator("#rerun-shown-args")).to_have_text("args [1,2]")
    expect(page.locator("#rerun-shown-kwargs")).to_have_text("kwargs {}")
    expect(page.locator("#rerun-message")).to_contain_text('"argsrepr": "[1, 2]"', use_inner_text=False)
    assert snapshot(db) == before
    page.click("#rerun-send")
    expect(page.locator("#job-action-log")).to_contain_text(f"replaces job {original['_id']}")
    new_id = page.locator("#job-page").get_attribute("data-job")
    assert new_id and new_id != original["_id"]
    new = wait_for(settled(db, db.jobs.find_one({"_id": new_id})["taskId"], "succeeded"), message="add(1, 2) ran")
    assert new["payload"]["args"] == [1, 2]
    assert_linked(db, original, new_id, by="admin")
    page.goto(f"{flower.url}/jobs/job?id={original['_id']}")
    expect(page.locator("#job-status")).to_have_text("failed")
    expect(page.locator("#job-action-log")).to_contain_text(f"replaced by job {new_id}")

    # A read-only user (not among --jobs_admins) sees the job and nothing of the action.
    viewer = browser.new_context(http_credentials=VIEWER).new_page()
    viewer.goto(f"{flower.url}/jobs/job?id={original['_id']}")
    expect(viewer.locator("#job-arguments")).to_be_visible()
    expect(viewer.locator("#rerun-open")).to_have_count(0)
    expect(viewer.locator("#rerun-form")).to_have_count(0)
