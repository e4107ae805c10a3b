"""Flower in bad times, for real: the server stopped under a running Flower, one user's many slow requests, a
15 MB field in a job, a page of another site posting to a Flower without login, and where Flower listens."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from tests.support.flower_process import ADMIN, VIEWER, FlowerProcess
from tests.support.servers import AUTH_PASSWORD, EmbeddedServer, with_database
from tests.support.workers import wait_for


def publish(store: JobStore, task_id: str, *, queue: str = "celery") -> str:
    return store.publish(queue=queue, kind="app.add", task_id=task_id, payload={"args": [1, 2]}, priority=0,
                         run_after=None, is_retry=False)  # fmt: skip


def failed_job(store: JobStore, task_id: str, error: str = "ValueError: broke") -> str:
    job_id = publish(store, task_id)
    claimed = store.claim("celery", "worker-1")
    assert claimed is not None and claimed.id == job_id and store.fail(claimed.id, claimed.attempts, error)
    return job_id


def as_json(body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


# --- an outage ----------------------------------------------------------------------------------------------------

#: The Jobs tab's reads, each of which queries the server.
JOBS_READS = ("/api/jobs", "/api/jobs?counts=1", "/jobs/data", "/jobs/data?breakdowns=1", "/api/jobs/job?id={job}",
              "/api/jobs/bulk/retry?status=failed", "/jobs/bulk/delete/count?status=failed")  # fmt: skip
#: Flower's own pages, and the Jobs tab's page (its data comes from /jobs/data).
PAGES = ("/", "/workers", "/workers?json=1", "/tasks", "/jobs", "/healthcheck")


@pytest.mark.parametrize("used_before", [False, True], ids=["first-use-in-the-outage", "used-before"])
def test_flower_answers_at_once_while_its_server_is_down(
    auth_server: EmbeddedServer, tmp_path: Path, used_before: bool
) -> None:
    mongo_url = f"mongodb://bb:{AUTH_PASSWORD}@127.0.0.1:{auth_server.port}/?authSource=admin"
    url = with_database(mongo_url, "outage")
    with MongoClient(mongo_url, tz_aware=True) as client:
        job_id = failed_job(JobStore(client.outage, Policy(max_attempts=1)), "t-1")
    flower = FlowerProcess(url, log_dir=tmp_path, launcher="bb-broker")
    flower.start()
    reads = [path.format(job=job_id) for path in JOBS_READS]
    try:
        # Used before, the tab has read the server's clock; first used in the outage, it has not.
        for path in reads if used_before else ("/", "/workers"):
            assert flower.request("GET", path)[0] == 200, path
        auth_server.stop()

        # Requests in flight while the server is gone: none of them holds up the rest of Flower.
        slow: dict[str, tuple[int, str, float]] = {}

        def ask(path: str) -> None:
            started = time.monotonic()
            status, body = flower.request("GET", path, timeout=120)
            slow[path] = (status, body, time.monotonic() - started)

        # As many as one user may have running at a time (more are refused: see the next test).
        in_flight = [reads[0], reads[3], reads[4], reads[5]]
        threads = [threading.Thread(target=ask, args=(path,)) for path in in_flight]
        for thread in threads:
            thread.start()
        for _ in range(3):
            for path in PAGES:
                try:
                    status, _ = flower.request("GET", path, timeout=5)
                except TimeoutError:
                    raise AssertionError(f"{path} waited over 5 s for the Jobs tab's queries") from None
                assert status in (200, 503), path  # /workers?json=1 fails (red dot) while the broker does
        for thread in threads:
            thread.join(120)
        shown = f"bbmongo://bb:**@127.0.0.1:{auth_server.port}/outage?authSource=admin"  # the URL, password masked
        for path in in_flight:
            status, body, took = slow[path]
            assert status == 503 and took < 30, (path, status, took, body[:300])
            assert as_json(body)["error"].startswith(f"cannot reach the server at {shown}: "), (path, body)

        # From then on each answers at once, with the reason and no password, and the page shows the banner.
        for path in reads:
            try:
                status, body = flower.request("GET", path, timeout=5)
            except TimeoutError:
                raise AssertionError(f"{path} took over 5 s to say the server is down") from None
            error = as_json(body)["error"]
            assert status == 503 and error.startswith(f"cannot reach the server at {shown}: "), (path, body)
            assert AUTH_PASSWORD not in body, body
        page = flower.request("GET", "/jobs", timeout=5)
        assert page[0] == 200 and 'id="bb-broker-error"' in page[1] and AUTH_PASSWORD not in page[1]
        assert flower.request("GET", f"/jobs/job?id={job_id}", timeout=5)[0] == 503

        auth_server.start()
        for path in reads:
            wait_for(lambda path=path: flower.request("GET", path)[0] == 200, 90, f"{path} answering again")
        assert AUTH_PASSWORD not in flower.log()
    finally:
        flower.stop()


#: How long the tab's client waits for an unreachable server (connection.QUICK_TIMEOUTS' serverSelectionTimeoutMS).
SERVER_SELECTION_S = 5.0


@pytest.mark.parametrize("path", ["/api/jobs", "/jobs/data"])
def test_the_jobs_list_says_the_server_is_down_after_one_wait_not_two(
    own_server: EmbeddedServer, flower_factory, path: str
) -> None:
    with MongoClient(own_server.url, tz_aware=True) as client:
        failed_job(JobStore(client.outage, Policy(max_attempts=1)), "t-1")
    flower = flower_factory(url=with_database(own_server.url, "outage"))
    assert flower.request("GET", "/workers")[0] == 200  # Flower up; the Jobs tab first used in the outage
    own_server.stop()
    started = time.monotonic()
    status, body = flower.request("GET", path, timeout=120)
    took = time.monotonic() - started
    assert status == 503 and as_json(body)["error"].startswith("cannot reach the server at "), (status, body[:300])
    # One wait for the server (5 s), not one to read its clock and a second for the list: 10 s before.
    assert took < SERVER_SELECTION_S * 1.5, took


# --- one user's many slow requests ----------------------------------------------------------------------------

#: How many Jobs-tab requests one user may have running, and the name its client gives the server
#: (bb_broker.contrib.flower.tab.PER_USER_REQUESTS, APPNAME).
PER_USER = 4
APPNAME = "bb_broker Jobs tab"


@pytest.mark.parametrize(
    "heavy", ["/api/jobs?counts=1", "/jobs/data?breakdowns=1", "/api/jobs/bulk/retry?status=failed"]
)
def test_one_users_slow_requests_are_bounded_and_leave_others_alone(
    own_server: EmbeddedServer, tmp_path: Path, flower_factory, heavy: str
) -> None:
    client = MongoClient(own_server.url, tz_aware=True)
    store = JobStore(client.bounded, Policy(max_attempts=1))
    store.ensure_indexes()
    failed_job(store, "t-1")
    flower = flower_factory(url=with_database(own_server.url, "bounded"), basic_auth=f"{ADMIN},{VIEWER}")
    # The server answers each of the Jobs tab's first PER_USER counts (pymongo counts with `aggregate`) after a long
    # while (Flower's own change streams are aggregates too: the fail point is for the tab's client only).
    slow_counts = {"failCommands": ["aggregate"], "appName": APPNAME, "blockConnection": True, "blockTimeMS": 20_000}
    client.admin.command("configureFailPoint", "failCommand", mode={"times": PER_USER}, data=slow_counts)
    answers: list[tuple[int, str]] = []

    def ask() -> None:
        answers.append(flower.request("GET", heavy, user=VIEWER, timeout=120))

    threads = [threading.Thread(target=ask) for _ in range(PER_USER + 6)]
    for thread in threads:
        thread.start()
    refused = wait_for(lambda: len(answers) >= 6 and answers[:], 60, "the viewer's requests over the bound")
    assert {status for status, _ in refused} == {429}, refused
    error = as_json(refused[0][1])["error"]
    assert error == (
        f"viewer has {PER_USER} Jobs-tab requests running already (at most {PER_USER} at a time): "
        "try again when one has answered"
    )
    # Meanwhile another user's request runs: the viewer's are bounded, not everyone's.
    assert flower.request("GET", "/api/jobs", user=ADMIN, timeout=60)[0] == 200
    for thread in threads:
        thread.join(120)
    assert sorted(status for status, _ in answers) == [200] * PER_USER + [429] * 6
    assert flower.request("GET", heavy, user=VIEWER)[0] == 200  # the bound frees as its requests end


# --- huge fields ---------------------------------------------------------------------------------------------------

HUGE = 15 * 1024 * 1024


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lastError", "ValueError: " + "x" * HUGE),
        ("lastError", "é" * (HUGE // 2)),  # counted in characters, not bytes
        ("kind", "app." + "k" * HUGE),
        ("leaseOwner", "w" * HUGE),
        ("attempts", list(range(HUGE // 16))),  # not even the right type
    ],
)
def test_a_huge_field_is_cut_in_the_list_and_whole_on_the_jobs_own_api(
    db: Database, flower_factory, field: str, value: Any
) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    job_id = failed_job(store, "t-1")
    db.jobs.update_one({"_id": job_id}, {"$set": {field: value}})
    flower = flower_factory()
    for path in ("/api/jobs", "/jobs/data"):
        status, body = flower.request("GET", path)
        assert status == 200 and len(body) < 20_000, (path, len(body))
        (row,) = as_json(body)["jobs"]
        assert row["id"] == job_id and row["truncated"] == [field], row
        if isinstance(value, str):
            assert row[field].startswith(value[:200]) and row[field].endswith(
                "… [cut: the job's own page has it whole]"
            )
        else:
            assert row[field] == "[array: the job's own page has it whole]"
    status, body = flower.request("GET", f"/api/jobs/job?id={job_id}")
    assert status == 200 and as_json(body)[field] == value


# --- another site's page, a Flower without login -------------------------------------------------------------------

CROSS_SITE = [
    {"Origin": "http://evil.example"},
    {"Origin": "null"},  # a sandboxed frame, a page with Referrer-Policy: no-referrer
    {"Referer": "http://evil.example/page"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Origin": "http://127.0.0.1.evil.example"},
]


@pytest.mark.parametrize("headers", CROSS_SITE, ids=lambda h: "-".join(f"{k}={v}" for k, v in h.items()))
def test_another_sites_post_is_refused_by_a_flower_without_login(db: Database, flower_factory, headers) -> None:
    # --no-auth and FLOWER_UNAUTHENTICATED_API=true (FlowerProcess's default for bb-broker): the API is open to
    # anyone who reaches it, and Flower answers every origin's requests (Access-Control-Allow-Origin: *).
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    failed = failed_job(store, "t-failed")
    queued = publish(store, "t-queued")
    flower = flower_factory()
    assert flower.env["FLOWER_UNAUTHENTICATED_API"] == "true"
    for path in ("/api/jobs/bulk/delete?status=failed", f"/api/jobs/job/delete?id={failed}", "/api/queues/celery/pause",
                 "/jobs/bulk/delete?status=failed", "/api/task/revoke/t-queued"):  # fmt: skip
        status, body = flower.request("POST", path, {}, headers=headers)
        assert status == 403 and "cross-site" in body, (path, status, body)
    assert db.jobs.find_one({"_id": failed})["status"] == "failed"
    assert db.jobs.find_one({"_id": queued})["status"] == "queued" and db.bb_queues.count_documents({}) == 0
    # The same requests from Flower's own pages, or from a script (no Origin), still act.
    own = {"Origin": flower.url, "Referer": flower.url + "/jobs", "Sec-Fetch-Site": "same-origin"}
    assert flower.request("POST", "/api/queues/celery/pause", {}, headers=own)[0] == 200
    assert flower.request("POST", f"/api/jobs/job/delete?id={failed}", {})[0] == 200
    assert db.jobs.find_one({"_id": failed}) is None


# --- another site's page after DNS rebinding: its own name in Host ------------------------------------------------

#: The name a rebinding page is served from: resolved to 127.0.0.1, it makes the page and Flower one origin.
REBOUND = "evil.example"
#: What such a page reads: the Jobs tab's page (for its XSRF token), data and API, Flower's pages, API and files.
HOST_READS = ("/jobs", "/jobs/data", "/api/jobs", "/api/jobs/job?id={failed}", "/api/jobs/stats", "/jobs/schedules",
              "/", "/tasks", "/api/workers", "/api/task/info/t-queued", "/jobs/static/uPlot.min.css",
              "/static/css/flower.css", "/healthcheck", "/nosuch")  # fmt: skip
#: What it does: pause a queue, delete a job (the API's, the page's with its token), revoke through Flower's API.
HOST_ACTIONS = ("/api/queues/celery/pause", "/api/jobs/job/delete?id={failed}", "/jobs/job/delete?id={failed}",
                "/jobs/bulk/delete?status=failed", "/api/task/revoke/t-queued")  # fmt: skip


def same_origin(flower: FlowerProcess, name: str) -> dict[str, str]:
    """The headers of a browser's request from a page of `name` at Flower's port: same origin in every header."""
    site = f"{name}:{flower.port}"
    return {"Host": site, "Origin": f"http://{site}", "Referer": f"http://{site}/jobs", "Sec-Fetch-Site": "same-origin"}


def xsrf_token(flower: FlowerProcess) -> str:
    """The XSRF token (Tornado's cookie, which the page's form sends back) of Flower's Jobs page."""
    with urllib.request.urlopen(flower.url + "/jobs", timeout=30) as response:
        cookies = SimpleCookie("; ".join(response.headers.get_all("Set-Cookie") or []))
    return cookies["_xsrf"].value


def refused_host(status: int, body: str) -> bool:
    return status == 403 and body.startswith("refused: Host ") and body.count("\n") == 1


def test_a_page_with_another_name_is_refused_everything_by_a_flower_without_login(db: Database, flower_factory) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    failed = failed_job(store, "t-failed")
    queued = publish(store, "t-queued")
    flower = flower_factory()  # --no-auth, FLOWER_UNAUTHENTICATED_API=true, on 127.0.0.1
    token = xsrf_token(flower)
    rebound = {**same_origin(flower, REBOUND), "Cookie": f"_xsrf={token}"}
    for path in HOST_READS:
        status, body = flower.request("GET", path.format(failed=failed), headers=rebound)
        assert refused_host(status, body) and repr(f"{REBOUND}:{flower.port}") in body, (path, status, body[:300])
    for path in HOST_ACTIONS:
        status, body = flower.request("POST", path.format(failed=failed), {"_xsrf": token}, headers=rebound)
        assert refused_host(status, body), (path, status, body[:300])
    # Nothing changed: the queue runs, both jobs are as they were, and nothing was revoked.
    assert db.bb_queues.count_documents({}) == 0
    assert db.jobs.find_one({"_id": failed})["status"] == "failed"
    untouched = db.jobs.find_one({"_id": queued})
    assert untouched["status"] == "queued" and "actions" not in untouched
    # A name that only ends like a loopback one, and one that only starts like it, are other names.
    for name in ("localhost.evil.example", "127.0.0.1.evil.example", "evil-localhost"):
        assert refused_host(*flower.request("GET", "/api/jobs", headers=same_origin(flower, name))), name

    # Loopback names read and act, the page's action with its token too.
    for name in ("localhost", "LOCALHOST.", "127.0.0.1", "127.0.0.2", "[::1]"):
        status, body = flower.request("GET", "/api/jobs", headers=same_origin(flower, name))
        assert status == 200 and failed in body, (name, status, body[:300])
    own = {**same_origin(flower, "localhost"), "Cookie": f"_xsrf={token}"}
    assert flower.request("POST", "/api/queues/celery/pause", {}, headers=own)[0] == 200
    assert flower.request("POST", f"/jobs/job/delete?id={failed}", {"_xsrf": token}, headers=own)[0] == 200
    assert db.bb_queues.find_one({"_id": "celery"})["paused"] is True and db.jobs.find_one({"_id": failed}) is None


def test_the_names_a_flower_is_told_it_serves_are_answered_and_only_those(
    db: Database, flower_factory, tmp_path: Path
) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    failed = failed_job(store, "t-failed")
    ours = "flower.example.test"
    # Without login: --allowed_hosts and FLOWER_ALLOWED_HOSTS, and the --address Flower listens on (this machine's
    # name: it is no loopback name, whatever it resolves to).
    machine = socket.gethostname()
    by_option = flower_factory(address=machine, extra_args=(f"--allowed_hosts=other.test,{ours.upper()}:80",))
    by_env = flower_factory(env={"FLOWER_ALLOWED_HOSTS": f"{ours},other.test"})
    for flower in (by_option, by_env):
        for name in (ours, "other.test"):
            status, body = flower.request("GET", "/api/jobs", headers=same_origin(flower, name))
            assert status == 200 and failed in body, (name, status, body[:300])
        assert refused_host(*flower.request("GET", "/api/jobs", headers=same_origin(flower, REBOUND)))
        assert refused_host(*flower.request("GET", "/api/jobs", headers=same_origin(flower, f"www.{ours}")))
    assert by_option.request("GET", "/api/jobs", headers=same_origin(by_option, machine))[0] == 200
    assert refused_host(*by_env.request("GET", "/api/jobs", headers=same_origin(by_env, machine)))
    assert by_env.request("POST", "/api/queues/celery/pause", {}, headers=same_origin(by_env, ours))[0] == 200
    assert db.bb_queues.find_one({"_id": "celery"})["paused"] is True

    # With a login every name is answered as before, unless --allowed_hosts is given: then only those.
    any_name = flower_factory(basic_auth=ADMIN)
    assert any_name.request("GET", "/api/jobs", headers=same_origin(any_name, REBOUND))[0] == 200
    named = flower_factory(basic_auth=ADMIN, extra_args=(f"--allowed_hosts={ours}",))
    assert named.request("GET", "/api/jobs", headers=same_origin(named, ours))[0] == 200
    assert refused_host(*named.request("GET", "/api/jobs", headers=same_origin(named, REBOUND)))
    assert refused_host(*named.request("POST", "/api/queues/celery/resume", {}, headers=same_origin(named, REBOUND)))
    assert db.bb_queues.find_one({"_id": "celery"})["paused"] is True

    # An entry that is not a host name: `bb-broker flower` says so in one line and does not start.
    bad = subprocess.run(
        [sys.executable, "-m", "bb_broker.cli", "flower", "-A", "tests.support.e2e_app", "--no-auth",
         "--allowed_hosts=https://flower.example.test/"],
        env=by_env.env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "bb-broker: flower: --allowed_hosts: 'https://flower.example.test/' is not a host name (give names such as "
        "flower.example.com or 10.0.0.5, without scheme or path)"
    ], bad.stderr


# --- where Flower listens --------------------------------------------------------------------------------------


def listening(port: int) -> set[str]:
    """The local addresses with a socket listening on `port`, from /proc/net/tcp and tcp6 (state 0A)."""
    found = set()
    for table, size in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is reversed
                found.add(".".join(map(str, words)) if size == 8 else words.hex())
    return found


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ((), {}, {"127.0.0.1"}),
        (("--address=0.0.0.0",), {}, {"0.0.0.0"}),
        ((), {"FLOWER_ADDRESS": "0.0.0.0"}, {"0.0.0.0"}),
    ],
)
def test_bb_broker_flower_listens_on_loopback_unless_told(flower_factory, args, env, expected) -> None:
    flower = flower_factory(address=None, extra_args=args, env=env)
    assert listening(flower.port) == expected
    (shown,) = expected
    visit = wait_for(lambda: "Visit me at" in flower.log() and flower.log(), message="Flower's banner")
    assert f"Visit me at http://{shown}:{flower.port}" in visit
    assert f"anyone who can reach {shown}:{flower.port} " in visit


EVIL_PAGE = '<form id="f" method="post" action="{url}"></form><script>document.getElementById("f").submit()</script>'


def test_another_sites_page_in_a_real_browser_cannot_delete_through_the_open_api(
    db: Database, flower_factory, browser
) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    failed = failed_job(store, "t-failed")
    flower = flower_factory()  # --no-auth, FLOWER_UNAUTHENTICATED_API=true
    target = f"{flower.url}/api/jobs/bulk/delete?status=failed"
    context = browser.new_context()
    page = context.new_page()
    evil = EVIL_PAGE.format(url=target)
    page.route("http://elsewhere.test/", lambda route: route.fulfill(body=evil, content_type="text/html"))
    with page.expect_response(lambda response: "/api/jobs/bulk/delete" in response.url) as answered:
        page.goto("http://elsewhere.test/")
    assert answered.value.status == 403
    assert db.jobs.find_one({"_id": failed})["status"] == "failed"
    context.close()
