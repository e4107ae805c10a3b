"""bb_broker.enqueue_many: many signatures in a few inserts, each job as apply_async writes it, run by a real worker;
what a partial failure says, a call repeated, and input refused before anything is written."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery, chain, group, signals
from pymongo import monitoring
from pymongo.database import Database

import bb_broker
from bb_broker import DuplicateJob, EnqueueManyError, JobTooLarge
from bb_broker.jobs.document import MAX_DOCUMENT_BYTES
from tests.support import unique_app, wire
from tests.support.servers import with_database
from tests.support.workers import all_succeeded, producer, wait_for

E2E = "tests.support.e2e_app."
#: What differs between two publishes of the same signature: the ids and the times.
IDS_AND_TIMES = ("_id", "taskId", "createdAt", "updatedAt", "runAfter")


@pytest.fixture
def tasks(results_app: Celery) -> dict[str, Any]:
    return unique_app.register(results_app)


class Inserts(monitoring.CommandListener):
    """The inserts into `jobs` this process sends while on, by how many documents each carried."""

    def __init__(self) -> None:
        self.on = False
        self.sizes: list[int] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self.on and event.command_name == "insert" and event.command.get("insert") == "jobs":
            self.sizes.append(len(event.command.get("documents", [])))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


INSERTS = Inserts()
monitoring.register(INSERTS)


@pytest.mark.timeout(1200)  # a thousand runs on a loaded 2-core machine
def test_a_thousand_signatures_in_one_call_all_run_once(results_app, tasks, results_worker, db: Database) -> None:
    add = results_app.signature(E2E + "add")  # not registered here: sent by name, as send_task does
    signatures = [add.clone(args=(i, i)) for i in range(1000)]
    INSERTS.sizes.clear()
    INSERTS.on = True
    try:
        results = bb_broker.enqueue_many(signatures, batch_size=400)
    finally:
        INSERTS.on = False
    assert INSERTS.sizes == [400, 400, 200]  # three inserts, not a thousand
    assert [r.id for r in results] == [s.id for s in signatures]
    assert db.jobs.count_documents({"status": "queued"}) == 1000  # durable before any worker ran
    results_worker(concurrency=4, extra_args=("--prefetch-multiplier", "4"))
    wait_for(all_succeeded(db, [r.id for r in results]), timeout=1100, message="the thousand jobs succeeded")
    assert [r.get(timeout=60) for r in results[::100]] == [2 * i for i in range(0, 1000, 100)]
    assert db.jobs.count_documents({}) == 1000
    assert all(j["attempts"] == 1 for j in db.jobs.find({}, {"attempts": 1}))


def _without_ids_and_times(document: dict[str, Any], task_id: str) -> dict[str, Any]:
    """A job document without what two publishes of one signature make differently (the task id appears in the
    headers and properties too: replaced by a marker)."""
    shown = {k: ("<id>" if v == task_id else v) for k, v in document.items() if k not in IDS_AND_TIMES}  # rootId
    payload = shown["payload"]
    for part in ("headers", "properties"):
        payload[part] = {k: ("<id>" if v == task_id else v) for k, v in payload[part].items()}
    if payload["headers"].get("eta"):
        payload["headers"]["eta"] = "<eta>"
    if payload["headers"].get("expires"):
        payload["headers"]["expires"] = "<expires>"
    return shown


def test_each_job_is_the_document_apply_async_writes(results_app: Celery, tasks, db: Database) -> None:
    add, charge = tasks["add"], tasks["charge"]
    results_app.conf.task_routes = {unique_app.NAME + "charge": {"queue": "billing"}}
    soon = datetime.now(UTC) + timedelta(hours=1)
    # In twos: the first of each kind through apply_async itself, the second replaying its publish (bulk.py's
    # _Shapes) with its own arguments, task id, ETA and unique, serial, rate and fair keys.
    signatures = [
        add.s(1, 2),
        add.s(101, 2),
        add.s(3, 4).set(countdown=30, priority=7),
        add.s(103, 4).set(countdown=30, priority=7),
        add.s(5, 6).set(expires=600, queue="other"),
        add.s(105, 6).set(expires=600, queue="other"),
        charge.s(11, amount=5),  # unique on its account, routed to billing by the app's task_routes
        charge.s(12, amount=5),
        add.s(7, 8).set(serial_key="customer-1", rate_key="tenant-2", fair_key="tenant-3", eta=soon),
        add.s(107, 8).set(serial_key="customer-9", rate_key="tenant-8", fair_key="tenant-7", eta=soon + timedelta(1)),
        add.s(9, 10).set(unique=False, headers={"mine": "x"}, time_limit=30, soft_time_limit=20),
        add.s(109, 10).set(unique=False, headers={"mine": "x"}, time_limit=30, soft_time_limit=20),
        add.s(11, 12).set(unique_key="mine-1", group_id="g-1", group_index=0),
        add.s(111, 12).set(unique_key="mine-2", group_id="g-1", group_index=0),
    ]
    single = [s.clone().apply_async() for s in signatures]
    singles = {r.id: db.jobs.find_one({"taskId": r.id}) for r in single}
    # Their unique keys are taken by the single publishes: those jobs go, and the keys with them.
    db.jobs.delete_many({})
    bulk = bb_broker.enqueue_many(signatures, app=results_app)
    for signature, one, many in zip(signatures, single, bulk, strict=True):
        expected = _without_ids_and_times(singles[one.id], one.id)
        written = db.jobs.find_one({"taskId": many.id})
        assert written is not None
        assert _without_ids_and_times(written, many.id) == expected
        if signature.options.get("eta"):  # the same moment, however long after the single publish the bulk came
            assert abs(written["runAfter"] - singles[one.id]["runAfter"]) < timedelta(seconds=1)
        else:  # the same countdown from its own publish
            delay = written["runAfter"] - written["createdAt"]
            single_delay = singles[one.id]["runAfter"] - singles[one.id]["createdAt"]
            assert abs(delay - single_delay) < timedelta(seconds=5)
        assert (type(many), many.backend, many.ignored) == (type(one), one.backend, one.ignored)
    jobs = [db.jobs.find_one({"taskId": r.id}) for r in bulk]
    assert [j["queue"] for j in jobs[6:8]] == ["billing", "billing"]
    assert [(j["serialKey"], j["rateKey"], j["fairKey"]) for j in jobs[8:10]] == [
        ("customer-1", "tenant-2", "tenant-3"),
        ("customer-9", "tenant-8", "tenant-7"),
    ]
    assert jobs[9]["runAfter"] - jobs[8]["runAfter"] > timedelta(hours=23)  # each its own ETA
    assert [j["payload"]["args"] for j in jobs[:2]] == [[1, 2], [101, 2]]
    assert jobs[0]["unique"]["key"] != jobs[1]["unique"]["key"]  # each key made of its own arguments
    assert [j["unique"]["key"] for j in jobs[12:14]] == ["mine-1", "mine-2"]


def test_options_python_takes_for_equal_and_a_task_id_of_none_publish_as_apply_async_does(
    results_app: Celery, tasks, db: Database
) -> None:
    add = tasks["add"]
    # True, 1 and 1.0 are one value to Python's `==`: a kind's later signatures replayed its first one's options.
    signatures = [add.s(n, 0).set(unique=False, headers={"flag": flag}) for n, flag in enumerate((1, True, 1.0))]
    signatures += [add.s(n, 1).set(unique=False, link=add.si(flag, 0)) for n, flag in enumerate((1, True, 1.0))]
    # send_task gives a task id of None or "" a new one (`task_id or uuid()`); enqueue_many refused None.
    signatures += [add.s(n, 2).set(unique=False, task_id=given) for n, given in enumerate((None, ""))]
    single = [s.clone().apply_async() for s in signatures]
    expected = [repr(_without_ids_and_times(db.jobs.find_one({"taskId": r.id}), r.id)) for r in single]
    db.jobs.delete_many({})
    bulk = bb_broker.enqueue_many(signatures, app=results_app)
    written = [repr(_without_ids_and_times(db.jobs.find_one({"taskId": r.id}), r.id)) for r in bulk]
    assert written == expected
    jobs = [db.jobs.find_one({"taskId": r.id}) for r in bulk]
    assert [repr(j["payload"]["headers"]["flag"]) for j in jobs[:3]] == ["1", "True", "1.0"]
    assert [repr(j["payload"]["options"]["callbacks"][0]["args"]) for j in jobs[3:6]] == [
        "[1, 0]",
        "[True, 0]",
        "[1.0, 0]",
    ]
    assert all(r.id for r in bulk[6:]) and len({r.id for r in bulk}) == len(bulk)


def test_duplicates_and_an_oversize_one_are_reported_by_index_and_the_rest_published(
    tasks, results_worker, db: Database
) -> None:
    add, echo = tasks["add"], tasks["add"].app.signature(E2E + "echo")
    held = add.delay(100, 100)  # holds the key of add(100, 100) before the call
    signatures = [
        add.s(1, 1),
        add.s(100, 100),  # against the job already there
        add.s(2, 2),
        add.s(1, 1),  # against #0, in the same call
        echo.clone(args=("x" * (MAX_DOCUMENT_BYTES + 10),)),  # no document holds it
        add.s(3, 3),
    ]
    with pytest.raises(EnqueueManyError) as raised:
        bb_broker.enqueue_many(signatures)
    error = raised.value
    assert [(i, t) for i, t, _ in error.refused] == [
        (1, signatures[1].id),
        (3, signatures[3].id),
        (4, signatures[4].id),
    ]
    reasons = {i: reason for i, _, reason in error.refused}
    assert isinstance(reasons[1], DuplicateJob) and reasons[1].task_id == held.id
    assert isinstance(reasons[3], DuplicateJob) and reasons[3].task_id == signatures[0].id
    assert isinstance(reasons[4], JobTooLarge)
    assert error.published == [(i, signatures[i].id) for i in (0, 2, 5)]
    assert [r is None for r in error.results] == [False, True, False, True, True, False]
    assert "3 of 6 signatures not published" in str(error) and f"#1 ({signatures[1].id})" in str(error)
    published = {j["taskId"] for j in db.jobs.find({}, {"taskId": 1})}
    assert published == {held.id, signatures[0].id, signatures[2].id, signatures[5].id}
    results_worker()
    assert [error.results[i].get(timeout=60) for i in (0, 2, 5)] == [2, 4, 6]


def test_the_same_call_again_writes_nothing_twice(tasks, db: Database) -> None:
    signatures = [tasks["charge"].s(i, amount=i) for i in range(50)] + [tasks["add"].s(1, 2).set(countdown=60)]
    first = bb_broker.enqueue_many(signatures, batch_size=20)
    jobs = sorted(db.jobs.find({}), key=lambda j: j["_id"])
    # As after an answer lost: the caller does not know, and calls again with the same signatures.
    again = bb_broker.enqueue_many(signatures, batch_size=20)
    assert [r.id for r in again] == [r.id for r in first]
    assert sorted(db.jobs.find({}), key=lambda j: j["_id"]) == jobs
    # One of them gone meanwhile (as one never inserted): only it is written again, under its own job id.
    db.jobs.delete_one({"taskId": first[7].id})
    bb_broker.enqueue_many(signatures, batch_size=20)
    assert db.jobs.count_documents({}) == 51
    assert db.jobs.find_one({"taskId": first[7].id})["_id"] == next(
        j["_id"] for j in jobs if j["taskId"] == first[7].id
    )


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"task": "tests.support.e2e_app.add"}, "enqueue_many takes Celery signatures"),
        ("tests.support.e2e_app.add", "enqueue_many takes Celery signatures"),
        (None, "enqueue_many takes Celery signatures"),
    ],
)
def test_what_is_not_a_signature_is_refused_before_anything_is_written(tasks, db: Database, bad, words) -> None:
    with pytest.raises(TypeError, match=words):
        bb_broker.enqueue_many([tasks["add"].s(1, 2), bad])
    assert db.jobs.count_documents({}) == 0


def test_one_signature_object_listed_twice_is_refused_before_anything_is_written(tasks, db: Database) -> None:
    # Its task id and job id are kept in it: the three were one job, and the call answered for three.
    ping = tasks["add"].s(1, 2)
    with pytest.raises(TypeError, match=r"#2 \(tests.support.unique_app.add\) is the same signature object as #1"):
        bb_broker.enqueue_many([tasks["add"].s(3, 4), ping, ping, ping])
    assert db.jobs.count_documents({}) == 0
    # Each its own, as a group clones them (other arguments: the task is unique on its arguments).
    second, third = ping.clone(), ping.clone()
    second["args"], third["args"] = (2, 3), (3, 4)
    results = bb_broker.enqueue_many([ping, second, third])
    assert len({result.id for result in results}) == 3 and db.jobs.count_documents({}) == 3


def test_a_canvas_and_a_bad_option_are_refused_before_anything_is_written(tasks, db: Database) -> None:
    add = tasks["add"]
    for canvas in (chain(add.s(1, 2), add.s(3)), group(add.s(1, 2), add.s(3, 4))):
        with pytest.raises(TypeError, match=r"#1 is a (chain|group)"):
            bb_broker.enqueue_many([add.s(5, 6), canvas])
    with pytest.raises(bb_broker.MalformedTaskMessage) as raised:
        bb_broker.enqueue_many([add.s(5, 6), add.s(7, 8), add.s(1, 1).set(priority=300)])
    assert "signature #2" in " ".join(raised.value.__notes__)
    assert db.jobs.count_documents({}) == 0
    with pytest.raises(ValueError, match="batch_size"):
        bb_broker.enqueue_many([add.s(5, 6)], batch_size=0)


def test_a_task_name_not_registered_is_published_as_send_task_publishes_it(app: Celery, db: Database) -> None:
    # Celery's send_task (and a signature of a name the app does not know) publishes any name: so does this.
    unknown = app.signature("nobody.registered.this")
    results = bb_broker.enqueue_many([unknown.clone(args=(1,)), unknown.clone(args=(2,))])  # the second replayed
    for result, arg in zip(results, (1, 2), strict=True):
        sent = app.send_task("nobody.registered.this", args=(arg,))
        bulk, single = db.jobs.find_one({"taskId": result.id}), db.jobs.find_one({"taskId": sent.id})
        assert _without_ids_and_times(bulk, result.id) == _without_ids_and_times(single, sent.id)
        assert type(result) is type(sent)


def test_a_broker_that_is_not_bbmongo_is_refused(tasks) -> None:
    other = Celery("other", broker="memory://", set_as_current=False)
    try:
        with pytest.raises(TypeError, match="needs a bbmongo:// broker; this app's is memory://"):
            bb_broker.enqueue_many([other.signature("x")], app=other)
    finally:
        other.close()


def test_a_server_refusal_mid_call_says_which_batches_were_published(mongo_url: str, db: Database) -> None:
    # The server refuses the call's second insert as a whole (a refusal no retry passes: not authorized), after the
    # first landed: the first batch is reported published, the second refused with the server's words, none lost.
    inserts = []

    def second_insert_refused(command: dict[str, Any]) -> dict[str, Any] | None:
        if command.get("insert") == "jobs":
            inserts.append(len(command.get("documents", [])))
            if len(inserts) == 3:  # the warm-up's insert, then the call's two
                return {"ok": 0.0, "code": 13, "codeName": "Unauthorized", "errmsg": "not authorized on jobs"}
        return None

    proxy = wire.WireProxy(mongo_url, wire.Profile("refuses an insert", refuse=second_insert_refused))
    app = producer(with_database(f"mongodb://{proxy.address}", db.name))
    try:
        app.send_task(E2E + "add", args=(0, 0))
        add = app.signature(E2E + "add")
        signatures = [add.clone(args=(i, i)) for i in range(10)]
        with pytest.raises(EnqueueManyError) as raised:
            bb_broker.enqueue_many(signatures, app=app, batch_size=6)
        error = raised.value
        assert error.published == [(i, signatures[i].id) for i in range(6)]
        assert [(i, t) for i, t, _ in error.refused] == [(i, signatures[i].id) for i in range(6, 10)]
        assert all("not authorized on jobs" in str(reason) for _, _, reason in error.refused)
        assert {j["taskId"] for j in db.jobs.find({"taskId": {"$ne": None}})} >= {s.id for s in signatures[:6]}
        assert db.jobs.count_documents({}) == 7  # the warm-up's and the first batch
        # Called again once the server takes it: the refused four are written, the six not twice.
        bb_broker.enqueue_many(signatures, app=app, batch_size=6)
        assert db.jobs.count_documents({}) == 11
    finally:
        app.close()
        proxy.close()


def test_a_replayed_message_is_checked_and_stored_as_alone_where_it_differs_from_its_kinds_first(
    tasks, db: Database
) -> None:
    # A receiver of the app's gives some messages headers their kind's first did not have: a dotted key, which BSON
    # holds but the job keeps raw (as a single publish does), and a serial key that is no key (refused).
    add = tasks["add"]

    def headers_of_some(body: Any = None, headers: Any = None, **_: Any) -> None:
        first = body[0][0] if isinstance(body, tuple) and body[0] else None
        if first == 2:
            headers["mine"] = {"a.b": 1}
        if first == 3:
            headers["bb_serial_key"] = ""

    signals.before_task_publish.connect(headers_of_some, weak=False)
    try:
        single = db.jobs.find_one({"taskId": add.s(2, 0).apply_async().id})
        db.jobs.delete_many({})
        results = bb_broker.enqueue_many([add.s(1, 0), add.s(2, 0), add.s(4, 0)])
        jobs = [db.jobs.find_one({"taskId": r.id}) for r in results]
        assert ["raw" in j["payload"] for j in jobs] == [False, True, False]
        assert "raw" in single["payload"]  # as the single publish of the same signature
        with pytest.raises(bb_broker.MalformedTaskMessage, match="bb_serial_key") as raised:
            bb_broker.enqueue_many([add.s(5, 0), add.s(3, 0)])
        assert "signature #1" in " ".join(raised.value.__notes__)
        assert db.jobs.count_documents({}) == 3
    finally:
        signals.before_task_publish.disconnect(headers_of_some)
