"""Spies the tests put on the change-stream watcher: what it does, which the library keeps no count of for itself."""

from __future__ import annotations

import threading
from typing import Any

from bb_broker.transport.wakeups import Wakeups


class _PaceRecorder(threading.Event):
    """The watcher's idle event, noting the length of each pause taken on it: its paces (and its pauses after an
    outage, which the tests that record paces have none of)."""

    def __init__(self, paces: list[float]) -> None:
        super().__init__()
        self._paces = paces

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self._paces.append(timeout)
        return super().wait(timeout)


def record_paces(wakeups: Wakeups) -> list[float]:
    """The seconds of each pace the watcher of `wakeups` takes from now on, in order (appended as it takes them).

    Put on a live watcher, which waits in a getMore: a pace it was in already ends on its own, unrecorded."""
    paces: list[float] = []
    wakeups._feed._idle = _PaceRecorder(paces)
    return paces


def record_changes(wakeups: Wakeups) -> list[dict[str, Any]]:
    """The changes the watcher tells `wakeups` of from now on (appended as it does)."""
    changes: list[dict[str, Any]] = []
    told = wakeups._on_change

    def recording(change: dict[str, Any]) -> Any:
        changes.append(change)
        return told(change)

    wakeups._on_change = recording  # type: ignore[method-assign]
    return changes


def watcher_thread(wakeups: Wakeups) -> threading.Thread:
    """The thread of the change-stream watcher `wakeups` is subscribed to."""
    thread = wakeups._feed.thread
    assert thread is not None, "the watcher was never started"
    return thread
