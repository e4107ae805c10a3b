"""A checkpoint's value rules and the progress bar's clamps, where no server is needed to see them."""

from __future__ import annotations

import pytest

import bb_broker
from bb_broker.jobs.checkpoints import MAX_CHECKPOINT_BYTES, counts_of, decoded, encoded, shown_progress


def nested(levels: int, innermost: list) -> list:
    value = innermost
    for _ in range(levels - 1):
        value = [value]
    return value


def test_every_json_value_round_trips_as_it_was_saved() -> None:
    value = {"cursor": 2**70, "$where": "a.b", "items": (1, 2.5, None, True, "é")}
    assert decoded(encoded(value), "j") == {**value, "items": [1, 2.5, None, True, "é"]}
    assert len(encoded("x" * (MAX_CHECKPOINT_BYTES - 2)).encode()) == MAX_CHECKPOINT_BYTES  # the limit itself
    deepest = nested(32, [1])  # 32 levels of arrays
    assert decoded(encoded(deepest), "j") == deepest
    text = encoded("x" * (MAX_CHECKPOINT_BYTES - 2))
    assert decoded(text, "j") == "x" * (MAX_CHECKPOINT_BYTES - 2)  # what a save writes reads back, at its limit


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"name": "caf\udce9"}, "the value holds a lone surrogate"),
        ({"at": float("inf")}, "the value['at'] is inf"),
        ({("a",): 1}, "the value has the key ('a',)"),
        ({"ids": {1, 2}}, "the value['ids'] is a set"),
        ("é" * (MAX_CHECKPOINT_BYTES // 2 + 1), "this one is 16388"),  # bytes as UTF-8, not characters
        # Past Python's digits for an integer's text: json.dumps's own ValueError escaped as no CheckpointError.
        ({"cursor": 10**5000}, "cannot be written as JSON: Exceeds the limit (4300 digits)"),
        # 33 levels of arrays, however empty the innermost.
        (nested(33, []), "nests at most 32 levels deep"),
        (nested(33, [1]), "nests at most 32 levels deep"),
    ],
)
def test_a_value_that_cannot_be_a_checkpoint_says_what_is_wrong(value, says) -> None:
    with pytest.raises(bb_broker.CheckpointError, match="checkpoint") as raised:
        encoded(value)
    assert says in str(raised.value)


@pytest.mark.parametrize(
    "stored",
    [
        {"done": 1},
        "{not json",
        "[" * 5000 + "]" * 5000,
        # What no save writes: a number JSON has not, text past a save's size.
        '{"done": NaN}',
        "[Infinity, -Infinity]",
        '"' + "x" * (MAX_CHECKPOINT_BYTES - 1) + '"',
    ],
)
def test_a_hand_edited_checkpoint_that_is_no_json_text_is_said_to_be_one(stored) -> None:
    with pytest.raises(bb_broker.CheckpointError, match="job j's checkpoint is .*hand edit"):
        decoded(stored, "j")


def test_outside_a_task_delivered_through_the_broker_both_calls_say_where_they_work() -> None:
    with pytest.raises(RuntimeError, match=r"checkpoint\(\) works only inside a task delivered through bbmongo://"):
        bb_broker.checkpoint({"done": 1})
    with pytest.raises(RuntimeError, match=r"last_checkpoint\(\) works only inside a task"):
        bb_broker.last_checkpoint()


def test_counts_and_bars() -> None:
    assert counts_of({"done": 2, "total": 4, "cursor": "x"}) == {"done": 2, "total": 4}
    assert counts_of({"done": True, "total": 4}) is None and counts_of([2, 4]) is None
    assert shown_progress({"done": 1, "total": 3}, "running") == {"done": 1, "total": 3, "percent": 33}
    assert shown_progress({"done": 5, "total": 3}, "queued") == {"done": 3, "total": 3, "percent": 100}
    assert shown_progress({"done": 1, "total": 3}, "succeeded") is None
    assert shown_progress({"done": 1, "total": 3}, ["a list"]) == {"done": 1, "total": 3, "percent": 33}
