"""The operator's queries and actions (ops.queries, ops.operations, jobs.revokes) on a real server: lists, look-ups,
actions, refusals."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.queues import CONTROL_SETTLE, QueueControls
from bb_broker.jobs.revokes import revoke_queued, revoked_task_ids
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import FilterError, JobFilter
from bb_broker.ops.operations import ActionRefused, Operations
from bb_broker.ops.present import arguments
from tests.support.store import CommandLog, FakeClock, assert_lists_read_through_an_index


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ops(db: Database, clock: FakeClock) -> Operations:
    store = JobStore(db, Policy(max_attempts=1, stale_after=60.0), clock=clock)
    store.ensure_indexes(retention=0)
    return Operations(store)


def publish(ops: Operations, task_id: str, *, queue: str = "celery", kind: str = "app.add", eta: bool = False) -> str:
    headers = {"id": task_id, "task": kind, "eta": "2030-01-01T00:00:00+00:00" if eta else None}
    payload = {"args": [1], "kwargs": {}, "options": {}, "headers": headers, "properties": {"correlation_id": task_id}}
    return ops.store.publish(queue=queue, kind=kind, task_id=task_id, payload=payload, priority=0, run_after=None,
                             is_retry=False)  # fmt: skip


def failed(ops: Operations, task_id: str, **kwargs) -> str:
    job_id = publish(ops, task_id, **kwargs)
    job = ops.store.claim(kwargs.get("queue", "celery"), "w")
    assert job is not None and job.id == job_id
    ops.store.fail(job.id, job.attempts, f"{task_id} broke")
    return job_id


def test_find_by_job_id_or_task_id(ops: Operations) -> None:
    job_id = publish(ops, "task-1")
    assert ops.find(job_id)["taskId"] == "task-1"
    assert ops.find("task-1")["_id"] == job_id
    assert ops.find("nothing") is None


def test_retry_by_job_or_task_id_says_which_matched_nothing(ops: Operations, db: Database) -> None:
    a = failed(ops, "task-a")
    b = failed(ops, "task-b")
    queued = publish(ops, "task-q")
    retried = ops.retry([a, "task-b", queued, "nope"], by="alice")
    assert sorted(retried.job_ids) == sorted([a, b]) and retried.unmatched == [queued, "nope"]
    for job_id in (a, b):
        doc = db.jobs.find_one({"_id": job_id})
        assert doc["status"] == "queued" and doc["attempts"] == 0 and "finishedAt" not in doc
        assert doc["actions"][-1]["action"] == "retry" and doc["actions"][-1]["by"] == "alice"
    assert db.jobs.find_one({"_id": queued})["status"] == "queued"


def test_a_job_written_by_hand_under_a_document_id_is_refused_and_nothing_else_breaks(
    ops: Operations, db: Database
) -> None:
    # Its _id could not be hashed: a retry by its task id raised TypeError half-way (the job already queued again,
    # where a claim fails it as malformed), and an action on it was a 500 in the Jobs tab.
    job_id = failed(ops, "task-dict")
    doc = db.jobs.find_one_and_delete({"_id": job_id})
    db.jobs.insert_one({**doc, "_id": {"legacy": job_id}})
    sound = failed(ops, "task-sound")
    retried = ops.retry(["task-dict", "task-sound"], by="alice")
    assert retried.job_ids == [sound] and retried.held == {
        "task-dict": f"job {{'legacy': {job_id!r}}} stays failed: its _id is object, not a string: no worker can run it"
    }
    assert db.jobs.find_one({"taskId": "task-dict"})["status"] == "failed"
    with pytest.raises(ActionRefused, match="has an _id that is not a string"):
        ops.act("retry", "task-dict", by="alice")
    raw = {"raw": "[" * 100_000 + "]" * 100_000}  # nested beyond the JSON decoder's depth, as a hand edit can
    assert arguments({"payload": raw}) == {} and arguments({"payload": {"raw": '{"headers": 5}'}}) == {}


def test_a_revoked_job_is_retried_under_a_new_task_id_due_now(ops: Operations, db: Database) -> None:
    job_id = publish(ops, "task-r", eta=True)
    assert revoke_queued(ops.store, ["task-r", "unknown"], by="tester") == 1
    doc = db.jobs.find_one({"_id": job_id})
    assert doc["status"] == "failed" and doc["lastError"] == "revoked before it ran" and doc["revokedAt"]
    assert doc["actions"][-1]["action"] == "revoke"

    assert ops.retry(["task-r"], by="alice").job_ids == [job_id]
    doc = db.jobs.find_one({"_id": job_id})
    # Every worker that saw the revoke keeps the old id in memory: the job runs under a new one, now.
    new_id = doc["taskId"]
    assert new_id != "task-r" and doc["payload"]["headers"]["id"] == new_id
    assert doc["payload"]["properties"]["correlation_id"] == new_id and doc["payload"]["headers"]["eta"] is None
    assert doc["status"] == "queued" and "revokedAt" not in doc
    assert doc["actions"][-1] | {"at": None} == {
        "action": "retry", "by": "alice", "at": None, "previousTaskId": "task-r", "taskId": new_id,
    }  # fmt: skip
    # A job that merely failed keeps its task id.
    plain = failed(ops, "task-p", queue="other")
    ops.retry([plain], by="alice")
    assert db.jobs.find_one({"_id": plain})["taskId"] == "task-p"


class RetriedMeanwhile(Operations):
    """An operator's retry that another operator's retry of the same jobs overtakes: both read them failed, the other
    one's write lands first."""

    def _retry_docs(self, docs, **kwargs):
        docs = list(docs)
        Operations(self.store).retry([doc["_id"] for doc in docs], by="alice")
        return super()._retry_docs(docs, **kwargs)


def test_two_retries_of_a_revoked_job_at_once_rename_it_once(ops: Operations, db: Database) -> None:
    job_id = publish(ops, "task-r")
    revoke_queued(ops.store, ["task-r"], by="tester")
    assert RetriedMeanwhile(ops.store).retry(["task-r"], by="bob").job_ids == []  # alice's landed: not bob's
    doc = db.jobs.find_one({"_id": job_id})
    assert doc["status"] == "queued" and [action["by"] for action in doc["actions"]] == ["tester", "alice"]
    # The old id names the task id the job runs under: alice's, not one bob chose that no job has.
    assert doc["actions"][-1]["taskId"] == doc["taskId"] and doc["renamedFrom"] == "task-r"
    kept = db.bb_results.find_one({"_id": "task:task-r"})
    assert kept["state"] == "REVOKED" and kept["lastError"].endswith(f"as task {doc['taskId']}")


def test_revoke_leaves_running_and_finished_jobs_to_the_workers(ops: Operations, db: Database) -> None:
    running = publish(ops, "task-run")
    assert ops.store.claim("celery", "w").id == running
    done = failed(ops, "task-done")
    assert revoke_queued(ops.store, ["task-run", "task-done"], by="t") == 0
    assert db.jobs.find_one({"_id": running})["status"] == "running"
    assert db.jobs.find_one({"_id": done})["lastError"] == "task-done broke"


def test_each_action_and_each_refusal(ops: Operations, db: Database, clock: FakeClock) -> None:
    fail = failed(ops, "task-failed")
    done = publish(ops, "task-done")
    assert ops.store.claim("celery", "w").id == done
    ops.store.succeed(done, 1)
    running = publish(ops, "task-running")
    claimed = ops.store.claim("celery", "w")
    assert claimed is not None and claimed.id == running
    waiting = publish(ops, "task-waiting")

    with pytest.raises(ActionRefused, match="no job has the id or task id 'nope'") as refused:
        ops.act("cancel", "nope", by="alice")
    assert refused.value.reason == "not found"
    for action, job_id, status in [("cancel", running, "running"), ("retry", waiting, "queued"),
                                   ("delete", running, "running"), ("requeue", done, "succeeded")]:  # fmt: skip
        with pytest.raises(ActionRefused, match=f"is {status}: {action} needs it") as refused:
            ops.act(action, job_id, by="alice")
        assert refused.value.reason == "conflict"
    with pytest.raises(ActionRefused, match="live lease"):
        ops.act("requeue", running, by="alice")

    doc = ops.act("cancel", "task-waiting", by="alice")
    assert doc["status"] == "failed" and doc["lastError"] == "cancelled by alice" and doc["finishedAt"]
    assert [(a["action"], a["by"]) for a in doc["actions"]] == [("cancel", "alice")]
    assert ops.store.claim("celery", "w") is None  # no worker may take it

    clock.advance(61)  # the running job's lease runs out
    doc = ops.act("requeue", running, by="bob")
    assert doc["status"] == "queued" and "leaseOwner" not in doc and doc["lastError"].startswith("requeued by bob")
    assert ops.act("retry", fail, by="carol")["status"] == "queued"
    assert ops.act("delete", done, by="dave") == {"_id": done, "deleted": True}
    assert db.jobs.find_one({"_id": done}) is None


def test_bulk_actions_count_then_act_on_the_filter(ops: Operations, db: Database) -> None:
    for i in range(3):
        failed(ops, f"mail-{i}", queue="mail")
    failed(ops, "other", queue="celery")
    publish(ops, "queued-mail", queue="mail")
    mail = JobFilter(queue="mail")
    assert ops.count(mail) == 4
    assert ops.count(mail, "retry") == 3 and ops.count(mail, "cancel") == 1 and ops.count(mail, "requeue") == 0
    assert ops.count(JobFilter(queue="mail", status="queued"), "retry") == 0
    assert ops.act_on_filter("retry", JobFilter(queue="mail", status="queued"), by="x") == 0
    assert ops.act_on_filter("retry", mail, by="x") == 3
    assert db.jobs.count_documents({"queue": "mail", "status": "queued"}) == 4
    assert db.jobs.find_one({"taskId": "other"})["status"] == "failed"
    assert ops.act_on_filter("cancel", mail, by="x") == 4
    assert ops.act_on_filter("delete", mail, by="x") == 4 and ops.count(mail) == 0


def test_lists_page_by_key_newest_first_with_every_filter(ops: Operations, clock: FakeClock) -> None:
    ids = [publish(ops, f"t{i}", queue="mail" if i % 2 else "celery", kind=f"k{i % 3}") for i in range(7)]
    first = ops.list_jobs(JobFilter(), limit=3)
    assert [d["_id"] for d in first.jobs] == ids[::-1][:3] and first.next == ids[4]
    second = ops.list_jobs(JobFilter(), after=first.next, limit=3)
    third = ops.list_jobs(JobFilter(), after=second.next, limit=3)
    assert [d["_id"] for d in second.jobs + third.jobs] == ids[::-1][3:] and third.next is None
    assert "payload" not in first.jobs[0]

    assert [d["_id"] for d in ops.list_jobs(JobFilter(queue="mail")).jobs] == [ids[5], ids[3], ids[1]]
    assert [d["_id"] for d in ops.list_jobs(JobFilter(kind="k0", queue="celery")).jobs] == [ids[6], ids[0]]
    assert ops.list_jobs(JobFilter(status="failed")).jobs == []
    assert len(ops.list_jobs(JobFilter(status="queued", kind="k1")).jobs) == 2


def test_time_range_and_error_search(ops: Operations, db: Database) -> None:
    old = failed(ops, "old-one")
    new = failed(ops, "new-one")
    created = {doc["_id"]: doc["_id"] for doc in db.jobs.find()}
    assert set(created) == {old, new}
    now = JobFilter.parse({}, ops.now())  # no filter at all
    assert now == JobFilter()
    everything = JobFilter.parse({"since": "2000-01-01T00:00:00"}, ops.now())
    assert {d["_id"] for d in ops.list_jobs(everything).jobs} == {old, new}
    assert ops.list_jobs(JobFilter.parse({"until": "2000-01-01"}, ops.now())).jobs == []
    hits = ops.list_jobs(JobFilter(error="NEW-ONE BR"))
    assert [d["_id"] for d in hits.jobs] == [new] and not hits.stopped_early
    assert ops.list_jobs(JobFilter(error="a.b")).jobs == []  # the text is literal, not a pattern


def test_a_search_that_takes_too_long_says_it_stopped_early(ops: Operations, db: Database) -> None:
    docs = [{"_id": f"{i:026d}", "status": "failed", "queue": "q", "lastError": "x" * 500} for i in range(3000)]
    db.jobs.insert_many(docs)
    page = ops.list_jobs(JobFilter(error="not there"), search_ms=1)
    assert page.stopped_early and page.jobs == [] and page.next is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"status": "done"}, "status 'done' is not one of"),
        ({"since": "yesterday"}, "is neither an ISO 8601 time nor a duration"),
        ({"since": "1h", "until": "2h"}, "since is after until"),
        ({"queue": "q" * 201}, "queue is longer than 200"),
        ({"colour": "red"}, "unknown filter 'colour'"),
    ],
)
def test_bad_filters_say_what_is_wrong(values: dict, message: str, ops: Operations) -> None:
    with pytest.raises(FilterError, match=message):
        JobFilter.parse(values, ops.now())


def test_bad_paging_says_what_is_wrong(ops: Operations) -> None:
    with pytest.raises(FilterError, match="limit must be between 1 and 200"):
        ops.list_jobs(JobFilter(), limit=0)


def test_a_pause_that_finds_its_queue_paused_answers_after_the_settle_too(db: Database) -> None:
    # "Paused already" may be this very call's own first write, landed with its answer lost and made again by pymongo,
    # or another operator's pause still settling: claims made before it must have had their settle time as well.
    controls = QueueControls(db)
    assert controls.pause("mail", by="alice", now=datetime.now(UTC)) is True
    began = time.monotonic()
    assert controls.pause("mail", by="alice", now=datetime.now(UTC)) is False
    assert time.monotonic() - began >= CONTROL_SETTLE  # a lower bound: a loaded machine only waits longer


def test_pause_and_resume_are_kept_with_who_and_when(ops: Operations, db: Database) -> None:
    assert ops.pause("mail", by="alice") is True
    assert ops.pause("mail", by="bob") is False
    assert ops.paused()["mail"]["pausedBy"] == "alice"
    assert ops.queues(["celery"])["mail"]["paused"] is True and ops.queues(["celery"])["celery"]["paused"] is False
    assert ops.resume("mail", by="bob") is True and ops.resume("mail", by="bob") is False
    assert ops.paused() == {} and db.bb_queues.find_one({"_id": "mail"})["resumedBy"] == "bob"
    with pytest.raises(FilterError):
        ops.pause(" ", by="alice")


def test_queues_come_from_the_collection_too(ops: Operations) -> None:
    failed(ops, "f", queue="reports")
    publish(ops, "q", queue="mail")
    assert list(ops.queues(["celery"])) == ["celery", "mail", "reports"]
    assert ops.queues([])["reports"] == {"queued": 0, "running": 0, "failed": 1, "paused": False}


def test_a_revoke_broadcast_is_recognised_and_nothing_else() -> None:
    body = b'{"method": "revoke", "arguments": {"task_id": ["a", "b"], "terminate": false}}'
    message = {"content-type": "application/json", "content-encoding": "utf-8"}
    assert revoked_task_ids(message, body) == ["a", "b"]
    assert revoked_task_ids(message, b'{"method": "revoke", "arguments": {"task_id": "a"}}') == ["a"]
    assert revoked_task_ids(message, b'{"method": "ping", "arguments": {}}') == []
    assert revoked_task_ids(message, b"not json") == []
    assert revoked_task_ids({"content-type": "application/x-python-serialize"}, b"\x80\x04") == []


def test_lists_look_ups_and_counts_read_through_an_index(mongo_url: str, db: Database, clock: FakeClock) -> None:
    from pymongo import MongoClient

    setup = Operations(JobStore(db, clock=clock))
    setup.store.ensure_indexes(retention=0)
    for i in range(6):
        publish(setup, f"t{i}", queue=("celery", "mail")[i % 2], kind=f"k{i % 3}")
    log = CommandLog()
    with MongoClient(mongo_url, event_listeners=[log], tz_aware=True) as client:
        ops = Operations(JobStore(client[db.name], clock=clock))
        assert_lists_read_through_an_index(ops, db, log)


def test_counting_a_search_that_takes_too_long_is_refused(ops: Operations, db: Database) -> None:
    docs = [{"_id": f"{i:026d}", "status": "failed", "queue": "q", "lastError": "x" * 500} for i in range(3000)]
    db.jobs.insert_many(docs)
    with pytest.raises(FilterError, match="took over 1 ms: narrow the filter"):
        ops.count(JobFilter(error="not there"), "retry", search_ms=1)
    assert ops.count(JobFilter(error="not there"), "retry") == 0


def test_a_consumers_view_of_the_pauses_follows_the_change_stream_or_the_clock(db: Database, clock: FakeClock) -> None:
    from bb_broker.jobs.queues import KnownControls, QueueControls
    from tests.support.workers import wait_for

    controls = QueueControls(db)
    controls.pause("mail", by="t", now=clock.now)
    polled = KnownControls(controls, max_age=0.05)  # no change stream: read again every max_age
    version = [1]
    watched = KnownControls(controls, max_age=0.05, version=lambda: version[0])
    assert "mail" in polled and "mail" in watched and "celery" not in polled
    controls.resume("mail", by="t", now=clock.now)
    wait_for(lambda: "mail" not in polled, message="the polled view sees the resume")
    assert "mail" in watched  # a live stream would have reported it: no read until it does
    version[0] += 1
    assert "mail" not in watched
