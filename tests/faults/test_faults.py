"""Faults done for real: a stopped server, injected command failures, killed workers, racing workers, auth."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kombu
import pytest
from pymongo import MongoClient

import bb_broker
from bb_broker.jobs.document import attempt_entry
from bb_broker.jobs.store import JobStore
from bb_broker.server import capabilities
from bb_broker.transport.plumbing import MessageStore, payload_of
from tests.support.faults import crash_repeatedly, fail_point, start_worker
from tests.support.servers import AnswerDroppingProxy, EmbeddedServer, with_database
from tests.support.workers import job, producer, send, settled, wait_for


def test_mongodb_outage_loses_nothing_and_workers_reconnect(own_server, tmp_path) -> None:
    url = with_database(own_server.url, "outage")
    db = MongoClient(own_server.url, tz_aware=True).outage
    # A claim in flight as the stand-in stops can be carried out twice (it forgets retryable writes at restart;
    # see docs/explanation/reliability.md): the first job waits for the stale sweep, which must fall well inside this
    # test's wait.
    worker = start_worker(url, tmp_path, "w0", options={"stale_after": 30.0})
    app = producer(url)
    ids = [send(app, "sleep", 0.3) for _ in range(6)]
    wait_for(lambda: db.runs.count_documents({}) >= 1, message="work under way")
    own_server.stop()
    during: list[str] = []
    errors: list[BaseException] = []

    def publish_during_outage() -> None:
        try:
            during.append(send(app, "add", 1, 1))
        except Exception as exc:  # a clear error to the caller is the other acceptable outcome
            errors.append(exc)

    publisher = threading.Thread(target=publish_during_outage)
    publisher.start()
    publisher.join(10)  # the outage lasts ~10 s while the publisher waits for the server
    own_server.start()
    publisher.join(60)
    ids += during + [send(app, "add", 2, 2) for _ in range(3)]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == len(ids),
             timeout=120, message="every job succeeded after the outage")  # fmt: skip
    assert len(during) + len(errors) == 1 and (during or "OperationalError" in type(errors[0]).__name__)
    assert db.jobs.count_documents({}) == len(ids)  # nothing duplicated, nothing half-written
    started = db.runs.count_documents({"phase": "start"})
    assert started == 6, f"{started - 6} sleep tasks ran twice"
    assert worker.process.poll() is None  # reconnected without a restart


def test_injected_faults_in_claims_and_settles_lose_nothing(own_server, tmp_path) -> None:
    url = with_database(own_server.url, "faults")
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.faults
    # heartbeats are a minute apart here, so the `update` commands the fail point hits are settling writes
    worker = start_worker(url, tmp_path, "w0", options={"stale_after": 300})
    app = producer(url)
    # dropped connections in the middle of claims
    fail_point(client, 3, failCommands=["findAndModify"], closeConnection=True)
    first = [send(app, "add", i, i) for i in range(5)]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": first}, "status": "succeeded"}) == 5,
             timeout=120, message="claims survived dropped connections")  # fmt: skip
    # transient errors on settling writes, more than pymongo's one retry absorbs
    fail_point(client, 4, failCommands=["update"], errorCode=91, errorLabels=["RetryableWriteError"])
    second = [send(app, "sleep", 1.5) for _ in range(3)]
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": second}, "status": "succeeded"}) == 3,
             timeout=180, message="settles survived transient errors")  # fmt: skip
    assert db.runs.count_documents({"phase": "start"}) == 3  # no settle was lost, so nothing re-ran
    assert db.runs.count_documents({"name": "tests.support.e2e_app.add"}) == 5
    assert worker.process.poll() is None


def test_a_batch_claim_whose_write_outlived_the_client_still_knows_its_jobs(own_server) -> None:
    client = MongoClient(own_server.url, tz_aware=True)
    impatient = MongoClient(own_server.url, tz_aware=True, socketTimeoutMS=400)
    store = JobStore(impatient.batch)
    store.ensure_indexes()
    ids = [store.publish(queue="celery", kind="k", task_id=f"t{i}", payload={}, priority=0, run_after=None,
                         is_retry=False) for i in range(4)]  # fmt: skip
    # The claiming write waits on the server past the client's patience, and is then carried out there.
    fail_point(client, 1, failCommands=["update"], blockConnection=True, blockTimeMS=1500)
    claimed = store.claim_many("celery", "w", 4)
    assert sorted(job.id for job in claimed) == sorted(ids) and {job.attempts for job in claimed} == {1}
    docs = list(client.batch.jobs.find())
    assert {(d["status"], d["attempts"], d["leaseOwner"]) for d in docs} == {("running", 1, "w")}
    assert store.claim_many("celery", "other", 4) == []


def test_a_claim_whose_update_could_not_apply_fails_no_sound_job_in_place_of_the_one_it_met(own_server) -> None:
    # Two workers meet a hand-edited job at once: one fails it, and the other, reading the head again to fail it,
    # found the sound job behind it and failed that one. (The server's refusal is injected here: TypeMismatch.)
    client = MongoClient(own_server.url, tz_aware=True)
    store = JobStore(client.unclaimable)
    store.ensure_indexes()
    capabilities(client.unclaimable)  # known before the first claim, as a worker's channel probes at connect
    job_id = store.publish(queue="celery", kind="k", task_id="t", payload={}, priority=0, run_after=None,
                           is_retry=False)  # fmt: skip
    fail_point(client, 1, failCommands=["findAndModify"], errorCode=14)
    assert store.claim("celery", "w") is None
    assert client.unclaimable.jobs.find_one({"_id": job_id})["status"] == "queued"
    claimed = store.claim("celery", "w")
    assert claimed is not None and claimed.id == job_id


def test_a_failed_attempt_recorded_again_after_its_answer_was_lost_has_one_history_entry(own_server) -> None:
    # A broker retry records the failed attempt while the job stays `running`, so the attempt's fence still matches
    # once the write has landed: made again after its answer was lost (to pymongo's own retry too), it pushed a
    # second entry for the attempt, and a taken-over attempt's check must still say False.
    proxy = AnswerDroppingProxy(own_server.url)
    store = JobStore(MongoClient(proxy.url, tz_aware=True, directConnection=True).recorded)
    store.ensure_indexes()
    job_id = store.publish(queue="celery", kind="k", task_id="t", payload={}, priority=0, run_after=None,
                           is_retry=False)  # fmt: skip
    claimed = store.claim("celery", "w")
    assert claimed is not None and claimed.attempts == 1
    entry = attempt_entry(1, worker="w", started_at=None, finished_at=store.now(), outcome="failed", error="boom")
    proxy.drop_the_answers_to(command_on("update", "jobs"), times=2)
    assert store.record_failed_attempt(job_id, 1, "boom", attempt=entry)  # recorded: the retry is published
    assert proxy.dropped == 2
    doc = MongoClient(own_server.url, tz_aware=True).recorded.jobs.find_one({"_id": job_id})
    assert [(e["n"], e["outcome"]) for e in doc["history"]] == [(1, "failed")], doc["history"]
    assert doc["status"] == "running" and doc["lastError"] == "boom"
    assert not store.record_failed_attempt(job_id, 2, "boom", attempt={**entry, "n": 2})  # not the job's attempt


def test_a_publish_retried_after_its_insert_landed_unseen_makes_one_job(own_server) -> None:
    client = MongoClient(own_server.url, tz_aware=True)
    proxy = AnswerDroppingProxy(own_server.url)
    app = producer(with_database(proxy.url, "twins") + "?directConnection=true")  # through the proxy only
    send(app, "add", 0, 0)  # connected and indexes made
    # The server carries out the publish's insert and its answer is lost, twice: pymongo's own retry of the write
    # (which the server knows for the same write) and then Kombu's retry of the publish (a new write).
    proxy.drop_the_answers_to(b"jobs", times=2)
    task_id = send(app, "add", 1, 1)
    assert proxy.dropped == 2
    assert client.twins.jobs.count_documents({"taskId": task_id}) == 1  # not a twin per try
    assert client.twins.jobs.count_documents({}) == 2


def test_an_enqueue_many_whose_insert_landed_unseen_publishes_each_job_once(own_server) -> None:
    # The answer to a batch's insert is lost twice (pymongo's own retry of the write, then the call's retry of the
    # same documents): the jobs that landed come back as duplicates of their own ids, and count as published.
    client = MongoClient(own_server.url, tz_aware=True)
    proxy = AnswerDroppingProxy(own_server.url)
    app = producer(with_database(proxy.url, "bulk_twins") + "?directConnection=true")  # through the proxy only
    send(app, "add", 0, 0)  # connected and indexes made
    add = app.signature("tests.support.e2e_app.add")
    proxy.drop_the_answers_to(command_on("insert", "jobs"), times=2)
    results = bb_broker.enqueue_many([add.clone(args=(n, n)) for n in range(5)], app=app)
    assert proxy.dropped == 2
    for result in results:
        assert client.bulk_twins.jobs.count_documents({"taskId": result.id}) == 1
    assert client.bulk_twins.jobs.count_documents({}) == 6


def command_on(command: str, collection: str) -> bytes:
    """The bytes that open `command` on `collection` in a wire message (its first field, a BSON string)."""
    name = collection.encode() + b"\x00"
    return b"\x02" + command.encode() + b"\x00" + len(name).to_bytes(4, "little") + name


@pytest.mark.parametrize("kind", ["direct", "fanout"])
def test_a_plain_publish_retried_after_its_insert_landed_unseen_stores_one_message(own_server, kind: str) -> None:
    # As for task messages: the server stores the insert and its answer is lost, to pymongo's own retry and then
    # to Kombu's retry of the publish (retry=True). Each queue must hold the message once, not once per try.
    client = MongoClient(own_server.url, tz_aware=True)
    proxy = AnswerDroppingProxy(own_server.url)
    exchange = kombu.Exchange(f"plain_twins_{kind}", type=kind)
    queues = [
        kombu.Queue(f"plain_twins_{kind}_{n}", exchange, routing_key="twins")
        for n in range(2 if kind == "fanout" else 1)
    ]
    with kombu.Connection(with_database(proxy.url, "plain_twins") + "?directConnection=true") as conn:
        producer = kombu.Producer(conn.channel(), exchange=exchange, routing_key="twins")
        producer.publish({"n": 0}, declare=list(queues), retry=True)  # connected, indexes made
        proxy.drop_the_answers_to(command_on("insert", "bb_messages"), times=2)
        producer.publish({"n": 1}, retry=True, retry_policy={"interval_start": 0, "max_retries": 5})
        assert proxy.dropped == 2
    for queue in queues:
        stored = client.plain_twins.bb_messages.find({"queue": queue.name}, sort=[("_id", 1)])
        assert [json.loads(base64.b64decode(payload_of(doc)["body"])) for doc in stored] == [{"n": 0}, {"n": 1}]


@pytest.mark.parametrize("lost_answer", [command_on("update", "bb_messages"), command_on("delete", "bb_messages")])
def test_a_batched_take_whose_answer_is_lost_delivers_each_message_once(own_server, lost_answer: bytes) -> None:
    # A batched take marks the head of the queue as its own, then deletes what it marked. When the answer to either
    # write is lost (the network fails between the server and the consumer) the messages were marked or deleted on
    # the server all the same: they must still reach the consumer, once, not stay marked (or gone) for nobody.
    proxy = AnswerDroppingProxy(own_server.url)
    client = MongoClient(proxy.url, tz_aware=True, directConnection=True)
    store = MessageStore(client.lost_take)
    store.ensure_indexes()
    for i in range(5):
        store.put("events", {"body": str(i), "properties": {}}, 0)
    proxy.drop_the_answers_to(lost_answer, times=1)
    delivered: list[str] = []

    def take_what_is_there() -> bool:
        try:
            taken, _ = store.take("events", 5)
        except Exception:  # the lost answer: the consumer reads again, as Kombu would
            return False
        delivered.extend(payload_of(doc)["body"] for doc in taken)
        return len(delivered) >= 5

    wait_for(take_what_is_there, timeout=20, message="the five messages delivered")
    assert proxy.dropped == 1
    assert delivered == [str(i) for i in range(5)]  # each once, in order
    assert client.lost_take.bb_messages.count_documents({}) == 0


def test_crash_under_load_repeatedly(broker_url, db, tmp_path) -> None:
    ids, starts, cut_short, kills = crash_repeatedly(
        broker_url, db, tmp_path, jobs=30, task_seconds=0.4, kills=3, starts_per_kill=4, timeout=180
    )
    ran_twice = {task for task, n in starts.items() if n > 1}
    assert set(starts) == set(ids)
    assert ran_twice <= cut_short  # only jobs running when a worker was killed ran again
    print(f"crash-under-load: kills={kills} jobs={len(ids)} lost=0 ran_twice={len(ran_twice)}")


def test_racing_workers_run_each_job_exactly_once(broker_url, db, tmp_path) -> None:
    app = producer(broker_url)
    ids = [send(app, "add", i, 1) for i in range(150)]
    workers = [start_worker(broker_url, tmp_path, f"w{i}") for i in range(3)]
    wait_for(lambda: db.jobs.count_documents({"status": "succeeded"}) == len(ids), timeout=240,
             message="all jobs drained")  # fmt: skip
    for worker in workers:
        worker.kill()
    per_task = list(db.runs.aggregate([{"$group": {"_id": "$taskId", "n": {"$sum": 1}}}]))
    assert len(per_task) == len(ids) and all(row["n"] == 1 for row in per_task)
    assert len({run["pid"] for run in db.runs.find()}) > 1  # more than one pool process took part
    assert bb_broker.statuses(db) == {"queued": 0, "running": 0, "succeeded": len(ids), "failed": 0}


@pytest.mark.parametrize("retry", ["the broker's", "the task's own"])
def test_a_retry_from_an_attempt_whose_job_was_taken_over_leaves_the_new_attempt_alone(
    retry, broker_url, db, worker_factory
) -> None:
    # The first worker's main process stops (no heartbeats) while its pool process runs attempt 1; the sweep gives
    # the job to a second worker (attempt 2). Attempt 1 then fails (a broker retry) or calls self.retry(): neither
    # may send back to the queue the job attempt 2 holds (its settle would be fenced out, the task run a third time).
    options = {"stale_after": 4.0}
    first = worker_factory(options=options, concurrency=1)
    task_id = send(producer(broker_url), "waits_then_fails_first", "k", retry == "the task's own")
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 1}), message="attempt 1 runs")
    first.signal(signal.SIGSTOP)
    worker_factory(options=options, concurrency=1)
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 2}), timeout=60, message="attempt 2 runs")
    db.fixes.insert_one({"_id": "k:1"})
    _attempt_two_keeps_its_job_after_attempt_one(db, task_id)


def test_a_broker_retry_published_after_its_job_was_taken_over_leaves_the_new_attempt_alone(
    broker_url, db, worker_factory
) -> None:
    # Attempt 1 fails and its failure is recorded while it still holds the job; then its pool process waits (a busy
    # machine) before the retry's publish. Meanwhile its worker's heartbeats stop and the sweep gives the job to a
    # second worker (attempt 2). The late publish must not send the job attempt 2 holds back to the queue.
    options = {"stale_after": 4.0}
    first = worker_factory(options=options, concurrency=1, env={"BB_TEST_HOLD_AFTER_RECORDING": "k"})
    task_id = send(producer(broker_url), "waits_then_fails_first", "k")
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 1}), message="attempt 1 runs")
    first.signal(signal.SIGSTOP)
    db.fixes.insert_one({"_id": "k:1"})
    wait_for(lambda: db.runs.find_one({"name": "recorded"}), message="attempt 1's failure recorded")
    worker_factory(options=options, concurrency=1)
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 2}), timeout=60, message="attempt 2 runs")
    db.fixes.insert_one({"_id": "k:go"})
    _attempt_two_keeps_its_job_after_attempt_one(db, task_id)


def _attempt_two_keeps_its_job_after_attempt_one(db, task_id: str) -> None:
    """Attempt 1 (of `waits_then_fails_first` on key "k") is over: attempt 2 still holds the job, and settles it."""
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "phase": "postrun"}), message="attempt 1 dealt with")
    assert (job(db, task_id)["status"], job(db, task_id)["attempts"]) == ("running", 2)
    db.fixes.insert_one({"_id": "k:2"})
    done = wait_for(settled(db, task_id, "succeeded"), message="attempt 2 succeeded")
    assert done["attempts"] == 2 and db.runs.count_documents({"taskId": task_id, "phase": None}) == 2


@pytest.mark.parametrize("killed", ["the whole worker", "its pool process", "a hard time limit"])
def test_an_attempt_killed_between_its_recorded_failure_and_its_retry_has_one_history_entry(
    killed, broker_url, db, worker_factory
) -> None:
    # The broker's retry records the failed attempt, then publishes the retry: a SIGKILL between the two leaves the
    # job running with its attempt in the history already. Whoever settles it then (the stale sweep, the worker
    # whose pool process died, or the worker's main process that killed it at its hard time limit, which knows only
    # the task id) must not add a second entry for that attempt.
    options = {"stale_after": 4.0}
    first = worker_factory(options=options, concurrency=1, env={"BB_TEST_HOLD_AFTER_RECORDING": "k"})
    limit = {"time_limit": 8} if killed == "a hard time limit" else {}  # the held publish runs into it
    task_id = send(producer(broker_url), "waits_then_fails_first", "k", **limit)
    db.fixes.insert_one({"_id": "k:1"})
    recorded = wait_for(lambda: db.runs.find_one({"name": "recorded"}), message="attempt 1's failure recorded")
    if killed == "the whole worker":
        first.kill()
        worker_factory(options=options, concurrency=1)
    elif killed == "its pool process":
        os.kill(recorded["pid"], signal.SIGKILL)
    db.fixes.insert_one({"_id": "k:2"})
    done = wait_for(settled(db, task_id, "succeeded"), timeout=90, message="attempt 2 succeeded")
    assert done["attempts"] == 2
    assert [(a["n"], a["outcome"]) for a in done["history"]] == [(1, "failed"), (2, "succeeded")], done["history"]
    assert done["history"][0]["error"] == "RuntimeError: the first attempt fails"


def test_scram_auth_works_and_a_wrong_password_says_so_without_the_password(auth_server, tmp_path) -> None:
    good = with_database(f"mongodb://bb:s3cret-pw@127.0.0.1:{auth_server.port}/?authSource=admin", "authdb")
    worker = start_worker(good, tmp_path, "w0")
    task_id = send(producer(good), "add", 1, 2)
    db = MongoClient(f"mongodb://bb:s3cret-pw@127.0.0.1:{auth_server.port}/?authSource=admin", tz_aware=True).authdb
    wait_for(settled(db, task_id, "succeeded"), message="task succeeded with SCRAM auth")
    assert bb_broker.statuses(good)["succeeded"] == 1
    worker.kill()
    assert "s3cret-pw" not in worker.log()

    wrong = good.replace("s3cret-pw", "wrong-pw-123")
    status = subprocess.run([sys.executable, "-m", "bb_broker.cli", "status", "--broker", wrong],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode == 1 and status.stdout == ""
    # Who failed to log in where, and nothing else: no server reply ($clusterTime, raw bytes), no password.
    assert status.stderr == "bb-broker: authentication failed for user bb on database admin\n"


def skewed_clock_env(offset: str) -> dict[str, str]:
    """libfaketime (the PyPI wheel ships the library) moves this process's wall clock by `offset`."""
    import libfaketime

    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    return {"LD_PRELOAD": str(library), "FAKETIME": offset, "DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}


def test_a_worker_whose_clock_runs_a_minute_ahead_steals_no_live_job(broker_url, db, worker_factory) -> None:
    options = {"stale_after": 3.0}
    honest = worker_factory(options=options)
    app = producer(broker_url)
    task_id = send(app, "sleep", 8)
    wait_for(lambda: db.runs.find_one({"taskId": task_id}), message="the long task started")
    # this worker sweeps every 1.5 s; by its own clock every lease in the collection is a minute old
    ahead = worker_factory(options=options, env=skewed_clock_env("+60s"))
    wait_for(settled(db, task_id, "succeeded"), timeout=60, message="the long task succeeded")
    assert db.runs.count_documents({"taskId": task_id, "phase": "start"}) == 1
    doc = db.jobs.find_one({"taskId": task_id})
    assert doc["attempts"] == 1 and doc["lastError"] == ""
    honest.kill()
    quick = send(app, "add", 1, 1)  # and the skewed worker still claims due work
    wait_for(settled(db, quick, "succeeded"), message="due work is still claimed")
    assert db.runs.find_one({"taskId": quick})["at"] - time.time() > 50  # it ran there, a minute "ahead"
    assert ahead.process.poll() is None


def test_a_worker_whose_clock_runs_behind_still_backs_off_its_failed_attempts(broker_url, db, worker_factory) -> None:
    # Celery turns the broker's backoff (a countdown) into an ETA on the failing worker's clock: a minute behind the
    # server's, the retry was due a minute before it was published, and another worker ran it at once.
    options = {"backoff_base": 5.0}  # 10 s after attempt 1
    behind = worker_factory(options=options, concurrency=1, env=skewed_clock_env("-60s"))
    task_id = send(producer(broker_url), "waits_then_fails_first", "k")
    wait_for(lambda: db.runs.find_one({"taskId": task_id, "attempt": 1}), message="attempt 1 runs")
    behind.signal(signal.SIGSTOP)  # its pool process goes on (and publishes the retry); its main one claims nothing
    worker_factory(options=options)
    db.fixes.insert_many([{"_id": "k:1"}, {"_id": "k:2"}])
    done = wait_for(settled(db, task_id, "succeeded"), timeout=90, message="attempt 2 succeeded")
    failed, retried = done["history"]
    assert (failed["outcome"], retried["outcome"]) == ("failed", "succeeded")
    # every time here is the server's: the failure's, the due time the retry got, and the start of attempt 2
    assert done["runAfter"] - failed["finishedAt"] >= timedelta(seconds=9.5), done
    assert retried["startedAt"] - failed["finishedAt"] >= timedelta(seconds=9.5), done


def test_a_worker_whose_clock_runs_behind_runs_a_due_countdown_task_at_once(broker_url, db, worker_factory) -> None:
    # The job is claimed once it is due by the server's clock; the message's ETA was its publisher's. A worker an hour
    # behind held the claimed task in Celery's timer until its own clock reached that ETA: an hour late.
    worker_factory(env=skewed_clock_env("-3600s"))
    publisher = producer(broker_url)
    sent_at = datetime.now(UTC)
    task_id = send(publisher, "add", 1, 1, countdown=2)
    done = wait_for(settled(db, task_id, "succeeded"), timeout=120, message="the countdown task ran once due")
    # Due two seconds after it was sent, and claimed no earlier than that. Measured from before the send: the insert
    # (its createdAt) can come most of a second after the publisher computed the ETA, on a loaded machine. The margin
    # is the publisher's estimate of the server's clock, to within half a round trip.
    assert done["runAfter"] - sent_at >= timedelta(seconds=1.5), done
    assert done["startedAt"] >= done["runAfter"], done
    # The history's start is the pool process's reading of the server's clock, not the claim's: each process reads it
    # to within half a round trip, tens of milliseconds apart on a loaded machine. An hour is what this tells apart.
    assert done["history"][0]["startedAt"] >= done["runAfter"] - timedelta(seconds=1), done


def test_a_worker_whose_clock_runs_ahead_runs_a_task_before_its_expiry(broker_url, db, worker_factory) -> None:
    # `expires` is its publisher's clock plus the seconds given, and Celery compares it with the worker's: a worker an
    # hour ahead revoked as expired a task with ten minutes to live.
    worker_factory(env=skewed_clock_env("+3600s"))
    task_id = send(producer(broker_url), "add", 2, 2, expires=600)
    ended = wait_for(lambda: job(db, task_id).get("status") in ("succeeded", "failed") and job(db, task_id))
    assert (ended["status"], ended["attempts"]) == ("succeeded", 1), ended


def test_a_worker_whose_clock_runs_behind_runs_no_expired_task(broker_url, db, worker_factory) -> None:
    # The reverse: an hour behind, the worker took a task whose expiry had passed for an hour of its own time to come.
    task_id = send(producer(broker_url), "add", 2, 2, expires=1)
    expires_at = datetime.now(UTC) + timedelta(seconds=1)
    wait_for(lambda: datetime.now(UTC) > expires_at, message="the task's expiry passed")
    worker_factory(env=skewed_clock_env("-3600s"))
    ended = wait_for(lambda: job(db, task_id).get("status") in ("succeeded", "failed") and job(db, task_id))
    assert (ended["status"], ended["lastError"]) == ("failed", "revoked: the task expired before it ran"), ended


def test_a_worker_whose_clock_is_stepped_an_hour_ahead_steals_no_live_job(broker_url, db, worker_factory, tmp_path):
    # A worker measures its offset to the server's clock once a minute. Its wall clock stepped meanwhile (NTP, a VM
    # resumed), the offset measured before the step made every lease in the collection an hour old to its sweeps.
    options = {"stale_after": 3.0}  # a heartbeat every 0.6 s, a sweep every 1.5 s
    honest = worker_factory(options=options)
    task_id = send(producer(broker_url), "sleep", 8)
    wait_for(lambda: db.runs.find_one({"taskId": task_id}), message="the long task started")
    wall_clock = tmp_path / "faketime"
    wall_clock.write_text("+0\n")
    env = {**skewed_clock_env("+0"), "FAKETIME_TIMESTAMP_FILE": str(wall_clock)}
    del env["FAKETIME"]  # libfaketime reads the file at each call: the test steps this worker's clock
    stepped = worker_factory(options=options, env=env)
    wall_clock.write_text("+3600s\n")
    wait_for(settled(db, task_id, "succeeded"), timeout=60, message="the long task succeeded")
    assert db.runs.count_documents({"taskId": task_id, "phase": "start"}) == 1
    assert db.jobs.find_one({"taskId": task_id})["attempts"] == 1
    assert honest.process.poll() is None and stepped.process.poll() is None


def test_a_password_in_a_task_error_never_reaches_last_error(auth_server, tmp_path) -> None:
    good = with_database(f"mongodb://bb:s3cret-pw@127.0.0.1:{auth_server.port}/?authSource=admin", "authdb")
    worker = start_worker(good, tmp_path, "w0", options={"max_attempts": 1})
    task_id = send(producer(good), "raise_message", f"could not log in to {good}")
    db = MongoClient(f"mongodb://bb:s3cret-pw@127.0.0.1:{auth_server.port}/?authSource=admin", tz_aware=True).authdb
    failed = wait_for(settled(db, task_id, "failed"), message="the task failed")
    assert "s3cret-pw" not in failed["lastError"] and "bb:**@127.0.0.1" in failed["lastError"]
    assert "s3cret-pw" not in worker.log()  # not even in the traceback Celery logs for the task


def test_a_password_in_a_task_error_never_reaches_the_job_s_result_or_history(auth_server, tmp_path) -> None:
    # With results on the jobs: the stored exception (what get() raises, what the Jobs tab shows) and every history
    # entry, a task's own self.retry() included, have the password masked as lastError has.
    good = with_database(f"mongodb://bb:s3cret-pw@127.0.0.1:{auth_server.port}/?authSource=admin", "authdb")
    start_worker(good, tmp_path, "w0", options={"max_attempts": 2}, env={"BB_RESULT_BACKEND": "broker"})
    app = producer(good)
    text = f"could not log in to {good}"
    ids = [send(app, "raise_message", text), send(app, "retry_message", text)]
    db = MongoClient(f"mongodb://bb:s3cret-pw@127.0.0.1:{auth_server.port}/?authSource=admin", tz_aware=True).authdb
    for task_id in ids:
        failed = wait_for(settled(db, task_id, "failed"), message="the task failed")
        assert failed["state"] == "FAILURE" and len(failed["history"]) == 2
        stored = json.dumps({key: failed[key] for key in ("result", "traceback", "history")}, default=str)
        assert "s3cret-pw" not in stored and "bb:**@127.0.0.1" in stored


def test_tls_options_in_the_url_reach_pymongo(tmp_path) -> None:
    import trustme

    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1", "localhost")
    chain, key, ca = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    certificate.private_key_pem.write_to_path(str(key))
    with chain.open("wb") as out:
        for blob in certificate.cert_chain_pems:
            out.write(blob.bytes())
    authority.cert_pem.write_to_path(str(ca))
    server = EmbeddedServer(tmp_path / "data", tls=(chain, key))
    server.start()
    try:
        url = f"bbmongo://127.0.0.1:{server.port}/tlsdb?tls=true&tlsCAFile={ca}"
        start_worker(url, tmp_path, "w0")
        task_id = send(producer(url), "add", 2, 2)
        db = MongoClient(server.url, tz_aware=True, tls=True, tlsCAFile=str(ca)).tlsdb
        wait_for(settled(db, task_id, "succeeded"), message="a task over TLS succeeded")
        plain = subprocess.run([sys.executable, "-m", "bb_broker.cli", "status", "--broker", url.split("?")[0]],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert plain.returncode != 0  # without the TLS options the server will not talk
    finally:
        server.stop()


def test_failed_heartbeats_are_retried_and_the_live_job_keeps_its_lease(own_server, tmp_path) -> None:
    url = with_database(own_server.url, "heartbeats")
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.heartbeats
    start_worker(url, tmp_path, "w0", options={"stale_after": 6.0})  # a heartbeat every 1.2 s
    task_id = send(producer(url), "sleep", 14)
    wait_for(lambda: db.runs.find_one({"taskId": task_id}), message="the long task started")
    before = db.jobs.find_one({"taskId": task_id})["updatedAt"]
    # The running job's heartbeats (`update` commands) fail for two ticks, short of stale_after. MaxTimeMSExpired,
    # an error that leaves the server known: a shutdown's (91) makes pymongo wait for its monitor to find the server
    # again, ~10 s, and after that the sweep may run before the settle it waits behind (the task has ended by then).
    fail_point(client, 2, failCommands=["update"], errorCode=50)

    def lease_kept_after_the_failures() -> bool:
        job = db.jobs.find_one({"taskId": task_id})
        return job["status"] == "running" and job["updatedAt"] - before >= timedelta(seconds=4)

    # Past the two failed ticks (2.4 s), the keeper's heartbeats go on: the worker that sweeps is this one, so a
    # keeper that stopped would leave the job alone and the task would still run once.
    wait_for(lease_kept_after_the_failures, timeout=30, message="heartbeats after the failed ones")
    wait_for(settled(db, task_id, "succeeded"), timeout=60, message="the long task succeeded")
    assert db.runs.count_documents({"taskId": task_id, "phase": "start"}) == 1  # never taken for lost
    assert db.jobs.find_one({"taskId": task_id})["attempts"] == 1


def test_the_password_never_reaches_flowers_pages(auth_server, tmp_path) -> None:
    from tests.support.flower_process import FlowerProcess

    good = with_database(f"mongodb://bb:s3cret-pw@127.0.0.1:{auth_server.port}/?authSource=admin", "authdb")
    worker = start_worker(good, tmp_path, "w0", extra_args=("-E",))
    flower = FlowerProcess(good, log_dir=tmp_path, launcher="bb-broker")
    flower.start()
    try:
        node = wait_for(lambda: next(iter(flower.get("/api/workers")), None), message="Flower sees the worker")
        task_id = send(producer(good), "add", 1, 2)
        wait_for(lambda: task_id in flower.get("/api/tasks"), message="Flower sees the task")
        pages = [flower.page(path) for path in ("/", "/workers", f"/worker/{node}", "/tasks", "/broker")]
        pages += [json.dumps(flower.get(path)) for path in ("/api/workers?refresh=1", "/api/tasks")]
        leaks = [page[page.find("s3cret") - 200 :][:250] for page in pages if "s3cret" in page]
        assert not leaks, leaks
        assert any("bb:**@127.0.0.1" in page for page in pages)  # the URL is shown, masked
        assert "s3cret-pw" not in flower.log() + worker.log()
    finally:
        flower.stop()
