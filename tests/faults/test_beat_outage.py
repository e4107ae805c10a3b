"""`celery beat` on bb_broker.beat through a server outage longer than its server selection timeout: the publish of
a slot's job raises instead of waiting the outage out, the beats log it and keep running, and once the server is
back each entry's catch-up policy covers the slots the outage hid, with one job per slot."""

from __future__ import annotations

import re
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pymongo import MongoClient

from bb_broker.clock import ServerClock
from tests.support.beat_process import Beat, recorded, slot_jobs
from tests.support.faults import fail_point_on
from tests.support.servers import EmbeddedServer, with_database
from tests.support.workers import wait_for

#: The beats' server selection timeout (pymongo's default is 30 s): the outage below lasts several of it, so every
#: read and every publish the beats try meanwhile fails, each after this long.
SELECTION_MS = 1500
OUTAGE_SECONDS = 15.0
ENTRIES = {
    "once-a-second": {"task": "tests.support.e2e_app.add", "schedule": 1.0, "args": [1, 2], "catch_up": "once"},
    "each-second": {"task": "tests.support.e2e_app.add", "schedule": 1.0, "args": [3, 4], "catch_up": "all"},
}


#: Celery's log line for a send, as the beat's log has it: "[2026-12-06 12:29:26,910: INFO/MainProcess] Scheduler:
#: Sending due task ...".
SEND_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/\w+\] Scheduler: Sending due task", re.M)


def _aware(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def last_send(beat: Beat) -> datetime:
    """When the beat last said "Sending due task" (its log's local time), or the start of time."""
    stamps = SEND_LINE.findall(beat.log())
    return datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f") if stamps else datetime.min


def assert_slots_follow_the_policy(jobs: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Every slot from the entry's first job to its last has a job, but those of a catch-up: `once` one, for its
    first slot; `all` one each."""
    catch_ups = [(_aware(c["from"]), _aware(c["to"]), c["policy"]) for c in entry.get("catchUps") or []]
    sent = {job["slot"] for job in jobs}
    slot, last = jobs[0]["slot"], jobs[-1]["slot"]
    while slot <= last:
        policy = next(((first, p) for first, to, p in catch_ups if first <= slot <= to), None)
        expected = policy is None or policy[1] == "all" or (policy[1] == "once" and slot == policy[0])
        assert (slot in sent) == expected, f"{entry['_id']}: slot {slot} sent {slot in sent}, catch-ups {catch_ups}"
        slot += timedelta(seconds=1)


def test_two_beats_outlive_an_outage_longer_than_server_selection_and_catch_up_without_a_duplicate(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    url = with_database(own_server.url, "beat_long_outage") + f"?serverSelectionTimeoutMS={SELECTION_MS}"
    env = {"BB_BEAT_MISSED_AFTER": "2"}
    beats = [Beat(url, tmp_path, f"b{n}", ENTRIES, env).start() for n in range(2)]
    client: MongoClient = MongoClient(own_server.url, tz_aware=True)
    db = client.beat_long_outage
    try:
        wait_for(lambda: all(len(slot_jobs(db, name)) >= 3 for name in ENTRIES), 60, "3 slots of each entry")
        # The next insert of each beat hangs on the server, and the server goes away under it: the outage meets a
        # publish, not only the look that reads the schedule.
        # Every insert from now on hangs (until the server goes away, its fail points with it): however many other
        # inserts reach the server meanwhile, none of the beats' gets through.
        armed = datetime.now()  # the beats' log lines are stamped in local time
        fail_point_on(client, failCommands=["insert"], blockConnection=True, blockTimeMS=60_000)
        sent = db.jobs.count_documents({})
        last_slot = max(job["slot"] for name in ENTRIES for job in slot_jobs(db, name))
        clock = ServerClock(db)
        wait_for(lambda: clock() > last_slot + timedelta(seconds=2.5), 30, "the next slot's time, and a second more")
        # Each beat has begun the publish that now hangs (a loaded machine's beat may be seconds behind the clock): a
        # send said after the fail point was armed, or just before it, its insert let go only after (a beat can be
        # descheduled between its line and its insert).
        for beat in beats:
            wait_for(lambda beat=beat: last_send(beat) > armed - timedelta(seconds=0.5), 60, f"a send of {beat.name}")
        assert db.jobs.count_documents({}) == sent, "an insert got through the fail point"
        own_server.stop()
        outage_ends = time.monotonic() + OUTAGE_SECONDS
        wait_for(lambda: time.monotonic() > outage_ends, OUTAGE_SECONDS + 5, "the outage to last")
        assert [beat.process.poll() for beat in beats] == [None, None], "a beat died in the outage"
        own_server.start()  # the same port, the same data

        def caught_up() -> bool:
            for name in ENTRIES:
                entry = db.bb_schedules.find_one({"_id": name})
                if not entry.get("catchUps"):
                    return False
                to = _aware(entry["catchUps"][-1]["to"])
                if not slot_jobs(db, name) or slot_jobs(db, name)[-1]["slot"] < to + timedelta(seconds=3):
                    return False
            return True

        wait_for(caught_up, 90, "each entry's catch-up and 3 slots after it")
        assert [beat.process.poll() for beat in beats] == [None, None], "a beat died after the outage"
        for name, config in ENTRIES.items():
            jobs = slot_jobs(db, name)
            per_slot = Counter(job["payload"]["headers"]["bb_beat_slot"] for job in jobs)
            assert max(per_slot.values()) == 1, f"{name}: two jobs for one slot: {per_slot.most_common(3)}"
            entry = db.bb_schedules.find_one({"_id": name})
            # The outage's slots are one catch-up: the beat that lost a fenced write to the other's sends on within
            # it. (A slot that a long catch-up on a busy machine made late is another, of its own.)
            ranges = [(_aware(c["from"]), _aware(c["to"])) for c in entry["catchUps"]]
            overlaps = [(a, b) for a, b in zip(ranges, ranges[1:], strict=False) if b[0] <= a[1]]
            assert not overlaps, f"{name}: catch-ups recorded twice for the same slots: {overlaps}"
            outage = entry["catchUps"][0]
            assert outage["missed"] >= OUTAGE_SECONDS - 5, f"{name}: the outage hid only {outage['missed']} slots"
            assert {c["policy"] for c in entry["catchUps"]} == {config["catch_up"]}
            assert_slots_follow_the_policy(jobs, entry)
            entry, covered = recorded(db, name)  # both beats run on
            assert entry["runCount"] == len(covered)
    finally:
        client.close()
        for beat in beats:
            beat.kill()
