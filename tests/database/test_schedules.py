"""The `bb_schedules` entries: bad input refused with nothing written, beat_schedule synced, the CLI's commands."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta

import bson
import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from celery.schedules import crontab
from pymongo.database import Database

from bb_broker import MalformedTaskMessage
from bb_broker.beat import EntryError, JobScheduler, ScheduleStore, run_now
from bb_broker.beat.entries import parse_entry
from bb_broker.beat.scheduler import send_entry, slot_key
from bb_broker.clock import ServerClock
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import JobFilter
from bb_broker.ops.operations import Operations
from tests.support.beat_process import OUT_OF_RANGE, add_out_of_range_entries
from tests.support.store import CommandLog, assert_each_reads_through_an_index
from tests.support.workers import ROOT


@pytest.fixture
def store(db: Database) -> ScheduleStore:
    return ScheduleStore(db, ServerClock(db))


@pytest.fixture
def beat_app(broker_url: str) -> Iterator[Celery]:
    app = Celery("beat_test", broker=broker_url, set_as_current=False)

    @app.task(name="reports.nightly", shared=False)
    def nightly() -> None:
        pass

    yield app
    app.close()


@pytest.mark.parametrize(
    ("task", "schedule", "how", "message"),
    [
        ("reports.nightly", {"crontab": "0 25 * * *"}, {}, "invalid crontab '0 25"),
        ("reports.nightly", crontab(minute="*/5"), {"timezone": "Mars/Olympus"}, "unknown timezone 'Mars/Olympus'"),
        ("reports.nope", 60, {}, "unknown task 'reports.nope'"),
        ("reports.nightly", 60, {"catch_up": "twice"}, "catchUp must be one of once, all, none"),
        ("reports.nightly", 60, {"options": {"priority": 300}}, "option priority must be 0 to 255"),
        ("reports.nightly", "daily", {}, "a schedule must be seconds, a timedelta, a crontab or a solar"),
    ],
)
def test_an_entry_that_cannot_be_scheduled_is_refused_and_nothing_written(
    store: ScheduleStore, beat_app: Celery, db: Database, task, schedule, how, message
) -> None:
    with pytest.raises(EntryError, match=message):
        store.add("nightly", task, schedule, known_tasks=beat_app.tasks, **how)
    assert db.bb_schedules.count_documents({}) == 0


def test_a_name_too_long_for_a_unique_key_is_refused(store: ScheduleStore, db: Database) -> None:
    with pytest.raises(EntryError, match="an entry's name must be a string of 1 to 200 characters"):
        store.add("n" * 201, "reports.nightly", 60)
    assert db.bb_schedules.count_documents({}) == 0
    store.add("n" * 200, "reports.nightly", 60)  # its keys fit: beat:<200>:<29-character time>


def test_a_duplicate_entry_name_is_refused_and_the_first_kept(store: ScheduleStore, db: Database) -> None:
    store.add("nightly", "reports.nightly", crontab(hour=3, minute=0))
    with pytest.raises(EntryError, match="an entry named 'nightly' exists already"):
        store.add("nightly", "reports.other", 60)
    assert db.bb_schedules.find_one({"_id": "nightly"})["schedule"] == {"crontab": "0 3 * * *"}


def test_beat_schedule_is_synced_as_configuration_and_a_bad_entry_left_out(
    beat_app: Celery, store: ScheduleStore, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    store.add("operator-added", "reports.nightly", 30)
    beat_app.conf.timezone = "Europe/Paris"
    beat_app.conf.beat_schedule = {
        "nightly": {"task": "reports.nightly", "schedule": crontab(hour=3, minute=0), "catch_up": "none"},
        "bad-cron": {"task": "reports.nightly", "schedule": {"crontab": "every day"}},
        "bad-task": {"task": "reports.nope", "schedule": 10},
        "operator-added": {"task": "reports.nightly", "schedule": 5},
        "infinite": {"task": "reports.nightly", "schedule": math.inf},
        "thousands-of-years": {"task": "reports.nightly", "schedule": timedelta(days=10**6)},
    }
    beat_app.add_periodic_task(15.0, beat_app.tasks["reports.nightly"].s(), name="quarter-minute")
    with caplog.at_level(logging.ERROR):
        JobScheduler(beat_app)
    names = sorted(doc["_id"] for doc in db.bb_schedules.find({"owner": "config"}))
    assert names == ["nightly", "quarter-minute"]
    nightly = db.bb_schedules.find_one({"_id": "nightly"})
    assert (nightly["timezone"], nightly["catchUp"], nightly["enabled"]) == ("Europe/Paris", "none", True)
    assert db.bb_schedules.find_one({"_id": "operator-added"})["schedule"] == {"every": 30.0}
    logged = caplog.text
    assert "'bad-cron' is not scheduled: entry 'bad-cron': a crontab has 5 fields" in logged
    assert "'bad-task' is not scheduled: entry 'bad-task': unknown task 'reports.nope'" in logged
    assert "an entry added at run time has that name" in logged
    for name in ("infinite", "thousands-of-years"):
        assert f"{name!r} is not scheduled: entry {name!r}: every must be a number of seconds, at least 0.001" in logged
    # an entry removed from the configuration goes at the next start; the operator's disabling is kept
    store.set_enabled("quarter-minute", False)
    beat_app.conf.beat_schedule = {"quarter-minute": beat_app.conf.beat_schedule["quarter-minute"]}
    JobScheduler(beat_app)
    assert sorted(doc["_id"] for doc in db.bb_schedules.find()) == ["operator-added", "quarter-minute"]
    assert db.bb_schedules.find_one({"_id": "quarter-minute"})["enabled"] is False


@pytest.mark.parametrize("setting", [math.inf, math.nan, -1, 1e12, "soon"])
def test_a_beat_refuses_to_start_with_a_missed_after_no_date_holds(beat_app: Celery, db: Database, setting) -> None:
    beat_app.conf.bb_beat_missed_after = setting
    with pytest.raises(ImproperlyConfigured, match="bb_beat_missed_after must be seconds, more than 0 and at most"):
        JobScheduler(beat_app)
    assert db.bb_schedules.count_documents({}) == 0  # refused before anything is written


def cli(broker_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "bb_broker.cli", "schedules", "--broker", broker_url, *args]
    env = {**os.environ, "BB_BROKER_URL": broker_url}  # read by tests/support/e2e_app.py, the app `-A` names
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_the_cli_lists_runs_now_disables_and_enables_an_entry(
    broker_url: str, store: ScheduleStore, db: Database
) -> None:
    store.add("nightly", "reports.nightly", {"crontab": "0 3 * * *"}, timezone="Europe/Paris", catch_up="all")
    listed = cli(broker_url)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(
        "nightly: reports.nightly crontab 0 3 * * * [Europe/Paris] enabled, catch-up all, runs 0, next "
    )
    ran = cli(broker_url, "run-now", "nightly")
    assert ran.returncode == 0, ran.stderr
    task_id = ran.stdout.strip().rpartition(" ")[2]
    job = db.jobs.find_one({"taskId": task_id})
    assert job["kind"] == "reports.nightly" and "uniqueKey" not in job
    assert job["payload"]["headers"]["bb_beat_run_now"] is True
    assert job["payload"]["headers"]["bb_beat_entry"] == "nightly"
    rows = json.loads(cli(broker_url, "--json").stdout)
    assert (rows[0]["lastTaskId"], rows[0]["lastRunNow"], rows[0]["lastStatus"]) == (task_id, True, "queued")
    # Given as mongodb://, the job is a job still (not a message of Kombu's own MongoDB transport).
    again = cli("mongodb://" + broker_url.partition("://")[2], "run-now", "nightly")
    assert again.returncode == 0 and db.jobs.find_one({"taskId": again.stdout.strip().rpartition(" ")[2]}), again
    assert cli(broker_url, "disable", "nightly").stdout == "disabled nightly\n"
    assert db.bb_schedules.find_one({"_id": "nightly"})["enabled"] is False
    assert "disabled" in cli(broker_url).stdout
    assert cli(broker_url, "enable", "nightly").stdout == "enabled nightly\n"
    assert db.bb_schedules.find_one({"_id": "nightly"})["enabled"] is True
    missing = cli(broker_url, "disable", "weekly")
    assert (missing.returncode, missing.stderr) == (1, "bb-broker: disable: no entry named 'weekly'\n")


def test_celery_beat_finds_the_scheduler_by_its_alias_bbmongo(beat_app: Celery) -> None:
    from celery.beat import Service

    assert isinstance(Service(beat_app, scheduler_cls="bbmongo").get_scheduler(lazy=True), JobScheduler)


def test_the_cli_adds_and_removes_an_entry_and_refuses_bad_input_writing_nothing(broker_url: str, db: Database) -> None:
    added = cli(broker_url, "add", "hourly", "tests.support.e2e_app.add", "--crontab", "0 * * * *", "--timezone",
                "America/New_York", "--catch-up", "none", "--args", "[1, 2]", "--queue", "reports")  # fmt: skip
    assert (added.returncode, added.stdout) == (0, "added hourly\n"), added.stderr
    doc = db.bb_schedules.find_one({"_id": "hourly"})
    assert (doc["schedule"], doc["timezone"], doc["catchUp"], doc["args"], doc["options"], doc["owner"]) == (
        {"crontab": "0 * * * *"}, "America/New_York", "none", [1, 2], {"queue": "reports"}, "runtime",
    )  # fmt: skip
    taken = cli(broker_url, "add", "hourly", "tests.support.e2e_app.add", "--every", "5")
    assert taken.returncode == 1 and taken.stderr.endswith("bb-broker: add: an entry named 'hourly' exists already\n")
    refusals = {  # bad arguments: exit 2, one line, before the server is asked
        ("add", "bad", "tests.support.e2e_app.add", "--crontab", "0 9 * *"): "add: entry 'bad': a crontab has 5 fields",
        ("add", "bad", "tests.support.e2e_app.add", "--every", "5", "--timezone", "Nowhere/City"): "unknown timezone",
        ("add", "bad", "tests.support.e2e_app.add", "--every", "5", "--timezone", "localtime"): "each host's own",
        (
            "add",
            "bad",
            "tests.support.e2e_app.nope",
            "--every",
            "5",
            "-A",
            "tests.support.e2e_app",
        ): "unknown task 'tests.support.e2e_app.no",
        ("add", "bad", "tests.support.e2e_app.add"): "add: give one of --every or --crontab",
        ("add", "bad", "x.add", "--every", "5", "--args", "[" * 100_000): "nested deeper than JSON can be read",
        ("add", "bad", "x.add", "--every", "5", "-A", "tests.support.no_such_module"): "-A tests.support.no_such",
        ("add", "bad", "x.add", "--every", "5", "-A", "os:path"): "-A os:path: cannot load its Celery app",
    }
    for args, message in refusals.items():
        refused = cli(broker_url, *args)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)
        assert refused.stderr.count("\n") == 1, refused.stderr
    assert [doc["_id"] for doc in db.bb_schedules.find()] == ["hourly"]
    assert cli(broker_url, "remove", "hourly").stdout == "removed hourly\n"
    assert db.bb_schedules.count_documents({}) == 0


@pytest.mark.parametrize("every", ["1e12", "inf", "nan", "-5", "0"])
def test_the_cli_refuses_an_interval_no_date_holds_in_one_line_writing_nothing(
    broker_url: str, db: Database, every: str
) -> None:
    refused = cli(broker_url, "add", "bad", "tests.support.e2e_app.add", "--every", every)
    assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
    assert (
        refused.stderr.startswith(
            "bb-broker: add: entry 'bad': every must be a number of seconds, at least 0.001 and at most 3155760000 "
            "(100 years), got "
        )
        and refused.stderr.count("\n") == 1
    ), refused.stderr
    assert db.bb_schedules.count_documents({}) == 0


def test_the_cli_lists_entries_edited_into_numbers_no_date_holds_flagging_each(
    broker_url: str, store: ScheduleStore, db: Database
) -> None:
    store.add("nightly", "reports.nightly", {"crontab": "0 3 * * *"})
    add_out_of_range_entries(db)
    listed = cli(broker_url)
    assert listed.returncode == 0 and "Error" not in listed.stderr, listed.stderr
    assert listed.stdout.startswith("every-1e12: tests.support.e2e_app.add every 1e+12s [UTC] enabled, ")
    assert "nightly: reports.nightly crontab 0 3 * * * [UTC] enabled, catch-up once, runs 0, next 20" in listed.stdout
    for name in OUT_OF_RANGE:
        assert f"  skipped by beat: entry {name!r}: " in listed.stdout
    as_json = cli(broker_url, "--json")
    assert as_json.returncode == 0, as_json.stderr
    rows = {row["name"]: row for row in json.loads(as_json.stdout)}
    assert rows["nightly"]["problem"] is None and rows["nightly"]["nextSlot"].startswith("20")
    assert [(rows[name]["nextSlot"], rows[name]["problem"] is not None) for name in OUT_OF_RANGE] == [
        (None, True)
    ] * len(OUT_OF_RANGE)
    assert rows["every-1e12"]["problem"] == (
        "entry 'every-1e12': every must be a number of seconds, at least 0.001 and at most 3155760000 (100 years), "
        "got 1000000000000.0"
    )
    assert rows["last-slot-year-1"]["problem"] == (
        "entry 'last-slot-year-1': lastSlot must be a date from 1970-01-01 to 9898-12-29, got 0001-01-01T00:00:00+00:00"
    )


def test_an_entry_a_beat_cannot_check_is_kept_for_the_beats_that_can(
    beat_app: Celery, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    # A beat without the task's module (or an older release) left the entry out of what it synced, and then deleted
    # it as gone from the configuration: the beats that run it lost it, its counts and its slots until a restart.
    beat_app.conf.beat_schedule = {"nightly": {"task": "reports.nightly", "schedule": crontab(hour=3, minute=0)}}
    JobScheduler(beat_app)
    db.bb_schedules.update_one({"_id": "nightly"}, {"$set": {"runCount": 1234}})
    without_the_task = Celery("beat_test_without", broker=beat_app.conf.broker_url, set_as_current=False)
    without_the_task.conf.beat_schedule = beat_app.conf.beat_schedule
    with caplog.at_level(logging.ERROR):
        JobScheduler(without_the_task)
    assert "'nightly' is not scheduled" in caplog.text
    assert db.bb_schedules.find_one({"_id": "nightly"})["runCount"] == 1234
    without_the_task.close()


@pytest.mark.parametrize("how", ["change", "beat_schedule"])
def test_a_changed_schedule_starts_from_now_and_catches_up_nothing(
    beat_app: Celery, store: ScheduleStore, db: Database, how: str
) -> None:
    # The new schedule's slots since the last run were never due, but older than bb_beat_missed_after they were
    # caught up as missed: an hourly entry 50 minutes after its last slot made 300 jobs on the next tick when it
    # was changed to every 10 s (with catch_up="all").
    beat_app.conf.beat_schedule = {"often": {"task": "reports.nightly", "schedule": 3600.0, "catch_up": "all"}}
    scheduler = JobScheduler(beat_app)
    back = db.bb_schedules.find_one({"_id": "often"})["anchor"] - timedelta(minutes=50)
    db.bb_schedules.update_one({"_id": "often"}, {"$set": {"anchor": back, "lastSlot": back}})
    if how == "change":
        store.change("often", schedule=10.0, known_tasks=beat_app.tasks)
    else:
        beat_app.conf.beat_schedule = {"often": {**beat_app.conf.beat_schedule["often"], "schedule": 10.0}}
        scheduler = JobScheduler(beat_app)
    scheduler.tick()
    entry = db.bb_schedules.find_one({"_id": "often"})
    assert "catchUps" not in entry and db.jobs.count_documents({"uniqueKey": {"$regex": "^beat:often:"}}) <= 1


def test_catch_up_all_sends_a_bounded_number_of_slots_a_look_and_the_rest_at_the_next(
    beat_app: Celery, store: ScheduleStore, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bb_broker.beat import scheduler as beat_scheduler

    monkeypatch.setattr(beat_scheduler, "MAX_SLOTS_PER_LOOK", 50)  # 1000 in use: the same logic, a quicker test
    scheduler = JobScheduler(beat_app)
    store.add("busy", "reports.nightly", 1.0, catch_up="all")
    # as if every beat had been down for 120 slots
    back = db.bb_schedules.find_one({"_id": "busy"})["anchor"] - timedelta(seconds=120)
    db.bb_schedules.update_one({"_id": "busy"}, {"$set": {"anchor": back, "lastSlot": back}})
    scheduler.tick()
    entry = db.bb_schedules.find_one({"_id": "busy"})
    looks = entry["catchUps"]
    assert [(look["missed"], look["sent"]) for look in looks[:2]] == [(50, 50), (50, 50)]
    assert looks[1]["from"] == looks[0]["to"] + timedelta(seconds=1)
    slots = [job["uniqueKey"] for job in db.jobs.find({"uniqueKey": {"$regex": "^beat:busy:"}})]
    assert len(slots) == len(set(slots)) == entry["runCount"] >= 110


def test_one_downtime_is_one_catch_up_however_long_the_look_takes(
    beat_app: Celery, store: ScheduleStore, db: Database
) -> None:
    scheduler = JobScheduler(beat_app)  # slots missed after 10 s
    store.add("late", "reports.nightly", 1.0)  # catch-up once
    back = db.bb_schedules.find_one({"_id": "late"})["anchor"] - timedelta(seconds=30)
    db.bb_schedules.update_one({"_id": "late"}, {"$set": {"anchor": back, "lastSlot": back}})
    server_clock = scheduler._clock
    readings = iter(range(1000))
    # A slow look, as on a loaded machine: each reading of the clock 1.5 s after the one before.
    scheduler._clock = lambda: server_clock() + timedelta(seconds=1.5 * next(readings))
    scheduler.tick()
    entry = db.bb_schedules.find_one({"_id": "late"})
    (catch_up,) = entry["catchUps"]
    assert catch_up["missed"] >= 19 and catch_up["sent"] == 1
    slots = sorted(job["uniqueKey"] for job in db.jobs.find({"uniqueKey": {"$regex": "^beat:late:"}}))
    assert len(slots) == entry["runCount"] >= 10  # the catch-up's job and each slot on time when the look began


@pytest.mark.parametrize("policy", ["once", "none"])
def test_a_downtime_of_more_slots_than_a_look_walks_is_still_one_catch_up(
    beat_app: Celery, store: ScheduleStore, db: Database, policy: str
) -> None:
    # A second's slots over 42 hours: past the 100,000 slots a look collected, the rest was another catch-up in the
    # same look, and `once` sent a job for each.
    scheduler = JobScheduler(beat_app)
    store.add("every-second", "reports.nightly", 1.0, catch_up=policy)
    back = db.bb_schedules.find_one({"_id": "every-second"})["anchor"] - timedelta(hours=42)
    db.bb_schedules.update_one({"_id": "every-second"}, {"$set": {"anchor": back, "lastSlot": back}})
    scheduler.tick()
    entry = db.bb_schedules.find_one({"_id": "every-second"})
    (catch_up,) = entry["catchUps"]
    assert catch_up["missed"] >= 42 * 3600 - 20 and catch_up["sent"] == (1 if policy == "once" else 0)
    jobs = db.jobs.count_documents({"uniqueKey": {"$regex": "^beat:every-second:"}})
    assert jobs == entry["runCount"] <= catch_up["sent"] + 12  # the catch-up's and the slots on time since (10 s)


#: Entry names a pattern would confuse: a prefix of another, regex metacharacters, MongoDB's `$` and `.`.
TRICKY_NAMES = ("nightly", "nightly.eu", "a.*", "$where", "cost$", "night & day")


def backdated(db: Database, name: str, seconds: float) -> None:
    """As if the entry had been stored `seconds` ago: its slots since are due (fewer than bb_beat_missed_after's
    10 s ago: sent one by one, not caught up)."""
    back = db.bb_schedules.find_one({"_id": name})["anchor"] - timedelta(seconds=seconds)
    db.bb_schedules.update_one({"_id": name}, {"$set": {"anchor": back, "lastSlot": back}})


def jobs_keyed_for(db: Database, name: str) -> set[str]:
    """The entry's slot jobs found another way: by their unique key's prefix, the name escaped."""
    return {job["_id"] for job in db.jobs.find({"uniqueKey": {"$regex": "^" + re.escape(f"beat:{name}:")}})}


def test_the_jobs_of_an_entry_are_its_slots_and_run_nows_whatever_its_name_holds(
    beat_app: Celery, store: ScheduleStore, db: Database
) -> None:
    scheduler = JobScheduler(beat_app)  # the jobs' indexes too
    for name in TRICKY_NAMES:  # every entry sends the same task
        store.add(name, "reports.nightly", 1.0)
        backdated(db, name, 3)
    scheduler.tick()
    run_nows = {name: run_now(beat_app, store, name) for name in ("nightly", "a.*")}
    plain = beat_app.send_task("reports.nightly").id  # the task sent by hand, not by an entry
    operations = Operations(JobStore(db))
    for name in TRICKY_NAMES:
        listed = operations.list_jobs(JobFilter(schedule=name), limit=200).jobs
        slots = {job["_id"] for job in listed if "uniqueKey" in job}
        assert slots == jobs_keyed_for(db, name) and len(slots) >= 2, name
        extra = [job for job in listed if "uniqueKey" not in job]
        # A run-now job is listed with its entry's, told apart by having no slot (no unique key).
        assert [job["taskId"] for job in extra] == ([run_nows[name]] if name in run_nows else []), name
        assert all(job["schedule"] == name and job["kind"] == "reports.nightly" for job in listed)
        assert operations.count(JobFilter(schedule=name), "cancel") == len(listed)
    assert "schedule" not in db.jobs.find_one({"taskId": plain})
    by_kind = operations.list_jobs(JobFilter(kind="reports.nightly"), limit=200).jobs
    assert len(by_kind) == db.jobs.count_documents({}), "the kind filter mixes every entry and the hand-sent job"


def test_entries_a_slots_write_cannot_be_made_on_are_skipped_and_the_entries_after_them_sent(
    beat_app: Celery, store: ScheduleStore, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    # A slot's write adds to runCount ($inc) and catchUps ($push), and sets lastJob: edited by hand into text, a
    # document, or so large that lastJob no longer fits, the server refused it after the slot's job was sent, and
    # the beat gave up that look at it: every entry after it (in name order) was never sent, for good.
    scheduler = JobScheduler(beat_app)
    names = ("a-count-text", "b-catch-ups-document", "c-full", "d-fine")
    for name in names:
        store.add(name, "reports.nightly", 1.0)
        backdated(db, name, 3)
    db.bb_schedules.update_one({"_id": "a-count-text"}, {"$set": {"runCount": "0"}})
    db.bb_schedules.update_one({"_id": "b-catch-ups-document"}, {"$set": {"catchUps": {}}})
    full = 16 * 1024 * 1024 - len(bson.encode(db.bb_schedules.find_one({"_id": "c-full"}))) - 64
    db.bb_schedules.update_one({"_id": "c-full"}, {"$set": {"note": "x" * full}})
    with caplog.at_level(logging.ERROR):
        scheduler.tick()
    assert "entry 'a-count-text': runCount must be a number, got '0'" in caplog.text
    assert "entry 'b-catch-ups-document': catchUps must be an array, got {}" in caplog.text
    assert "entry 'c-full': the server refused its write" in caplog.text
    assert len(jobs_keyed_for(db, "d-fine")) >= 2 and not jobs_keyed_for(db, "a-count-text")
    assert len(jobs_keyed_for(db, "c-full")) == 1, "its first slot, sent again under its key at each look"
    with pytest.raises(EntryError, match="catchUps must be an array"):
        run_now(beat_app, store, "b-catch-ups-document")
    db.bb_schedules.update_one({"_id": "a-count-text"}, {"$set": {"runCount": 0}})  # repaired, it runs
    scheduler.tick()
    assert jobs_keyed_for(db, "a-count-text")


@pytest.mark.parametrize(
    ("edit", "said"),
    [({"options.headers": "oops"}, "option headers must be a document"), ({"options.eta": "tomorrow"}, "option eta")],
)
def test_an_entrys_headers_or_eta_edited_by_hand_is_refused_naming_it(
    beat_app: Celery, store: ScheduleStore, db: Database, edit: dict[str, object], said: str
) -> None:
    # run-now (and each slot) ended in a traceback: TypeError merging the headers, MalformedTaskMessage for the ETA.
    store.add("nightly", "reports.nightly", 60)
    db.bb_schedules.update_one({"_id": "nightly"}, {"$set": edit})
    with pytest.raises(EntryError, match=said):
        run_now(beat_app, store, "nightly")
    assert not db.jobs.count_documents({})


def test_a_once_catch_up_after_a_beat_died_before_recording_a_slot_sends_the_downtimes_job(
    beat_app: Celery, store: ScheduleStore, db: Database
) -> None:
    # The dead beat had sent the first slot's job, not recorded it: the catch-up's one job, keyed on that slot, was
    # refused by its key, and the downtime got none while the record said one was sent.
    scheduler = JobScheduler(beat_app)
    store.add("every-second", "reports.nightly", 1.0)
    backdated(db, "every-second", 30)  # 30 slots missed: more than bb_beat_missed_after (10 s)
    doc = db.bb_schedules.find_one({"_id": "every-second"})
    entry = parse_entry(doc)
    first = entry.slots.next_after(entry.last_slot)
    send_entry(beat_app, entry, first, slot_key("every-second", first))  # the dead beat's send
    scheduler.tick()
    after = db.bb_schedules.find_one({"_id": "every-second"})
    keys = sorted(job["uniqueKey"] for job in db.jobs.find({"schedule": "every-second"}))
    caught_up = after["catchUps"][-1]
    # The dead beat's slot is recorded as sent; the catch-up's one job is the first slot after it that was missed.
    assert caught_up["sent"] == 1 and caught_up["from"] > first, caught_up
    assert slot_key("every-second", caught_up["from"]) in keys and slot_key("every-second", first) in keys


def test_the_entry_filter_combines_with_the_others_and_narrows_a_bulk_action(
    beat_app: Celery, store: ScheduleStore, db: Database
) -> None:
    JobScheduler(beat_app)
    for name in ("a.*", "a.b"):
        store.add(name, "reports.nightly", 60)
        run_now(beat_app, store, name)
        run_now(beat_app, store, name)
    operations = Operations(JobStore(db))
    first = operations.list_jobs(JobFilter(schedule="a.*"), limit=1).jobs[0]
    db.jobs.update_one({"_id": first["_id"]}, {"$set": {"status": "failed", "lastError": "boom"}})
    assert [job["_id"] for job in operations.list_jobs(JobFilter(schedule="a.*", status="failed")).jobs] == [
        first["_id"]
    ]
    assert operations.list_jobs(JobFilter(schedule="a.b", status="failed")).jobs == []
    assert operations.list_jobs(JobFilter(schedule="a.*", kind="reports.other")).jobs == []
    assert len(operations.list_jobs(JobFilter(schedule="a.*", queue="celery")).jobs) == 2
    assert operations.act_on_filter("cancel", JobFilter(schedule="a.*"), by="tester") == 1  # the queued one
    statuses = {job["schedule"] + " " + job["status"] for job in db.jobs.find({}, {"schedule": 1, "status": 1})}
    assert sorted(statuses) == ["a.* failed", "a.b queued"]
    assert db.jobs.count_documents({"schedule": "a.b", "status": "queued"}) == 2
    failed = operations.failed_jobs(schedule="a.*")  # the CLI's `bb-broker failed --schedule a.*`
    assert {job["_id"] for job in failed} == {doc["_id"] for doc in db.jobs.find({"schedule": "a.*"})}


def test_the_entry_filter_reads_through_its_partial_index(
    mongo_url: str, beat_app: Celery, store: ScheduleStore, db: Database
) -> None:
    from pymongo import MongoClient

    JobScheduler(beat_app)
    for name in ("nightly", "$where"):
        store.add(name, "reports.nightly", 60)
        run_now(beat_app, store, name)
    beat_app.send_task("reports.nightly")
    index = next(ix for ix in db.jobs.list_indexes() if ix["name"] == "bb_list_schedule")
    assert dict(index["partialFilterExpression"]) == {"schedule": {"$exists": True}}
    assert db.jobs.count_documents({"schedule": {"$exists": True}}) == 2  # the hand-sent job is not in the index
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        operations = Operations(JobStore(client[db.name]))
        for job_filter in (JobFilter(schedule="$where"), JobFilter(schedule="nightly", status="queued")):
            assert len(operations.list_jobs(job_filter).jobs) == 1
            operations.count(job_filter, "cancel")
        operations.act_on_filter("cancel", JobFilter(schedule="nightly"), by="tester")
    assert [next(iter(command)) for command in log.commands] == ["find", "aggregate"] * 2 + ["update"]
    assert_each_reads_through_an_index(db, log.commands)


@pytest.mark.parametrize("name", ["", "n" * 201, 42, None])
def test_an_entry_header_that_is_no_entry_name_is_refused_and_nothing_written(
    beat_app: Celery, db: Database, name: object
) -> None:
    with pytest.raises(MalformedTaskMessage, match="header 'bb_beat_entry'"):
        beat_app.send_task("reports.nightly", headers={"bb_beat_entry": name})
    assert db.jobs.count_documents({}) == 0


def test_the_schedules_view_points_at_the_entrys_jobs(broker_url: str, store: ScheduleStore) -> None:
    store.add("night & day", "reports.nightly", 60)
    listed = cli(broker_url)
    assert listed.stdout.splitlines()[1] == (
        "  jobs: Flower /jobs?schedule=night+%26+day; failed ones: bb-broker failed --schedule 'night & day'"
    )
    assert json.loads(cli(broker_url, "--json").stdout)[0]["jobsQuery"] == "schedule=night+%26+day"


def test_a_beat_that_finds_another_beats_catch_up_under_way_sends_on_within_it_without_a_record_of_its_own(
    beat_app: Celery, store: ScheduleStore, db: Database
) -> None:
    scheduler = JobScheduler(beat_app)  # slots missed after 10 s
    store.add("busy", "reports.nightly", 1.0, catch_up="all")
    anchor = db.bb_schedules.find_one({"_id": "busy"})["anchor"] - timedelta(seconds=60)
    first, to = anchor + timedelta(seconds=1), anchor + timedelta(seconds=40)
    # As another beat leaves it when it lost the server (or this beat's fenced write won over it) three slots into
    # its catch-up of slots 1 to 40.
    record = {"from": first, "to": to, "missed": 40, "sent": 40, "policy": "all", "at": anchor}
    db.bb_schedules.update_one(
        {"_id": "busy"},
        {"$set": {"anchor": anchor, "lastSlot": anchor + timedelta(seconds=3), "catchUps": [record]}},
    )
    scheduler.tick()
    entry = db.bb_schedules.find_one({"_id": "busy"})
    keyed = sorted(job["uniqueKey"] for job in db.jobs.find({"schedule": "busy"}))
    sent = [datetime.fromisoformat(key.removeprefix("beat:busy:")) for key in keyed]
    assert sent[:37] == [anchor + timedelta(seconds=n) for n in range(4, 41)], "slots 4 to 40, one job each"
    later = entry["catchUps"][1:]  # slots 41 on, missed too by now: a catch-up of their own, after the first
    assert entry["catchUps"][0] == record and all(c["from"] > to for c in later), entry["catchUps"]
