"""The Jobs tab in a real browser (Playwright driving Debian's Chromium): an operator's round, with real workers."""

from __future__ import annotations

from playwright.sync_api import Dialog, Page, expect
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from tests.support.store import wait_past
from tests.support.workers import ARTIFACTS, job, send, settled, wait_for

ADMIN = {"username": "admin", "password": "s3cret"}
VIEWER = {"username": "viewer", "password": "peek"}


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"jobs-{name}.png"), full_page=True)


def test_an_operators_round_in_the_jobs_tab(app, db: Database, worker_factory, flower_factory, browser) -> None:
    worker_factory(extra_args=("-Q", "celery,other"))
    flower = flower_factory(basic_auth="admin:s3cret,viewer:peek", extra_args=("--jobs_admins=admin",))
    broken = send(app, "fails_until_fixed", "invoice-42")
    for i in range(3):
        wait_for(settled(db, send(app, "add", i, i), "succeeded"), message="a few jobs ran")
    failed = wait_for(settled(db, broken, "failed"), message="the broken job out of attempts")
    assert failed["attempts"] == 3
    waiting = send(app, "add", 5, 5, countdown=600)

    # Log in (basic auth) and filter to the failed jobs.
    context = browser.new_context(http_credentials=ADMIN, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # every confirmation: yes
    page.goto(f"{flower.url}/jobs")
    expect(page.locator("#count-failed")).to_have_text("failed 1")
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(5)
    shot(page, "list")
    page.select_option("#f-status", "failed")
    page.click("#apply-filters")
    rows = page.locator("#jobs-table tbody tr[data-job]")
    expect(rows).to_have_count(1)
    expect(rows.first.locator(".job-status")).to_have_text("failed")

    # Open it: its attempts, each with its error, as the job document records them.
    rows.first.locator("a").click()
    expect(page.locator("#job-status")).to_have_text("failed")
    page.wait_for_load_state("load")  # the page's script, which gives its buttons their clicks, has run
    history = db.jobs.find_one({"taskId": broken}).get("history") or []
    expect(page.locator("tr.attempt")).to_have_count(len(history))
    for entry in history:
        expect(page.locator("#job-attempts")).to_contain_text(entry["error"])
    expect(page.locator("#job-fields")).to_contain_text("invoice-42 is broken (attempt 3)")
    expect(page.locator("#flower-task")).to_have_attribute("href", f"/task/{broken}")
    shot(page, "failed-job")

    # Fix the bug, retry it, and watch it succeed.
    db.fixes.insert_one({"_id": "invoice-42"})
    page.click("[data-action=retry]")
    expect(page.locator("#job-action-log")).to_contain_text("retry")  # the page reloads itself after an action
    wait_for(settled(db, broken, "succeeded"), message="the retried job succeeded")
    page.goto(f"{flower.url}/jobs/job?id={broken}")
    expect(page.locator("#job-status")).to_have_text("succeeded")

    # Cancel a queued countdown job: it ends failed, said who cancelled it.
    page.goto(f"{flower.url}/jobs/job?id={waiting}")
    page.click("[data-action=cancel]")
    expect(page.locator("#job-status")).to_have_text("failed")
    expect(page.locator("#job-fields")).to_contain_text("cancelled by admin")
    assert job(db, waiting)["lastError"] == "cancelled by admin"

    # Pause a queue: new jobs wait while the worker runs others; resume it and they run.
    page.goto(f"{flower.url}/jobs")
    celery_row = page.locator("#queue-controls tr[data-queue=celery]")
    celery_row.locator("button[data-change=pause]").click()
    expect(celery_row.locator(".queue-state")).to_have_text("paused by admin")
    held = send(app, "add", 7, 7)
    wait_for(settled(db, send(app, "add", 8, 8, queue="other"), "succeeded"), message="the other queue ran")
    assert job(db, held)["status"] == "queued"
    expect(page.locator("#jobs-table tbody tr[data-job]").first).to_have_attribute("data-status", "succeeded")
    shot(page, "paused")
    celery_row.locator("button[data-change=resume]").click()
    expect(celery_row.locator(".queue-state")).to_have_text("active")
    wait_for(settled(db, held, "succeeded"), message="the held job ran after the resume")
    page.select_option("#f-status", "")
    shot(page, "after")
    context.close()

    # A read-only user sees everything and can do nothing: no buttons, and a 403 if they try anyway.
    viewer = browser.new_context(http_credentials=VIEWER).new_page()
    viewer.goto(f"{flower.url}/jobs")
    expect(viewer.locator("#read-only")).to_be_visible()
    expect(viewer.locator("#jobs-table tbody tr[data-job]").first).to_be_visible()
    expect(viewer.locator("#bulk")).to_have_count(0)
    expect(viewer.locator("#queue-controls button")).to_have_count(0)
    viewer.goto(f"{flower.url}/jobs/job?id={broken}")
    expect(viewer.locator("[data-action]")).to_have_count(0)
    refused = viewer.request.post(f"{flower.url}/api/queues/celery/pause")
    assert refused.status == 403 and "viewer may read the jobs but not act" in refused.json()["error"]
    shot(viewer, "read-only")


def test_the_bulk_button_leaves_a_job_published_while_the_operator_confirms(
    db: Database, flower_factory, browser
) -> None:
    store = JobStore(db, Policy())
    store.ensure_indexes()
    for task_id in ("mail-1", "mail-2"):
        store.publish(queue="mail", kind="app.mail", task_id=task_id, payload={"args": []}, priority=0,
                      run_after=None, is_retry=False)  # fmt: skip
    flower = flower_factory(basic_auth="admin:s3cret")
    late: list[str] = []

    def meanwhile_then_confirm(dialog: Dialog) -> None:
        # While "cancel 2 job(s)?" is on screen, a worker takes one and a producer publishes another.
        assert "cancel 2 job(s)" in dialog.message
        wait_past(store, store.now())  # the count came before the dialog
        assert store.claim("mail", "worker-1") is not None
        late.append(store.publish(queue="mail", kind="app.mail", task_id="mail-late", payload={"args": []},
                                  priority=0, run_after=None, is_retry=False))  # fmt: skip
        dialog.accept()

    context = browser.new_context(http_credentials=ADMIN)
    page = context.new_page()
    page.on("dialog", meanwhile_then_confirm)
    page.goto(f"{flower.url}/jobs?queue=mail")
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(2)
    page.click("[data-bulk=cancel]")
    expect(page.locator("#notice")).to_have_text("1 jobs match now, not 2: confirm again")
    assert late and job_status(db, late[0]) == "queued"
    context.close()


def job_status(db: Database, job_id: str) -> str:
    return db.jobs.find_one({"_id": job_id})["status"]


def test_another_site_cannot_act_through_a_flower_without_login(db: Database, flower_factory, browser) -> None:
    # `--no-auth` on the operator's own machine: a page of any other site open in the same browser posts a form
    # to the Jobs tab. Without the page's XSRF token nothing may happen.
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    job_id = store.publish(queue="celery", kind="app.add", task_id="t-1", payload={"args": []}, priority=0,
                           run_after=None, is_retry=False)  # fmt: skip
    claimed = store.claim("celery", "worker-1")
    assert claimed is not None and store.fail(claimed.id, claimed.attempts, "ValueError: broke")
    flower = flower_factory(env={"FLOWER_UNAUTHENTICATED_API": "false"})
    evil = f"""<form id="f" method="post" action="{flower.url}/jobs/bulk/delete?status=failed"></form>
               <script>document.getElementById('f').submit()</script>"""
    context = browser.new_context()
    page = context.new_page()
    page.route("http://elsewhere.test/", lambda route: route.fulfill(body=evil, content_type="text/html"))
    with page.expect_response(lambda response: "/jobs/bulk/delete" in response.url) as answered:
        page.goto("http://elsewhere.test/")
    assert answered.value.status == 403
    assert job_status(db, job_id) == "failed"

    # The Jobs tab's own button still works: it sends the token.
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(f"{flower.url}/jobs?status=failed")
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(1)
    page.click("[data-bulk=delete]")
    expect(page.locator("#notice")).to_have_text("delete: 1 job")
    assert db.jobs.find_one({"_id": job_id}) is None
    context.close()


def test_delete_on_a_jobs_page_deletes_that_job_alone_whatever_its_id(db: Database, flower_factory, browser) -> None:
    # Documents whose own ids are words of the Jobs tab's paths, or read as something else in one: each opened
    # from the list, as an operator does, and deleted with its page's button, among seven other finished jobs.
    store = JobStore(db, Policy())
    store.ensure_indexes()
    now = store.now()
    others = [f"01OTHER{n}" for n in range(7)]
    awkward = ["bulk", "data", "queue", "..", "a/b", "a%2Fb", "ünï ✓"]
    for job_id in others + awkward:
        db.jobs.insert_one({"_id": job_id, "taskId": f"task-{job_id}", "status": "succeeded", "queue": "celery",
                            "kind": "app.add", "attempts": 1, "createdAt": now, "updatedAt": now})  # fmt: skip
    flower = flower_factory(basic_auth="admin:s3cret")
    context = browser.new_context(http_credentials=ADMIN)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    # With no filter set, the bulk button is refused before it asks: it would take every job.
    page.goto(f"{flower.url}/jobs")
    page.click("[data-bulk=delete]")
    expect(page.locator("#notice")).to_contain_text("bulk delete needs a filter")
    assert db.jobs.count_documents({}) == len(others + awkward)
    for job_id in awkward:
        page.goto(f"{flower.url}/jobs")
        page.locator(f'#jobs-table tbody tr[data-job="{job_id}"] a').click()  # the list refreshes: it re-finds the row
        expect(page.locator("#job-page")).to_have_attribute("data-job", job_id)
        page.wait_for_load_state("load")  # the page's script, which gives its buttons their clicks, has run
        page.click("[data-action=delete]")
        expect(page.locator("#jobs-page")).to_be_visible()  # back on the list after the delete
        wait_for(lambda gone=job_id: db.jobs.find_one({"_id": gone}) is None, message=f"job {job_id!r} deleted")
        assert sorted(doc["_id"] for doc in db.jobs.find({"_id": {"$in": others}})) == others, job_id
    context.close()
