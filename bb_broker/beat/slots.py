"""The slots of a periodic entry: the moments its runs are due, a pure function of the entry, the same on every beat.

A schedule is stored as a document (SCHEDULE FORMS below) and read back into Slots, whose `next_after(t)` is the
first slot after `t` (aware, UTC). Every beat computes the same slots from the same document, whatever its clock
says: they are compared with the server's time, and a slot's time is part of its job's unique key.

- `{"every": seconds}`: slots at `anchor + k * every` (k >= 1), `anchor` being when the entry was first stored;
  whole milliseconds, as BSON keeps dates.
- `{"crontab": "m h dom mon dow"}`: Celery's crontab fields (day of month AND day of week must match, as Celery's),
  in the entry's timezone. Across a DST change each local wall time runs once: one that does not exist that day
  (the hour skipped in spring) runs when it would have with the offset before the change, i.e. an hour later by the
  new clock; one that happens twice (the hour repeated in autumn) runs at its first occurrence only.
- `{"solar": event, "lat": degrees, "lon": degrees}`: Celery's solar events (the `ephem` package computes them),
  to the whole second.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from bb_broker.upstream import celery as upstream_celery

#: How many days ahead a crontab is searched for its next slot (February 29th on a Monday comes round in 28 years).
CRON_SEARCH_DAYS = 366 * 29
#: The shortest interval of an `every` schedule, in seconds: slots are whole milliseconds.
MIN_EVERY = 0.001
#: The longest interval of an `every` schedule: 100 years, longer than any deployment runs, and short enough that an
#: entry's next slot (its anchor or lastSlot plus one interval) is always a date Python and BSON hold (year 9999).
MAX_EVERY = timedelta(days=36525)
#: The longest crontab text: its five fields with every value listed take 357 characters; a longer one is hand-made,
#: and would be parsed again at each of a beat's looks.
MAX_CRONTAB_LENGTH = 1000
#: The dates an entry's anchor and lastSlot may hold. From the Unix epoch (nothing was scheduled before it) to far
#: enough before the last date Python holds that the next slot after it (one interval, or a crontab's search, plus a
#: day either side for timezones) is still a date; a hand-edited one outside is the entry's problem, not the beat's.
EARLIEST_SLOT = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_SLOT = datetime(9999, 1, 1, tzinfo=UTC) - max(MAX_EVERY, timedelta(days=CRON_SEARCH_DAYS)) - timedelta(days=2)


class ScheduleError(ValueError):
    """A schedule, or a timezone, no slot can be computed from."""


class Slots(Protocol):
    def next_after(self, moment: datetime) -> datetime | None:
        """The first slot strictly after `moment` (aware), in UTC; None when there is none."""


#: Names of the zoneinfo database that are not one zone but each host's setting.
HOST_ZONES = frozenset({"localtime", "posixrules"})


def zone(name: Any) -> tzinfo:
    """The timezone of this IANA name, or ScheduleError."""
    if not isinstance(name, str) or not name:
        raise ScheduleError(f"the timezone must be an IANA name such as 'Europe/Paris', got {name!r}")
    if name in HOST_ZONES:
        # Each host's own zone (a link to /etc/localtime): beats on hosts set apart would find different slots.
        raise ScheduleError(f"the timezone {name!r} is each host's own: name the zone, such as 'Europe/Paris'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"unknown timezone {name!r}") from None


@dataclass(frozen=True)
class Every:
    milliseconds: int
    anchor: datetime

    def next_after(self, moment: datetime) -> datetime:
        return self._slot(self._index_after(moment))

    def span(self, after: datetime, before: datetime) -> tuple[datetime, datetime, int] | None:
        """As missed_span, counted instead of walked."""
        first = self._index_after(after)
        # The last k with anchor + k * every < before, in whole microseconds (a slot at `before` is not before it).
        last = ((before - self.anchor) // timedelta(microseconds=1) - 1) // (self.milliseconds * 1000)
        return None if last < first else (self._slot(first), self._slot(last), last - first + 1)

    def _index_after(self, moment: datetime) -> int:
        elapsed = (moment - self.anchor) // timedelta(milliseconds=1)
        return int(max(elapsed // self.milliseconds + 1, 1))

    def _slot(self, k: int) -> datetime:
        return self.anchor + timedelta(milliseconds=k * self.milliseconds)


@dataclass(frozen=True)
class Cron:
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_week: frozenset[int]  # 0 is Sunday, as in Celery
    days_of_month: frozenset[int]
    months: frozenset[int]
    tz: tzinfo

    def _matches(self, day: date) -> bool:
        return day.month in self.months and day.day in self.days_of_month and day.isoweekday() % 7 in self.days_of_week

    @functools.lru_cache(maxsize=8)  # noqa: B019 (a few days of a few crontabs; walking a downtime reads each often)
    def _on(self, day: date) -> tuple[datetime, ...]:
        # Converted one by one: a time in a skipped hour maps later than the hour after it (see the module's doc);
        # then sorted, for that reason too.
        return tuple(
            sorted(
                datetime.combine(day, time(hour, minute), self.tz).astimezone(UTC)
                for hour in self.hours
                for minute in self.minutes
            )
        )

    def next_after(self, moment: datetime) -> datetime | None:
        day = moment.astimezone(self.tz).date() - timedelta(days=1)  # the day before may end after `moment` in UTC
        for _ in range(CRON_SEARCH_DAYS):
            if self._matches(day):
                later = _first_after(self._on(day), moment)
                if later is not None:
                    following = day + timedelta(days=1)  # a skipped time of `day` may map past its next day's first
                    if self._matches(following):
                        then = _first_after(self._on(following), moment)
                        if then is not None and then < later:
                            return then
                    return later
            day += timedelta(days=1)
        return None


def _first_after(slots: tuple[datetime, ...], moment: datetime) -> datetime | None:
    """The first of the sorted `slots` strictly after `moment`, or None."""
    at = bisect.bisect_right(slots, moment)
    return slots[at] if at < len(slots) else None


@dataclass(frozen=True)
class Solar:
    event: str
    lat: float
    lon: float
    _celery: Any  # celery.schedules.solar, which holds the ephem observer

    def next_after(self, moment: datetime) -> datetime | None:
        slot = upstream_celery.solar_next_event(self._celery, moment.astimezone(UTC) + timedelta(seconds=1))
        if slot is None:  # no such event within Celery's search (a polar night): checked again then
            return None
        return slot.replace(microsecond=0) + (timedelta(seconds=1) if slot.microsecond >= 500_000 else timedelta())


def missed_span(slots: Slots, after: datetime, before: datetime) -> tuple[datetime, datetime, int] | None:
    """The first and the last slot strictly after `after` and strictly before `before`, and how many there are; None
    when there is none. An interval's are counted (a second's slots over a year of downtime are 31 million); the
    others are walked (a crontab's minutes over a week: 10,080 slots)."""
    if isinstance(slots, Every):
        return slots.span(after, before)
    found = slots_between(slots, after, before)
    first = next(found, None)
    if first is None:
        return None
    last, count = first, 1
    for last in found:  # noqa: B007 (the loop's last value is the last slot)
        count += 1
    return first, last, count


def slots_between(slots: Slots, after: datetime, before: datetime) -> Iterator[datetime]:
    """The slots strictly after `after` and strictly before `before`, oldest first."""
    slot = slots.next_after(after)
    while slot is not None and slot < before:
        yield slot
        slot = slots.next_after(slot)


def cron_text(celery_crontab: Any) -> str:
    """A Celery crontab as the five fields of `{"crontab": ...}` (minute hour day-of-month month day-of-week)."""

    def field(value: Any) -> str:
        if isinstance(value, (set, frozenset, list, tuple, range)):
            return ",".join(str(v) for v in sorted(value))
        return str(value)

    return " ".join(field(part) for part in upstream_celery.crontab_fields(celery_crontab))


def schedule_document(schedule: Any) -> dict[str, Any]:
    """The stored form of what Celery accepts as an entry's `schedule`: seconds, a timedelta, or a Celery schedule,
    crontab or solar."""
    from celery import schedules

    if isinstance(schedule, schedules.crontab):
        return {"crontab": cron_text(schedule)}
    if isinstance(schedule, schedules.solar):
        return {"solar": schedule.event, "lat": schedule.lat, "lon": schedule.lon}
    if isinstance(schedule, schedules.schedule):
        interval: Any = schedule  # celery-types omits `run_every`, which schedule.__init__ sets
        return {"every": interval.run_every.total_seconds()}
    if isinstance(schedule, timedelta):
        return {"every": schedule.total_seconds()}
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return {"every": float(schedule)}
    raise ScheduleError(f"a schedule must be seconds, a timedelta, a crontab or a solar, not {type(schedule).__name__}")


def slots_of(schedule: Any, *, timezone: str, anchor: datetime | None) -> Slots:
    """The Slots of a stored schedule document, or ScheduleError saying what is wrong with it."""
    if not isinstance(schedule, dict) or len({"every", "crontab", "solar"} & set(schedule)) != 1:
        raise ScheduleError(f"a schedule must have one of every, crontab or solar, got {schedule!r}"[:300])
    tz = zone(timezone)
    if "every" in schedule:
        return Every(_milliseconds(schedule["every"]), slot_date(anchor, "anchor"))
    if "crontab" in schedule:
        return _cron(schedule["crontab"], tz)
    return _solar(schedule)


def _milliseconds(seconds: Any) -> int:
    """An interval's seconds as whole milliseconds, or ScheduleError: a number, MIN_EVERY to MAX_EVERY."""
    # Compared, not given to math.isfinite: a Python config may hold an int no float holds (NaN and infinity fail
    # the comparisons).
    longest = MAX_EVERY.total_seconds()
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not MIN_EVERY <= seconds <= longest:
        raise ScheduleError(
            f"every must be a number of seconds, at least {MIN_EVERY} and at most {longest:.0f} (100 years), "
            f"got {seconds!r}"[:300]
        )
    return round(seconds * 1000)


def slot_date(moment: Any, field: str) -> datetime:
    """An entry's anchor or lastSlot as an aware date its slots can be computed from, or ScheduleError."""
    if not isinstance(moment, datetime):
        raise ScheduleError(f"{field} must be a date, got {moment!r}"[:300])
    aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    if not EARLIEST_SLOT <= aware <= LATEST_SLOT:
        raise ScheduleError(
            f"{field} must be a date from {EARLIEST_SLOT.date()} to {LATEST_SLOT.date()}, got {aware.isoformat()}"
        )
    return aware


def _cron(text: Any, tz: tzinfo) -> Cron:
    from celery.schedules import crontab

    if not isinstance(text, str):
        raise ScheduleError(f"a crontab must be text such as '*/5 * * * *', got {text!r}"[:300])
    if len(text) > MAX_CRONTAB_LENGTH:
        raise ScheduleError(f"a crontab is at most {MAX_CRONTAB_LENGTH} characters, got {len(text)}")
    fields = text.split()
    if len(fields) != 5:
        raise ScheduleError(f"a crontab has 5 fields (minute hour day-of-month month day-of-week), got {text!r}")
    minute, hour, day_of_month, month, day_of_week = fields
    try:
        # Any: celery-types omits the expanded sets (minute, hour, ...) crontab.__init__ sets.
        parsed: Any = crontab(minute, hour, day_of_week, day_of_month, month)
    except Exception as exc:  # Celery's parser raises ValueError and its own ParseException
        raise ScheduleError(f"invalid crontab {text!r}: {exc}") from None
    return Cron(
        tuple(sorted(parsed.minute)),
        tuple(sorted(parsed.hour)),
        frozenset(parsed.day_of_week),
        frozenset(parsed.day_of_month),
        frozenset(parsed.month_of_year),
        tz,
    )


def _solar(schedule: dict[str, Any]) -> Solar:
    from celery.exceptions import ImproperlyConfigured
    from celery.schedules import solar

    # Any: a hand-written document's values; Celery's solar checks the event's name itself.
    event: Any = schedule.get("solar")
    lat, lon = schedule.get("lat"), schedule.get("lon")
    if not (_is_degrees(lat, 90) and _is_degrees(lon, 180)):
        raise ScheduleError(f"a solar schedule needs lat and lon in degrees, got {lat!r}, {lon!r}")
    assert isinstance(lat, int | float) and isinstance(lon, int | float)  # what _is_degrees says, for mypy
    try:
        celery_solar = solar(event, lat, lon)
    except ImproperlyConfigured:
        raise ScheduleError("solar schedules need the ephem package (pip install ephem)") from None
    except (ValueError, TypeError) as exc:
        raise ScheduleError(f"invalid solar schedule: {exc}") from None
    return Solar(event, float(lat), float(lon), celery_solar)


def _is_degrees(value: Any, most: int) -> bool:
    # Compared, as _milliseconds does: NaN fails (Celery's own check lets it through).
    return isinstance(value, int | float) and not isinstance(value, bool) and -most <= value <= most
