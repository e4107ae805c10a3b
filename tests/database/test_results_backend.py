"""The result backend's own writes and reads against the real server, called directly (no worker)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from bson import Binary
from celery import Celery, states
from celery.app.task import Context
from celery.exceptions import ChordError, TaskRevokedError
from pymongo import MongoClient
from pymongo.database import Database

import bb_broker
import bb_broker.app_stores
from bb_broker.jobs.document import HISTORY_LIMIT, attempt_entry
from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.results.backend import JobFailed, JobResultBackend
from bb_broker.server import capabilities
from bb_broker.worker import settle
from tests.support.faults import fail_point_off, fail_point_on
from tests.support.servers import with_database
from tests.support.workers import producer, wait_for


@pytest.fixture
def app(broker_url: str):
    app = producer(broker_url)
    app.conf.result_backend = broker_url
    app.conf.result_expires = 3600
    yield app
    app.close()


def tsum(app: Celery):
    return app.signature("tests.support.e2e_app.tsum")


def part(task_id: str, group_id: str, index: int, callback) -> Context:
    return Context({"id": task_id, "group": group_id, "group_index": index, "chord": callback})


def test_a_chord_part_that_runs_again_is_counted_once(app: Celery, db: Database):
    backend = app.backend
    backend.apply_chord(("g1", [app.AsyncResult("t0"), app.AsyncResult("t1")]), tsum(app))
    backend.set_chord_size("g1", 2)
    callback = tsum(app)
    backend.on_chord_part_return(part("t0", "g1", 0, callback), states.SUCCESS, 5)
    backend.on_chord_part_return(part("t0", "g1", 0, callback), states.SUCCESS, 5)  # its worker died, it ran again
    assert db.bb_results.find_one({"_id": "chord:g1"})["count"] == 1
    assert db.jobs.count_documents({"kind": "tests.support.e2e_app.tsum"}) == 0
    backend.on_chord_part_return(part("t1", "g1", 1, callback), states.SUCCESS, 7)
    backend.on_chord_part_return(part("t1", "g1", 1, callback), states.SUCCESS, 7)
    [sent] = db.jobs.find({"kind": "tests.support.e2e_app.tsum"})
    assert sent["payload"]["args"] == [[5, 7]]  # in header order, the callback sent once


def test_parts_completing_together_send_the_callback_once(app: Celery, db: Database):
    size = 8
    app.backend.apply_chord(("g2", [app.AsyncResult(f"t{i}") for i in range(size)]), tsum(app))
    app.backend.set_chord_size("g2", size)
    barrier = threading.Barrier(size)

    def complete(i: int) -> None:
        backend = JobResultBackend(app, url=app.conf.result_backend)  # a backend per thread, as Celery has
        barrier.wait()
        backend.on_chord_part_return(part(f"t{i}", "g2", i, tsum(app)), states.SUCCESS, i)

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    [sent] = db.jobs.find({"kind": "tests.support.e2e_app.tsum"})
    assert sent["payload"]["args"] == [list(range(size))]


def test_a_chords_counter_expires_result_expires_after_its_latest_part(app: Celery, db: Database):
    """As Celery's Redis backend renews a chord's keys on every part: a header that runs longer than `result_expires`
    keeps its counter (and so its callback) while its parts keep coming."""
    backend = app.backend
    backend.apply_chord(("g-long", [app.AsyncResult("t0"), app.AsyncResult("t1")]), tsum(app))
    backend.set_chord_size("g-long", 2)
    # The header has run for almost result_expires: the counter is about to expire.
    soon = datetime.now(UTC) + timedelta(seconds=30)
    db.bb_results.update_one({"_id": "chord:g-long"}, {"$set": {"expiresAt": soon}})
    backend.on_chord_part_return(part("t0", "g-long", 0, tsum(app)), states.SUCCESS, 1)
    expires_at = db.bb_results.find_one({"_id": "chord:g-long"})["expiresAt"].replace(tzinfo=UTC)
    assert expires_at > datetime.now(UTC) + timedelta(minutes=59)


def test_values_json_cannot_hold_as_bson_are_kept_encoded(app: Celery, db: Database):
    backend = app.backend
    big = 2**70  # JSON has it, BSON's integers do not
    backend.store_result("t-big", {"n": big, "$key": 1}, states.SUCCESS)
    doc = db.bb_results.find_one({"_id": "task:t-big"})
    assert isinstance(doc["result"], bytes | Binary) and doc["resultFormat"] == "encoded:json"
    assert backend.get_task_meta("t-big", cache=False)["result"] == {"n": big, "$key": 1}
    backend.store_result("t-plain", {"a": [1, "b", None]}, states.SUCCESS)
    assert db.bb_results.find_one({"_id": "task:t-plain"})["result"] == {"a": [1, "b", None]}  # readable as BSON


def test_results_without_a_job_expire_with_result_expires(app: Celery, db: Database):
    app.backend.store_result("t-side", 1, states.SUCCESS)
    doc = db.bb_results.find_one({"_id": "task:t-side"})
    assert timedelta(minutes=59) < doc["expiresAt"] - doc["dateDone"] <= timedelta(hours=1, seconds=5)
    index = {ix["name"]: ix for ix in db.bb_results.list_indexes()}["bb_expiry"]
    assert index["expireAfterSeconds"] == 0


def test_on_a_server_without_ttl_indexes_a_result_without_a_job_is_stored_and_read(own_server):
    client = MongoClient(own_server.url, tz_aware=True)
    # createIndexes refused as a server without TTL indexes refuses them (NotImplemented): the probe finds it.
    fail_point_on(client, failCommands=["createIndexes"], errorCode=238, appName="bb_broker")
    app = producer(with_database(own_server.url, "no_ttl"))
    app.conf.result_backend = with_database(own_server.url, "no_ttl")
    try:
        app.backend.store_result("t-side", 1, states.SUCCESS)
        assert app.AsyncResult("t-side").get(timeout=10) == 1
        assert not capabilities(app.backend.database).ttl_indexes
    finally:
        fail_point_off(client)
        app.close()
    assert "bb_expiry" not in client.no_ttl.bb_results.index_information()


def test_a_success_is_never_overwritten(app: Celery):
    app.backend.store_result("t-done", 1, states.SUCCESS)
    app.backend.store_result("t-done", RuntimeError("late"), states.FAILURE)
    assert app.backend.get_task_meta("t-done", cache=False)["status"] == states.SUCCESS


def test_jobs_that_failed_without_a_celery_result_read_as_failures(app: Celery, db: Database):
    now = datetime.now(UTC)
    base = {"kind": "k", "queue": "celery", "attempts": 1, "createdAt": now, "updatedAt": now, "runAfter": now}
    db.jobs.insert_many(
        [
            {**base, "_id": "j1", "taskId": "lost", "status": "failed", "lastError": "worker lost: no heartbeat"},
            {**base, "_id": "j2", "taskId": "revoked", "status": "failed", "lastError": "revoked before it ran"},
            {**base, "_id": "j3", "taskId": "waiting", "status": "queued"},
        ]
    )
    lost = app.AsyncResult("lost")
    assert lost.state == states.FAILURE and isinstance(lost.result, JobFailed)
    with pytest.raises(JobFailed, match="worker lost"):
        lost.get(timeout=5)
    assert app.AsyncResult("revoked").state == states.REVOKED
    assert app.AsyncResult("waiting").state == states.PENDING


def test_a_result_over_the_limit_is_refused_before_any_write(app: Celery, db: Database):
    with pytest.raises(bb_broker.ResultTooLarge, match="16 MB"):
        app.backend.store_result("t-huge", "x" * (16 * 1024 * 1024), states.SUCCESS)
    assert db.bb_results.count_documents({}) == 0


def test_history_keeps_the_last_attempts_and_the_sweep_records_lost_ones(db: Database):
    store = JobStore(db, Policy(max_attempts=20, stale_after=1.0))
    store.ensure_indexes()
    store.publish(queue="q", kind="k", task_id="t", payload={}, priority=0, run_after=None, is_retry=False)
    for n in range(1, HISTORY_LIMIT + 3):
        claimed = store.claim("q", "owner-a")
        entry = attempt_entry(n, worker="w@h", started_at=None, finished_at=store.now(), outcome="failed", error="e")
        store.fail(claimed.id, claimed.attempts, "e", attempt=entry)
        db.jobs.update_one({"_id": claimed.id}, {"$set": {"runAfter": store.now()}})
    doc = db.jobs.find_one({"_id": claimed.id})
    assert [a["n"] for a in doc["history"]] == list(range(3, HISTORY_LIMIT + 3))
    claimed = store.claim("q", "owner-b")
    db.jobs.update_one({"_id": claimed.id}, {"$set": {"updatedAt": store.now() - timedelta(seconds=5)}})
    assert store.requeue_stale() == (1, 0)
    lost = db.jobs.find_one({"_id": claimed.id})["history"][-1]
    assert lost["n"] == HISTORY_LIMIT + 3 and lost["worker"] == "owner-b" and lost["outcome"] == "lost"
    assert lost["startedAt"] is not None and "no heartbeat" in lost["error"]
    assert len(db.jobs.find_one({"_id": claimed.id})["history"]) == HISTORY_LIMIT


def test_the_backend_url_never_shows_its_password(app: Celery):
    backend = JobResultBackend(app, url="bbmongo://ops:s3cret@127.0.0.1:1/db")
    assert "s3cret" not in backend.as_uri() and backend.as_uri() == "bbmongo://ops:**@127.0.0.1:1/db"


def test_a_broker_url_with_other_options_shares_the_jobs(broker_url: str):
    # Then a worker writes each result in its settling write (it does not fall back to a second write).
    app = producer(f"{broker_url}?appname=worker")
    app.conf.result_backend = broker_url
    try:
        assert app.backend._store() is not None
    finally:
        app.close()


class Killed(BaseException):
    """Stands for the SIGKILL of the worker at that point (the e2e test kills real workers there)."""


@pytest.mark.parametrize("dies", ["before the send", "after the send"])
def test_the_part_that_claimed_the_callback_takes_it_over_when_it_runs_again(
    app: Celery, db: Database, monkeypatch: pytest.MonkeyPatch, dies: str
):
    backend = app.backend
    backend.apply_chord(("g4", [app.AsyncResult("t0"), app.AsyncResult("t1")]), tsum(app))
    backend.set_chord_size("g4", 2)
    backend.on_chord_part_return(part("t0", "g4", 0, tsum(app)), states.SUCCESS, 5)
    send = JobResultBackend._send_callback

    def dying_send(self, *args):
        if dies == "after the send":
            send(self, *args)
        raise Killed

    monkeypatch.setattr(JobResultBackend, "_send_callback", dying_send)
    with pytest.raises(Killed):
        backend.on_chord_part_return(part("t1", "g4", 1, tsum(app)), states.SUCCESS, 7)
    monkeypatch.setattr(JobResultBackend, "_send_callback", send)
    claim = db.bb_results.find_one({"_id": "chord:g4"})["callback"]
    assert claim["by"] == "t1:1"
    # Another part completing late changes nothing; the claiming part's rerun sends it, with the claimed id.
    backend.on_chord_part_return(part("t0", "g4", 0, tsum(app)), states.SUCCESS, 5)
    backend.on_chord_part_return(part("t1", "g4", 1, tsum(app)), states.SUCCESS, 7)
    backend.on_chord_part_return(part("t1", "g4", 1, tsum(app)), states.SUCCESS, 7)
    [sent] = db.jobs.find({"kind": "tests.support.e2e_app.tsum"})
    assert sent["taskId"] == claim["firstId"] and sent["payload"]["args"] == [[5, 7]]
    assert db.bb_results.find_one({"_id": "chord:g4"})["sent"]


@pytest.mark.change_streams
def test_a_waiting_get_is_woken_by_a_new_job_of_a_task_id_it_knows(app: Celery, db: Database):
    # Task.replace: the replaced task's id comes back on its replacement's job (for a chain, only once the chain's
    # earlier steps ran), while the job the waiter knows has settled and changes no more.
    backend = app.backend
    now = datetime.now(UTC)
    replaced = {"_id": "job-replaced", "taskId": "t-replaced", "status": "succeeded", "createdAt": now}
    db.jobs.insert_one(replaced)
    assert backend.metas(["t-replaced"])["t-replaced"]["status"] == states.PENDING
    stream = backend.result_consumer.watch(["job-replaced"], [], ["t-replaced"])
    try:
        db.jobs.insert_one({"_id": "job-replacement", "taskId": "t-replaced", "status": "queued", "createdAt": now})
        change = wait_for(stream.try_next, timeout=30, message="the replacement's job woke the waiter")
        assert change["documentKey"]["_id"] == "job-replacement"
    finally:
        stream.close()


def held_part(app: Celery, task_id: str, group_id: str, callback) -> Context:
    """A chord part as a worker holds it: its job claimed (attempt 1 of 1), the request naming job and attempt."""
    store = bb_broker.app_stores.store_for(app)
    store.ensure_indexes()
    job_id = store.publish(queue="q", kind="k", task_id=task_id, payload={}, priority=0, run_after=None, is_retry=False)
    claimed = store.claim("q", "owner-a")
    assert claimed.id == job_id
    return Context(
        {
            "id": task_id,
            "group": group_id,
            "group_index": 0,
            "chord": callback,
            "bb_job_id": job_id,
            "bb_attempts": claimed.attempts,
            "errbacks": None,
        }
    )


def test_a_chord_part_whose_failure_is_over_the_limit_still_fails_the_chord(app: Celery, db: Database):
    app.conf.broker_transport_options = {"max_attempts": 1}
    callback = tsum(app)
    app.backend.apply_chord(("g5", [app.AsyncResult("t-huge-error")]), callback)
    app.backend.set_chord_size("g5", 1)
    request = held_part(app, "t-huge-error", "g5", callback)
    app.backend.mark_as_failure("t-huge-error", RuntimeError("x" * (17 * 1024 * 1024)), request=request)
    doc = db.jobs.find_one({"taskId": "t-huge-error"})
    assert doc["status"] == "failed" and "ResultTooLarge" in doc["lastError"]
    # The part is counted, and the callback's result is the chord's error, not a callback that never comes.
    assert db.bb_results.find_one({"_id": "chord:g5"})["count"] == 1
    with pytest.raises(ChordError, match="ResultTooLarge"):
        app.AsyncResult(callback.id).get(timeout=10)


def test_a_revoked_chord_part_reads_revoked_before_the_chord_fails(app: Celery, db: Database):
    """Celery's backends store REVOKED before they count the chord part: a get() on the chord's result, which checks
    the chord's parents, raises the part's TaskRevokedError, not the ChordError (Celery's own
    test_revoked_by_headers_complex_canvas). The worker settles the job at task_revoked, after the part is counted."""
    callback = tsum(app)
    app.backend.apply_chord(("g6", [app.AsyncResult("t-revoked")]), callback)
    app.backend.set_chord_size("g6", 1)
    request = held_part(app, "t-revoked", "g6", callback)
    app.backend.mark_as_revoked("t-revoked", "revoked", request=request)  # as a worker does, before task_revoked
    assert db.bb_results.find_one({"_id": "chord:g6"})["count"] == 1
    assert db.jobs.find_one({"taskId": "t-revoked"})["status"] == "running"
    header = app.GroupResult("g6", [app.AsyncResult("t-revoked")])
    with pytest.raises(TaskRevokedError):
        app.AsyncResult(callback.id, parent=header).get(timeout=10)
    with pytest.raises(ChordError, match="TaskRevokedError"):
        app.AsyncResult(callback.id).get(timeout=10, follow_parents=False)
    settle.revoked(bb_broker.app_stores.store_for(app), request, why="revoked before it ran")  # task_revoked
    doc = db.jobs.find_one({"taskId": "t-revoked"})
    assert doc["status"] == "failed" and doc["lastError"] == "revoked before it ran"
    assert app.AsyncResult("t-revoked").state == states.REVOKED


def test_get_calls_on_interval_after_the_read_that_finds_the_result(app: Celery):
    """Redis's get() calls on_interval after the wait that brought the result, however soon it came: a chord's
    parents are checked after its result is found failed, so a header task's error stored before the chord's is the
    one raised, even when both came between get()'s own first check of the parents and its first read."""
    app.backend.store_result("done-early", 3, states.SUCCESS)
    intervals: list[str] = []
    assert app.AsyncResult("done-early").get(timeout=10, on_interval=lambda: intervals.append("checked")) == 3
    assert intervals == ["checked"]


def test_a_failure_the_main_process_reports_adds_no_second_entry_for_an_attempt_its_retry_recorded(
    app: Celery, db: Database
) -> None:
    # A pool process's broker retry records the failed attempt, then the process dies before the retry's publish:
    # the worker's main process reports the lost process to the result backend, with the request it holds (the
    # task never started in that process). The attempt has its entry already; the job goes back with that one.
    from billiard.exceptions import WorkerLostError

    store = bb_broker.app_stores.store_for(app)
    store.ensure_indexes()
    job_id = store.publish(queue="q", kind="k", task_id="lost", payload={}, priority=0, run_after=None, is_retry=False)
    held = store.claim("q", "owner-a")
    error = "RuntimeError: the first attempt fails"
    recorded = attempt_entry(
        held.attempts, worker="w0", started_at=store.now(), finished_at=store.now(), outcome="failed", error=error
    )
    assert store.record_failed_attempt(job_id, held.attempts, error, attempt=recorded)
    request = Context({"id": "lost", "bb_job_id": job_id, "bb_attempts": held.attempts, "errbacks": None})
    app.backend.mark_as_failure(
        "lost", WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)."), request=request
    )
    doc = db.jobs.find_one({"_id": job_id})
    assert (doc["status"], doc["attempts"]) == ("queued", 1), doc
    assert [(entry["n"], entry["error"]) for entry in doc["history"]] == [(1, error)], doc["history"]
