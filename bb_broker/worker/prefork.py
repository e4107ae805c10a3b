"""A prefork pool process that is terminated while it waits for a task never leaves the pool's job queue locked."""

from __future__ import annotations

import signal
from typing import Any, Protocol

from billiard.queues import SimpleQueue

#: The signal billiard's pool ends its processes with (pool shrink, pool terminate).
_TERMINATE = {signal.SIGTERM}
#: Seconds a waiting process keeps the signal pending before it looks again: the most a shrink waits for it.
_WAIT_SLICE = 0.5


class _PoolQueue(Protocol):
    """What billiard's SimpleQueue sets in its __init__ and reads in its own get_payload (its stubs leave it out)."""

    _rlock: Any  # a billiard (multiprocessing) Lock
    _reader: Any  # the pipe's reading end, a billiard Connection


def _get_payload(self: _PoolQueue) -> bytes:
    # Without an event loop every idle pool process reads the one shared job queue under its read lock, and
    # `pool_shrink` SIGTERMs idle processes together. billiard's handler raises SystemExit, which a process inside
    # `with lock:` survives cleanly; but a process whose lock wait succeeds just as its own signal arrives raises
    # inside `__enter__`, before the `with` protects anything, and dies holding the lock: every other process then
    # waits on it forever, tasks are received and never start, and the worker cannot stop. So the signal is held
    # back while the lock is taken, and let in only where a `finally` releases the lock.
    while True:
        masked = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINATE)
        try:
            if self._rlock.acquire(timeout=_WAIT_SLICE):
                try:
                    signal.pthread_sigmask(signal.SIG_SETMASK, masked)  # a pending SIGTERM is raised here
                    return self._reader.recv_bytes()
                finally:
                    self._rlock.release()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, masked)  # not holding the lock: a pending SIGTERM may act


def guard_pool_queue() -> None:
    """Install the guarded read (idempotent): the pool processes forked after this inherit it."""
    # Patching billiard's method is the point; its stubs lack the _rlock and _reader _get_payload reads (_PoolQueue).
    SimpleQueue.get_payload = _get_payload  # type: ignore[method-assign, assignment]
