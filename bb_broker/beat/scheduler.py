"""`celery beat -S bb_broker.beat:JobScheduler`: the schedule in `bb_schedules`, exactly one job per slot.

Every beat sends every due slot; the job carries the unique key `beat:<entry>:<slot>` (bb_broker.jobs.unique), so
whichever beat inserts first makes the slot's job and the others' inserts are refused by the index, at the cost of
that one refused insert. No beat needs to lead, none waits for a lock to run out after another died: however many
run, each slot makes one job, and the next slot is sent on time by whichever is alive. Slots are computed on the
server's clock (bb_broker.clock.ServerClock), so a beat whose own clock is off by minutes sends at the same times.

A slot is "missed" when a beat first finds it more than `bb_beat_missed_after` seconds (default
DEFAULT_MISSED_AFTER) after its time: every beat was down, or the server was. The entry's catch-up policy then says
what to send for the missed slots of one look: `once` one job (keyed on the first of them), `all` one each, `none`
nothing; the catch-up is recorded in the entry's `catchUps`.
"""

from __future__ import annotations

import itertools
import logging
import math
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.beat import Scheduler
from celery.exceptions import ImproperlyConfigured
from kombu.exceptions import OperationalError
from pymongo.errors import OperationFailure, PyMongoError, WriteError

from bb_broker.beat.entries import CONFIG, Entry, EntryError, ScheduleStore, entry_fields, parse_entry
from bb_broker.beat.slots import MAX_EVERY, ScheduleError, missed_span, slots_between
from bb_broker.clock import ServerClock
from bb_broker.connection import get_database, parse_broker_url
from bb_broker.jobs.outages import Refusals
from bb_broker.jobs.payloads import SCHEDULE_HEADER
from bb_broker.jobs.store import JobStore
from bb_broker.jobs.unique import UNIQUE_KEY_HEADER, DuplicateJob
from bb_broker.server import is_unrecognised

logger = logging.getLogger(__name__)

#: Seconds after its time past which a slot a beat finds unsent counts as missed (then its catch-up policy applies).
DEFAULT_MISSED_AFTER = 10.0
#: The most slots one look sends for an entry under the `all` policy: the rest are sent at the next looks.
MAX_SLOTS_PER_LOOK = 1000
#: Headers of a beat's job: the entry that made it (the job's `schedule` field: the Jobs view's filter), its slot,
#: and whether it is an operator's "run now".
ENTRY_HEADER, SLOT_HEADER, RUN_NOW_HEADER = SCHEDULE_HEADER, "bb_beat_slot", "bb_beat_run_now"


def slot_key(name: str, slot: datetime) -> str:
    """The unique key of an entry's job for a slot: the same on every beat."""
    return f"beat:{name}:{iso(slot)}"


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds")


def task_id_of(key: str) -> str:
    # Derived from the key, so that a slot's job has one Celery task id whichever beat sent it.
    return str(uuid.uuid5(uuid.NAMESPACE_URL, key))


def _server_answer(exc: BaseException) -> OperationFailure | None:
    """The server's answer behind `exc`: itself, or what Kombu's OperationalError (a publish's) was raised from."""
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, OperationFailure):
            return error
    return None


def send_entry(
    app: Any, entry: Entry, slot: datetime, key: str | None, *, producer: Any = None, run_now: bool = False
) -> str | None:
    """Send one job of `entry` for `slot`; with `key`, under that unique key. Returns the task id of the slot's job,
    this call's or, when the index refused it (DuplicateJob), the existing one's (None if since deleted)."""
    headers = {ENTRY_HEADER: entry.name, SLOT_HEADER: iso(slot), "celery_beat_task": True}
    if key is not None:
        headers[UNIQUE_KEY_HEADER] = key
    if run_now:
        headers[RUN_NOW_HEADER] = True
    options = dict(entry.options)
    options["headers"] = {**(options.get("headers") or {}), **headers}
    try:
        result = app.send_task(
            entry.task,
            args=entry.args,
            kwargs=entry.kwargs,
            task_id=task_id_of(key) if key is not None else None,
            producer=producer,
            **options,
        )
    except DuplicateJob as exc:
        return exc.task_id
    return result.id


def _missed_after(setting: Any) -> timedelta:
    """The `bb_beat_missed_after` setting, checked: seconds, more than 0, at most MAX_EVERY (a date is made of it)."""
    try:
        seconds = float(setting)
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds <= MAX_EVERY.total_seconds():  # NaN and infinity fail the comparison
        raise ImproperlyConfigured(
            f"bb_beat_missed_after must be seconds, more than 0 and at most {MAX_EVERY.days} days, got {setting!r}"
        )
    return timedelta(seconds=seconds)


class JobScheduler(Scheduler):
    """Celery's beat scheduler on the broker's database (see the module's doc)."""

    #: Seconds between looks at the collection when no slot is due sooner: a change made at run time shows by then.
    max_interval = 5

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._reported: dict[str, str] = {}  # entry name -> the problem last logged for it
        self._store: ScheduleStore | None = None
        self._clock: ServerClock | None = None
        #: The jobs the slots are sent as (setup_schedule).
        self._jobs: JobStore | None = None
        #: The server's answers the code does not recognise, per entry (and for the schedule's read): said once,
        #: counted, and that entry backed off while the others are sent.
        self._refusals = Refusals("beat")
        self.missed_after = _missed_after(app.conf.get("bb_beat_missed_after") or DEFAULT_MISSED_AFTER)
        super().__init__(app, *args, **kwargs)

    # --- Celery's Scheduler interface --------------------------------------

    def setup_schedule(self) -> None:
        target = parse_broker_url(self.app.conf.broker_write_url or self.app.conf.broker_url)
        db = get_database(target)
        self._clock = ServerClock.of(db)
        options = self.app.conf.broker_transport_options or {}
        self._jobs = JobStore(db, collection=options.get("jobs_collection", "jobs"))
        self._jobs.ensure_indexes()  # the unique key's index
        self._store = ScheduleStore(db, self._clock)
        entries, unchecked = self._config_entries()
        written = self._store.sync_config(entries, unchecked=unchecked)
        logger.info("bb_broker beat: %d configured entries synced to %s", len(written), self._store.coll.full_name)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Send what is due; the seconds until the next slot (at most max_interval)."""
        assert self._store is not None and self._clock is not None
        try:
            docs = self._store.load()
        except PyMongoError as exc:
            if isinstance(exc, OperationFailure) and is_unrecognised(exc):
                return min(self._refusals.met(self._store.coll.full_name, exc), self.max_interval)
            logger.warning("bb_broker beat: cannot read the schedule (%s); trying again", type(exc).__name__)
            return min(1.0, self.max_interval)
        self._refusals.cleared(self._store.coll.full_name)
        next_look = self._clock() + timedelta(seconds=self.max_interval)
        for doc in docs:
            name = str(doc.get("_id"))
            if (backed_off := self._refusals.wait(name)) > 0:
                next_look = min(next_look, self._clock() + timedelta(seconds=backed_off))
                continue
            try:
                entry = self._checked(doc)
                if entry is None:
                    continue
                if not entry.enabled:
                    self._reported.pop(name, None)
                    continue
                entry = self._send_due(entry)
                upcoming = entry.slots.next_after(entry.last_slot)
            except (PyMongoError, OperationalError) as exc:  # the server went away mid-look (Kombu's name for it
                # once its publish retries are spent): the slot is sent at a later look, under the same key
                answer = _server_answer(exc)
                if answer is not None and is_unrecognised(answer):
                    # An answer the code does not recognise: this entry backs off, the others are sent
                    pause = self._refusals.met(name, answer)
                    next_look = min(next_look, self._clock() + timedelta(seconds=pause))
                    continue
                if isinstance(exc, WriteError):  # a refusal of this entry's write alone: the others are sent
                    self._report(name, f"entry {name!r}: the server refused its write: {exc}")
                    continue
                logger.warning("bb_broker beat: entry %r: %s; trying again", name, exc)
                return min(1.0, self.max_interval)
            except Exception as exc:  # this entry's alone (a task's own publish check refused it, ...): the others
                # are sent; it is tried again at each look, and logged again only when its problem changes
                self._report(name, f"entry {name!r} could not be sent: {exc!r}", traceback=True)
                continue
            self._reported.pop(name, None)
            self._refusals.cleared(name)
            if upcoming is not None:
                next_look = min(next_look, upcoming)
        return max((next_look - self._clock()).total_seconds(), 0.0)

    @property
    def schedule(self) -> dict[str, Any]:
        # What `celery beat` shows and Celery's Scheduler reads; the entries live in the collection.
        return {}

    @schedule.setter
    def schedule(self, value: Any) -> None:
        pass

    @property
    def info(self) -> str:
        return "    . db -> bb_schedules (bb_broker)"

    def sync(self) -> None:
        pass  # every change is written as it is made

    # --- the entries --------------------------------------------------------

    def _config_entries(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """The entries of `beat_schedule` (and `add_periodic_task`), checked, and the names of those that are not:
        one that is wrong here is logged and left out, and what the collection holds under its name is not changed
        (another beat, a newer release or one that imports its task, may well schedule it)."""
        timezone = str(self.app.conf.timezone or "UTC")
        fields = {}
        unchecked = []
        for name, config in dict(self.app.conf.beat_schedule or {}).items():
            try:
                config = dict(config)
                fields[name] = entry_fields(
                    name,
                    config.get("task"),
                    config.get("schedule"),
                    timezone=config.get("timezone", timezone),
                    args=config.get("args") or (),
                    kwargs=config.get("kwargs"),
                    options=config.get("options"),
                    catch_up=config.get("catch_up", "once"),
                    known_tasks=self.app.tasks,
                )
            except (EntryError, ScheduleError, TypeError, ValueError) as exc:
                logger.error("bb_broker beat: beat_schedule entry %r is not scheduled: %s", name, exc)
                unchecked.append(name)
        return fields, unchecked

    def _checked(self, doc: dict[str, Any]) -> Entry | None:
        """The entry, or None (logged once per problem) when it is nonsense or its task is unknown here."""
        name = str(doc.get("_id"))
        try:
            entry = parse_entry(doc)
            if entry.task not in self.app.tasks and doc.get("owner") != CONFIG:
                raise EntryError(f"entry {name!r}: unknown task {entry.task!r} (not registered in this beat's app)")
        except EntryError as exc:
            self._report(name, f"skipping an entry: {exc}")
            return None
        return entry

    def _report(self, name: str, problem: str, *, traceback: bool = False) -> None:
        """Log the entry's problem once: a beat looks every few seconds, and a document edited into nonsense, or a
        send that fails the same way each time, stays so until someone changes it (then the new problem is logged)."""
        if self._reported.get(name) != problem:
            self._reported[name] = problem
            logger.error("bb_broker beat: %s", problem, exc_info=traceback)

    def _send_due(self, entry: Entry) -> Entry:
        """Deal with the entry's due slots; the entry as it now stands (its lastSlot moved on)."""
        assert self._store is not None and self._clock is not None
        # One `now` for the whole look: a slot that was on time when the look began is sent as such, not found
        # missed because the catch-up before it took a moment (that made a second catch-up of one slot).
        now = self._clock()
        for _ in range(MAX_SLOTS_PER_LOOK):
            due = entry.slots.next_after(entry.last_slot)
            if due is None or due > now:
                return entry
            if now - due > self.missed_after:
                reached = self._catch_up(entry, now)
            else:
                job = {"slot": due, "taskId": self._send_slot(entry, due), "runNow": False}
                reached = due if self._store.advance(entry.name, entry.last_slot, due, job=job) else None
            if reached is not None:
                entry.last_slot = reached
                continue
            # Another beat dealt with the slot first: go on from where it left the entry.
            doc = self._store.get(entry.name)
            fresh = self._checked(doc) if doc is not None else None
            if fresh is None or not fresh.enabled:
                return entry
            entry = fresh
        return entry

    def _missed(self, entry: Entry, before: datetime) -> list[datetime]:
        """The entry's first missed slots (those before `before`), oldest first, at most MAX_SLOTS_PER_LOOK: the
        `all` policy's for this look (a second's slots missed for a week are 600,000: the rest at the next looks)."""
        return list(itertools.islice(slots_between(entry.slots, entry.last_slot, before), MAX_SLOTS_PER_LOOK))

    def _catch_up(self, entry: Entry, now: datetime) -> datetime | None:
        """Apply the entry's catch-up policy to its missed slots: the slot the entry is now at, or None when another
        beat moved it first."""
        assert self._store is not None
        before = now - self.missed_after
        if entry.catch_up != "all":
            # `once` and `none` take the whole downtime in one catch-up, however long: its first and last slots.
            span = missed_span(entry.slots, entry.last_slot, before)
            assert span is not None  # called for a missed slot
            first, last, count = span
            if entry.catch_up == "once" and self._sent_before(entry, first):
                # A beat died between sending this slot's job and recording it: the slot was not missed, and is
                # recorded as sent. The downtime's one job is then keyed on the next missed slot (keyed on this one,
                # its key refused it, and the downtime got none).
                sent: dict[str, Any] = {
                    "slot": first,
                    "taskId": task_id_of(slot_key(entry.name, first)),
                    "runNow": False,
                }
                if not self._store.advance(entry.name, entry.last_slot, first, job=sent):
                    return None
                entry = replace(entry, last_slot=first)
                if missed_span(entry.slots, first, before) is None:
                    return first
                return self._catch_up(entry, now)
            summary = self._catch_up_record(entry, first, last, count, now)
            # `once`: keyed on the first missed slot, which every beat reading this lastSlot agrees on.
            job = None if entry.catch_up == "none" else self._send_late(entry, first)
            return last if self._store.advance(entry.name, entry.last_slot, last, job=job, catch_up=summary) else None
        missed = self._missed(entry, before)
        record: dict[str, Any] | None = None
        if entry.catching_up_to is not None and missed[0] <= entry.catching_up_to:
            # Another beat's catch-up, under way slot by slot (this beat lost a fenced write to it): its record
            # names these slots already, so they are sent on (one job each, as its record says) without a second.
            missed = [slot for slot in missed if slot <= entry.catching_up_to]
        else:
            record = self._catch_up_record(entry, missed[0], missed[-1], len(missed), now)  # the rest: another
        at = entry.last_slot
        for n, slot in enumerate(missed):
            if not self._store.advance(
                entry.name, at, slot, job=self._send_late(entry, slot), catch_up=record if n == 0 else None
            ):
                return None
            at = slot
        return at

    def _sent_before(self, entry: Entry, slot: datetime) -> bool:
        """Whether the job of `slot` is there already (its key's task id)."""
        assert self._jobs is not None
        return self._jobs.coll.find_one({"taskId": task_id_of(slot_key(entry.name, slot))}, {"_id": 1}) is not None

    def _catch_up_record(
        self, entry: Entry, first: datetime, last: datetime, count: int, now: datetime
    ) -> dict[str, Any]:
        sent = {"all": count, "once": 1, "none": 0}[entry.catch_up]
        logger.warning(
            "bb_broker beat: entry %r missed %d slots from %s to %s: catch-up %s, %d to send",
            entry.name, count, iso(first), iso(last), entry.catch_up, sent,
        )  # fmt: skip
        return {"from": first, "to": last, "missed": count, "policy": entry.catch_up, "at": now, "sent": sent}

    def _send_late(self, entry: Entry, slot: datetime) -> dict[str, Any]:
        """Send the job of a missed slot; what the entry records of it."""
        return {"slot": slot, "taskId": self._send_slot(entry, slot), "runNow": False, "late": True}

    def _send_slot(self, entry: Entry, slot: datetime) -> str | None:
        """Send the job of one of the entry's slots, saying so as Celery's own beat does (its operators look for the
        line; without it a beat's terminal looks dead)."""
        logger.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
        return send_entry(self.app, entry, slot, slot_key(entry.name, slot), producer=self.producer)


def run_now(app: Any, store: ScheduleStore, name: str) -> str:
    """Send one extra job of entry `name` at once (no unique key: it is no slot's), marked as such; its task id."""
    doc = store.get(name)
    if doc is None:
        raise EntryError(f"no entry named {name!r}")
    entry = parse_entry(doc)
    now = store.now()
    task_id = send_entry(app, entry, now, None, run_now=True)
    assert task_id is not None  # sent without a unique key: no index refuses it, the id is the send's own
    store.record_run_now(name, {"slot": now, "taskId": task_id, "runNow": True})
    return task_id
