"""The Jobs tab's run now, orphans and holders, argument search and charts in a real browser (Playwright, Chromium)."""

from __future__ import annotations

from playwright.sync_api import Page, expect
from pymongo.database import Database

from tests.support.workers import ARTIFACTS, send, settled, wait_for

ADMIN = {"username": "admin", "password": "s3cret"}


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"jobs-board-{name}.png"), full_page=True)


def test_run_now_from_a_jobs_page_and_for_a_filter(app, db: Database, worker_factory, flower_factory, browser) -> None:
    worker_factory(extra_args=("-Q", "celery,mail"), options={"safety_poll_interval": 3600.0})
    flower = flower_factory(basic_auth="admin:s3cret")
    later = send(app, "add", 1, 2, countdown=3600)
    mail = [send(app, "add", n, n, countdown=3600, queue="mail") for n in range(2)]
    for task_id in [later, *mail]:
        wait_for(settled(db, task_id, "queued"), message=f"{task_id} waiting for its countdown")

    context = browser.new_context(http_credentials=ADMIN, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(f"{flower.url}/jobs/job?id={later}")
    page.wait_for_load_state("load")  # the page's script, which gives its buttons their clicks, has run
    expect(page.locator("[data-action=run-now]")).to_have_text("Run now")
    shot(page, "run-now-job")
    page.click("[data-action=run-now]")
    expect(page.locator("#job-action-log")).to_contain_text("run-now")  # the page reloads itself after an action
    done = wait_for(settled(db, later, "succeeded"), message="the job ran after its page's Run now")
    assert done["actions"][-1]["by"] == "admin"

    page.goto(f"{flower.url}/jobs?queue=mail")
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(2)
    page.click("[data-bulk=run-now]")
    expect(page.locator("#notice")).to_have_text("run-now: 2 jobs")
    for task_id in mail:
        wait_for(settled(db, task_id, "succeeded"), message=f"{task_id} ran after the bulk Run now")
    expect(page.locator("#jobs-table tbody tr[data-status=succeeded]")).to_have_count(2)
    context.close()
