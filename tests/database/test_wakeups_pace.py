"""The change stream's cost: a busy queue's jobs do not cost a getMore each, news still wakes at once (a short
burst of repeats does not hold it back), and a watched topic table is read again only when a binding changes."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from kombu import Connection, Consumer, Queue
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from bb_broker.jobs.document import due_query
from bb_broker.jobs.indexes import INDEXES
from bb_broker.transport import wakeups as wakeups_module
from bb_broker.transport.plumbing import MessageStore
from bb_broker.transport.wakeups import BUSY_PACE, FIRST_PACE, PACED_CHANGES, Look, Wakeups
from tests.support.spies import record_changes, record_paces
from tests.support.workers import producer, send, wait_for

#: Every test here measures the change stream itself: on the embedded server where BB_TEST_MONGO_URL's has none.
pytestmark = pytest.mark.change_streams


class GetMores(monitoring.CommandListener):
    def __init__(self) -> None:
        self.count = 0
        self.binding_reads = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "getMore":
            self.count += 1
        if event.command_name == "find" and event.command.get("find") == "bb_bindings":
            self.binding_reads += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


#: The queues the watched connection's consumers read.
READ = {"busy", "last", "quiet", "q", "mine"}


@pytest.fixture
def watched(mongo_url: str, db: Database) -> Iterator[tuple[Wakeups, GetMores]]:
    listener = GetMores()
    with MongoClient(mongo_url, event_listeners=[listener], tz_aware=True) as client:
        wakeups = Wakeups(
            client[db.name],
            jobs="jobs",
            messages="bb_messages",
            bindings="bb_bindings",
            clock=lambda: datetime.now(UTC),
            safety_poll_interval=3600,
        )
        wakeups.consume_only(READ)
        wait_for(lambda: wakeups.available, message="the change stream is live")
        yield wakeups, listener


def publish(db: Database, queue: str) -> None:
    db.jobs.insert_one({"status": "queued", "queue": queue, "runAfter": datetime.now(UTC)})


def seen(wakeups: Wakeups, queue: str) -> Callable[[], bool]:
    """A consumer's check for news of `queue`: each look that finds some ends as a consumer's does, by going idle.

    A queue being looked at is in flight, and a change to it then is a repeat, not news: a look left open would make
    the next job a repeat whenever the watcher sees it before the test's next look, and pace the watcher.
    """
    assert wakeups.look(queue, job_queue=False)  # the first look at a queue; from now on only news
    assert wakeups.look(queue, job_queue=False) is None

    def news() -> bool:
        if wakeups.look(queue, job_queue=False) is None:
            return False
        wakeups.seconds_until_next_poll({queue})  # the read came back: the consumer waits for more
        return True

    return news


def draining(wakeups: Wakeups, queue: str) -> None:
    """The consumer looks at `queue` and takes a message of an unknown number there: more jobs there are no news."""
    assert wakeups.look(queue, job_queue=True)
    wakeups.looked(queue, Look())


def paced_getmores(changes: int, seconds: float) -> float:
    """The getMores a paced stream may cost for `changes` repeats that came over `seconds`: one per PACED_CHANGES of
    them, or one per BUSY_PACE where they came slower than that (a loaded machine publishes slower), and a few for
    the pace's ramp after news, half as many again for a machine so loaded that the watcher's own reads lag. A
    getMore per claim (the regression these tests guard: 63-65 for 300 jobs on a quiet machine, where this allows 35)
    is more, loaded or not."""
    return 1.5 * (changes / PACED_CHANGES + seconds / BUSY_PACE + 10)


def test_a_busy_queue_costs_far_fewer_getmores_than_jobs(watched, db: Database) -> None:
    wakeups, getmores = watched
    draining(wakeups, "busy")
    last = seen(wakeups, "last")
    before, began = getmores.count, time.monotonic()
    jobs = 300
    for _ in range(jobs):
        publish(db, "busy")
    publish(db, "last")  # the stream is ordered: once this is seen, every job before it was
    wait_for(last, message="the change after the busy queue's jobs")
    allowed = paced_getmores(jobs, time.monotonic() - began)
    assert getmores.count - before <= allowed, f"{getmores.count - before} getMores for {jobs} jobs ({allowed:.0f})"


def test_a_burst_a_consumer_keeps_up_with_costs_far_fewer_getmores_than_jobs(watched, db: Database) -> None:
    # A worker at Celery's prefetch claims what each look's news told of and goes idle: the first change of each
    # read was news again, and ended the pacing, at a getMore per claim (0.22 per task in the bench's window).
    wakeups, getmores = watched
    assert wakeups.look("busy", job_queue=True)  # the first look reads all, and finds the queue empty
    wakeups.looked("busy", Look(jobs=0, messages=0))
    last = seen(wakeups, "last")
    taken, stop = [0], threading.Event()

    def claim_as_they_come() -> None:
        while not stop.is_set():
            look = wakeups.look("busy", job_queue=True)
            if look is not None:
                count = int(look.jobs)
                look.took("jobs", count, all_there_was=False)  # the claim took every job the news told of
                wakeups.looked("busy", look)
                taken[0] += count
            stop.wait(0.003)  # the claim's round trip and the hand-off
            wakeups.seconds_until_next_poll({"busy"})

    consumer = threading.Thread(target=claim_as_they_come)
    consumer.start()
    try:
        before, began = getmores.count, time.monotonic()
        jobs = 300
        for _ in range(jobs):
            publish(db, "busy")
        publish(db, "last")
        wait_for(last, message="the change after the burst")
        published = time.monotonic() - began
        wait_for(lambda: taken[0] == jobs, message="the consumer took every job")
        # About one per PACED_CHANGES jobs on a quiet machine (18 here), 35-45 on a loaded one that published slower;
        # a getMore per claim was 63-65 on a quiet one.
        allowed = paced_getmores(jobs, published)
        assert getmores.count - before <= allowed, f"{getmores.count - before} getMores for {jobs} jobs ({allowed:.0f})"
    finally:
        stop.set()
        consumer.join()


def test_news_for_a_quiet_queue_wakes_while_another_is_busy(watched, db: Database) -> None:
    wakeups, _ = watched
    draining(wakeups, "busy")
    quiet = seen(wakeups, "quiet")
    for _ in range(50):
        publish(db, "busy")
    wakeups.event.clear()
    publish(db, "quiet")
    wait_for(quiet, message="news for the quiet queue")
    assert wakeups.event.is_set()  # and the consumer was woken for it


def test_a_queue_polled_empty_is_news_again(watched, db: Database) -> None:
    wakeups, _ = watched
    assert wakeups.look("q", job_queue=True)  # a look that comes back empty: nothing left
    assert wakeups.seconds_until_next_poll({"q"}) > 0  # the consumer goes idle
    publish(db, "q")
    wait_for(lambda: wakeups.look("q", job_queue=True) is not None, message="the new job's wake-up")


def put_message(db: Database, queue: str) -> None:
    db.bb_messages.insert_one({"queue": queue, "payload": "{}"})


def test_changes_to_a_queue_it_does_not_read_never_hold_back_its_news(watched, db: Database) -> None:
    # A worker sends ping replies and events to queues only other processes read, and a producer its pings: those
    # queues stay marked (nobody here polls them), so each further change to them looked like a repeat, and the
    # watcher paced its next read with the ping (or its reply) waiting behind it.
    wakeups, _ = watched
    paces, changes = record_paces(wakeups), record_changes(wakeups)
    mine = seen(wakeups, "mine")
    put_message(db, "their.reply")  # the first reply marks the caller's queue here
    publish(db, "mine")  # the next ping
    wait_for(mine, message="the first news")
    paced, told = len(paces), len(changes)
    put_message(db, "their.reply")  # the reply to it, alone in its getMore
    wait_for(lambda: len(changes) > told, message="the change after the reply")
    publish(db, "mine")  # the ping after: whatever the watcher decided about the reply is decided by now
    wait_for(mine, message="the news after the reply")
    assert len(paces) == paced, "a change to a queue nobody here reads paced the watcher"


#: A monitor's binding of Celery's events, as Kombu's topic exchange makes it (routing key, its pattern, queue).
EVENTS = ("worker.#", r"^worker\..*?$", "monitor")
ANY_AGE = 1e-9  # a table that may be cached at all, however briefly: only the stream keeps it longer


def test_a_watched_topic_table_is_read_again_only_when_a_binding_changes(watched, db: Database) -> None:
    wakeups, reads = watched
    store = MessageStore(wakeups._db)  # the watcher's client: the same process, the same registry
    assert store.table("celeryev", max_age=ANY_AGE) == []
    for _ in range(5):  # a worker's heartbeat events, every 2 s
        assert store.table("celeryev", max_age=ANY_AGE) == []
    assert reads.binding_reads == 1
    MessageStore(db).bind("celeryev", *EVENTS)  # a monitor in another process starts listening
    wait_for(lambda: store.table("celeryev", max_age=ANY_AGE) == [EVENTS], message="the new binding")


def test_unwatched_or_uncacheable_tables_are_read_every_time(mongo_url: str, watched, db: Database) -> None:
    wakeups, reads = watched
    store = MessageStore(wakeups._db)
    store.table("celery.pidbox", max_age=0.0)  # fanout and direct tables are never cached
    store.table("celery.pidbox", max_age=0.0)
    assert reads.binding_reads == 2
    other = GetMores()
    with MongoClient(mongo_url, event_listeners=[other], tz_aware=True) as client:
        unwatched = MessageStore(client[db.name])  # no change stream covers this client
        unwatched.table("celeryev", max_age=ANY_AGE)
        unwatched.table("celeryev", max_age=ANY_AGE)
    assert other.binding_reads == 2


def test_a_look_reads_what_the_news_told_of_and_only_that(watched, db: Database) -> None:
    # A consumer that claimed the one job a change told of, in a queue of jobs, reads neither bb_messages nor the
    # queue again; what a look did not take is news for the next look; a safety poll reads everything.
    wakeups, _ = watched
    assert wakeups.look("q", job_queue=True) == Look()  # the first look at a queue reads both collections
    last = seen(wakeups, "last")

    def news_of(*writes: Callable[[], None]) -> Look:
        for write in writes:
            write()
        publish(db, "last")  # the stream is ordered: once this is seen, every change before it was
        wait_for(last, message="the change after the writes")
        look = wakeups.look("q", job_queue=True)
        assert look is not None
        return look

    look = news_of(lambda: publish(db, "q"))
    assert look == Look(jobs=1, messages=0)
    look.took("jobs", 1, all_there_was=False)
    wakeups.looked("q", look)
    assert wakeups.look("q", job_queue=True) is None  # the job told of was taken: no second claim

    look = news_of(lambda: put_message(db, "q"), lambda: publish(db, "q"), lambda: publish(db, "q"))
    assert look == Look(jobs=2, messages=1)
    look.took("jobs", 1, all_there_was=False)  # a claim of one job, not the second
    wakeups.looked("q", look)
    assert wakeups.look("q", job_queue=True) == Look(jobs=1, messages=1)  # left unread, or untaken: still news

    look = news_of(lambda: publish(db, "q"), lambda: publish(db, "q"))
    look.took("jobs", 1, all_there_was=True)  # the claim found fewer than it asked for: the queue is empty
    wakeups.looked("q", look)
    assert wakeups.look("q", job_queue=True) is None


def test_a_short_burst_of_repeats_is_paced_briefly_and_news_ends_the_pacing(watched, db: Database) -> None:
    # Tasks queued for a worker whose pool is busy repeat what it knows; a long pace after them held back the
    # ping that came next by up to BUSY_PACE (the saturated ping's p95). Paces start short and grow only while
    # repeats keep coming; news (or a quiet read) starts them short again.
    wakeups, _ = watched
    paces = record_paces(wakeups)
    draining(wakeups, "busy")  # the consumer knows the queue has work: its jobs are repeats
    quiet = seen(wakeups, "quiet")
    publish(db, "busy")
    wait_for(lambda: paces, message="a pace after the repeat")
    assert paces[-1] == FIRST_PACE
    publish(db, "quiet")
    wait_for(quiet, message="news for the quiet queue")
    before_news = len(paces)
    for _ in range(3):  # repeats that keep coming, each in its own read: the paces grow
        paced = len(paces)
        publish(db, "busy")
        wait_for(lambda: len(paces) > paced, message="a pace after each repeat")  # noqa: B023
    after_news = paces[before_news:]
    # Without news between, the next pace doubles the last: news ended the pacing, which starts short again.
    assert after_news[0] == FIRST_PACE, f"the paces after the news: {after_news}"
    assert FIRST_PACE < paces[-1] <= BUSY_PACE


def test_the_wake_ups_and_the_claims_judge_a_due_time_by_one_clock(broker_url: str, db: Database) -> None:
    # Each channel measured its own offset to the server's clock (to the millisecond, once a minute), and the change
    # stream judged due times by the first consuming channel's: when it was ahead of the claiming channel's, a new
    # task was news, the claim found it not yet due, and it waited for the safety poll (idle probes of 10 s).
    delivered: list[str] = []
    with Connection(broker_url, transport_options={"safety_poll_interval": 3600}) as conn:
        replies = conn.channel()  # the first to consume, as Celery's remote control may be
        Consumer(replies, queues=[Queue("replies", auto_delete=True)], accept=["json"]).consume()
        tasks = conn.channel()
        Consumer(tasks, queues=[Queue("celery")], accept=["json"],
                 callbacks=[lambda body, message: delivered.append(message.job_id)]).consume()  # fmt: skip
        wakeups = wait_for(lambda: conn.transport.wakeups, message="the change stream")
        wait_for(lambda: wakeups.available, message="the change stream is live")
        clock = tasks.jobs.now
        clock()  # measured
        clock._offset -= timedelta(seconds=1)  # the claiming channel's reading a second behind the other's
        send(producer(broker_url), "add", 1, 1)
        conn.drain_events(timeout=30)  # due a second later by the claims' clock, and woken then
    assert len(delivered) == 1


def delayed(queue: str, count: int, due: datetime, step: float = 0.0) -> list[dict]:
    """`count` queued jobs of `queue`, the first due at `due`, each `step` seconds after the one before."""
    return [{"status": "queued", "queue": queue, "runAfter": due + timedelta(seconds=n * step)} for n in range(count)]


def claim_as_they_fall_due(wakeups: Wakeups, db: Database, queues: set[str], count: int) -> list[float]:
    """A consumer of `queues` that claims each job its wake-ups tell of, until it took `count`: how late each was
    (seconds after its runAfter, or after the consumer started, whichever is later)."""
    started = datetime.now(UTC)
    lateness: list[float] = []
    deadline = time.monotonic() + 180
    while len(lateness) < count:
        assert time.monotonic() < deadline, f"{len(lateness)} of {count} jobs claimed in 180 s (the safety poll is 1 h)"
        wakeups.event.clear()
        for queue in queues:
            look = wakeups.look(queue, job_queue=True)
            if look is None:
                continue
            now = datetime.now(UTC)
            while job := db.jobs.find_one_and_update(due_query(queue, now), {"$set": {"status": "running"}}):
                lateness.append((now - max(job["runAfter"], started)).total_seconds())
            look.took("jobs", 0, all_there_was=True)
            look.took("messages", 0, all_there_was=True)
            wakeups.looked(queue, look)
        wakeups.event.wait(min(wakeups.seconds_until_next_poll(queues), 0.5))
    return lateness


def test_delayed_jobs_cost_a_bounded_number_of_due_times_and_each_still_wakes_its_consumer_on_time(
    watched, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every connection kept a timer per future runAfter the change stream told of, of its queues or any other: 170
    # bytes a job scheduled ahead, in every worker. Now it keeps the earliest few of each queue it consumes, and
    # reads the next ones from the jobs when the first it let go falls due, or when a consumer starts on a queue.
    monkeypatch.setattr(wakeups_module, "DUE_TIMES_KEPT", 4, raising=False)
    wakeups, _ = watched
    db.jobs.create_indexes(INDEXES)  # the claims' and the reads' (a worker makes them at its start)
    last = seen(wakeups, "last")
    assert wakeups.look("q", job_queue=True)  # the first look at the consumed queue: everything once
    tomorrow = datetime.now(UTC) + timedelta(days=1)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for queue in ("q", "later"):  # one it consumes, one it starts on later
            db.jobs.insert_many(delayed(queue, 3_000, tomorrow))
        publish(db, "last")
        wait_for(last, message="the change after the delayed jobs")
        grown = sum(
            stat.size_diff
            for stat in tracemalloc.take_snapshot().compare_to(before, "filename")
            if stat.traceback[0].filename == wakeups_module.__file__
        )
    finally:
        tracemalloc.stop()
    # Before: 6,000 timers, 637 kB. Now about 55 kB, which 12,000 more jobs leave as it is; up to 105 kB seen when
    # the snapshot is taken while the watcher holds a batch of changes it has not handed out yet.
    assert grown < 200_000, f"the wake-ups grew by {grown} bytes for 6,000 jobs scheduled a day ahead"

    soon = datetime.now(UTC) + timedelta(seconds=3)
    db.jobs.insert_many(delayed("q", 10, soon, step=0.3))  # more than it keeps: read again as they fall due
    db.jobs.insert_many(delayed("later", 3, soon, step=0.5))  # told of while nobody here consumed it
    publish(db, "last")
    wait_for(last, message="the change after the jobs due soon")
    wakeups.consume_only(READ | {"later"})
    # Each claimed as it falls due, not at a safety poll (an hour here): the claims' deadline says so; how late each
    # was is the machine's load, printed, not asserted.
    lateness = claim_as_they_fall_due(wakeups, db, {"q", "later"}, 13)
    print(f"claimed {max(lateness):.2f} s late at most")
    assert db.jobs.count_documents({"status": "running"}) == 13  # and none of tomorrow's


def test_a_due_time_told_by_a_paused_watcher_still_wakes_its_job_when_it_comes(mongo_url: str, db: Database) -> None:
    # The change stream's thread read the monotonic time, then the clock: paused in between (a loaded machine), it
    # kept the due time early by the pause, the look it woke found the job not due yet, and nothing woke one again
    # before the safety poll (an hour here). Each clock read of the watcher's thread pauses it here.
    def paused_watcher_clock() -> datetime:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)
        return datetime.now(UTC)

    with MongoClient(mongo_url, tz_aware=True) as client:
        wakeups = Wakeups(
            client[db.name],
            jobs="jobs",
            messages="bb_messages",
            bindings="bb_bindings",
            clock=paused_watcher_clock,
            safety_poll_interval=3600,
        )
        wakeups.consume_only({"q"})
        wait_for(lambda: wakeups.available, message="the change stream is live")
        db.jobs.create_indexes(INDEXES)
        assert wakeups.look("q", job_queue=True)  # the first look at the consumed queue: everything once
        db.jobs.insert_many(delayed("q", 3, datetime.now(UTC) + timedelta(seconds=4), step=1.0))
        lateness = claim_as_they_fall_due(wakeups, db, {"q"}, 3)
    print(f"claimed {max(lateness):.2f} s late at most")
    assert db.jobs.count_documents({"status": "running"}) == 3


def test_jobs_due_before_a_late_look_reads_the_due_times_again_still_wake_it(
    watched, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # When the first due time a queue let go came inside a look, that look claimed what was due then, and the next
    # look read the due times from its own moment: a job that fell due in between (a busy consumer looks again
    # late) was neither claimed nor read, and waited for the safety poll (an hour here).
    monkeypatch.setattr(wakeups_module, "DUE_TIMES_KEPT", 2, raising=False)
    wakeups, _ = watched
    db.jobs.create_indexes(INDEXES)
    last = seen(wakeups, "last")
    assert wakeups.look("q", job_queue=True)  # the first look at the consumed queue: everything once
    # Five seconds out: the insert and the change's arrival must be over before the first look, at `first` + 0.4 s,
    # which must come before the fourth job's due time (`first` + 1 s), however loaded the machine.
    first = datetime.now(UTC) + timedelta(seconds=5)
    db.jobs.insert_many(
        [{"status": "queued", "queue": "q", "runAfter": first + timedelta(seconds=s)} for s in (0, 0.1, 0.2, 1.0, 1.2)]
    )  # two kept, the rest let go from 0.2 s on
    publish(db, "last")
    wait_for(last, message="the change after the delayed jobs")
    time.sleep(max((first + timedelta(seconds=0.4) - datetime.now(UTC)).total_seconds(), 0.0))
    look = wakeups.look("q", job_queue=True)  # the first let-go due time comes in this look
    assert look is not None
    now = datetime.now(UTC)
    while db.jobs.find_one_and_update(due_query("q", now), {"$set": {"status": "running"}}):
        pass
    look.took("jobs", 0, all_there_was=True)
    wakeups.looked("q", look)
    assert db.jobs.count_documents({"status": "running"}) == 3
    time.sleep(max((first + timedelta(seconds=1.5) - datetime.now(UTC)).total_seconds(), 0.0))  # looks again late
    claim_as_they_fall_due(wakeups, db, {"q"}, 2)
    assert db.jobs.count_documents({"status": "running"}) == 5
