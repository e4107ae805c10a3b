"""Real `celery beat` processes on bb_broker.beat: exactly one job per slot, however many beats, crashes, clocks."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import pytest
from pymongo.database import Database

from bb_broker.beat import ScheduleStore
from bb_broker.clock import ServerClock
from tests.support.beat_process import (
    ENTRY,
    OUT_OF_RANGE,
    TICK,
    Beat,
    add_out_of_range_entries,
    assert_one_job_per_slot,
    recorded,
    slot_jobs,
)
from tests.support.workers import ROOT, process_factory, wait_for


def skewed_clock_env(offset: str) -> dict[str, str]:
    """libfaketime (the PyPI wheel ships the library) moves the process's wall clock by `offset` (as in
    tests/faults/test_faults.py's clock tests)."""
    import libfaketime

    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    return {"LD_PRELOAD": str(library), "FAKETIME": offset, "DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}


@pytest.fixture
def beat_factory(broker_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Beat]]:
    """`make(schedule=TICK, env=None)` starts a beat on the test's database; each is killed after the test."""

    def build(n: int, schedule: dict[str, Any] = TICK, env: dict[str, str] | None = None) -> Beat:
        return Beat(broker_url, tmp_path, f"b{n}", schedule, env)

    yield from process_factory(request, build, Beat.kill)


def delay(job: dict[str, Any]) -> float:
    """Seconds from the slot's time to its job's insert, both on the server's clock."""
    return (job["createdAt"].replace(tzinfo=UTC) - job["slot"]).total_seconds()


def origin_pid(job: dict[str, Any]) -> int:
    # Celery's `origin` header, gen<pid>@host, names the process that sent the message.
    return int(job["payload"]["headers"]["origin"].removeprefix("gen").partition("@")[0])


def test_three_then_two_beats_make_one_job_per_slot_and_a_kill_costs_no_slot(beat_factory, db: Database) -> None:
    beats = [beat_factory() for _ in range(3)]
    wait_for(lambda: len(slot_jobs(db)) >= 60, 120, "60 slots with three beats")
    jobs = slot_jobs(db)
    assert_one_job_per_slot(jobs)
    senders = {origin_pid(job) for job in jobs}
    assert senders <= {beat.process.pid for beat in beats}
    last = jobs[-1]
    victim = next(beat for beat in beats if beat.process.pid == origin_pid(last))
    victim.kill()
    # Its last slot once it is dead: on a slow machine it can win another between the read above and the kill.
    killed_at = max(job["slot"] for job in slot_jobs(db) if origin_pid(job) == victim.process.pid)
    wait_for(lambda: len(slot_jobs(db)) >= len(jobs) + 20, 60, "20 more slots with two beats")
    jobs = slot_jobs(db)
    assert_one_job_per_slot(jobs)
    after = [job for job in jobs if job["slot"] > killed_at]
    assert len(jobs) >= 80 and len(after) >= 20
    assert victim.process.pid not in {origin_pid(job) for job in after}
    worst = max(delay(job) for job in after)
    print(f"largest delay after the kill: {worst:.3f} s; overall {max(delay(job) for job in jobs):.3f} s")
    # On time as the scheduler judges it (no timed assertion: a busy machine delays every process): no slot was
    # found unsent past the missed-slot threshold, which would have made it a catch-up in the entry's record.
    entry, covered = recorded(db)  # the survivor runs on
    assert not entry.get("catchUps"), f"slots sent as a catch-up: {entry.get('catchUps')}"
    assert entry["runCount"] == len(covered) and entry["lastSlot"].replace(tzinfo=UTC) == covered[-1]["slot"]


def test_a_beat_logs_each_job_it_sends_as_celerys_beat_does(beat_factory, db: Database) -> None:
    beat = beat_factory()
    wait_for(lambda: len(slot_jobs(db)) >= 3, 60, "3 slots")
    line = f" INFO/MainProcess] Scheduler: Sending due task {ENTRY} (tests.support.e2e_app.add)\n"
    # One line per job sent (a beat alone: each slot's job is its own), as `celery beat` prints for its scheduler.
    wait_for(lambda: beat.log().count(line) >= 3, 30, "the beat's lines")
    sent = beat.log().count(line)  # said before each send: no more lines than jobs once the sends are done
    wait_for(lambda: len(slot_jobs(db)) >= sent, 30, f"a job for each of the {sent} lines")


def test_beats_with_clocks_30_s_ahead_and_behind_send_each_slot_once_at_the_servers_time(
    beat_factory, db: Database
) -> None:
    beat_factory(env=skewed_clock_env("+30s"))
    beat_factory(env=skewed_clock_env("-30s"))
    wait_for(lambda: len(slot_jobs(db)) >= 15, 60, "15 slots")
    jobs = slot_jobs(db)
    assert_one_job_per_slot(jobs)
    # The clocks are 30 s off: a slot sent by a beat's own clock would be 30 s early or late. The bound of 10 s
    # tells the two apart without asking a busy machine for speed.
    assert all(0 <= delay(job) < 10.0 for job in jobs), [delay(job) for job in jobs]
    now = ServerClock(db)()
    assert abs((now - jobs[-1]["slot"]).total_seconds()) < 10, "the slots follow the server's clock"


@pytest.mark.parametrize(("policy", "sent"), [("once", 1), ("all", None), ("none", 0)])
def test_after_every_beat_was_down_the_missed_slots_follow_the_entrys_policy(
    beat_factory, db: Database, policy: str, sent: int | None
) -> None:
    schedule = {ENTRY: {**TICK[ENTRY], "catch_up": policy}}
    # A slot found 4 s late is missed: a beat stalled 2 s by a loaded machine would record a catch-up of its own.
    env = {"BB_BEAT_MISSED_AFTER": "4"}
    beat = beat_factory(schedule=schedule, env=env)
    wait_for(lambda: len(slot_jobs(db)) >= 3, 30, "3 slots")
    beat.kill()
    stopped_at = db.bb_schedules.find_one({"_id": ENTRY})["lastSlot"].replace(tzinfo=UTC)
    sent_by_the_first = {job["_id"] for job in slot_jobs(db)}
    clock = ServerClock(db)
    wait_for(lambda: clock() > stopped_at + timedelta(seconds=10.5), 30, "10 slots without a beat")
    beat_factory(schedule=schedule, env=env)
    catch_up = wait_for(lambda: (db.bb_schedules.find_one({"_id": ENTRY}).get("catchUps") or [None])[-1], 30)
    to = catch_up["to"].replace(tzinfo=UTC)
    wait_for(lambda: slot_jobs(db)[-1]["slot"] >= to + timedelta(seconds=3), 30, "3 slots after the catch-up")
    assert db.bb_schedules.find_one({"_id": ENTRY})["catchUps"] == [catch_up], "one catch-up for one downtime"
    assert catch_up["policy"] == policy and catch_up["missed"] >= 5
    assert catch_up["from"].replace(tzinfo=UTC) == stopped_at + timedelta(seconds=1)
    jobs = slot_jobs(db)
    before = [job for job in jobs if job["slot"] <= stopped_at]
    in_the_gap = [job for job in jobs if stopped_at < job["slot"] <= to]
    after = [job for job in jobs if job["slot"] > to]
    assert_one_job_per_slot(before)
    assert_one_job_per_slot(after)
    assert after[0]["slot"] == to + timedelta(seconds=1)
    # The first beat's own job in the gap, if it was killed after sending a slot and before recording it: that
    # slot is the first missed one. `once` and `all` send it again (its unique key keeps it one job) and count
    # it then; `none` leaves it as it is, uncounted.
    unrecorded = [job for job in in_the_gap if job["_id"] in sent_by_the_first]
    assert [job["slot"] for job in unrecorded] in ([], [stopped_at + timedelta(seconds=1)])
    sent_by_the_catch_up = [job for job in in_the_gap if job not in unrecorded or policy != "none"]
    assert len(sent_by_the_catch_up) == catch_up["sent"] == (catch_up["missed"] if sent is None else sent)
    if policy == "once":
        assert sent_by_the_catch_up[0]["slot"] == stopped_at + timedelta(seconds=1)
    if policy == "all":
        assert_one_job_per_slot(sent_by_the_catch_up)
    entry, covered = recorded(db)  # the second beat runs on
    assert entry["runCount"] == len(covered) - (len(unrecorded) if policy == "none" else 0)


def test_a_nonsense_entry_is_skipped_and_logged_while_the_others_keep_running(
    beat_factory, db: Database, broker_url: str
) -> None:
    store = ScheduleStore(db, ServerClock(db))
    store.add("unknown-task", "tests.support.e2e_app.no_such_task", 1.0)
    # Made nonsense before the beat starts: a beat running between the add and the edit would send its first slot.
    store.add("edited", "tests.support.e2e_app.add", 1.0, args=[3, 4])
    db.bb_schedules.update_one({"_id": "edited"}, {"$set": {"schedule": {"every": "soon"}}})
    beat = beat_factory()
    wait_for(lambda: len(slot_jobs(db)) >= 5, 30, "5 slots of the good entry")
    wait_for(lambda: "entry 'edited': every must be a number" in beat.log(), 30, "the edited entry logged")
    assert "unknown task 'tests.support.e2e_app.no_such_task'" in beat.log()
    assert slot_jobs(db, "edited") == [] and slot_jobs(db, "unknown-task") == []
    assert beat.log().count("entry 'edited': every must be a number") == 1, "logged once, not at every look"
    assert_one_job_per_slot(slot_jobs(db))
    # repaired at run time, it runs without a restart
    db.bb_schedules.update_one({"_id": "edited"}, {"$set": {"schedule": {"every": 1.0}}})
    wait_for(lambda: len(slot_jobs(db, "edited")) >= 2, 30, "the repaired entry's slots")


def test_entries_whose_numbers_no_date_holds_are_logged_once_and_skipped_while_the_others_keep_running(
    beat_factory, db: Database
) -> None:
    add_out_of_range_entries(db)  # an interval of Infinity among them: it crash-looped every beat
    configured = {**TICK, "every-infinite-config": {"task": "tests.support.e2e_app.add", "schedule": math.inf}}
    beat = beat_factory(schedule=configured)
    problems = [f"skipping an entry: entry {name!r}: " for name in OUT_OF_RANGE]
    problems.append("beat_schedule entry 'every-infinite-config' is not scheduled: entry 'every-infinite-config': ")
    wait_for(lambda: all(problem in beat.log() for problem in problems), 30, "each bad entry logged")
    logged = len(slot_jobs(db))
    wait_for(lambda: len(slot_jobs(db)) >= logged + 4, 30, "4 more slots of the good entry: 4 more looks")
    log = beat.log()
    assert [log.count(problem) for problem in problems] == [1] * len(problems), "logged once, not at every look"
    assert "Traceback" not in log and beat.process.poll() is None
    assert "every must be a number of seconds, at least 0.001 and at most 3155760000 (100 years), got inf" in log
    assert "lastSlot must be a date from 1970-01-01 to 9898-12-29, got 9999-12-31T00:00:00+00:00" in log
    assert db.jobs.count_documents({"schedule": {"$ne": ENTRY}}) == 0
    assert_one_job_per_slot(slot_jobs(db))


def test_the_server_stopped_20_s_under_two_beats_makes_no_duplicate_and_the_policy_covers_the_gap(
    own_server, tmp_path: Path
) -> None:
    from pymongo import MongoClient

    from tests.support.servers import with_database

    broker_url = with_database(own_server.url, "beat_outage")
    env = {"BB_BEAT_MISSED_AFTER": "4"}
    beats = [Beat(broker_url, tmp_path, f"b{n}", TICK, env).start() for n in range(2)]
    client: MongoClient = MongoClient(own_server.url, tz_aware=True)
    db = client.beat_outage
    try:
        wait_for(lambda: len(slot_jobs(db)) >= 5, 30, "5 slots")
        own_server.stop()
        outage_ends = time.monotonic() + 20
        wait_for(lambda: time.monotonic() > outage_ends, 30, "20 s of outage")
        own_server.start()
        catch_up = wait_for(lambda: (db.bb_schedules.find_one({"_id": ENTRY}).get("catchUps") or [None])[-1], 60)
        to = catch_up["to"].replace(tzinfo=UTC)
        wait_for(lambda: slot_jobs(db)[-1]["slot"] >= to + timedelta(seconds=3), 30, "3 slots after the catch-up")
        jobs = slot_jobs(db)
        ranges = [(c["from"].replace(tzinfo=UTC), c["to"].replace(tzinfo=UTC)) for c in db.bb_schedules.find_one(
            {"_id": ENTRY})["catchUps"]]  # fmt: skip
        for first, last in ranges:
            inside = [job for job in jobs if first <= job["slot"] <= last]
            assert [job["slot"] for job in inside] == [first], "catch-up once: one job, for the first missed slot"
        outside = [job for job in jobs if not any(first <= job["slot"] <= last for first, last in ranges)]
        assert len({job["slot"] for job in outside}) == len(outside)
        assert catch_up["missed"] >= 10
        entry, covered = recorded(db)  # both beats run on
        assert entry["runCount"] == len(covered)
    finally:
        client.close()
        for beat in beats:
            beat.kill()


def test_entries_added_disabled_enabled_changed_and_removed_at_run_time_take_effect_without_a_restart(
    beat_factory, db: Database, broker_url: str
) -> None:
    beat_factory()
    store = ScheduleStore(db, ServerClock(db))
    store.add("other", "tests.support.e2e_app.add", 1.0, args=[5, 5])
    wait_for(lambda: len(slot_jobs(db, "other")) >= 2, 30, "the added entry's slots")

    def ticks_after(n: int) -> Any:
        seen = len(slot_jobs(db))
        return lambda: len(slot_jobs(db)) >= seen + n

    disabled = subprocess.run(
        [sys.executable, "-m", "bb_broker.cli", "schedules", "--broker", broker_url, "disable", "other"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert disabled.stdout == "disabled other\n"
    # A look that began before the change may still send it once; the second slot's look began after.
    wait_for(ticks_after(2), 30, "two slots of the enabled entry")
    stopped = len(slot_jobs(db, "other"))
    wait_for(ticks_after(3), 30, "3 more slots of the enabled entry")
    assert len(slot_jobs(db, "other")) == stopped, "a disabled entry sent a job"

    # Changed while disabled, then enabled: enabled first, a look between the two writes sends a 1-second slot.
    store.change("other", schedule={"every": 2.0})
    store.set_enabled("other", True)
    wait_for(lambda: len(slot_jobs(db, "other")) >= stopped + 3, 30, "the re-enabled entry's slots")
    recent = slot_jobs(db, "other")[stopped:]
    assert_one_job_per_slot(recent, every=timedelta(seconds=2))

    store.remove("other")
    wait_for(ticks_after(2), 30, "two slots after the removal")
    gone = len(slot_jobs(db, "other"))
    wait_for(ticks_after(3), 30, "3 more slots")
    assert len(slot_jobs(db, "other")) == gone
    assert_one_job_per_slot(slot_jobs(db))
