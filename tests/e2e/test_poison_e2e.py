"""Poison task messages: headers, properties and bodies a Celery worker would choke on, through a real worker.

Each is written into its job's stored payload by hand (as another program, or an edited document, would), so the
producer's own check cannot stop it: the claim must. Each fails its own job once, naming the field; the worker
keeps running and the job queued behind them all runs.
"""

from __future__ import annotations

import base64
import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Producer, Queue
from pymongo.database import Database

import bb_broker
from tests.support.workers import job, producer, send, settled, wait_for

#: A JSON body kept as it is instead of as args, kwargs and options.
UNREADABLE_ARGS = {"payload.args": "", "payload.kwargs": "", "payload.options": ""}

#: (what it is, the change made to a stored payload of `add(1, 2)`, the field lastError must name)
POISONS: list[tuple[str, dict[str, Any], str]] = [
    ("timelimit text", {"$set": {"payload.headers.timelimit": "x"}}, "header 'timelimit'"),
    ("timelimit of three", {"$set": {"payload.headers.timelimit": [1, 2, 3]}}, "header 'timelimit'"),
    ("timelimit of text", {"$set": {"payload.headers.timelimit": ["a", None]}}, "header 'timelimit'"),
    ("timelimit negative", {"$set": {"payload.headers.timelimit": [-1, None]}}, "header 'timelimit'"),
    ("eta not a date", {"$set": {"payload.headers.eta": "not-a-date"}}, "header 'eta'"),
    ("expires junk", {"$set": {"payload.headers.expires": "5j"}}, "header 'expires'"),
    ("expires a number", {"$set": {"payload.headers.expires": 5}}, "header 'expires'"),
    ("retries negative", {"$set": {"payload.headers.retries": -1}}, "header 'retries'"),
    (
        "unique mode unknown",
        {"$set": {"payload.headers.bb_unique_key": "k", "payload.headers.bb_unique_mode": "sometimes"}},
        "header 'bb_unique_mode'",
    ),
    ("unique period without its mode", {"$set": {"payload.headers.bb_unique_period": 5}}, "header 'bb_unique_key'"),
    ("retries text", {"$set": {"payload.headers.retries": "x"}}, "header 'retries'"),
    ("id a list", {"$set": {"payload.headers.id": [1, 2]}}, "header 'id'"),
    ("task a list", {"$set": {"payload.headers.task": ["tests.support.e2e_app.add"]}}, "header 'task'"),
    ("root_id a document", {"$set": {"payload.headers.root_id": {"a": 1}}}, "header 'root_id'"),
    ("group a number", {"$set": {"payload.headers.group": 7}}, "header 'group'"),
    ("shadow a list", {"$set": {"payload.headers.shadow": ["x"]}}, "header 'shadow'"),
    ("argsrepr a list", {"$set": {"payload.headers.argsrepr": [1]}}, "header 'argsrepr'"),
    ("stamps a list", {"$set": {"payload.headers.stamps": [1]}}, "header 'stamps'"),
    ("stamped_headers text", {"$set": {"payload.headers.stamped_headers": 5}}, "header 'stamped_headers'"),
    ("ignore_result text", {"$set": {"payload.headers.ignore_result": "yes"}}, "header 'ignore_result'"),
    ("compression unknown", {"$set": {"payload.headers.compression": "zstd-x"}}, "header 'compression'"),
    ("broker retries text", {"$set": {"payload.headers.bb_broker_retries": "x"}}, "header 'bb_broker_retries'"),
    ("priority text", {"$set": {"payload.properties.priority": "high"}}, "property 'priority'"),
    ("delivery_info a list", {"$set": {"payload.properties.delivery_info": [1]}}, "property 'delivery_info'"),
    ("routing_key a list", {"$set": {"payload.properties.delivery_info.routing_key": [1]}}, "routing_key'"),
    ("reply_to a number", {"$set": {"payload.properties.reply_to": 5}}, "property 'reply_to'"),
    ("bb_publish_id a document", {"$set": {"payload.properties.bb_publish_id": {"celery": {"a": 1}}}}, "bb_publish_id"),
    ("args a document", {"$set": {"payload.args": {"x": 1}}}, "body's args"),
    ("kwargs a list", {"$set": {"payload.kwargs": [1]}}, "body's kwargs"),
    ("embed text", {"$set": {"payload.options": "x"}}, "body's embed"),
    ("callbacks junk", {"$set": {"payload.options.callbacks": ["junk"]}}, "'callbacks'"),
    ("errbacks a document", {"$set": {"payload.options.errbacks": {"task": "x"}}}, "'errbacks'"),
    ("chord text", {"$set": {"payload.options.chord": "x"}}, "'chord'"),
    (
        "body of two",
        {"$set": {"payload.body": [[1, 2], {}], "payload.bodyFormat": "json"}, "$unset": UNREADABLE_ARGS},
        "body",
    ),
    (
        "body not JSON",
        {"$set": {"payload.body": "bm90IGpzb24=", "payload.bodyFormat": "base64"}, "$unset": UNREADABLE_ARGS},
        "body",
    ),
]  # fmt: skip


def test_every_poison_message_fails_its_own_job_once_and_the_worker_keeps_going(
    app, db: Database, worker_factory
) -> None:
    poisoned = {}
    for name, change, _ in POISONS:
        task_id = send(app, "add", 1, 2)
        assert db.jobs.update_one({"taskId": task_id}, change).modified_count == 1, name
        poisoned[name] = task_id
    # A whole document written with pymongo, as another program would: a copy of a published job, its own ids.
    template = db.jobs.find_one({"taskId": send(app, "add", 1, 2)}, {"_id": 0})
    db.jobs.delete_many({"taskId": template["taskId"]})
    template["payload"]["headers"].update({"id": "hand-written", "timelimit": [1, 2, 3]})
    db.jobs.insert_one({**template, "_id": "hand-written-job", "taskId": "hand-written"})
    poisoned["hand-written document"] = "hand-written"
    # Plain messages written by hand that Celery's consumer still takes as tasks (their `task` header): no id, or a
    # task that is not a name. Never jobs, they are set aside where they are.
    plain_poisons = {"no id": {"task": "tests.support.e2e_app.add"}, "task a list": {"task": ["x"], "id": "plain-2"}}
    for headers in plain_poisons.values():
        db.bb_messages.insert_one(
            {"queue": "celery", "priority": 0, "payload": _plain_task(headers), "expiresAt": _soon()}
        )
    sentinel = send(app, "add", 20, 22)  # behind every poison job in the queue
    worker = worker_factory()
    wait_for(settled(db, sentinel, "succeeded"), timeout=120, message="the job behind the poison ones")
    for name, field in [*((name, field) for name, _, field in POISONS), ("hand-written document", "'timelimit'")]:
        failed = wait_for(settled(db, poisoned[name], "failed"), timeout=120, message=f"{name} failed")
        assert failed["attempts"] == 1, (name, failed["attempts"], failed.get("lastError"))
        assert "malformed message" in failed["lastError"] and field in failed["lastError"], (name, failed["lastError"])
        assert [entry["outcome"] for entry in failed["history"]] == ["failed"], name
    aside = wait_for(
        lambda: (docs := list(db.bb_messages.find({"unreadable": {"$exists": True}}))) and len(docs) == 2 and docs,
        message="the plain poison messages set aside",
    )
    assert sorted(doc["unreadable"].split(" must ")[0] for doc in aside) == [
        "malformed message: header 'id'",
        "malformed message: header 'task'",
    ]
    assert worker.process.poll() is None, "the worker died"
    assert "Unrecoverable error" not in worker.log()
    again = send(app, "add", 2, 2)
    wait_for(settled(db, again, "succeeded"), message="the worker still takes work")


def test_a_job_failed_at_its_claim_tells_the_apps_own_result_backend(
    app, db: Database, worker_factory, tmp_path: Path
) -> None:
    # A worker never receives such a task, so a result backend of the app's own (Redis, a database, files) was told
    # nothing: its result stayed PENDING, and `get()` without a timeout waited for ever.
    results = tmp_path / "results"
    results.mkdir()
    backend = f"file://{results}"
    poisoned = {
        "header 'timelimit'": {"$set": {"payload.headers.timelimit": "x"}},  # a message Celery would choke on
        "stored message is unreadable": {"$set": {"payload": "add(1, 2)"}},  # no stored message at all
    }
    task_ids: dict[str, list[str]] = {}
    for said, change in poisoned.items():
        task_ids[said] = [send(app, "add", 1, 2) for _ in range(4)]  # claimed in a batch: told one after the other
        assert db.jobs.update_many({"taskId": {"$in": task_ids[said]}}, change).modified_count == 4, said
    # One more, whose result a backend that does not answer keeps: the file backend writes into a pipe no one reads.
    hanging = send(app, "add", 1, 2)
    assert db.jobs.update_one({"taskId": hanging}, {"$set": {"payload.headers.retries": -1}}).modified_count == 1
    os.mkfifo(results / f"celery-task-meta-{hanging}")
    sentinel = send(app, "add", 20, 22)
    worker_factory(env={"BB_RESULT_BACKEND": backend})
    # The worker's event loop does not wait on that backend: the job behind runs.
    wait_for(settled(db, sentinel, "succeeded"), timeout=120, message="the job behind the poison ones")
    reader = producer(app.conf.broker_url)
    reader.conf.result_backend = backend
    try:
        for said, ids in task_ids.items():
            for task_id in ids:
                failed = wait_for(settled(db, task_id, "failed"), message=f"{said}: its job failed")
                assert said in failed["lastError"], failed["lastError"]
                with pytest.raises(Exception, match=re.escape(said)):
                    reader.AsyncResult(task_id).get(timeout=30)
                assert reader.AsyncResult(task_id).state == "FAILURE"
    finally:
        reader.close()
    # Its telling waits on the pipe, off the loop (Celery's backend first reads what the task has stored), and is
    # made once the backend answers: nothing stored yet, then its FAILURE written.
    fifo = results / f"celery-task-meta-{hanging}"
    os.close(wait_for(lambda: _opened(fifo, os.O_WRONLY), message="the telling waits on the backend's answer"))
    pipe = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        told = wait_for(lambda: _read_some(pipe), message="the waiting telling written")
    finally:
        os.close(pipe)
    assert b"FAILURE" in told and b"header 'retries'" in told, told


def _opened(fifo: Path, mode: int) -> int | None:
    """The pipe opened without waiting, once the other end is open (a writer's open fails until a reader waits)."""
    try:
        return os.open(fifo, mode | os.O_NONBLOCK)
    except OSError:
        return None


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)  # nothing (no writer yet) until the writer has written
    except BlockingIOError:
        return b""


#: Deeper than any JSON decoder's recursion allows: 100,000 nested lists, 200 KB.
DEEP = "[" * 100_000 + "]" * 100_000


def test_hostile_documents_only_a_hand_edit_makes_fail_their_own_jobs_and_the_worker_keeps_going(
    app, db: Database, worker_factory
) -> None:
    # Each ended the worker ("Unrecoverable error") at every claim of its job, until its attempts were spent as
    # "the worker shut down while the task ran". A stored message in Kombu's JSON (`payload.raw`, the form kept when
    # BSON cannot hold a header) holds what BSON cannot: an int of any size, nesting of any depth.
    raw = {
        "raw not an object": ("null", {}, "not a JSON object"),
        "raw timelimit no float holds": (None, {"timelimit": [10**400, None]}, "malformed message: header 'timelimit'"),
        "raw period no float holds": (
            None,
            {"bb_unique_key": "k", "bb_unique_mode": "period", "bb_unique_period": 10**400},
            "malformed message: header 'bb_unique_period'",
        ),
        "raw nested too deep": (None, {"deep": "DEEP"}, "RecursionError"),
    }
    failing = {}
    for name, (text, headers, error) in raw.items():
        task_id = send(app, "add", 1, 2)
        payload = job(db, task_id)["payload"]
        db.jobs.update_one({"taskId": task_id}, {"$set": {"payload": _raw_payload(payload, text, headers)}})
        failing[name] = (task_id, error)
    deep_body = send(app, "add", 1, 2)
    body = base64.b64encode(DEEP.encode()).decode()
    db.jobs.update_one({"taskId": deep_body}, {"$set": {"payload.body": body, "payload.bodyFormat": "base64"},
                                               "$unset": UNREADABLE_ARGS})  # fmt: skip
    failing["body nested too deep"] = (deep_body, "malformed message: the body must be JSON")
    tiny = send(app, "add", 1, 2)
    period = {"bb_unique_key": "k", "bb_unique_mode": "period", "bb_unique_period": 1e-300}
    db.jobs.update_one({"taskId": tiny}, {"$set": {f"payload.headers.{k}": v for k, v in period.items()}})
    failing["period below a millisecond"] = (tiny, "malformed message: header 'bb_unique_period'")
    # A null delivery_info is what check_envelope lets through (none): the job runs.
    no_delivery_info = send(app, "add", 1, 2)
    db.jobs.update_one({"taskId": no_delivery_info}, {"$set": {"payload.properties.delivery_info": None}})
    sentinel = send(app, "add", 20, 22)  # behind them all
    worker = worker_factory()
    wait_for(settled(db, sentinel, "succeeded"), timeout=120, message="the job behind the hostile ones")
    for name, (task_id, error) in failing.items():
        failed = wait_for(settled(db, task_id, "failed"), timeout=120, message=f"{name} failed")
        assert failed["attempts"] == 1 and error in failed["lastError"], (name, failed["attempts"], failed["lastError"])
    assert wait_for(settled(db, no_delivery_info, "succeeded"), message="the job without delivery_info ran")
    assert worker.process.poll() is None, worker.log()[-3000:]
    assert "Unrecoverable error" not in worker.log()


def _raw_payload(payload: dict[str, Any], text: str | None, headers: dict[str, Any]) -> dict[str, Any]:
    """A stored payload in Kombu's JSON form with `headers` changed, or `text` as its JSON."""
    if text is None:
        message = {"headers": {**payload["headers"], **headers}, "properties": payload["properties"],
                   "content-type": payload["contentType"], "content-encoding": payload["contentEncoding"],
                   "body": None}  # fmt: skip
        text = json.dumps(message).replace('"DEEP"', DEEP)
    body = json.dumps([payload["args"], payload["kwargs"], payload["options"]]).encode()
    return {"raw": text, "body": base64.b64encode(body).decode()}


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"headers": {"timelimit": "x"}}, "header 'timelimit'"),
        ({"headers": {"timelimit": [1, 2, 3]}}, "header 'timelimit'"),
        ({"headers": {"timelimit": [10**400, None]}}, "header 'timelimit'"),  # no float holds it (it raised)
        ({"headers": {"retries": -1}}, "header 'retries'"),
        ({"headers": {"eta": "not-a-date"}}, "header 'eta'"),
        ({"headers": {"expires": "5j"}}, "header 'expires'"),
        ({"headers": {"id": ["a"]}}, "header 'id'"),
        ({"headers": {"stamps": [1]}}, "header 'stamps'"),
        ({"bb_publish_id": {"celery": {"a": 1}}}, "property 'bb_publish_id'"),
        ({"bb_publish_id": ["x"]}, "property 'bb_publish_id'"),
        ({"bb_publish_id": 5}, "property 'bb_publish_id'"),
        ({"link": "junk"}, "'callbacks'"),
    ],
)
def test_a_malformed_task_message_is_refused_at_the_producer(app, db: Database, options, field) -> None:
    with pytest.raises(bb_broker.MalformedTaskMessage, match=field):
        app.send_task("tests.support.e2e_app.add", args=(1, 2), **options)
    assert db.jobs.count_documents({}) == 0


def test_a_poison_body_only_celery_decodes_fails_its_job_before_the_worker_ends(
    app, db: Database, worker_factory
) -> None:
    """A YAML body is Celery's to decode (only if the app accepts YAML): the claim does not parse it. One that is not
    [args, kwargs, embed] ends Celery's consumer; its job fails first, once, so no other worker takes it again."""
    poison = app.send_task("tests.support.e2e_app.add", args=(1, 2), serializer="yaml").id
    two_parts = base64.b64encode(b"[1, 2]\n").decode()
    assert db.jobs.update_one({"taskId": poison}, {"$set": {"payload.body": two_parts}}).modified_count == 1
    accepting_yaml = {"BB_ACCEPT_CONTENT": "json,yaml"}
    first = worker_factory(env=accepting_yaml)
    failed = wait_for(settled(db, poison, "failed"), timeout=120, message="the poison job failed")
    assert failed["attempts"] == 1 and "ValueError" in failed["lastError"], failed["lastError"]
    assert first.wait(timeout=120) != 0 and "Unrecoverable error" in first.log()  # Celery's own choice
    worker_factory(env=accepting_yaml)
    sentinel = send(app, "add", 20, 22)
    wait_for(settled(db, sentinel, "succeeded"), timeout=120, message="the next worker's job")
    assert job(db, poison)["attempts"] == 1 and job(db, poison)["status"] == "failed"


def test_a_task_message_without_an_id_is_refused_at_a_kombu_producer(broker_url: str, db: Database) -> None:
    """Not a task message for the transport (no id), it would be a plain one; Celery's consumer would take it as a
    task (its `task` header) and end on it."""
    with Connection(broker_url) as conn:
        producer = Producer(conn.default_channel)
        with pytest.raises(bb_broker.MalformedTaskMessage, match="header 'id'"):
            producer.publish([[1, 2], {}, {}], routing_key="celery", headers={"task": "t"}, declare=[Queue("celery")])
    assert db.bb_messages.count_documents({}) == 0 and db.jobs.count_documents({}) == 0


def _plain_task(headers: dict[str, Any]) -> str:
    """A bb_messages payload as Kombu stores one: a JSON body, base64-encoded."""
    body = base64.b64encode(json.dumps([[1, 2], {}, {}]).encode()).decode()
    properties = {"body_encoding": "base64", "delivery_info": {"exchange": "", "routing_key": "celery"}}
    message = {"body": body, "content-type": "application/json", "content-encoding": "utf-8", "headers": headers}
    return json.dumps({**message, "properties": properties})


def _soon() -> datetime:
    return datetime.now(UTC) + timedelta(minutes=10)
