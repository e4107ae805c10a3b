"""The shapes of pymongo that bb_broker/upstream/pymongo.py relies on: each test fails, naming the pymongo change and
the function it breaks, before a user meets the broken behaviour."""

from __future__ import annotations

import inspect
from functools import partial
from types import SimpleNamespace

from pymongo import MongoClient
from pymongo.change_stream import ChangeStream
from pymongo.command_cursor import CommandCursor

from bb_broker.upstream import pymongo as upstream_pymongo
from tests.support.upstream import where as where_in

where = partial(where_in, upstream_pymongo)


def test_a_change_stream_reads_its_changes_from_a_command_cursors_batch() -> None:
    stream_source = inspect.getsource(inspect.getmodule(ChangeStream))  # 4.9 and later: pymongo/synchronous/
    assert "self._cursor = self._create_cursor()" in stream_source and "self._cursor._try_next(" in stream_source, (
        "pymongo's ChangeStream no longer keeps its command cursor at `_cursor`: the watcher cannot tell a buffered "
        "change from a getMore; " + where("buffered_changes")
    )
    client: MongoClient[dict[str, object]] = MongoClient(connect=False)  # nothing here talks to a server
    try:
        batch = CommandCursor(client.db.jobs, {"id": 0, "ns": "db.jobs", "firstBatch": [{"a": 1}, {"a": 2}]}, None)
        stream = SimpleNamespace(_cursor=batch)
        assert upstream_pymongo.buffered_changes(stream) == 2, (
            "a CommandCursor no longer says how many documents of its batch are unread: the watcher never paces; "
            + where("buffered_changes")
        )
        next(batch)
        assert upstream_pymongo.buffered_changes(stream) == 1, "reading a document does not take it from the batch"
    finally:
        client.close()
