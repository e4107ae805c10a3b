"""A process's stop signals are its main thread's: no thread bb_broker starts, nor a pymongo thread of a client it
makes, may take SIGINT, SIGTERM, SIGQUIT or SIGHUP (connection.stop_signals_blocked says what went wrong)."""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pymongo import MongoClient

from bb_broker import connection, threads

#: A client's threads start at once, whether or not a server answers: nobody listens on port 1.
NOWHERE = "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=100&connectTimeoutMS=100"


def _signals_blocked_by(thread: threading.Thread) -> set[signal.Signals]:
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    mask = int(re.search(r"^SigBlk:\s+([0-9a-f]+)$", status, re.MULTILINE)[1], 16)  # type: ignore[index]
    return {signum for signum in signal.Signals if mask & (1 << (signum - 1))}


@contextmanager
def _threads_of(make: Callable[[], MongoClient]) -> Iterator[list[threading.Thread]]:
    """The pymongo threads the client `make` returns started, while it is open."""
    before = set(threading.enumerate())
    with make():
        yield [thread for thread in threading.enumerate() if thread not in before and thread.name.startswith("pymongo")]


def test_the_threads_of_a_client_bb_broker_makes_leave_the_stop_signals_to_the_main_thread() -> None:
    with _threads_of(lambda: connection.new_client(NOWHERE)) as started:
        assert started, "pymongo started no thread"
        for thread in started:
            assert _signals_blocked_by(thread) >= connection.STOP_SIGNALS, thread.name
    assert not connection.STOP_SIGNALS & _signals_blocked_by(threading.main_thread())


def test_a_plain_client_s_threads_would_take_them() -> None:
    # What the test above tells apart: pymongo's own threads inherit the main thread's mask, which blocks nothing.
    with _threads_of(lambda: MongoClient(NOWHERE)) as started:
        assert started and all(not connection.STOP_SIGNALS & _signals_blocked_by(thread) for thread in started)


def test_a_supervised_thread_leaves_them_to_the_main_thread_too() -> None:
    stop = threading.Event()
    thread = threads.start_supervised("bb-test-signals", stop.wait)
    try:
        assert _signals_blocked_by(thread) >= connection.STOP_SIGNALS
    finally:
        stop.set()
        thread.join(10)
