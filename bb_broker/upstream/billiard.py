"""billiard's internals bb_broker patches: the prefork pool's job queue (bb_broker/upstream/__init__.py has the rules).

billiard is imported inside the function that patches it: this module is imported while `celery` itself is.
"""

from __future__ import annotations

import signal
from typing import Any

#: The releases every function here was checked against (their sources read, the contract tests run on the newest).
CHECKED_AGAINST = "billiard 4.2.0, 4.2.4, 4.3.2"

#: The signal billiard's pool ends its processes with (pool shrink, pool terminate).
_TERMINATE = {signal.SIGTERM}
#: Seconds a waiting process keeps the signal pending before it looks again: the most a shrink waits for it.
_WAIT_SLICE = 0.5


def _get_payload_guarded(self: Any) -> bytes:
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


def install_pool_queue_guard() -> None:
    """Replace billiard's `SimpleQueue.get_payload` (`with self._rlock: return self._reader.recv_bytes()`) by one
    that holds SIGTERM back while it takes the read lock (idempotent): a pool process terminated by `pool_shrink`
    while it waits for a task then never leaves the pool's job queue locked. The pool processes forked after this
    inherit it.

    No public hook: billiard's pool builds its queues itself (Pool._setup_queues) and takes no queue class or reader
    from Celery or the app. Relies on: SimpleQueue's `_rlock` (a lock with `acquire(timeout=)`) and `_reader` (a
    Connection with `recv_bytes()`), and the pool reading through `get_payload` (billiard/pool.py's
    `conn.get_payload`). Checked against billiard 4.2.0, 4.2.4, 4.3.2."""
    from billiard.queues import SimpleQueue

    if SimpleQueue.get_payload is not _get_payload_guarded:
        SimpleQueue.get_payload = _get_payload_guarded  # type: ignore[method-assign]  # the patch itself
