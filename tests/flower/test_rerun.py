"""Retry with changed arguments (bb_broker.ops.rerun) through the Jobs tab's API in a real Flower, with a real worker,
and through `bb-broker retry ID --args`: the new job runs, both jobs record the link; read-only users and hostile
input are refused with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from http.cookies import SimpleCookie
from typing import Any

from pymongo.database import Database
from tornado.web import create_signed_value

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.rerun import ACTION, NEW_TASK_ID
from tests.support.flower_process import HAS_READ_ONLY, NO_READ_ONLY, FlowerProcess
from tests.support.workers import ROOT, send, settled, wait_for

ADD = "tests.support.e2e_app.add"
USERS = "admin:s3cret,viewer:peek"
VIEWER = "viewer:peek"


def post(flower: FlowerProcess, path: str, form: dict[str, Any], **options: Any) -> tuple[int, Any]:
    status, body = flower.request("POST", path, form, **options)
    return status, json.loads(body) if body.startswith("{") else body


def snapshot(db: Database) -> list[dict[str, Any]]:
    """Every job document, whole: what a refused request must leave as it was."""
    return list(db.jobs.find({}).sort("_id", 1))


def failed_add(app: Any, db: Database) -> dict[str, Any]:
    """`add(1, "x")`, run by the worker until it failed for good (1 + "x" is a TypeError)."""
    broken = send(app, "add", 1, "x")
    return wait_for(settled(db, broken, "failed"), timeout=120, message="add(1, 'x') failed for good")


def assert_linked(db: Database, original: dict[str, Any], new_id: str, by: str) -> dict[str, Any]:
    """Both jobs record the retry with changed arguments; the original is as it was otherwise. The new job."""
    new = db.jobs.find_one({"_id": new_id})
    assert new["replaces"] == original["_id"] and new["taskId"] != original["taskId"]
    (record,) = [entry for entry in new["actions"] if entry["action"] == ACTION]
    assert record["by"] == by and record["replaces"] == original["_id"]
    assert record["previousTaskId"] == original["taskId"]
    assert record["change"] == "args [1, 'x'] -> [1, 2]; kwargs unchanged"
    after = db.jobs.find_one({"_id": original["_id"]})
    assert after["replacedBy"] == [new_id]
    (back,) = [entry for entry in after["actions"] if entry["action"] == ACTION]
    assert back["by"] == by and back["replacedBy"] == new_id and back["taskId"] == new["taskId"]
    unchanged = {k: v for k, v in after.items() if k not in ("actions", "replacedBy")}
    assert unchanged == {k: v for k, v in original.items() if k != "actions"}  # still failed, as it was
    return new


def test_a_failed_add_retried_with_changed_arguments_runs_and_both_jobs_record_it(
    app, db: Database, worker_factory, flower_factory
) -> None:
    worker_factory()
    flower = flower_factory(basic_auth=USERS, extra_args=("--jobs_admins=admin",))
    original = failed_add(app, db)
    before = snapshot(db)

    # The preview: the arguments checked and normalized, the message that would go; nothing written.
    status, body = post(flower, f"/api/jobs/job/{ACTION}/preview", {"id": original["taskId"], "args": " [1,  2] "})
    assert status == 200, body
    preview = body["preview"]
    assert preview["args"] == [1, 2] and preview["kwargs"] == {} and preview["job"] == original["_id"]
    assert preview["task"] == ADD and preview["queue"] == "celery"
    message = preview["message"]
    assert message["body"][:2] == [[1, 2], {}] and message["content-type"] == "application/json"
    assert message["headers"]["id"] == NEW_TASK_ID and message["headers"]["argsrepr"] == "[1, 2]"
    assert message["headers"]["task"] == ADD and "retries" not in message["headers"]
    assert snapshot(db) == before

    # A read-only user: refused, the preview too, and nothing written.
    for path in (f"/api/jobs/job/{ACTION}/preview", f"/api/jobs/job/{ACTION}"):
        status, body = post(flower, path, {"id": original["_id"], "args": "[1, 2]"}, user=VIEWER)
        assert status == 403 and "viewer may read the jobs but not act on them" in body["error"], (path, body)
    assert snapshot(db) == before

    # Sent: a new job, which the worker runs with the new arguments.
    status, body = post(flower, f"/api/jobs/job/{ACTION}", {"id": original["_id"], "args": "[1, 2]"})
    assert status == 200, body
    new_id = body["job"]["id"]
    assert new_id != original["_id"]
    new = wait_for(settled(db, body["job"]["taskId"], "succeeded"), message="the new add(1, 2) succeeded")
    assert new["payload"]["args"] == [1, 2] and new["payload"]["headers"]["argsrepr"] == "[1, 2]"
    assert db.runs.find_one({"taskId": new["taskId"], "name": ADD}) is not None
    assert_linked(db, original, new_id, by="admin")


def test_a_read_only_flower_refuses_it_and_shows_no_control(app, db: Database, flower_factory) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    job_id = failed_job(store, "t-failed")
    flower = flower_factory(extra_args=("--read_only",))
    if not HAS_READ_ONLY:  # Flower 2.0 has no read-only mode and drops the option: bb_broker says so as it starts
        wait_for(lambda: NO_READ_ONLY in flower.log(), message="the notice")
        return
    before = snapshot(db)
    for path in (f"/api/jobs/job/{ACTION}/preview", f"/api/jobs/job/{ACTION}"):
        status, body = post(flower, path, {"id": job_id, "args": "[1, 2]"})
        assert status == 403 and "read-only" in body["error"], (path, body)
    page = flower.page(f"/jobs/job?id={job_id}")
    assert "rerun-" not in page and ACTION not in page and "changed arguments" not in page
    assert snapshot(db) == before


def failed_job(store: JobStore, task_id: str, *, content_type: str = "application/json") -> str:
    """A failed job of `add(1, "x")` as a Celery producer stores it (JSON), or with another content type (pickle)."""
    headers = {"task": ADD, "id": task_id, "lang": "py", "root_id": task_id, "argsrepr": "(1, 'x')"}
    payload: dict[str, Any] = {"headers": headers, "properties": {"correlation_id": task_id}}
    payload |= {"contentType": content_type, "contentEncoding": "utf-8"}
    if content_type == "application/json":
        payload |= {"args": [1, "x"], "kwargs": {}, "options": {"callbacks": None}}
    else:
        payload |= {"contentEncoding": "binary", "body": "gASVAAAAAAAAAAA=", "bodyFormat": "base64"}
    job_id = store.publish(queue="celery", kind=ADD, task_id=task_id, payload=payload, priority=0, run_after=None,
                           is_retry=False)  # fmt: skip
    claimed = store.claim("celery", "worker-1")
    assert claimed is not None and claimed.id == job_id
    store.fail(claimed.id, claimed.attempts, "TypeError: unsupported operand")
    return job_id


def test_hostile_input_is_refused_and_nothing_is_written(db: Database, flower_factory) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    job_id = failed_job(store, "t-failed")
    pickled = failed_job(store, "t-pickled", content_type="application/x-python-serialize")
    queued = store.publish(queue="celery", kind=ADD, task_id="t-queued", payload={"args": []}, priority=0,
                           run_after=None, is_retry=False)  # fmt: skip
    flower = flower_factory(basic_auth="admin:s3cret")
    before = snapshot(db)
    huge = json.dumps(["x" * (20 * 1024 * 1024)])
    refusals = [
        ({"id": job_id, "args": "[1, 2"}, 400, "args is not JSON"),
        ({"id": job_id, "args": "{'a': 1}"}, 400, "args is not JSON"),
        ({"id": job_id, "args": '{"a": 1}'}, 400, "args must be a JSON list, [1, 2], not object"),
        ({"id": job_id, "kwargs": "[1, 2]"}, 400, 'kwargs must be a JSON object, {"x": 3}, not array'),
        ({"id": job_id, "args": '["\\udce9"]'}, 400, "args[0] holds a lone surrogate"),
        ({"id": job_id, "args": huge}, 400, "over a job document's limit (16777216 bytes)"),
        ({"id": job_id, "args": "[" * 500 + "]" * 500}, 400, "args is nested deeper than 64 levels"),
        ({"id": job_id, "args": "[" * 65 + "]" * 65}, 400, "args is nested deeper than 64 levels"),
        ({"id": job_id, "args": "[1, NaN]"}, 400, "args[1] is nan, a number JSON has no way to write"),
        ({"id": job_id, "args": "[1e400]"}, 400, "args[0] is inf, a number JSON has no way to write"),
        ({"id": job_id, "kwargs": '{"a": [-Infinity]}'}, 400, "kwargs['a'][0] is -inf"),
        ({"id": "no-such-job", "args": "[1]"}, 404, "no job has the id or task id 'no-such-job'"),
        ({"args": "[1]"}, 400, "id is required"),
        ({"id": queued, "args": "[1]"}, 409, f"job {queued} is queued: it would still run with its old arguments"),
        ({"id": pickled, "args": "[1]"}, 409, "was sent as application/x-python-serialize, not JSON"),
    ]
    for preview in ("/preview", ""):
        for form, code, error in refusals:
            status, body = post(flower, f"/api/jobs/job/{ACTION}{preview}", form)
            assert status == code and error in body["error"], (preview, form.get("args", "")[:40], status, body)
    assert snapshot(db) == before


def test_another_sites_post_is_refused_by_a_flower_without_login(db: Database, flower_factory) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    job_id = failed_job(store, "t-failed")
    flower = flower_factory()  # --no-auth, its API open (FLOWER_UNAUTHENTICATED_API)
    before = snapshot(db)
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        for path in (f"/api/jobs/job/{ACTION}", f"/jobs/job/{ACTION}", f"/api/jobs/job/{ACTION}/preview"):
            status, body = post(flower, path, {"id": job_id, "args": "[1, 2]"}, headers=headers)
            assert status == 403 and "cross-site" in str(body), (path, headers, body)
    # The page's own route without its XSRF token.
    status, body = post(flower, f"/jobs/job/{ACTION}", {"id": job_id, "args": "[1, 2]"})
    assert status == 403 and "_xsrf" in str(body)
    assert snapshot(db) == before


def test_an_oauth_sessions_post_without_the_pages_token_is_refused(db: Database, flower_factory, tmp_path) -> None:
    # Flower's OAuth login is a session cookie, which the browser sends with another site's form too: the page's
    # token is wanted then (Flower 2.2's own rule; on Flower 2.0 and 2.1, which set no XSRF cookies, the tab's).
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    job_id = failed_job(store, "t-failed")
    secret = "a-test-cookie-secret"
    config = tmp_path / "flowerconfig.py"  # `celery flower` with the plugin, as `bb-broker flower` takes no OAuth here
    config.write_text("import bb_broker.contrib.flower  # noqa: F401\n")
    oauth = ("--auth=alice@example.com", f"--cookie_secret={secret}", f"--conf={config}")
    flower = flower_factory(launcher="celery", extra_args=oauth)
    session = f"user={create_signed_value(secret, 'user', 'alice@example.com').decode()}"
    before = snapshot(db)
    for path in (f"/jobs/job/{ACTION}", f"/api/jobs/job/{ACTION}", f"/jobs/job/{ACTION}/preview"):
        status, body = post(flower, path, {"id": job_id, "args": "[1, 2]"}, headers={"Cookie": session})
        assert status == 403 and "_xsrf" in str(body), (path, status, body)
    assert snapshot(db) == before
    # With the token the job page gives (its cookie and the form's field), the session's preview answers.
    request = urllib.request.Request(f"{flower.url}/jobs/job?id={job_id}", headers={"Cookie": session})
    with urllib.request.urlopen(request, timeout=30) as response:
        token = SimpleCookie("; ".join(response.headers.get_all("Set-Cookie") or []))["_xsrf"].value
    form = {"id": job_id, "args": "[1, 2]", "_xsrf": token}
    status, body = post(flower, f"/jobs/job/{ACTION}/preview", form, headers={"Cookie": f"{session}; _xsrf={token}"})
    assert status == 200 and body["preview"]["args"] == [1, 2], body
    assert snapshot(db) == before


def bb_broker(broker_url: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "bb_broker.cli", *args, "--broker", broker_url],
        input=stdin, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip


def test_the_cli_shows_asks_then_sends_and_refuses_bad_arguments(
    app, db: Database, broker_url: str, worker_factory
) -> None:
    worker_factory()
    original = failed_add(app, db)
    before = snapshot(db)
    for args, code, error in [
        (("--args", "[1, 2"), 2, "args is not JSON"),
        (("--kwargs", "[1]"), 2, "kwargs must be a JSON object"),
        (("--args", "[1]", "--all"), 2, "exactly one ID"),
    ]:
        done = bb_broker(broker_url, "retry", original["_id"], *args)
        assert done.returncode == code and error in done.stderr and done.stderr.count("\n") == 1, done
    unknown = bb_broker(broker_url, "retry", "no-such-job", "--args", "[1]")
    assert unknown.returncode == 2 and "no job has the id or task id 'no-such-job'" in unknown.stderr
    # Shown, then declined: nothing sent.
    declined = bb_broker(broker_url, "retry", original["taskId"], "--args", "[1, 2]", stdin="n\n")
    assert declined.returncode == 1 and '"args": [\n    1,\n    2\n  ]' in declined.stdout
    assert f"replacing job {original['_id']}?" in declined.stdout
    assert snapshot(db) == before

    sent = bb_broker(broker_url, "retry", original["taskId"], "--args", "[1, 2]", "--yes")
    assert sent.returncode == 0, sent
    new_id = sent.stdout.strip().splitlines()[-1].split()[2]
    new = wait_for(lambda: (doc := db.jobs.find_one({"_id": new_id})) and doc["status"] == "succeeded" and doc)
    assert new["payload"]["args"] == [1, 2]
    assert_linked(db, original, new_id, by=new["actions"][0]["by"])


def test_the_cli_given_a_mongodb_url_sends_the_new_job_as_a_job(db: Database, broker_url: str) -> None:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    original = failed_job(store, "t-failed")
    mongodb_url = "mongodb://" + broker_url.partition("://")[2]  # the CLI takes either
    sent = bb_broker(mongodb_url, "retry", original, "--args", "[1, 2]", "--yes")
    assert sent.returncode == 0, sent
    new_id = sent.stdout.strip().splitlines()[-1].split()[2]
    # Not through Kombu's own MongoDB transport, which answers mongodb:// with a message in `messages` and no job.
    assert db.jobs.find_one({"_id": new_id})["payload"]["args"] == [1, 2]
    assert "messages" not in db.list_collection_names()
