"""The shapes of billiard that bb_broker/upstream/billiard.py relies on: each test fails, naming the billiard change
and the function it breaks, before a user meets the broken behaviour."""

from __future__ import annotations

import inspect
from functools import partial

import pytest

from bb_broker.upstream import billiard as upstream_billiard
from tests.support.upstream import where as where_in

where = partial(where_in, upstream_billiard)


def test_billiards_pool_reads_its_job_queue_through_get_payload_under_its_read_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import billiard
    from billiard import pool, queues

    monkeypatch.setattr(queues.SimpleQueue, "get_payload", queues.SimpleQueue.get_payload)  # put back afterwards

    simple_queue = inspect.getsource(queues.SimpleQueue)  # the file's text, whatever is installed on the class
    assert "with self._rlock:\n            return self._reader.recv_bytes()" in simple_queue, (
        "billiard.queues.SimpleQueue.get_payload no longer reads `self._reader` under `self._rlock`: billiard changed "
        "its job queue, and the guarded read may lock what it no longer uses; " + where("install_pool_queue_guard")
    )
    assert "conn.get_payload" in inspect.getsource(pool), (
        "billiard's pool no longer reads tasks through `get_payload`: the guard is never called; "
        + where("install_pool_queue_guard")
    )
    queue = queues.SimpleQueue(ctx=billiard.get_context())
    locked = queue._rlock.acquire(timeout=0.01)
    assert locked, "billiard's SimpleQueue._rlock takes no acquire(timeout=); " + where("install_pool_queue_guard")
    queue._rlock.release()
    upstream_billiard.install_pool_queue_guard()
    queue.send_payload(b"job")
    assert queue.get_payload() == b"job", "the guarded read does not read what billiard wrote"
