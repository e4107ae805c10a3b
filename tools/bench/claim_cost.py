"""`python -m tools.bench.claim_cost`: what one claim costs on the server tools.bench.servers picks, per backlog.

For each backlog of BENCH_CLAIM_BACKLOGS (default 100,1000,10000: due jobs of one queue, ~1.1 KB each as a bench
task's are, all of one fair key but for nine keys of 10), in a fresh database: mongod's plan for the claim's read as
the server's `explain` gives it (keys and documents examined), then the median of BENCH_CLAIM_SAMPLES (30) single
claims, each claimed job put back so the backlog holds: the broker's own claim of an unfair and of a fair queue,
the same findAndModify with plain pymongo (hinted, then not), and a findAndModify of the head by its `_id`. The plans
are those of the claim, of a fair queue's turn of the big key, and of its turn of the jobs without a key when none is
due (what a claim that finds that turn empty reads).
Then, at the largest backlog, plain pymongo claims for BENCH_CLAIM_SECONDS (20) from one thread and from two at
once: two plain claims, then a plain claim beside a fair queue's turn of the big key (what two workers send while
one still rotates and the other saw the small keys run out), and the server's "re-picking" warnings (SecantusDB's
findAndModify re-reads the head each time another writer takes it first).
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pymongo import MongoClient, ReturnDocument
from pymongo.database import Database

from bb_broker.jobs.fair_keys import FAIR_INDEX, FAIR_ORDER, NO_KEY
from bb_broker.jobs.indexes import CLAIM_ORDER
from bb_broker.jobs.queues import QueueLimits
from bb_broker.jobs.store import JobStore
from tools.bench.servers import mongo_server

QUEUE = "q"
SMALL = [f"small-{n}" for n in range(9)]
#: (extra filter, sort, hint) of a claim: the plain one, and a fair queue's turn of the big key.
PLAIN = ({}, CLAIM_ORDER, "bb_claim")
FAIR_TURN = ({"fairKey": "big"}, FAIR_ORDER, "bb_fair")


def fill(db: Database, backlog: int) -> JobStore:
    store = JobStore(db)
    store.ensure_indexes()
    db.jobs.create_indexes([FAIR_INDEX])
    now = datetime.now(UTC)
    keys = ["big"] * (backlog - 10 * len(SMALL)) + SMALL * 10
    docs = [
        {"_id": f"j{i:07d}", "status": "queued", "queue": QUEUE, "priority": 0, "runAfter": now, "attempts": 0,
         "kind": "t", "taskId": f"t{i}", "payload": {"body": "x" * 800}, "createdAt": now, "updatedAt": now,
         "fairKey": key}
        for i, key in enumerate(keys)
    ]  # fmt: skip
    for start in range(0, len(docs), 1000):
        db.jobs.insert_many(docs[start : start + 1000])
    return store


def due() -> dict[str, Any]:
    return {"status": "queued", "queue": QUEUE, "runAfter": {"$lte": datetime.now(UTC)}}


def take(owner: str) -> dict[str, Any]:
    return {"$set": {"status": "running", "leaseOwner": owner}, "$inc": {"attempts": 1}}


def claim_with(db: Database, shape: tuple[dict[str, Any], Any, str | None], owner: str) -> dict[str, Any] | None:
    extra, order, hint = shape
    return db.jobs.find_one_and_update(
        {**due(), **extra},
        take(owner),
        sort=order,
        return_document=ReturnDocument.AFTER,
        **({"hint": hint} if hint else {}),
    )


def examined(db: Database, command: dict[str, Any]) -> str:
    stats = db.command("explain", command, verbosity="executionStats")["executionStats"]
    return f"{stats['totalKeysExamined']} / {stats['totalDocsExamined']}"


def one_backlog(db: Database, backlog: int, samples: int) -> str:
    store = fill(db, backlog)
    plan = examined(db, {"findAndModify": "jobs", "query": due(), "sort": dict(CLAIM_ORDER), "update": take("x"),
                         "hint": "bb_claim"})  # fmt: skip
    turns = [
        examined(db, {"findAndModify": "jobs", "query": {**due(), "fairKey": key}, "sort": dict(FAIR_ORDER),
                      "update": take("x"), "hint": "bb_fair"})
        for key in ("big", NO_KEY)  # the no-key turn with no such job due: what finding it empty costs
    ]  # fmt: skip

    def by_id() -> Any:
        head = db.jobs.find_one(due(), {"_id": 1}, sort=CLAIM_ORDER, hint="bb_claim")
        assert head is not None
        return lambda: db.jobs.find_one_and_update({"_id": head["_id"], "status": "queued"}, take("p"))

    claims: dict[str, Callable[[], Any]] = {
        "ours, unfair": lambda: store.claim(QUEUE, "p"),
        "ours, fair": lambda: store.claim(QUEUE, "p", QueueLimits(fair=True)),
        "hinted": lambda: claim_with(db, PLAIN, "p"),
        "unhinted": lambda: claim_with(db, ({}, CLAIM_ORDER, None), "p"),
        "by _id": by_id,
    }
    cells = []
    for name, claim in claims.items():
        times = []
        for _ in range(samples):
            run = claim() if name == "by _id" else claim
            started = time.perf_counter()
            got = run()
            times.append(time.perf_counter() - started)
            assert got is not None, name
            db.jobs.update_one({"_id": got.id if hasattr(got, "id") else got["_id"]}, {"$set": {"status": "queued"}})
        cells.append(f"{statistics.median(times) * 1000:.1f}")
    return f"| {backlog:,} | {plan} | {' | '.join(turns)} | " + " | ".join(cells) + " |"


def contended(db: Database, seconds: float, *shapes: tuple[dict[str, Any], Any, str | None]) -> str:
    """Claims from one thread per shape for `seconds`, the backlog made whole first: each one's count and times."""
    db.jobs.update_many({"status": "running"}, {"$set": {"status": "queued"}})
    times: list[list[float]] = [[] for _ in shapes]
    end = time.perf_counter() + seconds

    def loop(n: int) -> None:
        while time.perf_counter() < end:
            started = time.perf_counter()
            assert claim_with(db, shapes[n], f"w{n}") is not None
            times[n].append(time.perf_counter() - started)

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(len(shapes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return "; ".join(
        f"{'plain' if shape is PLAIN else 'fair turn'}: {len(took)} claims, median "
        f"{statistics.median(took) * 1000:.0f} ms, longest {max(took) * 1000:.0f} ms"
        for shape, took in zip(shapes, times, strict=True)
    )


def main() -> None:
    backlogs = [int(n) for n in os.environ.get("BENCH_CLAIM_BACKLOGS", "100,1000,10000").split(",")]
    samples = int(os.environ.get("BENCH_CLAIM_SAMPLES", "30"))
    seconds = float(os.environ.get("BENCH_CLAIM_SECONDS", "20"))
    server = mongo_server(Path(tempfile.mkdtemp(prefix="bb-claim-cost-")))
    server.start()
    client: MongoClient[dict[str, Any]] = MongoClient(server.url)
    try:
        print(f"{server.label}, load average {os.getloadavg()[0]:.1f}\n")
        print("| backlog | claim's plan: keys / docs examined | a fair turn's | the empty no-key turn's "
              "| ms a claim: ours, unfair | ours, fair | findAndModify hinted | unhinted | by `_id` |")  # fmt: skip
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for backlog in backlogs:
            print(one_backlog(client[f"claim_cost_{backlog}"], backlog, samples), flush=True)
        db = client[f"claim_cost_{backlogs[-1]}"]
        print(f"\nplain pymongo claims at {backlogs[-1]:,}, {seconds:.0f} s each, one findAndModify a claim:")
        print("  one claimer:                 ", contended(db, seconds, PLAIN))
        print("  one claimer, fair turn:      ", contended(db, seconds, FAIR_TURN))
        print("  two claimers:                ", contended(db, seconds, PLAIN, PLAIN))
        print("  a plain beside a fair turn:  ", contended(db, seconds, PLAIN, FAIR_TURN), flush=True)
    finally:
        client.close()
        server.stop()
    log = getattr(server, "log", None)
    if log is not None:
        warned = re.findall(r"re-picking for ([\d.]+)s \((\d+) steals\)", Path(log).read_text())
        longest = max(warned, key=lambda w: float(w[0]), default=None)
        print(
            f"  the server's re-picking warnings: {len(warned)}"
            + (f", the longest {longest[0]} s ({longest[1]} steals)" if longest else "")
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
