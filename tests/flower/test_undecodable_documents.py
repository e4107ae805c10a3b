"""Job documents BSON allows and Python's decoding does not, as another program writes them: a string whose bytes
are not UTF-8, a date before year 1 or after year 9999. pymongo's defaults raise InvalidBSON on the whole reply that
holds one. A worker claiming one fails that job alone and goes on; the Jobs tab and the CLI show every job.

A `mongod` keeps such documents; the stand-in refuses them at insert. Every process of these tests (worker, Flower,
CLI, producer) reaches the server through a wire proxy that answers as a mongod holding them would
(wire.mongod_keeping_what_the_stand_in_refuses); the test itself writes and reads the stand-in directly."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo.database import Database

from tests.flower.test_malformed_documents import SWEEPING, hand_written, runs_of
from tests.packaging.test_cli import run_cli
from tests.support import wire
from tests.support.servers import with_database
from tests.support.workers import send, settled, wait_for

pytestmark = pytest.mark.stand_in

MARKER = wire.NOT_UTF8_MARKER
#: How the marker's bytes read where the product decodes leniently: U+FFFD for the one byte that is not UTF-8.
REPLACED = "caf\ufffd.txt"


@pytest.fixture
def broker_url(mongo_url: str, db: Database) -> Iterator[str]:
    proxy = wire.WireProxy(mongo_url, wire.mongod_keeping_what_the_stand_in_refuses())
    yield with_database(f"mongodb://{proxy.address}", db.name)
    proxy.close()


def in_headers(doc: dict[str, Any]) -> None:
    doc["payload"]["headers"]["argsrepr"] = f"('{MARKER}',)"


def undecodable(db: Database, app: Any, edit: Any, **changes: Any) -> dict[str, Any]:
    """A hand_written job (its `changes`) with `edit(doc)` applied: its markers are what the product reads."""
    return hand_written(db, app, edit, **changes)


def test_a_worker_fails_a_job_it_cannot_decode_once_and_runs_the_others(app, db, worker_factory) -> None:
    worker = worker_factory(options=SWEEPING)
    in_message = undecodable(db, app, in_headers)
    in_task_id = undecodable(db, app, lambda doc: doc.update(taskId=f"{doc['taskId']}{MARKER}"))
    # Neither the claim nor a run reads a job's kind or createdAt: such a job runs. Due before year 1: it is due.
    elsewhere = undecodable(db, app, lambda doc: doc.update(kind=f"tests.{MARKER}", createdAt=wire.AFTER_9999_MARKER))
    long_due = hand_written(db, app, runAfter=wire.BEFORE_YEAR_1_MARKER)
    sentinel = send(app, "add", 2, 3)

    wait_for(settled(db, sentinel, "succeeded"), timeout=60, message="the sentinel ran after the bad documents")
    for doc, field in ((in_message, "payload"), (in_task_id, "taskId")):
        failed = wait_for(
            lambda doc=doc: (found := db.jobs.find_one({"_id": doc["_id"]}) or {}).get("status") == "failed" and found,
            message=f"the job {doc['_id']} failed",
        )
        assert failed["lastError"].startswith(f"malformed job document: {field} holds text that is not UTF-8 ("), (
            failed["lastError"]
        )
        assert failed["attempts"] == 1 and "leaseOwner" not in failed and runs_of(db, failed) == 0
    for doc in (elsewhere, long_due):
        wait_for(lambda doc=doc: (db.jobs.find_one({"_id": doc["_id"]}) or {}).get("status") == "succeeded")
    log = worker.log()
    assert "Unrecoverable error" not in log and "InvalidBSON" not in log, log[-3000:]
    later = send(app, "add", 3, 4)  # the worker still claims
    wait_for(settled(db, later, "succeeded"), timeout=60, message="a job sent after the bad documents ran")
    assert db.jobs.count_documents({"status": "failed"}) == 2


def bad_jobs(db: Database, app: Any) -> dict[str, dict[str, Any]]:
    """One failed job of each kind no default decoding reads, beside one ordinary failed job."""
    after_9999, before_1 = wire.AFTER_9999_MARKER, wire.BEFORE_YEAR_1_MARKER
    return {
        "kind": undecodable(db, app, lambda doc: doc.update(kind=MARKER), status="failed"),
        "lastError": undecodable(db, app, lambda doc: doc.update(lastError=f"boom {MARKER}"), status="failed"),
        "args": undecodable(db, app, in_headers, status="failed"),
        "year 19969": hand_written(db, app, status="failed", updatedAt=after_9999, finishedAt=after_9999),
        "before year 1": hand_written(db, app, status="failed", createdAt=before_1, startedAt=before_1),
        "plain": hand_written(db, app, status="failed", lastError="an ordinary failure"),
    }


def test_the_jobs_tab_lists_and_shows_jobs_it_cannot_decode(app, db, flower_factory) -> None:
    flower = flower_factory()
    jobs = bad_jobs(db, app)
    status, body = flower.request("GET", "/jobs")
    assert status == 200, body[:2000]
    listed = flower.get("/api/jobs?status=failed")["jobs"]
    assert {job["id"] for job in listed} == {doc["_id"] for doc in jobs.values()}
    for variant, doc in jobs.items():
        for path in ("/jobs/job", "/api/jobs/job", "/jobs/canvas", "/api/jobs/canvas"):
            status, body = flower.request("GET", f"{path}?id={doc['_id']}")
            assert status == 200, (variant, path, body[:2000])
    shown = flower.get(f"/api/jobs/job?id={jobs['kind']['_id']}")
    assert REPLACED in json.dumps(shown, ensure_ascii=False)
    assert flower.get("/api/jobs?counts=1")["statuses"]["failed"] == len(jobs)
    assert "Traceback" not in flower.log(), flower.log()[-3000:]


def test_the_cli_lists_and_shows_jobs_it_cannot_decode(app, db, broker_url) -> None:
    jobs = bad_jobs(db, app)
    commands = [
        ["status"],
        ["status", "--by", "kind"],
        ["failed"],
        ["failed", "--json"],
        ["stats"],
        *[["show", doc["_id"], *more] for doc in jobs.values() for more in ([], ["--json"], ["--tree"])],
    ]
    for command in commands:
        result = run_cli(*command, "--broker", broker_url)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (command, result.stderr[-3000:])
    listed = run_cli("failed", "--json", "--broker", broker_url)
    assert {job["id"] for job in json.loads(listed.stdout)} == {doc["_id"] for doc in jobs.values()}, listed.stdout
    by_kind = run_cli("status", "--by", "kind", "--broker", broker_url).stdout
    assert REPLACED in by_kind, by_kind
    shown = run_cli("show", jobs["year 19969"]["_id"], "--broker", broker_url).stdout
    assert "9999-12-31" in shown, shown


def test_every_action_on_a_job_whose_id_is_not_utf8_names_it_and_changes_nothing(
    app, db, broker_url, flower_factory
) -> None:
    # Found by its task id, its _id read with U+FFFD: each action's write by that id found no job, and the operator
    # was told it "changed meanwhile".
    flower = flower_factory()
    failed = hand_written(db, app, _id=f"f-{MARKER}", status="failed", lastError="an ordinary failure")
    waiting = hand_written(db, app, _id=f"q-{MARKER}", runAfter=wire.AFTER_9999_MARKER)
    before = list(db.jobs.find())
    refused = "has an _id that holds text that is not UTF-8"
    for action, doc in (("retry", failed), ("delete", failed), ("cancel", waiting), ("run-now", waiting)):
        status, body = flower.request("POST", f"/api/jobs/job/{action}?id={doc['taskId']}", {})
        assert status == 409 and json.loads(body)["error"] == f"job {doc['_id'][:2]}{REPLACED} {refused}", body
    # A bulk retry of the failed jobs answered "retry: 0 jobs", nothing of why.
    assert flower.get("/api/jobs/bulk/retry?status=failed")["count"] == 1
    answer = flower.post("/api/jobs/bulk/retry?status=failed&expected=1")
    held = f"job f-{REPLACED} stays failed: _id holds text that is not UTF-8"
    assert answer["message"] == f"retry: 0 jobs; {held}", answer
    status, body = flower.request("POST", f"/api/jobs/job/retry-with-args?id={failed['taskId']}", {"args": "[2]"})
    assert status == 409 and "holds text that is not UTF-8 in _id" in body, body
    # Cancelling its canvas: "cancelled 0 queued steps", the step counted as "finished before: 1 queued".
    left = f"job q-{REPLACED} left queued: its _id holds text that is not UTF-8"
    answer = flower.post(f"/api/jobs/canvas/cancel?id={waiting['taskId']}")
    assert answer["message"] == f"cancel canvas: 0 queued steps cancelled; {left}", answer
    assert [step["jobId"] for step in answer["refused"]] == [f"q-{REPLACED}"] and answer["finished"] == [], answer
    for command, doc, said in (
        (["cancel"], waiting, refused),
        (["cancel", "--canvas"], waiting, left),
        (["run-now"], waiting, refused),
        (["retry"], failed, "stays failed: _id holds text that is not UTF-8"),
        (["retry", "--args", "[2]", "--yes"], failed, "holds text that is not UTF-8 in _id"),
    ):
        result = run_cli(*command, doc["taskId"], "--broker", broker_url)
        assert result.returncode == 1 and said in result.stderr and "Traceback" not in result.stderr, result
    assert list(db.jobs.find()) == before
    # Listed, and shown by its task id.
    listed = {job["id"] for job in flower.get("/api/jobs")["jobs"]}
    assert listed == {f"f-{REPLACED}", f"q-{REPLACED}"}, listed
    for doc in (failed, waiting):
        assert flower.get(f"/api/jobs/job?id={doc['taskId']}")["taskId"] == doc["taskId"]
        shown = run_cli("show", doc["taskId"], "--broker", broker_url)
        assert shown.returncode == 0 and REPLACED in shown.stdout, shown
    # By the id the lists show: no look-up holds its bytes, and the answer says what to give instead.
    listed_id = urllib.parse.quote(f"f-{REPLACED}")
    for method, path in (("GET", f"/api/jobs/job?id={listed_id}"), ("POST", f"/api/jobs/job/retry?id={listed_id}")):
        status, body = flower.request(method, path, {})
        assert status == 404 and json.loads(body)["error"].endswith("give its task id)"), (path, body)
    shown = run_cli("show", f"f-{REPLACED}", "--broker", broker_url)
    assert shown.returncode == 1 and shown.stderr.endswith("give its task id)\n"), shown
    assert "Traceback" not in flower.log(), flower.log()[-3000:]
