"""The slots bb_broker.beat computes for crontab and interval schedules, DST changes included (no waiting)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from bb_broker.beat.slots import ScheduleError, missed_span, slots_of


def walk(slots, start: datetime, n: int) -> list[datetime]:
    found, moment = [], start
    for _ in range(n):
        moment = slots.next_after(moment)
        found.append(moment)
    return found


def paris(*args: int) -> datetime:
    from zoneinfo import ZoneInfo

    return datetime(*args, tzinfo=ZoneInfo("Europe/Paris")).astimezone(UTC)


def test_a_daily_crontab_in_paris_keeps_its_local_time_across_both_dst_changes() -> None:
    daily = slots_of({"crontab": "0 9 * * *"}, timezone="Europe/Paris", anchor=None)
    # Clocks go forward on 2026-03-29 (UTC+1 to UTC+2) and back on 2026-10-25.
    spring = walk(daily, paris(2026, 3, 27, 12, 0), 3)
    assert spring == [paris(2026, 3, 28, 9, 0), paris(2026, 3, 29, 9, 0), paris(2026, 3, 30, 9, 0)]
    assert [slot.hour for slot in spring] == [8, 7, 7]  # in UTC: 9:00 local is an hour earlier after the change
    autumn = walk(daily, paris(2026, 10, 24, 12, 0), 2)
    assert [slot.hour for slot in autumn] == [8, 8]  # 25th 9:00 CET = 8:00 UTC, 26th the same
    assert autumn[1] - autumn[0] == timedelta(days=1)


def test_a_time_in_the_skipped_hour_runs_once_an_hour_later_by_the_new_clock() -> None:
    at_two_thirty = slots_of({"crontab": "30 2 * * *"}, timezone="Europe/Paris", anchor=None)
    slots = walk(at_two_thirty, paris(2026, 3, 28, 12, 0), 2)
    # 02:30 does not exist on the 29th: it runs at 01:30 UTC, which is 03:30 by the new clock, once.
    assert slots == [datetime(2026, 3, 29, 1, 30, tzinfo=UTC), paris(2026, 3, 30, 2, 30)]


def test_a_time_in_the_repeated_hour_runs_once_at_its_first_occurrence() -> None:
    at_two_thirty = slots_of({"crontab": "30 2 * * *"}, timezone="Europe/Paris", anchor=None)
    slots = walk(at_two_thirty, paris(2026, 10, 24, 12, 0), 2)
    assert slots[0] == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST, not 02:30 CET an hour later
    assert slots[1] == paris(2026, 10, 26, 2, 30)


def test_day_of_month_and_day_of_week_must_both_match_as_in_celery() -> None:
    friday_13th = slots_of({"crontab": "0 0 13 * 5"}, timezone="UTC", anchor=None)
    assert walk(friday_13th, datetime(2026, 1, 1, tzinfo=UTC), 2) == [
        datetime(2026, 2, 13, tzinfo=UTC),
        datetime(2026, 3, 13, tzinfo=UTC),
    ]


def test_interval_slots_count_from_the_anchor_the_same_from_any_moment() -> None:
    anchor = datetime(2026, 1, 1, tzinfo=UTC)
    every = slots_of({"every": 1.5}, timezone="UTC", anchor=anchor)
    assert every.next_after(anchor - timedelta(days=1)) == anchor + timedelta(seconds=1.5)
    assert every.next_after(anchor + timedelta(seconds=3)) == anchor + timedelta(seconds=4.5)
    assert every.next_after(anchor + timedelta(seconds=3.2)) == anchor + timedelta(seconds=4.5)


@pytest.mark.parametrize(
    ("schedule", "timezone", "message"),
    [
        ({"crontab": "61 * * * *"}, "UTC", "invalid crontab '61 \\* \\* \\* \\*'"),
        ({"crontab": "* * *"}, "UTC", "a crontab has 5 fields"),
        ({"crontab": "0 9 * * *"}, "Europe/Atlantis", "unknown timezone 'Europe/Atlantis'"),
        # A link to each host's /etc/localtime: two beats on hosts set apart found different slots, and made both.
        ({"crontab": "*/2 * * * *"}, "localtime", "the timezone 'localtime' is each host's own"),
        ({"crontab": "*/2 * * * *"}, "posixrules", "the timezone 'posixrules' is each host's own"),
        ({"every": 0}, "UTC", "every must be a number of seconds"),
        ({"every": float("inf")}, "UTC", "every must be a number of seconds, at least 0.001 and at most 3155760000"),
        ({"every": float("nan")}, "UTC", "every must be a number of seconds, at least 0.001 and at most 3155760000"),
        ({"every": 1e12}, "UTC", "every must be a number of seconds, at least 0.001 and at most 3155760000"),
        ({"every": 10**30}, "UTC", "every must be a number of seconds, at least 0.001 and at most 3155760000"),
        ({"every": -1}, "UTC", "every must be a number of seconds"),
        ({"every": True}, "UTC", "every must be a number of seconds"),
        ({"every": "60"}, "UTC", "every must be a number of seconds"),
        ({"crontab": ",".join(["1"] * 1000) + " * * * *"}, "UTC", "a crontab is at most 1000 characters, got 2007"),
        ({"crontab": "*/99999999999 * * * 99999999999"}, "UTC", "invalid crontab"),
        ({"solar": "sunset", "lat": float("nan"), "lon": 0}, "UTC", "a solar schedule needs lat and lon in degrees"),
        ({"solar": "sunset", "lat": 0, "lon": float("inf")}, "UTC", "a solar schedule needs lat and lon in degrees"),
        ({"every": 1, "crontab": "* * * * *"}, "UTC", "one of every, crontab or solar"),
        ("hourly", "UTC", "one of every, crontab or solar"),
    ],
)
def test_a_schedule_no_slot_can_come_from_is_refused_saying_why(schedule, timezone: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        slots_of(schedule, timezone=timezone, anchor=datetime(2026, 1, 1, tzinfo=UTC))


def test_solar_slots_are_celerys_own_events_to_the_second() -> None:
    from celery.schedules import solar

    sunset = slots_of({"solar": "sunset", "lat": 48.85, "lon": 2.35}, timezone="Europe/Paris", anchor=None)
    start = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    first, second = walk(sunset, start, 2)
    celerys = solar("sunset", 48.85, 2.35, nowfun=lambda: start)
    expected = start + celerys.remaining_estimate(start)
    assert abs((first - expected).total_seconds()) <= 1 and first.microsecond == 0
    assert first.date() == start.date() and 15 <= first.hour <= 17  # a Paris sunset in December, in UTC
    assert timedelta(hours=23, minutes=55) < second - first < timedelta(hours=24, minutes=5)


def test_a_solar_event_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ScheduleError, match="invalid solar schedule"):
        slots_of({"solar": "moonrise", "lat": 0, "lon": 0}, timezone="UTC", anchor=None)


def _walked(slots, after: datetime, before: datetime) -> tuple[datetime, datetime, int] | None:
    """missed_span by the definition: every slot walked."""
    found = []
    slot = slots.next_after(after)
    while slot is not None and slot < before:
        found.append(slot)
        slot = slots.next_after(slot)
    return (found[0], found[-1], len(found)) if found else None


@pytest.mark.parametrize("every", [1.0, 0.25, 7.5, 3600.0])
def test_an_intervals_missed_span_is_counted_as_its_slots_walked(every: float) -> None:
    # Counted, not walked: a catch-up `once` of a second's slots after days down was several catch-ups of 100,000.
    anchor = datetime(2026, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)
    slots = slots_of({"every": every}, timezone="UTC", anchor=anchor)
    for after_s, before_s in [(0, 5), (-3, 2), (0.25, 0.25), (1, 1.000001), (7.5, 15), (10, 3600 * 3 + 0.5), (5, 4)]:
        after, before = anchor + timedelta(seconds=after_s), anchor + timedelta(seconds=before_s)
        assert missed_span(slots, after, before) == _walked(slots, after, before), (every, after_s, before_s)


def test_a_crontabs_missed_span_over_a_week_of_minutes_across_a_dst_change() -> None:
    slots = slots_of({"crontab": "* * * * *"}, timezone="Europe/Paris", anchor=None)
    after = datetime(2026, 3, 25, 22, 0, tzinfo=UTC)  # the clocks go forward on the 29th
    span = missed_span(slots, after, after + timedelta(days=7))
    assert span == (after + timedelta(minutes=1), after + timedelta(days=7, minutes=-1), 7 * 24 * 60 - 1)


@pytest.mark.parametrize(
    "anchor",
    [datetime(1, 1, 1, tzinfo=UTC), datetime(1969, 12, 31, tzinfo=UTC), datetime(9999, 12, 31, tzinfo=UTC), "2026"],
)
def test_an_interval_anchored_where_no_slot_is_a_date_is_refused(anchor) -> None:
    with pytest.raises(ScheduleError, match="anchor must be a date"):
        slots_of({"every": 60}, timezone="UTC", anchor=anchor)


@pytest.mark.parametrize("schedule", [{"every": 3155760000}, {"every": 0.001}, {"crontab": "0 0 29 2 1"}])
def test_the_next_slot_after_the_latest_date_a_schedule_takes_is_still_a_date(schedule) -> None:
    from bb_broker.beat.slots import LATEST_SLOT

    slots = slots_of(schedule, timezone="Pacific/Kiritimati", anchor=LATEST_SLOT)
    upcoming = slots.next_after(LATEST_SLOT)
    assert upcoming is not None and upcoming > LATEST_SLOT
