"""Pure pieces: URL parsing and masking, payload round trips, the lifecycle rules."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bb_broker.connection import BrokerURLError, parse_broker_url, redact_url, scrub
from bb_broker.jobs.lifecycle import FAILED, QUEUED, Policy, after_failure, retry_countdown
from bb_broker.jobs.payloads import PayloadError, to_document, to_message


def test_bbmongo_url_becomes_a_mongodb_uri_and_database() -> None:
    target = parse_broker_url("bbmongo://u:s3cret@h1:27017,h2:27018/bountyboard?replicaSet=rs0&authSource=admin")
    assert target.mongo_uri == "mongodb://u:s3cret@h1:27017,h2:27018/bountyboard?replicaSet=rs0&authSource=admin"
    assert target.database == "bountyboard"
    assert "s3cret" not in target.display and "s3cret" not in repr(target)
    assert parse_broker_url("mongodb://localhost/db").database == "db"


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("bbmongo://u:s3cret@localhost:27017", "must name the database"),
        ("redis://u:s3cret@localhost/0", "must start with bbmongo://"),
        ("bbmongo://u:s3cret@localhost:notaport/db", "not a valid MongoDB URI"),
        # MongoDB reads `a.b` as collection b of database a: the database would silently be `bounty`.
        ("bbmongo://u:s3cret@localhost/bounty.board", "database name cannot contain"),
        # Unacknowledged writes: a claim's or a cancel's answer never comes, and refusals are never seen.
        ("bbmongo://u:s3cret@localhost/db?w=0", "w=0 sends writes unacknowledged"),
        # pymongo's URI parser lets these through, and refuses them at the first Database made from the name.
        ("bbmongo://u:s3cret@localhost/a%5Cb", r"database name cannot contain '\\\\'"),
        ("bbmongo://u:s3cret@localhost/a%00b", r"database name cannot contain '\\x00'"),
    ],
)
def test_bad_urls_are_refused_with_the_password_masked(url: str, complaint: str) -> None:
    with pytest.raises(BrokerURLError, match=complaint) as caught:
        parse_broker_url(url)
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "bbmongo://u:left-half@right-half@localhost/db",  # an unescaped @ in the password
        "bbmongo://u:left-half/right-half@localhost/db",  # an unescaped / in the password
        "BBMONGO://u:left-half-right-half@localhost:27017",  # the scheme in capitals (and no database)
        "redis://u:left-half@right-half@localhost/0",
    ],
)
def test_a_password_written_unescaped_is_masked_whole_in_the_error(url: str) -> None:
    with pytest.raises(BrokerURLError) as caught:
        parse_broker_url(url)
    assert "left-half" not in str(caught.value) and "right-half" not in str(caught.value)
    assert "localhost" in str(caught.value)  # the host is still shown


def test_redaction_and_scrubbing() -> None:
    assert redact_url("bbmongo://admin:p%40ss@h/db") == "bbmongo://admin:**@h/db"
    assert redact_url("bbmongo://h/db") == "bbmongo://h/db"
    assert scrub("auth with p@ss failed", ("p@ss",)) == "auth with ** failed"


def celery_message(body: object, content_type: str = "application/json", **headers: object) -> dict:
    return {
        "body": json.dumps(body),
        "content-type": content_type,
        "content-encoding": "utf-8",
        "headers": {"task": "app.add", "id": "t1", **headers},
        "properties": {"delivery_info": {"routing_key": "celery"}, "body_encoding": "base64", "priority": 0},
    }


def test_a_json_task_message_is_stored_readable_and_comes_back_equal() -> None:
    message = celery_message([[1, "two"], {"k": {"nested": [3]}}, {"chain": None}])
    doc = to_document(message, message["body"].encode())
    assert doc["args"] == [1, "two"] and doc["kwargs"] == {"k": {"nested": [3]}}
    back = to_message(doc)
    assert json.loads(back["body"]) == json.loads(message["body"])
    assert back["headers"] == message["headers"] and back["properties"]["body_encoding"] is None


@pytest.mark.parametrize(
    "body",
    [
        [[2**70], {}, {}],  # BSON has no integers that wide
        [[], {"$where": "sleep(1)"}, {}],  # an operator-shaped key must stay a value
        [[], {"a.b": 1}, {}],
        [[-(2**63) - 1], {}, {}],
        [[], {"": 1}, {}],
        [[{"deep": [{"a\x00b": 1}]}], {}, {}],
    ],
)
def test_what_bson_cannot_hold_faithfully_is_kept_whole(body: object) -> None:
    message = celery_message(body)
    doc = to_document(message, message["body"].encode())
    assert "args" not in doc and ("raw" in doc or doc["bodyFormat"] == "base64")
    assert json.loads(to_message(doc)["body"]) == body


def test_the_widest_64_bit_integers_and_every_json_scalar_stay_readable() -> None:
    body = [[2**63 - 1, -(2**63), 1.5, True, None, "s"], {"k": [{"n": False}]}, {}]
    doc = to_document(celery_message(body), json.dumps(body).encode())
    assert doc["args"] == body[0] and doc["kwargs"] == body[1]


@pytest.mark.parametrize(
    "header",
    [
        {"when": datetime(2026, 1, 2, tzinfo=UTC)},  # BSON keeps it, JSON would give a string back
        {"pair": (1, 2)},
        {"big": 2**64},
        {"nested": {"a.b": 1}},
        {"keys": {1: "one"}},
    ],
)
def test_headers_bson_cannot_hold_faithfully_keep_the_whole_message(header: dict) -> None:
    message = celery_message([[1], {}, {}], **header)
    doc = to_document(message, message["body"].encode())
    assert "raw" in doc and "args" not in doc
    assert json.loads(to_message(doc)["body"]) == [[1], {}, {}]


def test_binary_bodies_round_trip() -> None:
    message = {**celery_message([]), "body": "", "content-type": "application/x-python-serialize",
               "content-encoding": "binary"}  # fmt: skip
    doc = to_document(message, b"\x80\x04\x95binary")
    assert to_message(doc)["body"] == b"\x80\x04\x95binary"


@pytest.mark.parametrize("payload", ["a string", {"args": [1]}, {"raw": "not json", "body": ""}])
def test_a_payload_that_is_not_a_message_is_refused_clearly(payload: object) -> None:
    with pytest.raises(PayloadError):
        to_message(payload)


def test_lifecycle_rules() -> None:
    policy = Policy()
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert [policy.backoff(n).total_seconds() for n in (1, 2)] == [10.0, 20.0]
    assert after_failure(policy, 1, "x", now).run_after == now + timedelta(seconds=10)
    assert after_failure(policy, 2, "x", now).status == QUEUED
    assert after_failure(policy, 3, "x", now).status == FAILED
    assert after_failure(policy, 1, "x", now, retryable=False).status == FAILED
    assert len(after_failure(policy, 1, "e" * 10_000, now).last_error) == 2000
    # The countdown of the Celery retry that runs a failed attempt again: the same backoff, none after the last.
    assert [retry_countdown(policy, n) for n in (1, 2, 3)] == [10.0, 20.0, None]
    assert retry_countdown(policy, 1, retryable=False) is None
    assert policy.heartbeat_interval < policy.sweep_interval < policy.stale_after
    # No doubling below none (a count below 0 made a backoff of nothing), none past a week (many attempts made
    # 2**attempts outgrow a date: OverflowError).
    assert policy.backoff(-1_000_000) == timedelta(seconds=5)
    assert Policy(max_attempts=100).backoff(60) == Policy(backoff_base=1e300).backoff(2) == timedelta(days=7)
    nan, inf = float("nan"), float("inf")
    for bad in ({"max_attempts": 0}, {"backoff_base": -1}, {"stale_after": 0}, {"stale_after": nan},
                {"stale_after": inf}, {"backoff_base": nan}, {"backoff_base": inf}):  # fmt: skip
        with pytest.raises(ValueError):
            Policy(**bad)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"stale_after": 1e308}, "at most a year"),  # a sweep's timedelta overflowed: its thread died, restarted
        ({"max_attempts": "9" * 30}, "whole number from 1 to 2147483647"),  # past what MongoDB's ints hold
        ({"events_linger": 1e308}, "at most a day"),  # the outbox's thread died, restarted, storing nothing
        ({"message_ttl": -1}, "more than 0"),  # every event, reply and control message expired at once
        ({"message_ttl": float("nan")}, "more than 0"),
        ({"safety_poll_interval": 0}, "0.05 or more"),  # a poll without end: a core's worth of CPU
        ({"max_claim_batch": 0}, "whole number from 1"),
        ({"retention": True}, "a flag, not a number"),  # was expireAfterSeconds 1: succeeded jobs gone in a second
        ({"max_attempts": True}, "a flag, not a number"),
        ({"retention": -1}, "whole number from 0"),
        ({"jobs_collection": None}, "a collection's name"),  # was a collection named 'None'
        ({"jobs_collection": "a$b"}, "no '$' or NUL"),
        ({"use_change_streams": "maybe"}, "one of true, 1, yes, on or false, 0, no, off"),
        ({"max_attempts": 0}, "whole number from 1"),
        ({"stale_after": "nan"}, "more than 0"),
    ],
    ids=repr,
)
def test_a_transport_option_out_of_its_bounds_is_refused_naming_it(given: dict, said: str) -> None:
    from bb_broker.options import BrokerOptions, OptionError

    with pytest.raises(
        OptionError, match=f"transport option {next(iter(given))}=.* cannot be read: .*{re.escape(said)}"
    ):
        BrokerOptions.parse(given)


def test_a_flag_given_as_off_is_off() -> None:
    from bb_broker.options import BrokerOptions

    assert BrokerOptions.parse({"use_change_streams": "off"}).use_change_streams is False  # was: on
    assert BrokerOptions.parse({"use_change_streams": "On"}).use_change_streams is True


def test_the_password_travels_apart_from_the_url_and_comes_back() -> None:
    from bb_broker.connection import join_password, split_password

    url = "bbmongo://bb:p%40ss:w@h1:27017,h2/db?replicaSet=rs0"
    masked, password = split_password(url)
    assert masked == "bbmongo://bb:**@h1:27017,h2/db?replicaSet=rs0" and password == "p%40ss:w"
    assert join_password(masked, password) == url
    assert split_password("bbmongo://x509user@h/db") == ("bbmongo://x509user@h/db", None)
    assert join_password("bbmongo://h/db", "pw") == "bbmongo://h/db"


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"countdown": 10, "expires": 60, "time_limit": 5, "soft_time_limit": 4, "retries": 2},
        {"eta": datetime(2030, 1, 1, tzinfo=UTC), "expires": datetime(2030, 1, 2), "shadow": "other"},
        {"group_id": "g", "group_index": 0, "root_id": "r", "parent_id": "p", "ignore_result": True},
        {"stamped_headers": ["colour"], "colour": "blue", "replaced_task_nesting": 1, "origin": "web@host"},
        {"callbacks": "link", "errbacks": "link", "chain": "link", "chord": "link"},
    ],
)
def test_every_message_celery_writes_passes_the_checks_at_publish_and_claim(options: dict) -> None:
    """The checks refuse only what a worker chokes on, never a message Celery itself writes (links, chains, chords,
    groups, stamps, time limits, dates), before it is stored and as a claim reads it back."""
    from celery import Celery, chain, chord, group, signature

    from bb_broker.jobs.payloads import PUBLISH_ID_PROPERTY, check_body, check_envelope

    app = Celery("checks", set_as_current=False)
    link = signature("t.callback", args=(1,), app=app)
    canvas = {
        "callbacks": [link, group([link, link])],
        "errbacks": [link],
        "chain": [chain(link, link), link],
        "chord": chord([link, link], link),
    }
    options = {name: canvas[name] if value == "link" else value for name, value in options.items()}
    headers, properties, body, _ = app.amqp.as_task_v2(
        "an-id", "t.task", args=(1, {"a": [2]}), kwargs={"k": None}, **options
    )
    encoded = json.dumps(body)  # signatures are dicts
    message = {
        "headers": headers,
        "properties": {**properties, "priority": 3, PUBLISH_ID_PROPERTY: {"celery": "01J"}},
        "body": encoded.encode(),
        "content-type": "application/json",
        "content-encoding": "utf-8",
    }
    check_envelope(message)
    payload = to_document(message, encoded.encode())
    check_body(message, payload)
    claimed = to_message(payload)
    check_envelope(claimed)
    check_body(claimed, payload)


def test_only_the_server_module_reads_server_error_codes() -> None:
    """Issue 43: what the server can do is known in one place (bb_broker/server.py), never learnt from error codes
    kept in other modules: no other module compares an error's code."""
    root = Path(__file__).resolve().parents[2] / "bb_broker"
    reading_a_code = re.compile(r"\.code\s*(==|!=|in\b|not in\b)|\.get\(\s*[\"']code[\"']\s*\)")
    found = [
        f"{path.relative_to(root.parent)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "server.py" or path.parent != root
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if reading_a_code.search(line)
    ]
    assert found == []
