"""Retry with changed arguments (bb_broker.ops.rerun) and the flow-control keys, against the real server: a key made of
the arguments is made again of the new ones, a key given by name is kept (and a holder of it refuses the send), a
key the process cannot make again is refused; nothing written on a refusal."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.jobs.unique import digest
from bb_broker.ops.operations import Operations
from bb_broker.ops.rerun import RerunRefused, plan, send
from tests.support import unique_app
from tests.support.unique_app import NAME
from tests.support.workers import wait_for


@pytest.fixture
def store(db: Database) -> JobStore:
    store = JobStore(db, Policy(max_attempts=1))
    store.ensure_indexes()
    return store


def failed(store: JobStore, task_id: str) -> dict[str, Any]:
    """The job of `task_id`, claimed and failed for good (its unique key given back), as every job before it. Waited
    for: the publisher's reading of the server's clock, which made its runAfter, and the store's, which says what is
    due, are each good to half a round trip; on a loaded machine a job published just now can be due a moment later
    for the store."""

    def claimed_up_to_it() -> dict[str, Any] | None:
        while (claimed := store.claim("celery", "worker-1")) is not None:
            store.fail(claimed.id, claimed.attempts, "ValueError: broke")
            if claimed.task_id == task_id:
                return store.coll.find_one({"_id": claimed.id})
        return None

    return wait_for(claimed_up_to_it, timeout=30, message=f"the job of task {task_id} claimed and failed")


def test_keys_made_of_the_arguments_are_made_again_and_a_given_key_is_kept(
    app: Celery, store: JobStore, db: Database
) -> None:
    tasks = unique_app.register(app)
    operations = Operations(store)

    # unique=True: the key is every argument's; made again of the new ones, held by the new job.
    original = failed(store, tasks["add"].delay(1, 2).id)
    assert original["unique"]["key"] == f"{NAME}add:{digest([[1, 2], {}], NAME + 'add')}"
    rerun = plan(operations, original["_id"], [3, 4], None)
    new_key = f"{NAME}add:{digest([[3, 4], {}], NAME + 'add')}"
    assert rerun.preview()["message"]["headers"]["bb_unique_key"] == new_key
    assert any("unique key is made again" in note for note in rerun.notes)
    with app.connection_for_write() as connection:
        new = send(operations, rerun, connection, by="ops")
    assert new["uniqueActive"] == new_key and new["replaces"] == original["_id"]

    # unique_on=("account_id",): made of the task's options where the task is known here, refused where not.
    charge = failed(store, tasks["charge"].delay(7, amount=5).id)
    refused = pytest.raises(RerunRefused, plan, operations, charge["_id"], [8], None)
    assert refused.value.reason == "conflict" and "options this process does not have" in str(refused.value)
    rerun = plan(operations, charge["_id"], [8], None, task_of=app.tasks.get)
    made = f"{NAME}charge:{digest({'account_id': 8}, NAME + 'charge')}"
    assert rerun.preview()["message"]["headers"]["bb_unique_key"] == made
    unchanged = plan(operations, charge["_id"], None, {"amount": 9}, task_of=app.tasks.get)
    assert unchanged.preview()["message"]["headers"]["bb_unique_key"] == charge["unique"]["key"]
    named = pytest.raises(RerunRefused, plan, operations, charge["_id"], [], {"amount": 1}, task_of=app.tasks.get)
    assert named.value.reason == "bad input" and "make no unique key" in str(named.value)

    # unique_key= given by the call: kept whatever the arguments; a job holding it refuses the send, nothing written.
    plain = failed(store, tasks["plain"].apply_async((1,), unique_key="nightly").id)
    with app.connection_for_write() as connection:
        first = send(operations, plan(operations, plain["_id"], [2], None), connection, by="ops")
        assert first["uniqueActive"] == "nightly"
        before = list(db.jobs.find({}).sort("_id", 1))
        held = pytest.raises(RerunRefused, send, operations, plan(operations, plain["_id"], [3], None), connection,
                             by="ops")  # fmt: skip
    assert held.value.reason == "conflict" and "a job with unique key 'nightly' exists already" in str(held.value)
    assert list(db.jobs.find({}).sort("_id", 1)) == before


def test_a_fair_key_made_of_the_arguments_is_made_again(app: Celery, store: JobStore) -> None:
    # It was kept: the new job waited in the turn of the customer it no longer was for.
    tasks = unique_app.register(app)
    operations = Operations(store)
    original = failed(store, tasks["notify"].delay(7).id)
    assert original["fairKey"] == f"{NAME}notify:{digest({'customer_id': 7}, NAME + 'notify')}"
    rerun = plan(operations, original["_id"], [8], None, task_of=app.tasks.get)
    made = f"{NAME}notify:{digest({'customer_id': 8}, NAME + 'notify')}"
    assert rerun.preview()["message"]["headers"]["bb_fair_key"] == made
    assert any("fair key is made again" in note for note in rerun.notes)
    with app.connection_for_write() as connection:
        assert send(operations, rerun, connection, by="ops")["fairKey"] == made
    # A `fair_key=` value that is no key (a number, a document) is digested as one made of arguments is: kept as given,
    # never a refusal (a fair key only orders the claims).
    for given in (7, {"customer": 7}):
        plain = failed(store, tasks["plain"].apply_async((1,), fair_key=given).id)
        kept = plan(operations, plain["_id"], [2], None, task_of=app.tasks.get)
        assert kept.preview()["message"]["headers"]["bb_fair_key"] == plain["fairKey"]
        assert (
            plan(operations, plain["_id"], [2], None).preview()["message"]["headers"]["bb_fair_key"] == plain["fairKey"]
        )
