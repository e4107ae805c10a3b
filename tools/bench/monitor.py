"""An event monitor for the bench's events-on drains, as Flower runs one: Celery's event Receiver on the broker.

`python -m tools.bench.monitor URL COUNTS`: consumes every event the workers send, discards it, and keeps a
count per event type in the JSON file COUNTS (rewritten a few times a second and at exit), which exists from the
moment the receiver consumes, so the bench can start the worker after it. Stops on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery

import bb_broker  # noqa: F401 (registers bbmongo://)

#: How often the counts file is rewritten while events arrive (seconds).
WRITE_EVERY = 0.25


def main(url: str, counts_path: Path) -> int:
    if os.environ.get("BENCH_COMMANDS"):
        # BENCH_DIAGNOSE: the monitor's reads are logged with the workers' commands, before any client exists. The
        # bench app registers its CommandLog when imported (registering another logged every command twice).
        import tools.bench.app  # noqa: F401
    app = Celery("bench-monitor", broker=url, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True)
    counts: dict[str, int] = {}
    written_at = 0.0

    def write() -> None:
        nonlocal written_at
        partial = counts_path.with_suffix(".partial")
        partial.write_text(json.dumps(counts))
        os.replace(partial, counts_path)  # the bench never reads half a file
        written_at = time.monotonic()

    def discard(event: dict[str, Any]) -> None:
        counts[event["type"]] = counts.get(event["type"], 0) + 1

    class Monitor(app.events.Receiver):  # type: ignore[name-defined,misc]
        def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
            super().on_consume_ready(*args, **kwargs)
            write()

        def on_iteration(self) -> None:
            if time.monotonic() - written_at >= WRITE_EVERY:
                write()

    with app.connection() as connection:
        receiver = Monitor(connection, handlers={"*": discard}, app=app)

        def stop(_signum: int, _frame: Any) -> None:
            receiver.should_stop = True  # seen within a second (ConsumerMixin's safety interval)

        signal.signal(signal.SIGTERM, stop)
        receiver.capture(limit=None, timeout=None, wakeup=True)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
