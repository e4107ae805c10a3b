"""Flower's Schedules view in a real browser: run now, disable, enable; a read-only user and a forged post refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect
from pymongo.database import Database

from bb_broker.beat import ScheduleStore
from bb_broker.clock import ServerClock
from tests.support.flower_process import FlowerProcess
from tests.support.workers import process_factory, wait_for

ADMIN = {"username": "admin", "password": "s3cret"}
VIEWER = {"username": "viewer", "password": "peek"}


@pytest.fixture
def flower_factory(request: pytest.FixtureRequest, broker_url: str, tmp_path: Path) -> Iterator[Callable]:
    def build(n: int, **kwargs: Any) -> FlowerProcess:
        return FlowerProcess(broker_url, log_dir=tmp_path, name=f"flower{n}", launcher="bb-broker", **kwargs)

    yield from process_factory(request, build, FlowerProcess.stop)


def test_an_operator_runs_disables_and_enables_an_entry_and_a_viewer_cannot(db: Database, flower_factory, browser):
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
