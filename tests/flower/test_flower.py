"""Flower 2 against bbmongo://: real Flower, real workers, Flower's HTTP API, its Broker tab, and a real browser."""

from __future__ import annotations

import base64
import html
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from pymongo import MongoClient
from pymongo.database import Database
from pymongo.errors import OperationFailure, ServerSelectionTimeoutError

from bb_broker.connection import parse_broker_url, redact_url
from bb_broker.contrib.flower import health
from tests.support.flower_process import FLOWER, FLOWERS_ACTIONS, FlowerProcess, broker_rows
from tests.support.servers import AUTH_PASSWORD, free_port, with_database
from tests.support.workers import ARTIFACTS, ROOT, job, send, settled, wait_for

#: The installed Flower's (major, minor): its own pages differ before 2.2 where the tests below say.

HOST = socket.gethostname()


@pytest.fixture
def flower_launcher() -> str:
    """This module's Flower is `celery flower`, as Flower's own users start it."""
    return "celery"


def node(worker: Any) -> str:
    return f"{worker.name}@{HOST}"


def ids(tasks: list[dict[str, Any]] | None) -> set[str]:
    return {t["id"] for t in tasks or []}


def answered(info: dict[str, Any]) -> bool:
    """Flower has every answer of its inspect broadcast (each command's replies arrive on their own)."""
    return {"stats", "registered", "active_queues", "conf"} <= set(info)


def events_flowing(flower: FlowerProcess, name: str) -> None:
    """Wait until Flower has an event from the worker: its event queue is bound and the worker publishes to it."""
    wait_for(lambda: flower.get("/api/workers?status=1").get(name), message=f"Flower receiving {name}'s events")


def task_in(flower: FlowerProcess, task_id: str, state: str) -> Callable[[], Any]:
    return lambda: (info := flower.task(task_id)).get("state") == state and info


# --- workers: broadcast and replies ---------------------------------------------------------------------------


def test_every_worker_answers_flowers_inspect(app, db, broker_url, worker_factory, flower_factory) -> None:
    busy = worker_factory(concurrency=1)
    other = worker_factory()
    flower = flower_factory(inspect_timeout_ms=3000)

    # Flower's first inspect is a broadcast without a destination: both workers' replies reach it.
    workers = wait_for(
        lambda: (w := flower.get("/api/workers")) and all(answered(w.get(node(x), {})) for x in (busy, other)) and w,
        message="both workers in Flower",
    )
    for worker in (busy, other):
        info = workers[node(worker)]
        assert info["stats"]["pid"] == worker.process.pid
        assert info["stats"]["broker"]["transport"] == "bbmongo"
        # the worker page's Broker section: the host and port the server listens on, the database as virtual host
        hosts, database = broker_url.split("://", 1)[1].split("/", 1)
        shown = info["stats"]["broker"]
        assert (shown["hostname"], str(shown["port"]), shown["virtual_host"]) == (*hosts.rsplit(":", 1), database)
        assert "tests.support.e2e_app.add" in info["registered"]
        assert [q["name"] for q in info["active_queues"]] == ["celery"]
        assert info["conf"]["broker_url"] == redact_url(broker_url)  # as Celery shows it: password masked

    other.kill()  # the rest is about the busy one
    running = send(app, "sleep", 60)
    wait_for(lambda: db.runs.find_one({"taskId": running}), message="sleep started")
    waiting = send(app, "sleep", 60)
    delayed = send(app, "add", 1, 2, countdown=120)

    # Its only process is busy and the next job waits in it, as Celery's prefetch allows: it still answers.
    wait_for(lambda: job(db, waiting).get("status") == "running", message="the next job prefetched")
    info = flower.worker(node(busy))
    assert ids(info["active"]) == {running} and ids(info["reserved"]) == {waiting}
    assert info["active"][0]["worker_pid"] in info["stats"]["pool"]["processes"]
    # An ETA task waits in MongoDB until it is due, not in a worker's memory: nothing is scheduled there.
    assert info["scheduled"] == [] and job(db, delayed)["status"] == "queued"
    # Busy as it is, it obeys a terminate, and the waiting job gets the freed process.
    flower.post(f"/api/task/revoke/{running}", terminate="true")
    wait_for(settled(db, running, "failed"), message="the running sleep terminated")
    wait_for(lambda: db.runs.find_one({"taskId": waiting}), message="the waiting sleep started")


def cpu_seconds(pid: int) -> float:
    """CPU time the process itself (not its children) has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_saturated_worker_waits_for_a_free_process_without_spinning(app, db, worker_factory) -> None:
    # No safety poll for an hour: the backlog runs once the process is free only if the worker notices that itself.
    worker = worker_factory(concurrency=1, options={"safety_poll_interval": 3600})
    busy = send(app, "sleep", 3)
    wait_for(lambda: db.runs.find_one({"taskId": busy}), message="sleep started")
    backlog = [send(app, "add", i, i) for i in range(3)]  # news it cannot take while its process is busy
    before = cpu_seconds(worker.process.pid)
    wait_for(lambda: db.runs.find_one({"taskId": busy, "phase": "end"}), message="sleep ended")
    assert cpu_seconds(worker.process.pid) - before < 1.0  # a busy loop would burn most of the three seconds
    for task_id in backlog:  # the freed process is noticed without an ack, or a safety poll an hour later
        wait_for(settled(db, task_id, "succeeded"), message="backlog ran")


# --- tasks: states through events ---------------------------------------------------------------------------


def test_task_states_and_details_arrive_through_events(app, db, worker_factory, flower_factory) -> None:
    worker = worker_factory(extra_args=("-E",))
    flower = flower_factory()
    events_flowing(flower, node(worker))

    ok = send(app, "add", 2, 3)
    doomed = send(app, "always_fails")
    retried = send(app, "retry_self", 0.3)

    done = wait_for(task_in(flower, ok, "SUCCESS"), message="add SUCCESS in Flower")
    assert done["args"] == "(2, 3)" and done["result"] == "5" and done["worker"] == node(worker)
    assert done["received"] and done["started"] and done["succeeded"]

    # The broker retries it (three attempts) as Celery retries: Flower shows RETRY between them, FAILURE at the end.
    wait_for(settled(db, doomed, "failed"), message="always_fails failed")
    last_run = db.runs.find_one({"taskId": doomed, "attempt": 3})["at"]
    info = wait_for(
        lambda: (i := flower.task(doomed)).get("state") == "FAILURE" and i["failed"] >= last_run and i,
        message="the last failure in Flower",
    )
    assert info["exception"] == "ValueError('always fails')" and "always fails" in info["traceback"]
    assert info["retried"] and info["retries"] == 2  # two task-retried events, no task-failed before the last

    # Celery's own retries: task-retried events, then the final failure after max_retries=2.
    wait_for(settled(db, retried, "failed"), message="retry_self gave up")
    info = wait_for(
        lambda: (i := flower.task(retried)).get("state") == "FAILURE" and i.get("retries") == 2 and i,
        message="retry_self's last run in Flower",
    )
    assert info["retried"] and "not yet" in info["exception"]

    # A live state: the task executing now.
    running = send(app, "sleep", 60)
    assert wait_for(task_in(flower, running, "STARTED"), message="STARTED")["args"] == "(60,)"

    listed = flower.get("/api/tasks")
    assert {ok, doomed, retried, running} <= set(listed) and all(listed[t]["received"] for t in listed)
    assert {t["uuid"] for t in flower.get("/api/tasks?state=FAILURE").values()} == {doomed, retried}

    # Flower's task page shows the arguments, the result and the exception.
    page = flower.page(f"/task/{ok}")
    shown = "<code>{}</code>" if FLOWER >= (2, 1) else "<td>{}</td>"  # Flower 2.0's table cells have no <code>
    assert shown.format("(2, 3)") in page and shown.format("5") in page
    assert "ValueError('always fails')" in html.unescape(flower.page(f"/task/{doomed}"))


# --- control from Flower ------------------------------------------------------------------------------------


def test_revoke_and_terminate_from_flower(app, db, worker_factory, flower_factory) -> None:
    worker = worker_factory(extra_args=("-E",))
    flower = flower_factory()
    events_flowing(flower, node(worker))

    # Queued until the revoke comes, however late: Flower 2.1 runs it in its thread pool (six threads on two cores)
    # behind its first inspection of every worker, eight broadcasts each as long as the inspect timeout (10 s here).
    waiting = send(app, "add", 1, 2, countdown=600)
    answer = flower.post(f"/api/task/revoke/{waiting}")
    assert answer == {"message": f"Revoked '{waiting}'"}
    # Failed at once, by Flower's own process (the transport) as the broadcast went out, even in a Flower started
    # without bb_broker.contrib.flower: no worker ever receives the job, so Flower's Tasks tab, which learns from
    # workers' events, never lists it (the Jobs tab does).
    revoked = job(db, waiting)
    assert revoked["status"] == "failed" and revoked["lastError"] == "revoked before it ran"

    running = send(app, "sleep", 60)
    wait_for(lambda: db.runs.find_one({"taskId": running}), message="sleep started")
    wait_for(task_in(flower, running, "STARTED"), message="STARTED in Flower")
    assert flower.post(f"/api/task/revoke/{running}", terminate="true") == {"message": f"Revoked '{running}'"}
    terminated = wait_for(settled(db, running, "failed"), message="terminated")
    assert terminated["lastError"] == "revoked: terminated by signal 15"
    wait_for(task_in(flower, running, "REVOKED"), message="REVOKED after terminate in Flower")

    # A refresh asked while Flower 2.1 still inspects every worker gets that inspection's answers, older than the ask.
    wait_for(
        lambda: (i := flower.worker(node(worker))) and not i["active"] and {waiting, running} <= set(i["revoked"]),
        message="nothing active, and the worker heard both revokes",
    )
    assert db.runs.count_documents({"taskId": waiting}) == 0


def test_queues_pool_and_rate_limit_from_flower(app, db, worker_factory, flower_factory) -> None:
    worker = worker_factory(extra_args=("-E",))
    name = node(worker)
    flower = flower_factory()
    assert answered(flower.worker(name))  # Flower controls only the workers it has inspected

    # Queues: consuming one more runs its jobs; cancelling it leaves them queued in MongoDB.
    answer = flower.post(f"/api/worker/queue/add-consumer/{name}", queue="reports")
    assert answer == {"message": "add consumer reports"}

    # The worker answers a control before its loop acts on it (Celery's add_consumer and cancel_consumer call soon):
    # Flower's next inspect may come first on a loaded machine.
    def consumed() -> set[str]:
        return {q["name"] for q in flower.worker(name)["active_queues"]}

    wait_for(lambda: consumed() == {"celery", "reports"}, message="the worker consumes reports, as Flower shows it")
    report = send(app, "add", 3, 3, queue="reports")
    assert wait_for(settled(db, report, "succeeded"), message="reports job ran")["queue"] == "reports"

    answer = flower.post(f"/api/worker/queue/cancel-consumer/{name}", queue="reports")
    assert answer == {"message": "no longer consuming from reports"}
    wait_for(lambda: consumed() == {"celery"}, message="the worker no longer consumes reports, as Flower shows it")
    parked = send(app, "add", 4, 4, queue="reports")
    after = send(app, "add", 5, 5)
    wait_for(settled(db, after, "succeeded"), message="a celery job sent after it ran")
    assert job(db, parked)["status"] == "queued" and job(db, parked)["attempts"] == 0

    # Pool grow and shrink: the worker's real process count, as its stats report it.
    assert len(flower.worker(name)["stats"]["pool"]["processes"]) == 2
    assert flower.post(f"/api/worker/pool/grow/{name}", n=1) == {"message": f"Growing '{name}' worker's pool by 1"}
    wait_for(lambda: len(flower.worker(name)["stats"]["pool"]["processes"]) == 3, message="three processes")
    assert flower.post(f"/api/worker/pool/shrink/{name}", n=1) == {"message": f"Shrinking '{name}' worker's pool by 1"}
    wait_for(lambda: len(flower.worker(name)["stats"]["pool"]["processes"]) == 2, message="two processes")

    # Rate limit: Flower's answer, the worker's registry, and the worker holding back the second run.
    events_flowing(flower, name)
    answer = flower.post("/api/task/rate-limit/tests.support.e2e_app.add", ratelimit="1/m", workername=name)
    assert answer == {"message": "new rate limit set successfully"}
    # Flower answers from its last inspect, which a loaded machine may have cut short: wait for a fresh one.
    wait_for(lambda: "tests.support.e2e_app.add [rate_limit=1/m]" in flower.worker(name)["registered"],
             message="the worker's registry shows the rate limit")  # fmt: skip
    pair = [send(app, "add", 1, 1), send(app, "add", 2, 2)]
    ran = wait_for(lambda: db.jobs.find_one({"taskId": {"$in": pair}, "status": "succeeded"}), message="one add ran")
    other = next(task_id for task_id in pair if task_id != ran["taskId"])  # sent together: either may go first
    held = wait_for(task_in(flower, other, "RECEIVED"), message="the other add received, held by the rate limit")
    assert held["started"] is None and job(db, other)["status"] == "running"  # claimed, waiting for its token
    assert db.runs.count_documents({"taskId": other}) == 0


def handler_of(path: str) -> type:
    """The class of Flower's URL table that serves `path` (the first pattern matching, as Tornado picks)."""
    import flower.urls

    import bb_broker.contrib.flower  # noqa: F401  (its handlers and guard, as in the Flower process)

    for spec in flower.urls.handlers:
        pattern, handler = (spec[0], spec[1]) if isinstance(spec, tuple) else (spec.regex.pattern, spec.handler_class)
        if re.fullmatch(pattern.rstrip("$"), path.split("?")[0]):
            return handler
    raise AssertionError(f"no handler for {path}")


def test_a_read_only_user_can_use_none_of_flowers_actions(app, db, worker_factory, flower_factory) -> None:
    worker = worker_factory(extra_args=("-E",))
    name = node(worker)
    flower = flower_factory(launcher="bb-broker", basic_auth="admin:s3cret,viewer:peek",
                            extra_args=("--jobs_admins=admin",))  # fmt: skip
    before = flower.worker(name)  # Flower controls only the workers it has inspected
    processes = len(before["stats"]["pool"]["processes"])
    waiting = send(app, "add", 1, 2, countdown=600)
    jobs = db.jobs.count_documents({})
    task = "tests.support.e2e_app.add"
    calls = [
        (f"/api/task/revoke/{waiting}", {}),
        (f"/api/task/revoke/{waiting}", {"terminate": "true"}),
        (f"/api/task/abort/{waiting}", {}),
        (f"/api/task/rate-limit/{task}", {"ratelimit": "1/m", "workername": name}),
        (f"/api/task/timeout/{task}", {"soft": "10", "hard": "20", "workername": name}),
        (f"/api/task/apply/{task}", {}),
        (f"/api/task/async-apply/{task}", {}),
        (f"/api/task/send-task/{task}", {}),
        (f"/api/worker/queue/add-consumer/{name}", {"queue": "reports"}),
        (f"/api/worker/queue/cancel-consumer/{name}", {"queue": "celery"}),
        (f"/api/worker/pool/grow/{name}", {"n": "1"}),
        (f"/api/worker/pool/shrink/{name}", {"n": "1"}),
        (f"/api/worker/pool/autoscale/{name}", {"min": "1", "max": "3"}),
        (f"/api/worker/pool/restart/{name}", {}),
        (f"/api/worker/shutdown/{name}", {}),
    ]
    # Every endpoint of Flower's that acts is here (tests/unit/test_upstream_flower.py keeps that list in step with
    # Flower's).
    assert {handler_of(path).__name__ for path, _ in calls} == FLOWERS_ACTIONS
    refused = "viewer may look but not act: only --jobs_admins may use Flower's actions"
    for path, form in calls:
        assert flower.request("POST", path, form, user="viewer:peek") == (403, refused), path

    # Nothing changed: the job still queued, the worker alive with its queue, its pool, no limits, no new job.
    after = flower.worker(name)
    assert worker.process.poll() is None and [q["name"] for q in after["active_queues"]] == ["celery"]
    assert len(after["stats"]["pool"]["processes"]) == processes and after["stats"]["pid"] == before["stats"]["pid"]
    assert task in after["registered"]  # as registered: no rate_limit or time limits added to its entry
    assert job(db, waiting)["status"] == "queued" and "actions" not in job(db, waiting)
    assert db.jobs.count_documents({}) == jobs
    assert flower.request("GET", "/api/workers", user="viewer:peek")[0] == 200  # reading is still theirs


def test_an_admins_revoke_through_flower_is_recorded_with_their_name(app, db, worker_factory, flower_factory) -> None:
    worker_factory(extra_args=("-E",))
    flower = flower_factory(launcher="bb-broker", basic_auth="admin:s3cret,viewer:peek",
                            extra_args=("--jobs_admins=admin",))  # fmt: skip
    waiting = send(app, "add", 1, 2, countdown=600)
    assert flower.post(f"/api/task/revoke/{waiting}") == {"message": f"Revoked '{waiting}'"}
    revoked = job(db, waiting)
    assert (revoked["status"], revoked["lastError"]) == ("failed", "revoked before it ran")
    assert [(a["action"], a["by"]) for a in revoked["actions"]] == [("revoke", "admin")]
    running = send(app, "sleep", 60)
    wait_for(lambda: db.runs.find_one({"taskId": running}), message="sleep started")
    assert flower.post(f"/api/task/revoke/{running}", terminate="true") == {"message": f"Revoked '{running}'"}
    terminated = wait_for(settled(db, running, "failed"), message="terminated")
    assert terminated["lastError"] == "revoked: terminated by signal 15"
    assert [(a["action"], a["by"], a.get("terminate")) for a in terminated["actions"]] == [("revoke", "admin", True)]


# --- the Broker tab -----------------------------------------------------------------------------------------


# Flower's internals the Broker tab and the banner rely on: tests/unit/test_upstream_flower.py.


def test_the_factory_answers_bbmongo_with_job_queues(broker_url: str) -> None:
    from flower.utils import broker as flower_broker

    from bb_broker.contrib.flower.broker import JobQueues

    made = flower_broker.Broker(broker_url, http_api=None, broker_options={"jobs_collection": "tasks"})
    assert isinstance(made, JobQueues) and made.store.coll.name == "tasks"
    srv = flower_broker.Broker(broker_url.replace("bbmongo://", "BBMONGO://"), http_api=None, broker_options={})
    assert isinstance(srv, JobQueues)


def test_queue_depths_count_per_queue_through_an_index(db: Database) -> None:
    from bb_broker.jobs.store import JobStore
    from bb_broker.ops.operations import Operations

    store = Operations(JobStore(db))
    store.store.ensure_indexes()
    rows = [("celery", "queued")] * 3 + [("celery", "running")] * 2 + [("celery", "failed"), ("celery", "succeeded")]
    rows += [("reports", "queued"), ("reports", "failed"), ("other", "queued")]
    db.jobs.insert_many([{"_id": str(i), "queue": q, "status": s} for i, (q, s) in enumerate(rows)])
    assert store.queue_depths(["celery", "reports", "empty"]) == {
        "celery": {"queued": 3, "running": 2, "failed": 1},
        "reports": {"queued": 1, "running": 0, "failed": 1},
        "empty": {"queued": 0, "running": 0, "failed": 0},
    }
    pipeline = [
        {"$match": {"status": {"$in": ["queued", "running", "failed"]}, "queue": {"$in": ["celery"]}}},
        {"$group": {"_id": {"queue": "$queue", "status": "$status"}, "n": {"$sum": 1}}},
    ]
    plan = str(db.command("explain", {"aggregate": "jobs", "pipeline": pipeline, "cursor": {}, "hint": "bb_claim"}))
    assert "IXSCAN" in plan and "COLLSCAN" not in plan, plan


def test_broker_tab_shows_each_queues_depth(app, db, tmp_path, worker_factory, flower_factory) -> None:
    worker = worker_factory(concurrency=1, options={"max_attempts": 1}, extra_args=("-Q", "celery,reports"))
    # One failed job in each queue, then one sleep running.
    for queue in ("celery", "reports"):
        wait_for(settled(db, send(app, "always_fails", queue=queue), "failed"), message=f"a failure in {queue}")
    running = send(app, "sleep", 60)
    wait_for(lambda: db.runs.find_one({"taskId": running}), message="sleep started")
    # Its only process is busy: one of these waits in the worker (Celery's prefetch), the rest stay queued.
    for queue, count in (("celery", 3), ("reports", 3)):
        for i in range(count):
            send(app, "add", i, i, queue=queue)
    wait_for(lambda: db.jobs.count_documents({"status": "running"}) == 2, message="the next job prefetched")

    def in_queue(queue: str, status: str) -> int:
        return db.jobs.count_documents({"queue": queue, "status": status})

    expected = {
        queue: dict(
            messages=in_queue(queue, "queued") + in_queue(queue, "running"),
            messages_ready=in_queue(queue, "queued"),
            messages_unacknowledged=in_queue(queue, "running"),
            queued=in_queue(queue, "queued"),
            running=in_queue(queue, "running"),
            failed=1,
            paused=False,
        )
        for queue in ("celery", "reports")
    }
    assert sum(row["queued"] for row in expected.values()) == 5
    config = tmp_path / "flowerconfig.py"
    config.write_text("import bb_broker.contrib.flower  # noqa: F401  (Flower's Broker tab for bbmongo://)\n")
    # The two documented ways: the bb-broker command, and Flower's own config file.
    for flower in (flower_factory(launcher="bb-broker"), flower_factory(extra_args=(f"--conf={config}",))):
        flower.worker(node(worker))  # Flower lists the queues its workers consume
        lengths = wait_for(
            lambda flower=flower: (q := flower.get("/api/queues/length")["active_queues"]) and len(q) == 2 and q,
            message="two queues",
        )
        assert {row.pop("name"): row for row in lengths} == expected
        # Messages, Unacked, Ready, Consumers, Idle since: the columns of Flower's table.
        page = flower.page("/broker")
        assert "not supported" not in page
        unknown = "—" if FLOWER >= (2, 2) else "N/A"  # what Flower's own columns show for no value
        assert broker_rows(page) == {  # the last column: paused or not
            queue: [queue, str(row["messages"]), str(row["running"]), str(row["queued"]), unknown, unknown, "—"]
            for queue, row in expected.items()
        }


# --- a real browser -----------------------------------------------------------------------------------------

SCREEN = {"width": 1400, "height": 900}


def screenshot(page: Page, name: str) -> None:
    """A PNG of the page as it is now in test-artifacts/, checked to be one."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    path.unlink(missing_ok=True)
    page.screenshot(path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000, path


def test_tasks_page_in_headless_chromium(app, db, worker_factory, flower_factory, browser) -> None:
    worker = worker_factory(extra_args=("-E",))
    flower = flower_factory(launcher="bb-broker")
    events_flowing(flower, node(worker))
    tasks = [send(app, "add", 20, 22), send(app, "add", 1, 1), send(app, "always_fails")]
    for task_id, state in zip(tasks, ["SUCCESS", "SUCCESS", "FAILURE"], strict=True):
        wait_for(task_in(flower, task_id, state), message=f"{task_id} {state} in Flower")
    wait_for(settled(db, tasks[2], "failed"), message="always_fails out of attempts")
    for _ in range(2):
        send(app, "add", 0, 0, countdown=600)  # queued in MongoDB: depth on the Broker tab

    # The Tasks page fills its table from /tasks/datatable by script: each check waits for the script's rows.
    page = browser.new_page(viewport=SCREEN)
    page.goto(f"{flower.url}/tasks")
    for text in (*tasks, "tests.support.e2e_app.add", "tests.support.e2e_app.always_fails"):
        expect(page.locator("body")).to_contain_text(text)
    screenshot(page, "flower-tasks.png")
    page.goto(f"{flower.url}/broker")
    celery_cells = page.locator('tr[id="celery"] td')
    for cell, text in enumerate(["celery", "2", "0", "2"]):
        expect(celery_cells.nth(cell)).to_have_text(text)
    screenshot(page, "flower-broker.png")


# --- authentication -----------------------------------------------------------------------------------------


def flower_env(**extra: str) -> dict[str, str]:
    """This environment without any FLOWER_* setting, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}, "PYTHONPATH": str(ROOT), **extra}


def bb_broker_flower(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "bb_broker.cli", "flower", "-A", "tests.support.e2e_app", *args]
    return subprocess.run(argv, cwd=cwd, env=flower_env(**env), capture_output=True, text=True, timeout=60)


def test_bb_broker_flower_refuses_to_start_without_authentication(broker_url: str, tmp_path: Path) -> None:
    port = free_port()
    refused = bb_broker_flower("--address=127.0.0.1", f"--port={port}", cwd=tmp_path, BB_BROKER_URL=broker_url)
    assert refused.returncode == 2, refused.stderr
    message = refused.stderr.strip()
    assert len(message.splitlines()) == 1 and "refusing to serve Flower without authentication" in message
    assert "--basic-auth=USER:PASSWORD" in message and "FLOWER_BASIC_AUTH" in message and "--no-auth" in message
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "nothing may listen"
    # --no-auth says the opposite of a configured authentication: refused as well.
    both = bb_broker_flower("--no-auth", cwd=tmp_path, BB_BROKER_URL=broker_url, FLOWER_BASIC_AUTH="ops:pw")
    assert both.returncode == 2 and "--no-auth contradicts the basic authentication" in both.stderr


@pytest.mark.parametrize(
    "login",
    [
        "--basic-auth=",
        "--basic-auth=:",
        "--basic-auth=,",
        "--basic-auth=ops:",
        "--basic-auth=:pw",
        "--basic-auth=ops:pw,",
    ],
)
def test_a_basic_auth_with_an_empty_login_is_refused_not_served_to_anyone(
    login: str, broker_url: str, tmp_path: Path
) -> None:
    # `--basic-auth=$CREDS` with CREDS unset: Flower let in a request whose Authorization header decoded to nothing.
    port = free_port()
    refused = bb_broker_flower("--address=127.0.0.1", f"--port={port}", login, cwd=tmp_path, BB_BROKER_URL=broker_url)
    assert refused.returncode == 2, refused.stderr
    assert "no USER:PASSWORD with both parts given" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "nothing may listen"


@pytest.mark.parametrize("port", ["-1", "0", "65536", "99999"])
def test_a_flower_port_that_is_no_port_is_refused_in_one_line(port: str, broker_url: str, tmp_path: Path) -> None:
    refused = bb_broker_flower(f"--port={port}", "--no-auth", cwd=tmp_path, BB_BROKER_URL=broker_url)
    assert refused.returncode == 2, refused.stderr
    assert (
        refused.stderr.strip().splitlines()[-1]
        == f"bb-broker: flower: --port {port} is no port: give one from 1 to 65535"
    )
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    ("args", "env", "config", "expected"),
    [
        ((), {}, None, None),
        (("--basic-auth=ops:pw",), {}, None, "basic"),
        ((), {"FLOWER_BASIC_AUTH": "ops:pw"}, None, "basic"),
        ((), {}, "basic_auth = ['ops:pw']\n", "basic"),
        (("--auth=.*@example\\.com", "--auth_provider=flower.views.auth.GithubLoginHandler"), {}, None, "oauth"),
        ((), {"FLOWER_AUTH": ".*@example\\.com"}, None, "oauth"),
        ((), {}, "auth = '.*@example\\\\.com'\n", "oauth"),
    ],
)
def test_authentication_is_read_as_flower_reads_it(args, env, config, expected, tmp_path: Path) -> None:
    if config is not None:
        (tmp_path / "flowerconfig.py").write_text(config)  # the file Flower reads from its working directory
    script = (
        "import sys; from bb_broker.contrib.flower.broker import authentication; print(authentication(sys.argv[1:]))"
    )
    found = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=tmp_path, env=flower_env(**env), capture_output=True, text=True
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(expected)


def test_flower_with_basic_auth_asks_every_page_and_api_call_for_the_credentials(app, flower_factory) -> None:
    flower = flower_factory(launcher="bb-broker", basic_auth="ops:s3cret")
    assert "FLOWER_UNAUTHENTICATED_API" not in flower.env  # the credentials open the API, not this variable
    for path in ("/", "/tasks", "/broker", "/api/workers", "/api/tasks"):
        assert flower.request("GET", path, credentials=False)[0] == 401, path
        assert flower.request("GET", path)[0] == 200, path
    task_id = send(app, "add", 1, 2, countdown=600)
    assert flower.request("POST", f"/api/task/revoke/{task_id}", credentials=False)[0] == 401
    # What Flower's Revoke button sends, with the browser's credentials: it works without FLOWER_UNAUTHENTICATED_API.
    assert flower.post(f"/api/task/revoke/{task_id}") == {"message": f"Revoked '{task_id}'"}
    assert flower.request("GET", "/healthcheck")[0] == 200


def test_flower_with_no_auth_serves_pages_says_so_and_keeps_its_api_closed(flower_factory) -> None:
    flower = flower_factory(launcher="bb-broker", env={"FLOWER_UNAUTHENTICATED_API": "false"})
    assert flower.request("GET", "/workers")[0] == 200
    status, body = flower.request("GET", "/api/workers")
    assert status == 401 and "FLOWER_UNAUTHENTICATED_API" in body
    note = wait_for(lambda: "WITHOUT authentication" in flower.log() and flower.log(), message="the --no-auth note")
    assert "FLOWER_UNAUTHENTICATED_API=true" in note and "--basic-auth=USER:PASSWORD" in note


def test_the_demos_flower_starts_with_the_credentials_the_demo_prints(broker_url: str, tmp_path: Path) -> None:
    from celery_app.demo import flower_command

    port = free_port()
    env = flower_env(BB_BROKER_URL=broker_url, FLOWER_BASIC_AUTH="demo:pw-the-demo-printed")
    log = tmp_path / "demo-flower.log"
    with log.open("wb") as out:
        demo_flower = subprocess.Popen(
            flower_command("127.0.0.1", port), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}/workers"

        def status(credentials: str | None) -> int | None:
            headers = (
                {"Authorization": "Basic " + base64.b64encode(credentials.encode()).decode()} if credentials else {}
            )
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code
            except OSError:
                return None

        wait_for(lambda: demo_flower.poll() is not None or status(None), 90, "the demo's Flower answering")
        assert demo_flower.poll() is None, log.read_text()[-3000:]
        assert status(None) == 401 and status("demo:pw-the-demo-printed") == 200
    finally:
        demo_flower.terminate()
        demo_flower.wait(30)


# --- a broker Flower cannot use ---------------------------------------------------------------------------


def test_a_wrong_broker_password_is_shown_on_flowers_pages_until_it_works(auth_server, tmp_path: Path, browser) -> None:
    wrong = with_database(f"mongodb://bb:wrong-pw-123@127.0.0.1:{auth_server.port}/?authSource=admin", "flowerdb")
    flower = FlowerProcess(wrong, log_dir=tmp_path, launcher="bb-broker")
    flower.start()
    try:
        expected = "authentication failed for user 'bb' on database 'admin'"
        # Flower's first ping of the broker starts with Flower; a page waits for its verdict only briefly.
        wait_for(lambda: expected in html.unescape(flower.page("/")), message="the broker's error on Flower's page")
        # Flower 2.0's Broker tab answers 500 while its broker fails, whatever the broker (its `queues` unbound).
        for path in ("/", "/workers", "/tasks", "/broker")[: None if FLOWER >= (2, 1) else 3]:
            page = html.unescape(flower.page(path))
            banner = re.search(r'id="bb-broker-error">([^<]*)', page)
            assert banner and expected in banner[1], f"{path}: {banner[1] if banner else 'no banner'}"
            assert f"bbmongo://bb:**@127.0.0.1:{auth_server.port}/flowerdb" in page, path
            assert "wrong-pw-123" not in page, path
        # The Workers table's refresh fails with the reason, so that its dot does not say "Updated".
        status, body = flower.request("GET", "/workers?json=1")
        assert status == 503 and "authentication failed for user 'bb'" in body and "wrong-pw-123" not in body

        # In a real browser, once the page's scripts ran: the banner, and the red dot.
        page = browser.new_page(viewport=SCREEN)
        page.goto(f"{flower.url}/workers")
        expect(page.locator("#bb-broker-error")).to_contain_text(expected)
        if FLOWER >= (2, 1):  # Flower 2.0's page ignores a failed refresh (it says so as it starts)
            expect(page.locator("#workers-refresh-status")).to_have_text("Update failed")
            expect(page.locator("#workers-live-indicator")).to_have_class(re.compile(r"\bstatus-dot-error\b"))
        page.goto(f"{flower.url}/")
        expect(page.locator("#bb-broker-error")).to_contain_text(expected)
        screenshot(page, "flower-broker-error.png")

        # The password becomes right (the server's side changes): the banner goes, the table refreshes again.
        with MongoClient(f"mongodb://bb:{AUTH_PASSWORD}@127.0.0.1:{auth_server.port}/?authSource=admin") as admin:
            admin.admin.command("updateUser", "bb", pwd="wrong-pw-123")
        wait_for(lambda: "bb-broker-error" not in flower.page("/workers"), message="the banner gone")
        assert flower.request("GET", "/workers?json=1")[0] == 200
        page.goto(f"{flower.url}/workers")
        if FLOWER >= (2, 1):  # Flower 2.0's Workers page has no refresh status
            expect(page.locator("#workers-refresh-status")).to_have_text(re.compile(r"^Updated "))
        expect(page.locator(".status-dot-error")).to_have_count(0)
        assert "wrong-pw-123" not in flower.log()
    finally:
        flower.stop()


def test_a_broker_nobody_answers_is_named_in_words(tmp_path: Path) -> None:
    from bb_broker.contrib.flower.health import BrokerHealth

    port = free_port()  # nothing listens there
    health = BrokerHealth(f"bbmongo://bb:pw-xyz@127.0.0.1:{port}/db?serverSelectionTimeoutMS=300")
    problem = health.check()
    assert problem is not None and problem.startswith(f"no server answered: 127.0.0.1:{port}")
    assert "pw-xyz" not in problem and "Topology" not in problem
    assert (
        health.banner() == f"Flower cannot use the broker bbmongo://bb:**@127.0.0.1:{port}/db?"
        f"serverSelectionTimeoutMS=300: {problem}. Workers, tasks and queues shown here may be missing or out of date."
    )


def test_a_refused_login_behind_a_server_selection_timeout_is_named(auth_server) -> None:
    # pymongo marks a server whose handshake refused the login unknown, with that refusal; a selection that then
    # times out on it (seen at a load of 100) must still read as the wrong password, not as a server that is down.
    target = parse_broker_url(f"bbmongo://bb:wrong-pw-123@127.0.0.1:{auth_server.port}/flowerdb?authSource=admin")
    with MongoClient(target.mongo_uri, serverSelectionTimeoutMS=2000) as client:
        with pytest.raises(OperationFailure):
            client.flowerdb.command("ping")
        timed_out = ServerSelectionTimeoutError("No servers found yet")
        shown = health.describe(health._refusal_behind(timed_out, client), target)
    assert shown == "authentication failed for user 'bb' on database 'admin'", shown
