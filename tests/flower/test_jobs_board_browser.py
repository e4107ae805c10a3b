"""The Jobs tab's run now, orphans and holders, argument search and charts in a real browser (Playwright, Chromium)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

from playwright.sync_api import Page, expect
from pymongo.database import Database

from tests.support.workers import ARTIFACTS, FAST_OPTIONS, job, send, settled, wait_for

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


#: A lease that runs out within the test: heartbeats every 1.2 s, a job without one for 6 s is orphaned.
SHORT_LEASE = {**FAST_OPTIONS, "stale_after": 6.0}


def test_a_sigkilled_workers_job_is_orphaned_until_the_sweep(
    app, db: Database, worker_factory, flower_factory, browser
) -> None:
    flower = flower_factory(basic_auth="admin:s3cret", env={"BB_TRANSPORT_OPTIONS": json.dumps(SHORT_LEASE)})
    worker = worker_factory(options=SHORT_LEASE)
    held = send(app, "sleep", 600)
    doc = wait_for(settled(db, held, "running"), message="the worker holds the sleeping job")
    context = browser.new_context(http_credentials=ADMIN, viewport={"width": 1400, "height": 1000})
    page = context.new_page()

    # While the worker lives: it holds the job, linked to its page in Flower (known from its heartbeats).
    page.goto(f"{flower.url}/jobs")
    holder = page.locator(f'#holders tbody tr[data-owner="{doc["leaseOwner"]}"]')
    expect(holder.locator(".holder-running")).to_have_text("1")
    expect(holder.locator(".holder-orphaned")).to_have_text("0")
    node = f"{worker.name}@{worker_host(doc)}"
    expect(holder.locator(".holder-worker a")).to_have_attribute("href", "/worker/" + quote(node, safe=""))
    expect(holder.locator(".holder-worker a")).to_have_text(node)
    expect(holder.locator(".holder-jobs a")).to_have_text(doc["_id"])
    expect(page.locator("#count-orphaned")).to_have_text("orphaned 0")
    shot(page, "holders")

    # SIGKILLed: no heartbeat any more, and no other worker to sweep. Its job is orphaned in the list and its page.
    worker.kill()
    expect(page.locator("#count-orphaned")).to_have_text("orphaned 1")
    row = page.locator(f'#jobs-table tbody tr[data-job="{doc["_id"]}"]')
    expect(row.locator(".job-orphaned")).to_have_text("orphaned")
    expect(holder.locator(".holder-orphaned")).to_have_text("1")
    shot(page, "orphaned")
    page.click("#count-orphaned")
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(1)
    page.goto(f"{flower.url}/jobs/job?id={doc['_id']}")
    expect(page.locator("#job-orphaned")).to_have_text("orphaned")
    expect(page.locator("#orphan-note")).to_contain_text(doc["leaseOwner"])
    assert job(db, held)["status"] == "running"  # still: nobody swept

    # A new worker sweeps as it starts: the job goes back to the queue (a lost attempt), and is orphaned no more.
    worker_factory(options=SHORT_LEASE)
    swept = wait_for(lambda: (d := job(db, held)).get("attempts") == 2 and d, message="the sweep sent it back")
    assert swept["history"][0]["outcome"] == "lost"
    page.goto(f"{flower.url}/jobs")
    expect(page.locator("#count-orphaned")).to_have_text("orphaned 0")
    expect(page.locator(f'#jobs-table tbody tr[data-job="{doc["_id"]}"] .job-orphaned')).to_have_count(0)
    context.close()


def worker_host(doc: dict) -> str:
    """The host of the worker node name `name@%h`: Celery's %h, the host part of the lease owner `host:pid:id`."""
    return doc["leaseOwner"].split(":")[0]


def test_searching_inside_arguments_from_the_filters(db: Database, flower_factory, browser) -> None:
    # More jobs than a search looks among (--jobs_search_window, 100 here; 10,000 by default): written as a publish
    # writes them, the newest with the searched value, the oldest too (out of the window).
    docs = [
        {"_id": f"01J{n:023d}", "taskId": f"t-{n}", "kind": "app.bill", "queue": "celery", "status": "succeeded",
         "attempts": 1, "payload": {"args": [n], "kwargs": {"account": "a.b" if n % 10 == 0 else "other"},
                                    "headers": {"id": f"t-{n}", "task": "app.bill"}}}
        for n in range(105)
    ]  # fmt: skip
    db.jobs.insert_many(docs)
    flower = flower_factory(basic_auth="admin:s3cret", extra_args=("--jobs_search_window=100",))
    context = browser.new_context(http_credentials=ADMIN, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(f"{flower.url}/jobs")
    page.wait_for_load_state("load")
    page.fill("#f-arg-name", "kwargs.account")
    page.fill("#f-arg-value", "a.b")
    page.click("#apply-filters")
    # Jobs 100 down to 10 hold it within the newest 100 (5 to 104); job 0 is older than the window.
    rows = page.locator("#jobs-table tbody tr[data-job]")
    expect(rows).to_have_count(10)
    expect(rows.first).to_have_attribute("data-job", f"01J{100:023d}")
    expect(page.locator(".argument-chip")).to_contain_text("kwargs.account = a.b")
    expect(page.locator("#search-window")).to_contain_text("looked at the newest 100 jobs")
    expect(page.locator("#search-window")).to_contain_text(f"01J{5:023d}")
    shot(page, "argument-search")
    page.click(".remove-argument")
    expect(rows).to_have_count(50)  # a whole page again
    expect(page.locator("#search-window")).to_be_hidden()
    context.close()


def test_the_charts_draw_the_apis_numbers_in_light_and_dark(db: Database, flower_factory, browser) -> None:
    now = datetime.now(UTC).replace(second=30, microsecond=0) - timedelta(minutes=5)  # mid-interval, 5 min ago
    for n, (queue, status, run) in enumerate([("a", "succeeded", 2.0), ("a", "succeeded", 4.0), ("b", "failed", 8.0)]):
        started = now - timedelta(seconds=run)
        db.jobs.insert_one({"_id": f"01J{n:023d}", "taskId": f"t-{n}", "queue": queue, "kind": f"app.{queue}",
                            "status": status, "attempts": 1, "runAfter": started - timedelta(seconds=1),
                            "startedAt": started, "finishedAt": now, "updatedAt": now, "createdAt": started,
                            "history": [{"n": 1, "outcome": status, "finishedAt": now}]})  # fmt: skip
    flower = flower_factory(basic_auth="admin:s3cret")
    api = flower.get("/api/jobs/stats?window=1h")
    (series,) = api["series"].values()
    at = next(n for n, value in enumerate(series["succeeded"]) if value)
    assert (series["succeeded"][at], series["failed"][at], series["runP50"][at], series["runP95"][at]) == (2, 1, 4, 8)
    for scheme in ("light", "dark"):
        context = browser.new_context(
            http_credentials=ADMIN, viewport={"width": 1400, "height": 1200}, color_scheme=scheme
        )
        page = context.new_page()
        page.goto(f"{flower.url}/jobs")
        page.wait_for_load_state("load")
        page.click("#charts summary")
        # Drawn from the page's own request, which may be a minute later than the API's: the same values, maybe
        # one interval further left.
        expect(page.locator("#charts")).to_have_attribute("data-drawn", re.compile(r"\d{4}-"))
        drawn = page.evaluate("() => window.bbCharts['chart-finished'].data")
        assert [v for v in drawn[1] if v] == [2] and [v for v in drawn[2] if v] == [1] and not any(drawn[3])
        assert [v for v in page.evaluate("() => window.bbCharts['chart-run'].data")[2] if v is not None] == [8]
        assert len(drawn[0]) == 60 and page.locator("#chart-finished canvas").count() == 1
        page.click("#chart-numbers >> xpath=.. >> summary")
        row = page.locator("#chart-numbers tbody tr")
        expect(row).to_have_count(1)
        expect(row.locator("td").nth(1)).to_have_text("2")
        expect(row.locator("td").nth(6)).to_have_text("4.000")
        ink = page.evaluate("() => getComputedStyle(document.body).color")
        legend = page.evaluate("() => getComputedStyle(document.querySelector('#chart-finished .u-legend')).color")
        assert legend == ink, (scheme, legend, ink)  # the legend in the theme's ink, readable on its background
        shot(page, f"charts-{scheme}")
        # Grouped by queue: queue b alone.
        page.select_option("#chart-by", "queue")
        expect(page.locator("#chart-group option")).to_have_count(2)
        page.select_option("#chart-group", "b")
        page.wait_for_function("() => window.bbCharts['chart-finished'].data[2].some(v => v === 1) && "
                               "!window.bbCharts['chart-finished'].data[1].some(v => v > 0)")  # fmt: skip
        context.close()


def test_charts_draw_gaps_where_a_pass_summarizing_ahead_is_under_way_and_fill_them_after_it(
    db: Database, flower_factory, browser
) -> None:
    from bb_broker.jobs.lifecycle import Policy
    from bb_broker.jobs.store import JobStore
    from bb_broker.ops.operations import Operations
    from bb_broker.ops.stats import SummarizingAhead
    from bb_broker.ops.summaries import Summaries

    now = datetime.now(UTC)
    for n, hours in enumerate((2 / 60, 10)):  # in the last minutes a chart reads from the jobs, and long before
        done = now - timedelta(hours=hours)
        db.jobs.insert_one({"_id": f"01J{n:023d}", "taskId": f"t-{n}", "queue": "a", "kind": "app.a",
                            "status": "succeeded", "attempts": 1, "runAfter": done - timedelta(seconds=3),
                            "startedAt": done - timedelta(seconds=2), "finishedAt": done, "updatedAt": done,
                            "createdAt": done - timedelta(seconds=3),
                            "history": [{"n": 1, "outcome": "succeeded", "finishedAt": done}]})  # fmt: skip
    store = JobStore(db, Policy())
    # A worker elsewhere has begun its pass over the week (its turn taken before this Flower's thread asks for it).
    assert Summaries(db.jobs, store.now).take_turn("worker@elsewhere:1", timedelta(minutes=10))
    flower = flower_factory(basic_auth="admin:s3cret")
    context = browser.new_context(http_credentials=ADMIN, viewport={"width": 1400, "height": 1200})
    page = context.new_page()
    page.goto(f"{flower.url}/jobs")
    page.wait_for_load_state("load")
    page.click("#charts summary")
    page.select_option("#chart-window", "1d")
    pending = page.locator("#chart-pending")
    expect(pending).to_contain_text("still being summarized by worker@elsewhere:1")
    expect(pending).to_be_visible()
    drawn = page.evaluate("() => window.bbCharts['chart-finished'].data")
    assert [v for v in drawn[1] if v] == [1]  # the job of 2 minutes ago; the other's interval is a gap
    assert drawn[1].count(None) >= 80 and drawn[1][-1] is not None
    shot(page, "charts-summarizing")

    assert SummarizingAhead(Operations(store), "worker@elsewhere:1").pass_once()  # the worker's pass ends
    expect(pending).to_be_hidden(timeout=30_000)  # at a live refresh
    drawn = page.evaluate("() => window.bbCharts['chart-finished'].data")
    assert [v for v in drawn[1] if v] == [1, 1] and None not in drawn[1]
    context.close()
