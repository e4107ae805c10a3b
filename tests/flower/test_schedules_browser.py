"""Flower's Schedules view in a real browser: what it says without entries; run now, disable, enable; a read-only user
and a forged post refused; an entry's jobs link lists exactly its jobs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect
from pymongo.database import Database

from bb_broker.beat import ScheduleStore
from bb_broker.beat.entries import parse_entry
from bb_broker.beat.scheduler import send_entry, slot_key
from bb_broker.clock import ServerClock
from tests.support.flower_process import FlowerProcess
from tests.support.workers import process_factory, producer, send, wait_for

ADMIN = {"username": "admin", "password": "s3cret"}
VIEWER = {"username": "viewer", "password": "peek"}
DAY = timedelta(days=1)


@pytest.fixture
def flower_factory(request: pytest.FixtureRequest, broker_url: str, tmp_path: Path) -> Iterator[Callable]:
    def build(n: int, **kwargs: Any) -> FlowerProcess:
        return FlowerProcess(broker_url, log_dir=tmp_path, name=f"flower{n}", launcher="bb-broker", **kwargs)

    yield from process_factory(request, build, FlowerProcess.stop)


def test_without_entries_the_view_says_so_and_how_to_add_one(db: Database, flower_factory, browser) -> None:
    flower = flower_factory()
    page = browser.new_page()
    page.goto(f"{flower.url}/jobs/schedules")
    expect(page.locator("#schedules-empty")).to_contain_text("No periodic tasks yet: start a beat with this scheduler")
    expect(page.locator("#schedules-empty")).to_contain_text("bb-broker schedules add NAME TASK --every 60")
    expect(page.locator("#schedules-table")).to_be_hidden()  # no header row over nothing
    ScheduleStore(db, ServerClock(db)).add("nightly", "tests.support.e2e_app.add", {"crontab": "0 3 * * *"})
    page.reload()
    expect(page.locator("#schedules-table tr[data-entry='nightly']")).to_be_visible()
    expect(page.locator("#schedules-empty")).to_have_count(0)


def test_an_operator_runs_disables_and_enables_an_entry_and_a_viewer_cannot(
    db: Database, broker_url: str, flower_factory, browser
):
    ScheduleStore(db, ServerClock(db)).add(
        "nightly", "tests.support.e2e_app.add", {"crontab": "0 3 * * *"}, timezone="Europe/Paris", args=[1, 2]
    )
    flower = flower_factory(basic_auth="admin:s3cret,viewer:peek", extra_args=("--jobs_admins=admin",))
    admin = browser.new_context(http_credentials=ADMIN).new_page()
    admin.goto(f"{flower.url}/jobs/schedules")
    row = admin.locator('#schedules-table tr[data-entry="nightly"]')
    expect(row).to_contain_text("crontab 0 3 * * *")
    expect(row).to_contain_text("Europe/Paris")
    expect(row.locator(".entry-state")).to_have_text("enabled")

    row.locator('button[data-action="run-now"]').click()
    expect(admin.locator("#notice")).to_have_text("nightly: sent now")
    job = wait_for(lambda: db.jobs.find_one({"payload.headers.bb_beat_entry": "nightly"}), message="the run-now job")
    assert job["payload"]["headers"]["bb_beat_run_now"] is True and "uniqueKey" not in job
    admin.reload()
    expect(row.locator(".entry-last")).to_contain_text(f"{job['taskId']} queued (run now)")
    expect(row.locator(".entry-runs")).to_have_text("1")

    row.locator('button[data-action="disable"]').click()
    expect(row.locator(".entry-state")).to_have_text("disabled")
    assert db.bb_schedules.find_one({"_id": "nightly"})["enabled"] is False
    row.locator('button[data-action="enable"]').click()
    expect(row.locator(".entry-state")).to_have_text("enabled")
    entry = db.bb_schedules.find_one({"_id": "nightly"})
    assert entry["enabled"] is True and entry["changedBy"] == "admin"

    viewer = browser.new_context(http_credentials=VIEWER).new_page()
    viewer.goto(f"{flower.url}/jobs/schedules")
    expect(viewer.locator('#schedules-table tr[data-entry="nightly"]')).to_contain_text("enabled")
    expect(viewer.locator("#schedules-table button")).to_have_count(0)
    refused = viewer.evaluate(
        "() => bbPost('/jobs/schedules/disable', {name: 'nightly'}).then(() => 'done', (e) => e.message)"
    )
    assert "viewer may read the jobs but not act on them" in refused
    # Another site's page posting with the admin's credentials: refused before anything runs.
    forged = admin.context.request.post(
        f"{flower.url}/jobs/schedules/disable",
        form={"name": "nightly"},
        headers={"Origin": "http://elsewhere.example", "Sec-Fetch-Site": "cross-site"},
    )
    assert forged.status == 403
    assert db.bb_schedules.find_one({"_id": "nightly"})["enabled"] is True
    assert db.jobs.count_documents({}) == 1

    # The JSON API: the same entries, and the same rule for who may act.
    listed = viewer.context.request.get(f"{flower.url}/api/schedules").json()["entries"]
    assert [(e["name"], e["enabled"], e["lastTaskId"], e["runCount"]) for e in listed] == [
        ("nightly", True, job["taskId"], 1)
    ]
    assert listed[0]["nextSlot"].startswith("20") and listed[0]["timezone"] == "Europe/Paris"
    by_viewer = viewer.context.request.post(f"{flower.url}/api/schedules/run-now", form={"name": "nightly"})
    assert by_viewer.status == 403 and "viewer may read the jobs but not act" in by_viewer.text()
    assert db.jobs.count_documents({}) == 1

    # Following an entry's "jobs" link lists exactly its jobs: its slots' and its run-now, not those of another
    # entry of the same task, nor the task sent by hand.
    store = ScheduleStore(db, ServerClock(db))
    store.add("nightly.eu", "tests.support.e2e_app.add", {"crontab": "0 4 * * *"})
    sender = producer(broker_url)
    try:
        for name in ("nightly", "nightly.eu"):
            entry = parse_entry(db.bb_schedules.find_one({"_id": name}))
            for slot in (entry.slots.next_after(entry.last_slot), entry.slots.next_after(entry.last_slot + DAY)):
                send_entry(sender, entry, slot, slot_key(name, slot))  # as a beat sends a slot's job
        send(sender, "add", 1, 2)
    finally:
        sender.close()
    ours = {doc["_id"] for doc in db.jobs.find({"payload.headers.bb_beat_entry": "nightly"})}
    assert len(ours) == 3 and db.jobs.count_documents({}) == 6
    admin.goto(f"{flower.url}/jobs/schedules")
    admin.locator('#schedules-table tr[data-entry="nightly"] a.entry-jobs').click()
    expect(admin.locator("#f-schedule")).to_have_value("nightly")
    rows = admin.locator("#jobs-table tbody tr[data-job]")
    expect(rows).to_have_count(3)
    assert {rows.nth(i).get_attribute("data-job") for i in range(3)} == ours
    marks = sorted(rows.nth(i).locator(".job-beat").inner_text() for i in range(3))
    assert marks[0] == "beat nightly, run now" and all(mark.startswith("beat nightly, slot 20") for mark in marks[1:])
