"""`python -m tools.bench.bulk`: N tasks enqueued with `bb_broker.enqueue_many` on `bbmongo://` against the same N
with `group(...).apply_async()` on Redis, in the same round (and, when asked, the group on `bbmongo://` too).

Each round publishes into an empty jobs collection and an empty Redis database; the variants take turns in a
rotating order from round to round, so that a busy moment of the shared machine lands on each alike. Only the
publish is timed (no worker runs): from the call until it returns, the jobs durable (bbmongo://) or pushed (Redis).

BENCH_N (10000), BENCH_REPEAT (3) and BENCH_SERVER (python forces the Python stand-in) as in `make bench`;
BENCH_BULK picks the variants (enqueue_many,redis_group,celery_floor; bbmongo_group adds the group on bbmongo://).
`celery_floor` is each signature's `apply_async` with a producer that drops the message (on Redis's app): what
Celery's own building of the messages costs, all of which the group pays; enqueue_many pays it for the first signature
of each kind only, and Celery's message builder and sender for every one (tools.bench.bulk_phases splits its time).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery, group

import bb_broker
from tests.support.servers import with_database
from tools.bench.app import QUEUE, TASK
from tools.bench.runner import QUIET_CLIENT
from tools.bench.servers import RedisServer, mongo_server

VARIANTS = ("enqueue_many", "redis_group", "celery_floor", "bbmongo_group")
DEFAULT_VARIANTS = "enqueue_many,redis_group,celery_floor"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _app(url: str) -> Celery:
    app = Celery("bench-bulk", broker=url, set_as_current=False)
    app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)
    return app


def _signatures(app: Celery, n: int) -> list[Any]:
    task = app.signature(TASK).set(queue=QUEUE)
    return [task.clone(args=(i, "d")) for i in range(n)]


class _Dropping:
    """A producer that drops what Celery's send_task publishes with it (send_task uses `publish` and `connection`)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def publish(self, body: Any, **options: Any) -> None:
        pass


def _timed(publish: Callable[[], Any]) -> float:
    started = time.perf_counter()
    publish()
    return time.perf_counter() - started


def one_round(rep: int, wanted: list[str], mongo_url: str, redis_url: str, n: int) -> dict[str, float]:
    quiet = "&".join(f"{k}={v}" for k, v in QUIET_CLIENT.items())
    urls = {
        "enqueue_many": with_database(mongo_url, f"bulk_many_{rep}") + f"?{quiet}",
        "bbmongo_group": with_database(mongo_url, f"bulk_group_{rep}") + f"?{quiet}",
        "redis_group": redis_url,
        "celery_floor": redis_url,
    }
    apps = {name: _app(urls[name]) for name in wanted}
    try:
        for name, app in apps.items():  # connect, declare and index outside the timed call
            app.send_task(TASK, args=(0, "warm"), queue=QUEUE)
            if name in ("redis_group", "celery_floor"):
                with app.connection_for_write() as conn:
                    conn.default_channel.client.flushdb()
        order = wanted[rep % len(wanted) :] + wanted[: rep % len(wanted)]
        seconds: dict[str, float] = {}
        for name in order:
            signatures = _signatures(apps[name], n)
            if name == "enqueue_many":
                seconds[name] = _timed(lambda s=signatures, a=apps[name]: bb_broker.enqueue_many(s, app=a))
            elif name == "celery_floor":
                with apps[name].connection_for_write() as conn:
                    dropping = _Dropping(conn)
                    seconds[name] = _timed(lambda s=signatures, p=dropping: [sig.apply_async(producer=p) for sig in s])
            else:
                seconds[name] = _timed(lambda s=signatures: group(s).apply_async())
            _log(f"round {rep + 1}: {name} {n} tasks in {seconds[name]:.2f}s")
        return seconds
    finally:
        for app in apps.values():
            app.close()


def main() -> int:
    n = int(os.environ.get("BENCH_N", "10000"))
    repeat = int(os.environ.get("BENCH_REPEAT", "3"))
    wanted = [v for v in os.environ.get("BENCH_BULK", DEFAULT_VARIANTS).split(",") if v]
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"BENCH_BULK: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    workdir = Path(tempfile.mkdtemp(prefix="bb-bench-bulk-"))
    mongo, redis_server = mongo_server(workdir), RedisServer(workdir)
    mongo.start()
    redis_server.start()
    rounds: dict[str, list[float]] = {name: [] for name in wanted}
    try:
        _log(f"bulk bench: N={n}, {repeat} rounds, on {mongo.label} and {redis_server.label}")
        for rep in range(repeat):
            for name, spent in one_round(rep, wanted, mongo.url, redis_server.url, n).items():
                rounds[name].append(spent)
    finally:
        redis_server.stop()
        mongo.stop()
    lines = [f"\n{n} tasks enqueued, seconds (median of {repeat} rounds; each round's figure)"]
    for name, values in rounds.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        median = statistics.median(values)
        lines.append(f"  {name:<16}{median:>8.2f}   ({shown})   {n / median:.0f} tasks/s")
    line: dict[str, Any] = {"bench": "bb_broker bulk enqueue", "n": n, "repeat": repeat, "seconds": rounds}
    if "enqueue_many" in rounds and "redis_group" in rounds:
        ratios = [r / m for m, r in zip(rounds["enqueue_many"], rounds["redis_group"], strict=True)]
        spread = ", ".join(f"{r:.2f}" for r in ratios)
        lines.append(f"  enqueue_many over Redis's group: {statistics.median(ratios):.2f}x  (rounds: {spread})")
        line["ratio_rounds"], line["ratio"] = ratios, statistics.median(ratios)
    if "celery_floor" in rounds and "redis_group" in rounds:
        ceilings = [r / f for f, r in zip(rounds["celery_floor"], rounds["redis_group"], strict=True)]
        spread = ", ".join(f"{c:.2f}" for c in ceilings)
        lines.append(
            f"  Redis's group over Celery's own apply_async (celery_floor): "
            f"{statistics.median(ceilings):.2f}x  (rounds: {spread})"
        )
        line["ceiling_rounds"], line["ceiling"] = ceilings, statistics.median(ceilings)
    line["servers"] = {"mongo": mongo.label, "redis": redis_server.label}
    print("\n".join(lines))
    print(json.dumps(line, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
