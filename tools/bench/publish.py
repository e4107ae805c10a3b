"""`python -m tools.bench.publish`: what one publish costs, part by part, on `bbmongo://` and on Kombu's `mongodb://`.

Three measurements, each repeated in rounds that alternate the variants so that drift on a shared machine hits
each alike (medians, with every round's figure kept):

- `send_task` end to end, as `make bench`'s publish figure, with the commands each publish sent (by name and
  collection, from a pymongo command listener in this process); a third producer publishes with `bbmongo://` into
  a jobs collection whose secondary indexes it dropped after the warm-up, to show what their upkeep costs;
- the client-side parts, in µs per call: Celery and Kombu alone (`send_task` on `memory://`), then each step of
  our `Channel._put` (payload conversion, job id, clock, metrics) against the built-in's own (`dumps` of the
  message);
- the server's part: `JobStore.publish` (our insert, round trip included) into a collection with the indexes as
  shipped, with only `_id`, and with each secondary index left out in turn, against the built-in's insert into a
  collection with its own index.

BENCH_N (inserts per variant per round, 300), BENCH_REPEAT (rounds, 3) and BENCH_SERVER (python forces the Python
stand-in) as in `make bench`; BENCH_PROFILE=1 adds a cProfile of the `bbmongo://` publish loop, by own time.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import timeit
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bson import encode
from celery import Celery
from kombu.utils.json import dumps
from pymongo import ASCENDING, MongoClient, monitoring
from pymongo.collection import Collection
from ulid import ULID

import bb_broker  # noqa: F401 (registers bbmongo://)
from bb_broker import metrics
from bb_broker.clock import ServerClock
from bb_broker.jobs import payloads
from bb_broker.jobs.indexes import INDEXES, RETENTION_INDEX
from bb_broker.jobs.store import JobStore
from tests.support.servers import with_database
from tools.bench.app import QUEUE, TASK
from tools.bench.runner import QUIET_CLIENT
from tools.bench.servers import mongo_server

SCHEMES = ("bbmongo", "mongodb")
#: A measuring device, not a configuration: `bbmongo://` publishing into a jobs collection whose secondary indexes
#: were dropped after the warm-up, to show what index maintenance costs a publish end to end.
UNINDEXED = "bbmongo_unindexed"
INDEX_NAMES = [ix.document["name"] for ix in INDEXES]
#: Publishes in one turn of one producer (send_task_rounds).
BLOCK = 25


class Commands(monitoring.CommandListener):
    """The commands this process sends while `on`, by name and collection."""

    def __init__(self) -> None:
        self.on = False
        self.counts: Counter[str] = Counter()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self.on:
            target = event.command.get(event.command_name)
            self.counts[f"{event.command_name} {target if isinstance(target, str) else '-'}"] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _producer(url: str) -> Celery:
    app = Celery("bench-publish", broker=url, set_as_current=False)
    app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)
    return app


def _send(app: Celery) -> None:
    app.send_task(TASK, args=[time.time(), "d"], queue=QUEUE)


def send_task_rounds(mongo_url: str, n: int, repeat: int, commands: Commands, profile: bool) -> dict[str, Any]:
    """`send_task` n times per scheme per round, as `make bench` publishes; the commands each publish sent.

    The producers stay open and take turns in blocks of BLOCK publishes, in a rotating order, so that a busy
    moment on the shared machine lands on each alike; a round's ratio is of its summed times.
    """
    schemes = (*SCHEMES, UNINDEXED)
    rounds: dict[str, list[float]] = {scheme: [] for scheme in schemes}
    sent: dict[str, Counter[str]] = {scheme: Counter() for scheme in schemes}
    quiet = "&".join(f"{k}={v}" for k, v in QUIET_CLIENT.items())
    blocks = max(n // BLOCK, 1)
    admin: MongoClient = MongoClient(mongo_url, **QUIET_CLIENT)
    for rep in range(repeat):
        apps = {
            s: _producer(with_database(mongo_url, f"publish_{s}_{rep}", s.partition("_")[0]) + f"?{quiet}")
            for s in schemes
        }
        try:
            for app in apps.values():
                _send(app)  # connect, declare and index outside the timed loop
            unindexed = admin[f"publish_{UNINDEXED}_{rep}"]["jobs"]
            unindexed.drop_indexes()  # a producer never makes them again (a worker's claim would)
            spent = dict.fromkeys(schemes, 0.0)
            for block in range(blocks):
                for scheme in schemes[block % 3 :] + schemes[: block % 3]:
                    app = apps[scheme]
                    commands.counts.clear()
                    commands.on = True
                    started = time.perf_counter()
                    for _ in range(BLOCK):
                        _send(app)
                    spent[scheme] += time.perf_counter() - started
                    commands.on = False
                    sent[scheme] += commands.counts
            if [ix["name"] for ix in unindexed.list_indexes()] != ["_id_"]:
                raise AssertionError("the unindexed jobs collection got its indexes back during the round")
            for scheme in schemes:
                rounds[scheme].append(spent[scheme] / (blocks * BLOCK) * 1e6)
        finally:
            for app in apps.values():
                app.close()
    admin.close()
    total = repeat * blocks * BLOCK
    figures: dict[str, Any] = {
        "send_task_us": {scheme: statistics.median(values) for scheme, values in rounds.items()},
        "send_task_us_rounds": rounds,
        # each one's publish rate over the built-in's, round by round
        "ratio_rounds": [m / b for b, m in zip(rounds["bbmongo"], rounds["mongodb"], strict=True)],
        "unindexed_ratio_rounds": [m / b for b, m in zip(rounds[UNINDEXED], rounds["mongodb"], strict=True)],
        "commands_per_publish": {s: {name: c / total for name, c in sent[s].items()} for s in schemes},
    }
    figures["ratio"] = statistics.median(figures["ratio_rounds"])
    figures["unindexed_ratio"] = statistics.median(figures["unindexed_ratio_rounds"])
    if profile:
        app = _producer(with_database(mongo_url, "publish_profile", "bbmongo") + f"?{quiet}")
        try:
            _send(app)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(n):
                _send(app)
            profiler.disable()
        finally:
            app.close()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
        figures["profile"] = out.getvalue()
    return figures


def _micros(call: Callable[[], Any], number: int = 2000) -> float:
    """The best of five runs, in µs per call: the call's own cost, with the least of the machine's noise."""
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def client_parts(mongo_url: str) -> dict[str, float]:
    """Each client-side step of a publish, in µs per call."""
    app = Celery("bench-parts", broker="memory://", set_as_current=False)
    app.conf.update(task_ignore_result=True)
    parts = {"send_task on memory:// (Celery and Kombu alone)": _micros(lambda: _send(app), 500)}
    channel = app.connection().default_channel
    message = channel._get(QUEUE)
    body = channel.decode_body(message["body"], message["properties"].get("body_encoding"))
    body = body.encode() if isinstance(body, str) else body
    document = payloads.to_document(message, body)
    client: MongoClient = MongoClient(mongo_url, tz_aware=True)
    try:
        clock = ServerClock(client.get_database("publish_parts"))
        clock()
        now = datetime.now(UTC)
        job = {
            "_id": str(ULID()), "kind": TASK, "taskId": message["headers"]["id"], "queue": QUEUE, "priority": 0,
            "payload": document, "status": "queued", "attempts": 0, "runAfter": now, "createdAt": now, "updatedAt": now,
        }  # fmt: skip
        builtin = {"payload": dumps(message), "queue": QUEUE, "priority": 9}
        parts |= {
            "bbmongo: payloads.to_document": _micros(lambda: payloads.to_document(message, body)),
            "bbmongo: job id (ULID)": _micros(lambda: str(ULID())),
            "bbmongo: server clock": _micros(clock),
            "bbmongo: metrics.record": _micros(lambda: metrics.record("enqueued")),
            "bbmongo: BSON of the job document": _micros(lambda: encode(job)),
            "mongodb: kombu dumps(message)": _micros(lambda: dumps(message)),
            "mongodb: BSON of the message document": _micros(lambda: encode(builtin)),
        }
        parts["bytes: job document"] = len(encode(job))
        parts["bytes: built-in message document"] = len(encode(builtin))
    finally:
        client.close()
        app.close()
    return parts


def _variants(message: dict[str, Any], document: dict[str, Any]) -> dict[str, Callable[[Collection], Callable]]:
    """Each collection shape: how to set it up, returning the insert it measures."""

    def ours(drop: str | None = None, plain: bool = False, stored: Any = document) -> Callable[[Collection], Callable]:
        def setup(coll: Collection) -> Callable:
            store = JobStore(coll.database, collection=coll.name)
            if not plain:
                store.ensure_indexes()
                if drop:
                    coll.drop_index(drop)
            else:
                coll.database.create_collection(coll.name)
            task = message["headers"]["id"]
            return lambda: store.publish(
                queue=QUEUE, kind=TASK, task_id=task, payload=stored, priority=0, run_after=None, is_retry=False
            )

        return setup

    def builtin(indexed: bool) -> Callable[[Collection], Callable]:
        def setup(coll: Collection) -> Callable:
            # What kombu.transport.mongodb does per publish (its message index; the TTL one only when ttl is set).
            if indexed:
                coll.create_index([("queue", ASCENDING), ("priority", ASCENDING), ("_id", ASCENDING)])
            else:
                coll.database.create_collection(coll.name)
            return lambda: coll.insert_one({"payload": dumps(message), "queue": QUEUE, "priority": 9})

        return setup

    variants = {"bbmongo: indexes as shipped": ours(), "bbmongo: _id only": ours(plain=True)}
    variants["bbmongo: _id only, payload as one JSON string"] = ours(plain=True, stored=dumps(message))
    variants |= {f"bbmongo: without {name}": ours(drop=name) for name in (*INDEX_NAMES, RETENTION_INDEX)}
    variants["mongodb: its insert and index"] = builtin(indexed=True)
    variants["mongodb: its insert, _id only"] = builtin(indexed=False)
    return variants


def server_parts(mongo_url: str, n: int, repeat: int) -> dict[str, Any]:
    """µs per insert, round trip included, for each collection shape, the shapes taking turns in blocks."""
    app = Celery("bench-parts", broker="memory://", set_as_current=False)
    app.conf.update(task_ignore_result=True)
    _send(app)
    channel = app.connection().default_channel
    message = channel._get(QUEUE)
    body = channel.decode_body(message["body"], message["properties"].get("body_encoding"))
    document = payloads.to_document(message, body.encode() if isinstance(body, str) else body)
    app.close()
    variants = _variants(message, document)
    names = list(variants)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    client: MongoClient = MongoClient(mongo_url, tz_aware=True, **QUIET_CLIENT)
    blocks = max(n // BLOCK, 1)
    try:
        for rep in range(repeat):
            db = client.get_database(f"publish_server_{rep}")
            inserts = {name: variants[name](db[f"c{k}"]) for k, name in enumerate(names)}
            for insert in inserts.values():
                for _ in range(20):  # warm: the collection and its indexes exist, the connection is checked out once
                    insert()
            spent = dict.fromkeys(names, 0.0)
            for block in range(blocks):  # variants take turns, in a rotating order, BLOCK inserts each
                for name in names[block % len(names) :] + names[: block % len(names)]:
                    insert = inserts[name]
                    started = time.perf_counter()
                    for _ in range(BLOCK):
                        insert()
                    spent[name] += time.perf_counter() - started
            for name in names:
                rounds[name].append(spent[name] / (blocks * BLOCK) * 1e6)
            client.drop_database(db.name)
    finally:
        client.close()
    median = {name: statistics.median(values) for name, values in rounds.items()}
    shipped = median["bbmongo: indexes as shipped"]
    marginal = {name: shipped - median[f"bbmongo: without {name}"] for name in (*INDEX_NAMES, RETENTION_INDEX)}
    return {"insert_us": median, "insert_us_rounds": rounds, "index_marginal_us": marginal}


def table(server: str, send: dict[str, Any], client: dict[str, float], inserts: dict[str, Any]) -> str:
    lines = [f"\npublish, part by part, on {server}"]
    lines.append("send_task, end to end (µs per publish, median of rounds; each round's figures)")
    for scheme in (*SCHEMES, UNINDEXED):
        rounds = ", ".join(f"{v:.0f}" for v in send["send_task_us_rounds"][scheme])
        lines.append(f"  {scheme:<20}{send['send_task_us'][scheme]:>8.0f}   ({rounds})")
        lines.append(f"  {'':<20}commands per publish: {send['commands_per_publish'].get(scheme)}")
    spread = ", ".join(f"{r:.2f}" for r in send["ratio_rounds"])
    lines.append(f"  bbmongo/mongodb publish rate: {send['ratio']:.2f}x  (rounds: {spread})")
    spread = ", ".join(f"{r:.2f}" for r in send["unindexed_ratio_rounds"])
    lines.append(f"  the same, jobs without secondary indexes: {send['unindexed_ratio']:.2f}x  (rounds: {spread})")
    lines.append("client side (µs per call, best of 5)")
    for name, value in client.items():
        lines.append(f"  {name:<52}{value:>8.1f}")
    lines.append("one insert, round trip included (µs, median of rounds; each round's figures)")
    for name, value in inserts["insert_us"].items():
        rounds = ", ".join(f"{v:.0f}" for v in inserts["insert_us_rounds"][name])
        lines.append(f"  {name:<52}{value:>8.0f}   ({rounds})")
    lines.append("each secondary index's share of an insert (as shipped − without it, µs)")
    for name, value in inserts["index_marginal_us"].items():
        lines.append(f"  {name:<52}{value:>8.0f}")
    if "profile" in send:
        lines.append(send["profile"])
    return "\n".join(lines)


def main() -> int:
    n = int(os.environ.get("BENCH_N", "300"))
    repeat = int(os.environ.get("BENCH_REPEAT", "3"))
    commands = Commands()
    monitoring.register(commands)  # before any client exists: the producers' clients report too
    workdir = Path(tempfile.mkdtemp(prefix="bb-bench-publish-"))
    server = mongo_server(workdir)
    server.start()
    try:
        _log(f"publish bench: N={n}, {repeat} rounds, on {server.label}")
        send = send_task_rounds(server.url, n, repeat, commands, os.environ.get("BENCH_PROFILE", "") not in ("", "0"))
        client = client_parts(server.url)
        inserts = server_parts(server.url, n, repeat)
    finally:
        server.stop()
    print(table(server.label, send, client, inserts))
    line = {"bench": "bb_broker publish", "server": server.label, "n": n, "repeat": repeat}
    line |= {"send_task": {k: v for k, v in send.items() if k != "profile"}, "client_us": client, "server": inserts}
    print(json.dumps(line, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
