"""`python -m tools.bench.bulk_phases`: where `bb_broker.enqueue_many`'s time goes, step by step, without a profiler.

BENCH_N signatures (10,000) of one task, as tools.bench.bulk sends them, BENCH_REPEAT calls (2), each into a fresh
database on the server tools.bench.servers picks (the Rust stand-in when it is on PATH). Each step's wall time is
summed by a perf_counter wrapper around it (nested: a replay holds the message builder and sender, the sender holds
the publish, the publish holds put_job), and printed per task and as a share of the call, with the load average:
on a shared machine only the shares compare from run to run.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import canvas
from celery.app import amqp

import bb_broker
from bb_broker import bulk
from tests.support.servers import with_database
from tools.bench.app import QUEUE, TASK
from tools.bench.bulk import _app, _signatures
from tools.bench.runner import QUIET_CLIENT
from tools.bench.servers import mongo_server

spent: Counter[str] = Counter()


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started

    return timed


def _instrument() -> None:
    amqp.AMQP.as_task_v2 = _timed("Celery's message builder (create_task_message)", amqp.AMQP.as_task_v2)
    canvas.Signature.freeze = _timed("Signature.freeze (the task id)", canvas.Signature.freeze)
    sender = amqp.AMQP._create_task_sender
    amqp.AMQP._create_task_sender = lambda self: _timed(  # type: ignore[method-assign]
        "Celery's sender (send_task_message: receivers, publish)", sender(self)
    )
    bulk._Shapes._replay = _timed("a replay (all of one task's publish)", bulk._Shapes._replay)  # type: ignore[method-assign]
    bulk._Batch.publish = _timed("the publish (Kombu's dumps, put_job)", bulk._Batch.publish)  # type: ignore[method-assign]
    bulk.put_job = _timed("put_job (the broker's checks, to_document, the job)", bulk.put_job)
    bulk.insert_queued = _timed("the inserts (BSON, insert_many)", bulk.insert_queued)


def main() -> int:
    n, repeat = int(os.environ.get("BENCH_N", "10000")), int(os.environ.get("BENCH_REPEAT", "2"))
    _instrument()
    mongo = mongo_server(Path(tempfile.mkdtemp(prefix="bb-bench-bulk-phases-")))
    mongo.start()
    quiet = "&".join(f"{k}={v}" for k, v in QUIET_CLIENT.items())
    try:
        for rep in range(repeat):
            app = _app(with_database(mongo.url, f"bulk_phases_{rep}") + f"?{quiet}")
            try:
                app.send_task(TASK, args=(0, "warm"), queue=QUEUE)  # connect, declare and index outside the call
                signatures = _signatures(app, n)
                spent.clear()
                started = time.perf_counter()
                bb_broker.enqueue_many(signatures, app=app)
                whole = time.perf_counter() - started
            finally:
                app.close()
            print(
                f"call {rep + 1}: {n} tasks in {whole:.2f} s, {whole / n * 1e6:.0f} µs per task, on {mongo.label}, "
                f"load average {os.getloadavg()[0]:.1f}"
            )
            for name, seconds in spent.most_common():
                print(f"  {name:<58}{seconds / n * 1e6:>6.0f} µs per task  {seconds / whole:>5.0%}")
    finally:
        mongo.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
