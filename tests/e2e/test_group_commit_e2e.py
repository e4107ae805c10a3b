"""A worker's settles, group-committed (bb_broker/jobs/settles.py): a burst settles in fewer round trips than tasks,
each result is there when its batch lands, a prefork worker's main process writes its pool processes' settles
together, a pool process killed with its settles waiting loses none, and a worker killed with settles waiting
loses no job."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from celery import group
from pymongo import MongoClient

from tests.support.faults import fail_point, start_worker
from tests.support.servers import with_database
from tests.support.workers import producer, send, wait_for

T = "tests.support.e2e_app."
TASKS = 40


def settle_commands(log: Path) -> list[int]:
    """The statements of each settling `update` the worker's processes sent (tests/support/e2e_app.py SettleLog)."""
    return [int(line.split()[1]) for line in log.read_text().splitlines()] if log.exists() else []


def settle_writes(log: Path) -> list[tuple[int, list[str]]]:
    """Each settling `update` the worker's processes sent: the process that sent it, and the jobs it settled."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(fields[2]), fields[4].split(",")) for fields in (line.split() for line in lines)]


@pytest.mark.parametrize("results", ["bbmongo results", "no results"])
def test_a_burst_of_tasks_settles_in_fewer_round_trips_than_tasks(results: str, own_server, tmp_path: Path) -> None:
    url = with_database(own_server.url, "burst")
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.burst
    log = tmp_path / "settles.log"
    env = {"BB_TEST_SETTLE_LOG": str(log)}
    app = producer(url)
    if results == "bbmongo results":
        app.conf.result_backend = url
        env["BB_RESULT_BACKEND"] = url
    burst = group(app.signature(T + "identity", args=(i,)) for i in range(TASKS)).apply_async()
    # A round trip longer than a task, as to a database across a network: each write waits 500 ms on the server. On
    # a loaded 2-core machine a task's run took about 100 ms, as long as the 100 ms this waited before, and then most
    # round trips carried one or two settles (22 for 40 tasks, in a make test beside the compat sessions).
    fail_point(client, 200, failCommands=["update"], blockConnection=True, blockTimeMS=500)
    start_worker(url, tmp_path, "w0", concurrency=1, env=env)
    if results == "bbmongo results":
        assert burst.get(timeout=120) == list(range(TASKS))  # each get() returns as its batch lands
    else:
        ids = [result.id for result in burst.results]
        wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == TASKS,
                 timeout=120, message="the burst succeeded")  # fmt: skip
    client.admin.command("configureFailPoint", "failCommand", mode="off")
    commands = settle_commands(log)
    assert sum(commands) == TASKS, commands  # each job settled once
    assert len(commands) < TASKS / 2, commands  # in fewer round trips than tasks: most carried several
    assert db.jobs.count_documents({"status": "succeeded", "history.0.outcome": "succeeded"}) == TASKS


def test_a_worker_killed_with_settles_waiting_loses_no_job(own_server, tmp_path: Path) -> None:
    url = with_database(own_server.url, "waiting_settles")
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.waiting_settles
    options = {"stale_after": 2.0}
    app = producer(url)
    # Two seconds each: time to set the fail point once both are claimed, before the first task ends and settles.
    ids = [send(app, "sleep", 2) for _ in range(2)]
    worker = start_worker(url, tmp_path, "w0", concurrency=1, options=options)  # one claim takes both
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "running"}) == 2,
             message="both jobs claimed")  # fmt: skip
    # From now on every update waits eight seconds on the server: the first task's settle is in flight until after
    # the kill (the second task ends two seconds into it), the second one's waits in the worker (its main process's
    # relay).
    slow = {"failCommands": ["update"], "blockConnection": True, "blockTimeMS": 8000}
    client.admin.command("configureFailPoint", "failCommand", mode="alwaysOn", data=slow)
    try:
        wait_for(lambda: db.runs.count_documents({"taskId": {"$in": ids}, "phase": "end"}) == 2,
                 message="both tasks finished")  # fmt: skip
        unsettled = db.jobs.count_documents({"taskId": {"$in": ids}, "status": "running"})
        worker.kill()
    finally:
        client.admin.command("configureFailPoint", "failCommand", mode="off")
    assert unsettled == 2, "the settles did not wait"
    start_worker(url, tmp_path, "w1", concurrency=1, options=options)
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == 2,
             timeout=90, message="each job settled or run again")  # fmt: skip
    starts = Counter(d["taskId"] for d in db.runs.find({"taskId": {"$in": ids}, "phase": "start"}))
    attempts = {d["taskId"]: d["attempts"] for d in db.jobs.find({"taskId": {"$in": ids}})}
    # The settle the server had when the worker died may land; the one still waiting in the worker is lost, and
    # the stale sweep runs its job again: once more, never left running.
    assert starts == attempts, (starts, attempts)
    assert attempts[ids[1]] == 2 and attempts[ids[0]] in (1, 2), attempts


def test_a_prefork_workers_main_process_writes_the_settles_of_both_pool_processes_together(
    own_server, tmp_path: Path
) -> None:
    url = with_database(own_server.url, "relayed")
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.relayed
    log = tmp_path / "settles.log"
    app = producer(url)
    ids = [send(app, "sleep", 0) for _ in range(TASKS)]
    # Each settle write held half a second: the tasks that end meanwhile, even on a machine too loaded to run one in
    # 100 ms (25 writes for 40 tasks at 100 ms, load 45), wait for the next write together.
    fail_point(client, 200, failCommands=["update"], blockConnection=True, blockTimeMS=500)
    worker = start_worker(url, tmp_path, "w0", concurrency=2, env={"BB_TEST_SETTLE_LOG": str(log)})
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": ids}, "status": "succeeded"}) == TASKS,
             timeout=120, message="the tasks succeeded")  # fmt: skip
    client.admin.command("configureFailPoint", "failCommand", mode="off")
    writes = settle_writes(log)
    assert worker.process is not None
    assert {pid for pid, _ in writes} == {worker.process.pid}  # the pool processes sent none themselves
    assert sum(len(jobs) for _, jobs in writes) == TASKS and len(writes) < TASKS / 2, writes
    task_of = {doc["_id"]: doc["taskId"] for doc in db.jobs.find({"taskId": {"$in": ids}}, {"taskId": 1})}
    ran_in = {doc["taskId"]: doc["pid"] for doc in db.runs.find({"taskId": {"$in": ids}, "phase": "end"})}
    pool = set(ran_in.values())
    assert len(pool) == 2 and worker.process.pid not in pool
    assert any({ran_in[task_of[job]] for job in jobs} == pool for _, jobs in writes), "no write carried both"


def test_a_pool_process_killed_with_its_settles_waiting_loses_none_of_them(own_server, tmp_path: Path) -> None:
    url = with_database(own_server.url, "pool_killed")
    client = MongoClient(own_server.url, tz_aware=True)
    db = client.pool_killed
    app = producer(url)
    done = [send(app, "sleep", 2) for _ in range(2)]  # two seconds: time to set the fail point once the first starts
    running = send(app, "sleep", 2)
    start_worker(url, tmp_path, "w0", concurrency=1)
    wait_for(lambda: db.runs.count_documents({"taskId": {"$in": done}, "phase": "start"}) >= 1,
             message="the first task started")  # fmt: skip
    # From now on every update waits six seconds on the server: the first settle is in flight until after the third
    # task starts (two seconds into it), the second waits.
    slow = {"failCommands": ["update"], "blockConnection": True, "blockTimeMS": 6000}
    client.admin.command("configureFailPoint", "failCommand", mode="alwaysOn", data=slow)
    try:
        # The third task started: the pool process has handed over both settles before it took it.
        third = wait_for(lambda: db.runs.find_one({"taskId": running, "phase": "start"}), message="the third task")
        unsettled = db.jobs.count_documents({"taskId": {"$in": done}, "status": "running"})
        os.kill(third["pid"], signal.SIGKILL)
    finally:
        client.admin.command("configureFailPoint", "failCommand", mode="off")
    assert unsettled == 2, "the settles did not wait"
    wait_for(lambda: db.jobs.count_documents({"taskId": {"$in": [*done, running]}, "status": "succeeded"}) == 3,
             timeout=90, message="every job succeeded")  # fmt: skip
    starts = Counter(d["taskId"] for d in db.runs.find({"taskId": {"$in": done}, "phase": "start"}))
    attempts = {d["taskId"]: d["attempts"] for d in db.jobs.find({"taskId": {"$in": done}})}
    # Both settles were in the main process's hands: each finished task ran once, none again.
    assert starts == {task: 1 for task in done} and attempts == {task: 1 for task in done}, (starts, attempts)
