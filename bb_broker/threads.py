"""The background threads bb_broker starts, supervised: one whose loop dies is logged, counted and run again.

A thread that died unseen degraded its whole process until it restarted (the change-stream watcher, killed by one
hand-written job document, left every worker waiting a safety poll for each job). Each of our threads now runs its
loop under `start_supervised`: an unexpected exception is logged with the thread's name, counted in
`bb_broker_thread_restarts_total{thread=...}` (metrics.py), and the loop starts again after a pause that doubles while
the fault keeps coming back, so that a permanent one costs a log line every RESTART_PAUSE_MAX seconds, not a spin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from bb_broker import metrics
from bb_broker.connection import stop_signals_blocked

logger = logging.getLogger(__name__)

#: Seconds before the first restart of a loop that died.
RESTART_PAUSE = 0.5
#: The longest pause between restarts of a loop that keeps dying.
RESTART_PAUSE_MAX = 30.0
#: A loop that ran this many seconds before it died is restarted after the first pause again: its fault is new.
HEALTHY_RUN = 60.0


def start_supervised(
    name: str, loop: Callable[[], object], *, after_crash: Callable[[], None] | None = None
) -> threading.Thread:
    """Start a daemon thread `name` running `loop` until it returns; an exception restarts it (see the module).

    `after_crash` runs after each death, before the pause: what the loop's users must know while it is down."""
    thread = threading.Thread(target=_supervise, args=(name, loop, after_crash), name=name, daemon=True)
    with stop_signals_blocked():  # the process's stop signals are its main thread's (connection.py says why)
        thread.start()
    return thread


def _supervise(name: str, loop: Callable[[], object], after_crash: Callable[[], None] | None) -> None:
    pause = RESTART_PAUSE
    while True:
        started = time.monotonic()
        try:
            loop()
            return
        except Exception:
            if time.monotonic() - started >= HEALTHY_RUN:
                pause = RESTART_PAUSE
            logger.exception("bb_broker thread %s died; restarting it in %.1f s", name, pause)
            metrics.record_restart(name)
        if after_crash is not None:
            try:
                after_crash()
            except Exception:
                logger.exception("bb_broker thread %s: its clean-up after a crash failed too", name)
        time.sleep(pause)
        pause = min(pause * 2, RESTART_PAUSE_MAX)
