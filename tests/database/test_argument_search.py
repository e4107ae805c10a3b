"""Searches inside a task's arguments and headers (ops.filters, ops.queries) on a real server: values only, bounded."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pymongo.database import Database

from bb_broker.jobs.lifecycle import Policy
from bb_broker.jobs.store import JobStore
from bb_broker.ops.filters import FilterError, JobFilter
from bb_broker.ops.operations import Operations
from tests.support.store import FakeClock

#: Values an operator searches for that a query built from text would take for something else.
AWKWARD = ["$where", "$gt", "a.b", "{'$ne': 1}", 'O\'Brien "quoted"', "ünïcødé ✓", "back\\slash", " padded "]


@pytest.fixture
def ops(db: Database) -> Operations:
    store = JobStore(db, Policy(max_attempts=1), clock=FakeClock())
    store.ensure_indexes(retention=0)
    return Operations(store)


def publish(ops: Operations, task_id: str, *args: Any, queue: str = "celery", **kwargs: Any) -> str:
    headers = {"id": task_id, "task": "app.bill", "tenant": kwargs.pop("tenant", "t1")}
    payload = {"args": list(args), "kwargs": kwargs, "options": {}, "headers": headers, "properties": {}}
    return ops.store.publish(queue=queue, kind="app.bill", task_id=task_id, payload=payload, priority=0,
                             run_after=None, is_retry=False)  # fmt: skip


def found(ops: Operations, **values: str) -> set[str]:
    job_filter = JobFilter.parse({name.replace("__", "."): value for name, value in values.items()}, ops.now())
    return {doc["taskId"] for doc in ops.list_jobs(job_filter).jobs}


def test_keyword_positional_and_header_values_match_exactly(ops: Operations) -> None:
    publish(ops, "int-42", "acme", invoice_id=42)
    publish(ops, "text-42", "acme corp", invoice_id="42", tenant="t.2")
    publish(ops, "float", 4.5, invoice_id=42.5, paid=True, note=None)
    for n, value in enumerate(AWKWARD):
        publish(ops, f"awkward-{n}", value, account=value)
    publish(ops, "nested", {"account": "$where"}, account=["$gt", "x"])  # an element of a list argument matches

    assert found(ops, kwargs__invoice_id="42") == {"int-42", "text-42"}  # the text, and the number it spells
    assert found(ops, kwargs__invoice_id="42.5") == {"float"}
    assert found(ops, kwargs__paid="true") == {"float"}
    assert found(ops, kwargs__note="null") == set()  # a null is no text: a search for "null" is for the text
    assert found(ops, args__0="acme") == {"int-42"}  # exact: not "acme corp"
    assert found(ops, args__0="4.5") == {"float"} and found(ops, args__1="acme") == set()
    assert found(ops, headers__tenant="t.2") == {"text-42"}
    assert found(ops, headers__tenant="t1", kwargs__invoice_id="42") == {"int-42"}  # searches combine
    for n, value in enumerate(AWKWARD):
        assert found(ops, kwargs__account=value) == {f"awkward-{n}"} | ({"nested"} if value == "$gt" else set()), value
        assert found(ops, args__0=value) == {f"awkward-{n}"}, value
    assert found(ops, kwargs__account="A.B") == set()  # exact, case included


def test_a_name_is_checked_whole_and_never_an_operator(ops: Operations) -> None:
    publish(ops, "one", "x", account="y")
    for name, message in [
        ("kwargs.$where", "after kwargs. comes a keyword argument's name"),
        ("kwargs.account.$ne", "after kwargs. comes a keyword argument's name"),
        ("kwargs.a.b", "after kwargs. comes a keyword argument's name"),
        ("kwargs.", "after kwargs. comes a keyword argument's name"),
        ("args.-1", "after args. comes a position from 0 to 999"),
        ("args.1000", "after args. comes a position from 0 to 999"),
        ("args.$", "after args. comes a position"),
        ("headers.x y", "after headers. comes a header's name"),
    ]:
        with pytest.raises(FilterError, match=message):
            JobFilter.parse({name: "y"}, ops.now())
    with pytest.raises(FilterError, match="unknown filter 'payload.kwargs.account'"):
        JobFilter.parse({"payload.kwargs.account": "y"}, ops.now())
    with pytest.raises(FilterError, match="at most 5 argument searches"):
        JobFilter.parse({f"kwargs.k{n}": "v" for n in range(6)}, ops.now())
    assert JobFilter.parse({"kwargs.account": ""}, ops.now()) == JobFilter()  # an empty value is no search


def test_argument_searches_take_part_in_counts_and_bulk_actions(ops: Operations, db: Database) -> None:
    for n in range(3):
        publish(ops, f"acme-{n}", queue="bills", customer="acme")
    publish(ops, "other", queue="bills", customer="other")
    publish(ops, "acme-mail", queue="mail", customer="acme")
    acme_bills = JobFilter.parse({"queue": "bills", "kwargs.customer": "acme"}, ops.now())
    assert acme_bills.as_dict() == {"queue": "bills", "kwargs.customer": "acme"}
    assert ops.count(acme_bills, "cancel") == 3
    assert ops.act_on_filter("cancel", acme_bills, by="alice") == 3
    statuses = {doc["taskId"]: doc["status"] for doc in db.jobs.find()}
    assert statuses == {"acme-0": "failed", "acme-1": "failed", "acme-2": "failed", "other": "queued",
                        "acme-mail": "queued"}  # fmt: skip


def test_a_search_looks_among_the_newest_jobs_only_and_says_where_it_stopped(ops: Operations) -> None:
    ops.search_window = 5
    ids = [publish(ops, f"job-{n}", customer="acme" if n % 2 == 0 else "other") for n in range(9)]
    acme = JobFilter.parse({"kwargs.customer": "acme"}, ops.now())
    bounded = ops.bounded(acme)
    assert bounded.search_from == ids[4]  # the fifth newest
    assert [doc["taskId"] for doc in ops.list_jobs(acme).jobs] == ["job-8", "job-6", "job-4"]
    assert ops.count(acme) == 3 and ops.count(bounded, "cancel") == 3
    # Newer jobs arrive: a search bounded before goes on from where it was, a new one moves its window.
    later = publish(ops, "job-9", customer="acme")
    assert ops.count(bounded) == 4 and ops.bounded(acme).search_from == ids[5]
    # With the rest of the filter narrowing it, the window is the newest of those (here: all of them).
    assert ops.bounded(JobFilter.parse({"kwargs.customer": "acme", "since": "1h"}, ops.now())).search_from == ids[5]
    assert ops.bounded(JobFilter.parse({"status": "queued"}, ops.now())).search_from is None  # no argument search
    assert later in {doc["_id"] for doc in ops.list_jobs(acme).jobs}


def test_a_search_from_sent_back_opens_at_most_twice_the_window(ops: Operations) -> None:
    ops.search_window = 3
    ids = [publish(ops, f"job-{n}", customer="acme") for n in range(9)]
    acme = JobFilter.parse({"kwargs.customer": "acme"}, ops.now())
    # The searchFrom of an earlier list, newer jobs since: kept while its window holds up to twice the search's.
    earlier = replace(acme, search_from=ids[3])
    assert ops.bounded(earlier).search_from == ids[3] and ops.count(earlier) == 6
    # One a client made up to read further back, where no index serves the search: the newest window instead.
    for made_up in (ids[2], "0", ""):
        widened = replace(acme, search_from=made_up)
        assert ops.bounded(widened).search_from == ids[6], made_up
        assert ops.count(widened) == 3 and len(ops.list_jobs(widened).jobs) == 3
