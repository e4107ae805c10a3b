"""The `bb_schedules` collection: one document per periodic entry, its schedule and where its slots have got to.

An entry document (its `_id` is the entry's name):

- `task`, `args`, `kwargs`, `options` (Celery's: queue, priority, expires, countdown, ...): what each slot sends;
- `schedule` (see bb_broker.beat.slots), `timezone` (an IANA name: where a crontab's fields are read), `anchor`;
- `catchUp`: what a beat does with the slots nobody sent in time (every beat down, the server down): `once` (one
  job for them all, the default), `all` (one job each) or `none`;
- `enabled`; `owner`: `config` for the entries of `beat_schedule` (written again at each beat's start), `runtime`
  for those added here;
- `lastSlot`: the latest slot dealt with (sent, or skipped by the catch-up policy), moved only by a write fenced on
  its previous value, so that each slot is dealt with once; `runCount` (jobs recorded with their slot: a beat
  killed between a slot's job and this record leaves that one job uncounted, unless a catch-up sends its slot
  again), `lastRunAt` (the slot of its last job), `lastJob` (that job's task id and whether "run now" made it),
  `catchUps` (the latest catch-ups: which slots, how many missed, how many sent).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import bson
from pymongo import ReturnDocument
from pymongo.database import Database
from pymongo.errors import DuplicateKeyError

from bb_broker.beat.slots import MAX_EVERY, ScheduleError, Slots, schedule_document, slot_date, slots_of
from bb_broker.jobs.payloads import MAX_SCHEDULE_LENGTH
from bb_broker.server import unique_refusals

logger = logging.getLogger(__name__)

SCHEDULES_COLLECTION = "bb_schedules"
CATCH_UP_POLICIES = ("once", "all", "none")
DEFAULT_CATCH_UP = "once"
CONFIG, RUNTIME = "config", "runtime"
#: The longest entry name: it is part of each job's unique key (bb_broker.jobs.unique.MAX_UNIQUE_KEY_LENGTH) and
#: the value of its `schedule` field.
MAX_NAME_LENGTH = MAX_SCHEDULE_LENGTH
#: Catch-ups kept in an entry, the latest last.
CATCH_UPS_KEPT = 10


def _seconds(value: Any) -> bool:
    """A countdown or an expiry: seconds that, added to now, are still a date (compared, as slots' `every` is)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_EVERY.total_seconds()


#: The options of a Celery entry that are checked here; any other goes to apply_async as it is.
_OPTION_CHECKS = {
    "queue": (lambda v: isinstance(v, str) and v != "", "a queue name"),
    "routing_key": (lambda v: isinstance(v, str), "a string"),
    "exchange": (lambda v: isinstance(v, str), "a string"),
    "priority": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255, "0 to 255"),
    "expires": (_seconds, "seconds, at most 100 years"),
    "countdown": (_seconds, "seconds, at most 100 years"),
    # Each slot's job adds its own headers to these, and Celery's ETA is a date: hand edits of either made run-now and
    # every slot end in a traceback.
    "headers": (lambda v: isinstance(v, dict), "a document"),
    "eta": (lambda v: isinstance(v, datetime), "a date"),
}


class EntryError(ValueError):
    """An entry that cannot be scheduled as written, or a change to one that cannot be made; nothing was written."""


@dataclass
class Entry:
    """An entry document, checked: what a beat needs to send its slots."""

    name: str
    task: str
    slots: Slots
    timezone: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    catch_up: str
    enabled: bool
    last_slot: datetime
    #: The last slot of the latest catch-up recorded (None: none recorded, or a hand-written record that has none):
    #: a beat that finds another's `all` catch-up under way sends on within it instead of recording one of its own.
    catching_up_to: datetime | None = None


def _latest_catch_up_end(records: Any) -> datetime | None:
    latest = records[-1] if isinstance(records, list) and records else None
    end = latest.get("to") if isinstance(latest, dict) else None
    return _aware(end) if isinstance(end, datetime) else None


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def parse_entry(doc: dict[str, Any]) -> Entry:
    """The Entry of a stored document, or EntryError naming the field that makes no sense (written by hand)."""
    name = doc.get("_id")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        shown = repr(name)[:80]
        raise EntryError(f"the entry's _id (its name) must be a string of 1 to {MAX_NAME_LENGTH} characters: {shown}")
    fields = _checked_fields(doc)
    enabled = doc.get("enabled", True)
    if not isinstance(enabled, bool):
        raise EntryError(f"entry {name!r}: enabled must be true or false, got {enabled!r}")
    # What a sent slot's write adds to ($inc, $push): the server refuses it on anything else, after the job is sent.
    run_count = doc.get("runCount", 0)
    if isinstance(run_count, bool) or not isinstance(run_count, (int, float, bson.Decimal128)):
        raise EntryError(f"entry {name!r}: runCount must be a number, got {run_count!r}"[:300])
    if not isinstance(doc.get("catchUps", []), list):
        raise EntryError(f"entry {name!r}: catchUps must be an array, got {doc['catchUps']!r}"[:300])
    try:
        last_slot = slot_date(doc.get("lastSlot"), "lastSlot")
        slots = slots_of(fields["schedule"], timezone=fields["timezone"], anchor=doc.get("anchor"))
    except ScheduleError as exc:
        raise EntryError(f"entry {name!r}: {exc}") from None
    return Entry(
        name=name,
        task=fields["task"],
        slots=slots,
        timezone=fields["timezone"],
        args=fields["args"],
        kwargs=fields["kwargs"],
        options=fields["options"],
        catch_up=fields["catchUp"],
        enabled=enabled,
        last_slot=last_slot,
        catching_up_to=_latest_catch_up_end(doc.get("catchUps")),
    )


def _checked_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The fields that say what an entry sends and when, checked; EntryError naming the first that is wrong."""
    name = doc.get("_id")
    task = doc.get("task")
    if not isinstance(task, str) or not task:
        raise EntryError(f"entry {name!r}: task must be a task name, got {task!r}")
    for key, kind, expected in (
        ("args", list, "a list"),
        ("kwargs", dict, "a document"),
        ("options", dict, "a document"),
    ):
        if not isinstance(doc.get(key, kind()), kind):
            raise EntryError(f"entry {name!r}: {key} must be {expected}, got {doc.get(key)!r}"[:300])
    options = dict(doc.get("options") or {})
    for key, (valid, expected) in _OPTION_CHECKS.items():
        if key in options and not valid(options[key]):
            raise EntryError(f"entry {name!r}: option {key} must be {expected}, got {options[key]!r}")
    catch_up = doc.get("catchUp", DEFAULT_CATCH_UP)
    if catch_up not in CATCH_UP_POLICIES:
        raise EntryError(f"entry {name!r}: catchUp must be one of {', '.join(CATCH_UP_POLICIES)}, got {catch_up!r}")
    return {
        "task": task,
        "schedule": doc.get("schedule"),
        "timezone": doc.get("timezone", "UTC"),
        "args": list(doc.get("args") or []),
        "kwargs": dict(doc.get("kwargs") or {}),
        "options": options,
        "catchUp": catch_up,
    }


def entry_fields(
    name: str,
    task: Any,
    schedule: Any,
    *,
    timezone: str = "UTC",
    args: Any = (),
    kwargs: Any = None,
    options: Any = None,
    catch_up: str = DEFAULT_CATCH_UP,
    known_tasks: Any = None,
) -> dict[str, Any]:
    """The stored fields of an entry (its schedule as Celery writes it or as a document), checked as a beat will:
    EntryError saying what is wrong. `known_tasks`, when given (an app's `tasks`), must hold the task's name."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
        shown = repr(name)[:80]
        raise EntryError(f"an entry's name must be a string of 1 to {MAX_NAME_LENGTH} characters, got {shown}")
    try:
        stored = schedule if isinstance(schedule, dict) else schedule_document(schedule)
    except ScheduleError as exc:
        raise EntryError(f"entry {name!r}: {exc}") from None
    doc = {
        "_id": name,
        "task": task,
        "schedule": stored,
        "timezone": timezone,
        "args": list(args) if isinstance(args, (list, tuple)) else args,
        "kwargs": {} if kwargs is None else kwargs,
        "options": {} if options is None else options,
        "catchUp": catch_up,
    }
    fields = _checked_fields(doc)
    if known_tasks is not None and task not in known_tasks:
        raise EntryError(f"entry {name!r}: unknown task {task!r} (not registered in the app)")
    try:
        slots_of(stored, timezone=timezone, anchor=datetime.now(UTC))
    except ScheduleError as exc:
        raise EntryError(f"entry {name!r}: {exc}") from None
    try:
        bson.encode({"args": fields["args"], "kwargs": fields["kwargs"], "options": fields["options"]})
    except (bson.InvalidDocument, OverflowError) as exc:
        raise EntryError(f"entry {name!r}: args, kwargs and options must be storable as BSON: {exc}") from None
    return {key: value for key, value in doc.items() if key != "_id"}


class ScheduleStore:
    """The entries of one database, read and changed by beats, the CLI and Flower's Schedules view."""

    def __init__(self, db: Database, clock: Any, *, collection: str = SCHEDULES_COLLECTION) -> None:
        self.coll = db[collection]
        self.now = clock

    def load(self) -> list[dict[str, Any]]:
        return list(self.coll.find({}).sort("_id", 1))

    def get(self, name: str) -> dict[str, Any] | None:
        return self.coll.find_one({"_id": name})

    def _created(self) -> dict[str, Any]:
        """The fields a new entry starts with. Its creation time is both an interval's anchor and where its slots
        start: a new entry sends nothing for the time before it."""
        now = self.now().replace(microsecond=0)
        return {"anchor": now, "lastSlot": now, "runCount": 0, "enabled": True, "createdAt": now}

    def add(self, name: str, task: str, schedule: Any, **how: Any) -> dict[str, Any]:
        """A new runtime entry; EntryError for a name taken or an entry that cannot be scheduled."""
        fields = entry_fields(name, task, schedule, **how)
        doc = {"_id": name, **fields, **self._created(), "owner": RUNTIME, "updatedAt": self.now()}
        try:
            with unique_refusals(self.coll.database):
                self.coll.insert_one(doc)
        except DuplicateKeyError:
            raise EntryError(f"an entry named {name!r} exists already") from None
        return doc

    def change(self, name: str, **changes: Any) -> dict[str, Any]:
        """Change an entry's task, schedule, timezone, args, kwargs, options or catch-up policy, checked as a whole."""
        current = self._existing(name)
        wanted = {
            "task": current.get("task"),
            "schedule": current.get("schedule"),
            "timezone": current.get("timezone", "UTC"),
            "args": current.get("args", []),
            "kwargs": current.get("kwargs", {}),
            "options": current.get("options", {}),
            "catch_up": current.get("catchUp", DEFAULT_CATCH_UP),
        }
        unknown = set(changes) - set(wanted) - {"known_tasks"}
        if unknown:
            raise EntryError(f"entry {name!r}: cannot change {', '.join(sorted(unknown))}")
        wanted.update(changes)
        fields = entry_fields(name, wanted.pop("task"), wanted.pop("schedule"), **wanted)
        return self._set(name, {**fields, "updatedAt": self.now(), **self._restarted(current, fields)})

    def set_enabled(self, name: str, enabled: bool, *, by: str | None = None) -> dict[str, Any]:
        """Enable or disable an entry (`by`: who, kept in `changedBy`). Enabled again, it starts from now: the slots
        it skipped are not caught up."""
        changes: dict[str, Any] = {"enabled": enabled, "updatedAt": self.now(), "changedBy": by}
        if enabled:
            changes["lastSlot"] = self.now()
        self._existing(name)
        # Enabling an enabled entry leaves its slots alone.
        selector = {"_id": name} if not enabled else {"_id": name, "enabled": {"$ne": True}}
        updated = self.coll.find_one_and_update(selector, {"$set": changes}, return_document=ReturnDocument.AFTER)
        return updated or self._existing(name)

    def remove(self, name: str) -> None:
        if self.coll.delete_one({"_id": name}).deleted_count != 1:
            raise EntryError(f"no entry named {name!r}")

    def _existing(self, name: str) -> dict[str, Any]:
        doc = self.get(name)
        if doc is None:
            raise EntryError(f"no entry named {name!r}")
        return doc

    def _set(self, name: str, changes: dict[str, Any]) -> dict[str, Any]:
        updated = self.coll.find_one_and_update({"_id": name}, {"$set": changes}, return_document=ReturnDocument.AFTER)
        if updated is None:
            raise EntryError(f"no entry named {name!r}")
        return updated

    def sync_config(self, entries: dict[str, dict[str, Any]], *, unchecked: Collection[str] = ()) -> list[str]:
        """Write the entries of `beat_schedule` (fields as entry_fields makes them) as configuration-owned, and remove
        the configuration-owned entries no longer there (`unchecked`: there, but not checked by this beat, and kept).
        Returns the names written. A runtime entry of the same name is left alone (logged): the configuration does
        not take over what an operator added."""
        written = []
        for name, fields in entries.items():
            now = self.now()
            created = self._created()
            current = self.coll.find_one({"_id": name, "owner": CONFIG}) or {}
            changes = {**fields, "owner": CONFIG, "updatedAt": now, **self._restarted(current, fields)}
            try:
                with unique_refusals(self.coll.database):
                    self.coll.update_one(
                        {"_id": name, "owner": CONFIG},
                        {"$set": changes, "$setOnInsert": {k: v for k, v in created.items() if k not in changes}},
                        upsert=True,
                    )
            except DuplicateKeyError:
                if self.coll.find_one({"_id": name, "owner": CONFIG}, {"_id": 1}) is None:
                    logger.error("beat_schedule entry %r: an entry added at run time has that name; it is kept", name)
                    continue
                # another beat created it a moment ago: write our fields over it
                self.coll.update_one({"_id": name, "owner": CONFIG}, {"$set": {**fields, "updatedAt": now}})
            written.append(name)
        self.coll.delete_many({"owner": CONFIG, "_id": {"$nin": [*entries, *unchecked]}})
        return written

    def _restarted(self, current: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
        """An entry whose schedule or timezone changes starts its slots from now (as set_enabled's does): the new
        schedule's slots before now were never due, and would otherwise be caught up as missed."""
        timing = (fields["schedule"], fields["timezone"])
        if not current or (current.get("schedule"), current.get("timezone", "UTC")) == timing:
            return {}
        now, last = self.now(), current.get("lastSlot")
        return {"lastSlot": max(last, now) if isinstance(last, datetime) and last.tzinfo is not None else now}

    def advance(
        self,
        name: str,
        from_slot: datetime,
        to_slot: datetime,
        *,
        job: dict[str, Any] | None,
        catch_up: dict[str, Any] | None = None,
    ) -> bool:
        """Move the entry's lastSlot from `from_slot` to `to_slot`, with the job made for it (None: skipped), only if
        no other beat moved it first: True when this call did."""
        changes: dict[str, Any] = {"lastSlot": to_slot}
        update: dict[str, Any] = {"$set": changes}
        if job is not None:
            changes.update(lastRunAt=job["slot"], lastJob=job)
            update["$inc"] = {"runCount": 1}
        if catch_up is not None:
            update["$push"] = {"catchUps": {"$each": [catch_up], "$slice": -CATCH_UPS_KEPT}}
        return self.coll.update_one({"_id": name, "lastSlot": from_slot}, update).modified_count == 1

    def record_run_now(self, name: str, job: dict[str, Any]) -> None:
        self.coll.update_one(
            {"_id": name}, {"$set": {"lastJob": job, "lastRunAt": job["slot"]}, "$inc": {"runCount": 1}}
        )
