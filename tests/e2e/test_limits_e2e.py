"""Queue limits with real workers: what the collection says holds whatever the number of workers and their `-c`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.jobs.store import JobStore
from bb_broker.ops.operations import Operations
from tests.support.workers import all_succeeded, job, send, settled, wait_for

LIMITED = ("-Q", "limited,other")


@contextmanager
def sampled(mongo_url: str, db: Database, count: Callable[[Database], int]) -> Iterator[list[int]]:
    """Every value of `count` read from the collection, as often as the server answers, while the block runs: from
    a thread and a client of its own, so that the test's own waits go on meanwhile."""
    samples: list[int] = []
    stop = threading.Event()
    client: MongoClient = MongoClient(mongo_url)

    def sample() -> None:
        own = client[db.name]
        while not stop.is_set():
            samples.append(count(own))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(10)
        client.close()


def running_in(queue: str) -> Callable[[Database], int]:
    return lambda db: db.jobs.count_documents({"queue": queue, "status": "running"})


def test_a_limit_of_two_holds_across_three_workers_of_two_processes(
    app, db: Database, mongo_url: str, worker_factory
) -> None:
    Operations(JobStore(db)).set_limits("limited", concurrency=2, by="tester")
    for _ in range(3):
        worker_factory(concurrency=2, extra_args=LIMITED)
    with sampled(mongo_url, db, running_in("limited")) as samples:
        ids = [send(app, "sleep", 0.3, queue="limited") for _ in range(14)]
        wait_for(all_succeeded(db, ids), timeout=120, message="every limited job")
    assert max(samples) == 2, samples  # reached, and never exceeded
    assert {doc["claimLimits"]["concurrency"] for doc in db.jobs.find({"taskId": {"$in": ids}})} == {2}
    assert db.jobs.count_documents({"limitSlot": {"$exists": True}}) == 0  # every slot given back
    # and the pool processes themselves never ran more than two at once (their own start and end records)
    edges = sorted(
        (run["at"], 1 if run["phase"] == "start" else -1) for run in db.runs.find({"name": {"$regex": "sleep"}})
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    assert peak <= 2


def test_a_sigkilled_workers_slot_comes_back_with_its_job_and_the_rest_finish(
    app, db: Database, mongo_url: str, worker_factory, tmp_path: Path
) -> None:
    Operations(JobStore(db)).set_limits("limited", concurrency=1, by="tester")
    quick_sweep = {"stale_after": 3.0}
    doomed_worker = worker_factory(concurrency=2, extra_args=LIMITED, options=quick_sweep)
    gate = tmp_path / "gate"
    held = send(app, "hold_until", str(gate), queue="limited")
    wait_for(settled(db, held, "running"), message="the first job holds the only slot")
    wait_for(lambda: db.runs.find_one({"taskId": held}), message="the first job started")
    later = [send(app, "add", n, n, queue="limited") for n in range(4)]
    survivor = worker_factory(concurrency=2, extra_args=LIMITED, options=quick_sweep)
    proof = send(app, "add", 0, 0, queue="other")
    wait_for(settled(db, proof, "succeeded"), message="the workers claim (another queue's job ran)")
    assert db.jobs.count_documents({"taskId": {"$in": later}, "status": "queued"}) == 4  # held back by the limit

    with sampled(mongo_url, db, running_in("limited")) as samples:
        doomed_worker.kill()
        gate.touch()  # the job runs to its end once the sweep gives it to the survivor
        wait_for(all_succeeded(db, [held, *later]), timeout=120, message="the lost job and the rest")
    assert max(samples) <= 1
    lost = db.jobs.find_one({"taskId": held})
    assert lost["attempts"] == 2 and [entry["outcome"] for entry in lost["history"]] == ["lost", "succeeded"]
    assert survivor.process.poll() is None


def test_a_limit_changed_while_jobs_wait_takes_effect_at_once(
    app, db: Database, mongo_url: str, worker_factory, tmp_path: Path
) -> None:
    operations = Operations(JobStore(db))
    operations.set_limits("limited", concurrency=1, by="tester")
    for _ in range(3):
        worker_factory(concurrency=2, extra_args=LIMITED)
    gate = tmp_path / "gate"
    ids = [send(app, "hold_until", str(gate), queue="limited") for _ in range(6)]
    with sampled(mongo_url, db, running_in("limited")) as samples:
        wait_for(lambda: running_in("limited")(db) == 1, message="one job running")
        proof = send(app, "add", 0, 0, queue="other")
        wait_for(settled(db, proof, "succeeded"), message="the workers claim (another queue's job ran)")
        assert max(samples) == 1

        operations.set_limits("limited", concurrency=4, by="tester")  # raised: three more start, no more
        wait_for(lambda: running_in("limited")(db) == 4, message="four jobs running")
        # Claimed, not run: the claim may go to a worker whose two processes both hold a limited job (its
        # prefetch has room), and there it waits for the gate like they do.
        proof = send(app, "add", 1, 1, queue="other")
        wait_for(lambda: job(db, proof).get("status") in ("running", "succeeded"), message="the workers claim again")
        assert max(samples) == 4

        operations.set_limits("limited", clear=True, by="tester")  # cleared: the rest start
        wait_for(lambda: running_in("limited")(db) == 6, message="every job running")
        gate.touch()
        wait_for(all_succeeded(db, ids), timeout=120, message="every job")


def intervals(db: Database, ids: list[str]) -> list[tuple[float, float]]:
    """Each task's run, (start, end), from its own records, in the order of `ids`."""
    runs = {(run["taskId"], run["phase"]): run["at"] for run in db.runs.find({"taskId": {"$in": ids}})}
    return [(runs[(task_id, "start")], runs[(task_id, "end")]) for task_id in ids]


def test_jobs_of_one_serial_key_never_overlap_and_run_in_queue_order(
    app, db: Database, mongo_url: str, worker_factory
) -> None:
    for _ in range(3):
        worker_factory(concurrency=2, extra_args=LIMITED)

    def keyed(key: str) -> str:
        # One key by the call option, the other by the header it writes: the same job either way.
        spelling: dict[str, Any] = {"serial_key": key} if key == "account-a" else {"headers": {"bb_serial_key": key}}
        return send(app, "sleep", 0.2, queue="limited", **spelling)

    def running_of(key: str) -> Callable[[Database], int]:
        return lambda own: own.jobs.count_documents({"serialKey": key, "status": "running"})

    with sampled(mongo_url, db, running_of("account-a")) as samples:
        by_key: dict[str, list[str]] = {"account-a": [], "account-b": []}
        free = []
        for _ in range(8):
            for key, ids in by_key.items():
                ids.append(keyed(key))
            free.append(send(app, "sleep", 0.2, queue="limited"))
        everything = [*by_key["account-a"], *by_key["account-b"], *free]
        wait_for(all_succeeded(db, everything), timeout=180, message="every job")
    assert max(samples) == 1
    for ids in by_key.values():
        runs = intervals(db, ids)
        assert all(earlier[1] <= later[0] for earlier, later in zip(runs, runs[1:], strict=False)), runs
    assert {doc["serialKey"] for doc in db.jobs.find({"taskId": {"$in": by_key["account-a"]}})} == {"account-a"}
    assert db.jobs.count_documents({"serialWaiters": {"$exists": True}}) == 0
    # The two keys, and the jobs without one, ran beside each other: a key holds back only its own jobs.
    a_runs, b_runs = intervals(db, by_key["account-a"]), intervals(db, by_key["account-b"])
    assert any(a[0] < b[1] and b[0] < a[1] for a in a_runs for b in b_runs)


def _key_held_and_waited_for(
    app, db: Database, holder_task: str, gate: Path, make_worker, safety: float
) -> tuple[str, str]:
    """A worker (its safety poll every `safety` seconds) where the job of `holder_task` holds the serial key "account"
    (under way until `gate` is made), and a second job of the key found it busy and flagged it: their task ids."""
    make_worker(concurrency=2, options={"safety_poll_interval": safety})
    holder = send(app, holder_task, str(gate), serial_key="account")
    wait_for(lambda: db.runs.find_one({"taskId": holder}), message="the key's holder under way")
    waiting = send(app, "add", 1, 1, serial_key="account")
    wait_for(lambda: bool(job(db, holder).get("serialWaiters")), message="the second job found the key busy")
    return holder, waiting


def test_a_serial_key_whose_job_goes_back_to_the_queue_is_tried_again(
    app, db: Database, worker_factory, tmp_path: Path
) -> None:
    # The write that sends a flagged job back to the queue (here a Celery retry; also the stale sweep, a release,
    # an operator's requeue) frees its key, but the wake-ups took it only for news of its queue: the worker kept the
    # key as busy, and both jobs of the key waited in the queue for good, the worker idle. The safety poll is out
    # of the test's reach: only the change stream can tell.
    gate = tmp_path / "gate"
    first, second = _key_held_and_waited_for(app, db, "hold_until_then_retry_once", gate, worker_factory, 600.0)
    gate.touch()
    wait_for(all_succeeded(db, [first, second]), timeout=60, message="both jobs of the key, the first retried")
    assert db.runs.count_documents({"taskId": first}) == 2
    assert [entry["outcome"] for entry in job(db, first)["history"]] == ["retry", "succeeded"]


def test_a_serial_key_freed_where_no_change_tells_is_tried_again_at_the_safety_poll(
    app, db: Database, worker_factory, tmp_path: Path
) -> None:
    # The job holding the key deleted by hand: the change stream carries no removed flag for a delete (nor, on some
    # servers, for the stale sweep's pipeline write). The worker kept the key busy for good; it tries it again at
    # its next safety poll.
    gate = tmp_path / "gate"
    holder, waiting = _key_held_and_waited_for(app, db, "hold_until", gate, worker_factory, 2.0)
    assert db.jobs.delete_one({"taskId": holder}).deleted_count == 1
    wait_for(settled(db, waiting, "succeeded"), timeout=60, message="the job of the freed key")
    gate.touch()


def test_a_serial_key_that_cannot_be_is_refused_at_the_producer(app, db: Database) -> None:
    from bb_broker.jobs.payloads import MalformedTaskMessage

    for bad in (42, "", "k" * 513, ["a"]):
        try:
            send(app, "add", 1, 1, queue="limited", headers={"bb_serial_key": bad})
        except MalformedTaskMessage as exc:
            assert "'bb_serial_key'" in str(exc) and "a non-empty string of at most 512 characters" in str(exc)
        else:
            raise AssertionError(f"a serial key {bad!r} was published")
    assert db.jobs.count_documents({}) == 0


def test_a_rate_holds_across_four_workers_in_every_window_counted_from_the_jobs_starts(
    app, db: Database, worker_factory
) -> None:
    Operations(JobStore(db)).set_limits("limited", rate="10/s", by="tester")
    for _ in range(4):
        worker_factory(concurrency=2, extra_args=LIMITED)
    ids = [send(app, "add", n, n, queue="limited") for n in range(40)]
    wait_for(all_succeeded(db, ids), timeout=120, message="every rate-limited job")
    jobs = list(db.jobs.find({"taskId": {"$in": ids}}))
    assert all(doc["attempts"] == 1 for doc in jobs)
    # A job's startedAt is its claim's moment, the one its start was counted at. Every one-second window, wherever
    # it begins, holds at most 10 starts: any 11 of them in order span a second or more.
    starts = sorted(doc["startedAt"] for doc in jobs)
    spans = [starts[n + 10] - starts[n] for n in range(len(starts) - 10)]
    assert min(spans) >= timedelta(seconds=1), min(spans)
    assert len({doc["history"][-1]["worker"] for doc in jobs}) >= 2  # the rate held across workers, not in one


def test_rate_keys_too_long_fail_their_own_jobs_and_the_other_keys_go_on(app, db: Database, worker_factory) -> None:
    # Written by hand (a publish refuses a key over 512 characters): each 6 MB key became its counter's _id, and the
    # held keys went into every later claim's filter, until it passed what a command may hold.
    Operations(JobStore(db)).set_limits("limited", rate="1/m per key", by="tester")
    huge = []
    for letter in "abc":
        task_id = send(app, "add", 1, 1, queue="parked")  # a queue no worker reads: edited before any claim
        db.jobs.update_one({"taskId": task_id}, {"$set": {"queue": "limited", "rateKey": letter * 6_000_000}})
        huge.append(task_id)
    worker = worker_factory(extra_args=LIMITED)
    keyed = [send(app, "add", 2, 2, queue="limited", rate_key=key) for key in ("customer:a", "customer:b")]
    wait_for(all_succeeded(db, keyed), timeout=60, message="the jobs of sound keys ran past the edited ones")
    for task_id in huge:
        failed = wait_for(settled(db, task_id, "failed"), message="the job with a key too long failed")
        assert failed["attempts"] == 0 and db.runs.count_documents({"taskId": task_id}) == 0
        assert failed["lastError"] == (
            "malformed job document: rateKey must be a string of 1 to 512 characters, not a string of 6000000"
        )
    assert all(len(counter["_id"].get("key") or "") <= 512 for counter in db.bb_rates.find())
    later = send(app, "add", 3, 3, queue="limited", rate_key="customer:c")
    wait_for(settled(db, later, "succeeded"), timeout=60, message="the worker claims on")
    assert "Unrecoverable error" not in worker.log() and "DocumentTooLarge" not in worker.log(), worker.log()[-3000:]


def test_a_rate_per_key_holds_for_each_key_across_four_workers_and_the_keys_start_side_by_side(
    app, db: Database, worker_factory
) -> None:
    Operations(JobStore(db)).set_limits("limited", rate="2/s per key", by="tester")
    for _ in range(4):
        worker_factory(concurrency=2, extra_args=LIMITED)
    by_key: dict[str | None, list[str]] = {"customer:a": [], "customer:b": [], None: []}
    for n in range(10):
        for key, ids in by_key.items():
            ids.append(send(app, "add", n, n, queue="limited", **({} if key is None else {"rate_key": key})))
    everything = [task_id for ids in by_key.values() for task_id in ids]
    wait_for(all_succeeded(db, everything), timeout=120, message="every job of the three keys")
    starts = {}
    for key, ids in by_key.items():
        jobs = list(db.jobs.find({"taskId": {"$in": ids}}))
        assert all(doc["attempts"] == 1 and doc.get("rateKey") == key for doc in jobs)
        assert {doc["claimLimits"]["rate"] for doc in jobs} == {"2/s per key"}
        starts[key] = sorted(doc["startedAt"] for doc in jobs)
        # Every one-second window, wherever it begins, holds at most 2 starts of the key: any 3 span a second.
        spans = [starts[key][n + 2] - starts[key][n] for n in range(len(starts[key]) - 2)]
        assert min(spans) >= timedelta(seconds=1), (key, min(spans))
    # The keys did not wait for each other: some second holds starts of all three.
    # By moment alone: two keys' jobs may start in the same millisecond, and a key None does not compare with a str.
    every = sorted(((moment, key) for key, moments in starts.items() for moment in moments), key=lambda start: start[0])
    assert any(
        len({key for moment, key in every if first <= moment < first + timedelta(seconds=1)}) == 3 for first, _ in every
    )
