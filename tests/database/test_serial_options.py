"""Serial keys from Celery's side: the task option `serial_on` and the call options `serial_key` / `serial_on` give
a job its `serialKey` (what the claim serialises on, tests/database/test_limits.py), and bad ones are refused with
nothing written."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from pymongo.database import Database

from bb_broker import UniqueOptionError
from bb_broker.jobs.serial import MAX_SERIAL_KEY_LENGTH, SERIAL_KEY_HEADER

NAME = "tests.serial_options."


@pytest.fixture
def tasks(app: Celery) -> dict[str, Any]:
    @app.task(name=NAME + "invoice", serial_on=("account_id",), shared=False)
    def invoice(account_id: int, amount: int = 0) -> int:
        return amount

    @app.task(name=NAME + "plain", shared=False)
    def plain(account_id: int) -> int:
        return account_id

    @app.task(name=NAME + "both", unique=True, serial_key="reports", shared=False)
    def both(day: str) -> str:
        return day

    return {"invoice": invoice, "plain": plain, "both": both}


def serial_key(db: Database, task_id: str) -> Any:
    doc = db.jobs.find_one({"taskId": task_id})
    assert doc is not None
    return doc.get("serialKey")


def test_serial_on_keys_the_jobs_of_one_account_together(tasks, db: Database) -> None:
    first = tasks["invoice"].delay(7, 10)
    same = [tasks["invoice"].delay(7, 20), tasks["invoice"].apply_async(kwargs={"account_id": 7})]
    other = tasks["invoice"].delay(8, 10)
    key = serial_key(db, first.id)
    assert key.startswith(NAME + "invoice:") and len(key) <= MAX_SERIAL_KEY_LENGTH
    assert [serial_key(db, result.id) for result in same] == [key, key]  # queued freely, all of them
    assert serial_key(db, other.id) not in (None, key)
    assert serial_key(db, tasks["plain"].delay(7).id) is None  # a task without the option pays nothing


def test_a_call_s_serial_key_or_serial_on_overrides_the_task_s(tasks, db: Database) -> None:
    given = tasks["invoice"].apply_async((7, 10), serial_key="account:7")
    assert serial_key(db, given.id) == "account:7"
    on_amount = tasks["invoice"].apply_async((7, 10), serial_on=("amount",))
    assert serial_key(db, on_amount.id) not in (None, "account:7", serial_key(db, tasks["invoice"].delay(7, 1).id))
    plain = tasks["plain"].apply_async((3,), serial_key="account:3")  # a call's option on a task without one
    assert serial_key(db, plain.id) == "account:3"


def test_a_header_set_by_hand_is_kept(tasks, db: Database) -> None:
    result = tasks["invoice"].apply_async((7,), headers={SERIAL_KEY_HEADER: "by-hand"})
    assert serial_key(db, result.id) == "by-hand"


def test_serial_and_unique_options_together(tasks, db: Database) -> None:
    result = tasks["both"].delay("monday")
    job = db.jobs.find_one({"taskId": result.id})
    assert job is not None and job["serialKey"] == "reports" and job["unique"]["mode"] == "active"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"serial_key": 42}, "serial_key must be a non-empty string of at most 512 characters, not 42"),
        ({"serial_key": ""}, "serial_key must be a non-empty string"),
        ({"serial_key": "k" * (MAX_SERIAL_KEY_LENGTH + 1)}, "serial_key must be a non-empty string"),
        ({"serial_key": "a", "serial_on": ("account_id",)}, "serial_key and serial_on do not go together"),
        ({"serial_on": ("customer",)}, "serial_on names 'customer', not an argument of tests.serial_options.invoice"),
        ({"serial_on": (5,)}, "serial_on position 5 is not among the 1 positional arguments"),
        ({"serial_on": {"x": 1}}, "serial_on must be argument names or positions"),
    ],
    ids=["not-a-string", "empty", "too-long", "both", "unknown-name", "no-such-position", "not-names"],
)
def test_a_bad_serial_option_is_refused_with_nothing_written(tasks, db: Database, options, message) -> None:
    with pytest.raises(UniqueOptionError, match=message.replace("(", r"\(")):
        tasks["invoice"].apply_async((7,), **options)
    assert db.jobs.count_documents({}) == 0


def test_arguments_that_are_not_json_say_which_option_to_give(tasks, db: Database) -> None:
    with pytest.raises(UniqueOptionError, match="give serial_key, or serial_on naming JSON arguments"):
        tasks["invoice"].apply_async((object(),), serializer="pickle")
    assert db.jobs.count_documents({}) == 0
