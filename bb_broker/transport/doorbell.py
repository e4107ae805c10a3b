"""The doorbell of a connection's consumers on Celery's event loop: a pipe any thread rings when a consumer has
something to do (the change stream's news, a freed prefetch slot), which the loop watches and drains."""

from __future__ import annotations

import contextlib
import os
import threading


class Doorbell:
    """A pipe an event loop watches: any thread rings it when a consumer has something to do, the loop drains it."""

    def __init__(self) -> None:
        self._reader, self._writer = os.pipe()
        os.set_blocking(self._reader, False)
        os.set_blocking(self._writer, False)
        self._lock = threading.Lock()  # a ring never writes to a closed (and maybe reused) descriptor
        self._rung = False  # a byte waits in the pipe: more rings add nothing
        self._closed = False

    def fileno(self) -> int:
        return self._reader

    def ring(self) -> None:
        if self._rung:
            return
        with self._lock:
            if self._closed or self._rung:
                return
            self._rung = True
            with contextlib.suppress(BlockingIOError):  # a full pipe: the loop has reading to do already
                os.write(self._writer, b"\0")

    def drain(self) -> None:
        """Empty the pipe (without blocking). Call before doing the work: a ring from now on is not lost."""
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):  # empty now
                while os.read(self._reader, 4096):
                    pass
            self._rung = False

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._reader)
                os.close(self._writer)
