"""`bb-broker doctor`: whether a MongoDB server can carry the broker safely, one verdict per capability."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from pymongo import ReturnDocument
from pymongo.database import Database
from pymongo.errors import PyMongoError
from pymongo.write_concern import WriteConcern
from ulid import ULID

from bb_broker import connection
from bb_broker.jobs.document import claim_query
from bb_broker.jobs.indexes import CLAIM_ORDER, INDEXES, RETENTION_INDEX
from bb_broker.jobs.store import JobStore
from bb_broker.options import DEFAULTS
from bb_broker.server import FALLBACKS, capabilities, is_transient

OK, DEGRADED, UNSAFE, UNKNOWN = "ok", "degraded", "unsafe", "unknown"

#: The race probe: this many claimers take this many documents at once; each must be taken exactly once.
CLAIMERS = 8
DOCUMENTS = 200
#: The dropped connections one claimer of the check outlasts, each claim tried again, before the check fails.
MAX_LOST_ANSWERS = 10
#: Seconds of clock difference beyond which a server's and this machine's times are worth a look.
CLOCK_TOLERANCE = 5.0


@dataclass(frozen=True)
class Verdict:
    capability: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<9} {self.capability}: {self.detail}"


def diagnose(
    db: Database, *, collection: str = DEFAULTS.jobs_collection, secrets: tuple[str, ...] = ()
) -> list[Verdict]:
    """Every check, each on its own: one that errors says so in its verdict and the rest still run."""
    scratch = db[f"bb_doctor_{ULID()}"]
    verdicts = []
    try:
        verdicts += _capabilities(db)
    except PyMongoError as exc:
        verdicts.append(Verdict("server", UNKNOWN, f"the probe failed: {_describe(exc, secrets)}"))
    checks: list[tuple[str, Callable[[], Verdict]]] = [
        ("atomic claims", lambda: _atomic_claims(db, scratch.name)),
        ("replica set", lambda: _replica_set(db, scratch)),
        ("clock", lambda: _clock(db)),
        ("jobs indexes", lambda: _jobs_indexes(db, collection)),
    ]
    for name, check in checks:
        try:
            verdicts.append(check())
        except PyMongoError as exc:
            verdicts.append(Verdict(name, UNKNOWN, f"the check failed: {_describe(exc, secrets)}"))
    try:
        scratch.drop()
    except PyMongoError as exc:
        verdicts.append(Verdict("cleanup", UNKNOWN, f"drop {scratch.full_name} by hand: {_describe(exc, secrets)}"))
    return verdicts


def _describe(exc: PyMongoError, secrets: tuple[str, ...]) -> str:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {connection.scrub(first_line, secrets)[:200]}"


def _atomic_claims(db: Database, scratch: str) -> Verdict:
    store = JobStore(db, collection=scratch)
    store.coll.insert_many(
        [
            {"_id": f"doc{i:04d}", "queue": "probe", "priority": 0, "status": "queued", "attempts": 0,
             "runAfter": datetime(2000, 1, 1, tzinfo=UTC)}
            for i in range(DOCUMENTS)
        ]
    )  # fmt: skip
    claimed: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(CLAIMERS)
    errors: list[BaseException] = []

    def claimer(n: int) -> None:
        # The store's own claim query, without its one-claim-per-process lock: here the claimers are meant to race.
        try:
            start.wait()
            lost = 0
            while True:
                due, take = claim_query("probe", f"doctor-{n}", store.now())
                try:
                    doc = store.coll.find_one_and_update(
                        due, take, sort=CLAIM_ORDER, return_document=ReturnDocument.AFTER
                    )
                except PyMongoError as exc:
                    # A dropped connection (a loaded machine, a failover): the claim may have landed, its answer
                    # lost. Claimed again; what landed is counted from the documents below, not from the answers.
                    lost += 1
                    if not is_transient(exc) or lost > MAX_LOST_ANSWERS:
                        raise
                    continue
                if doc is None:
                    return
                with lock:
                    claimed.append(doc["_id"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(CLAIMERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    # Each claim adds 1 to attempts: a document two claims took has 2 (or was answered twice, where the server lost
    # an increment). A claim whose answer was lost is in the documents, not in the answers: not counted against.
    twice = sum(1 for n in Counter(claimed).values() if n > 1)
    untaken = len(list(store.coll.find({"status": "queued"}, {"_id": 1})))  # a find: some servers lack aggregate
    overcounted = len(list(store.coll.find({"attempts": {"$ne": 1}}, {"_id": 1})))
    if twice or untaken or overcounted:
        return Verdict(
            "atomic claims",
            UNSAFE,
            f"{CLAIMERS} claimers on {DOCUMENTS} documents: {twice} claimed more than once, {untaken} never claimed, "
            f"{overcounted} with attempts other than 1: findAndModify is not atomic here, jobs would run twice",
        )
    unanswered = DOCUMENTS - len(set(claimed))
    lost = f" ({unanswered} of them claimed by a try whose answer the connection lost)" if unanswered else ""
    return Verdict(
        "atomic claims", OK, f"{CLAIMERS} concurrent claimers took {DOCUMENTS} documents, each exactly once{lost}"
    )


def _capabilities(db: Database) -> list[Verdict]:
    """The server's name and each capability the probe (server.py) found, with the fallback a missing one selects."""
    found = capabilities(db)
    verdicts = [Verdict("server", OK, found.describe())]
    for name, (label, fallback) in FALLBACKS.items():
        if getattr(found, name):
            verdicts.append(Verdict(label, OK, "offered"))
        else:
            refused = found.refusals.get(name)
            verdicts.append(Verdict(label, DEGRADED, f"not offered{f' ({refused})' if refused else ''}: {fallback}"))
    return verdicts


def _replica_set(db: Database, scratch) -> Verdict:
    hello = db.client.admin.command("hello")
    name = hello.get("setName")
    if not name:
        return Verdict(
            "replica set",
            DEGRADED,
            "standalone server: no failover and no majority write concern; a lost server loses acknowledged jobs",
        )
    scratch.with_options(write_concern=WriteConcern("majority", wtimeout=5000)).insert_one({"probe": "majority"})
    return Verdict("replica set", OK, f"replica set {name!r}; a write with write concern 'majority' succeeded")


def _clock(db: Database) -> Verdict:
    before = datetime.now(UTC)
    server = db.client.admin.command("hello")["localTime"]
    after = datetime.now(UTC)
    server = server if server.tzinfo else server.replace(tzinfo=UTC)
    skew = (server - (before + (after - before) / 2)).total_seconds()
    detail = f"server clock {skew:+.1f}s from this machine's"
    if abs(skew) > CLOCK_TOLERANCE:
        return Verdict(
            "clock",
            DEGRADED,
            f"{detail}: leases and due times use the server's clock, but times shown by this machine will differ",
        )
    return Verdict("clock", OK, detail)


def _jobs_indexes(db: Database, collection: str) -> Verdict:
    if collection not in db.list_collection_names():
        return Verdict("jobs indexes", OK, f"{db.name}.{collection} does not exist yet: the first worker creates it")
    present = {ix["name"] for ix in db[collection].list_indexes()}
    needed = [ix.document["name"] for ix in INDEXES]
    missing = [name for name in needed if name not in present]
    if missing:
        return Verdict(
            "jobs indexes",
            DEGRADED,
            f"{db.name}.{collection} lacks {', '.join(missing)}: the next worker or producer creates them",
        )
    retention = "with" if RETENTION_INDEX in present else "without"
    return Verdict(
        "jobs indexes", OK, f"{db.name}.{collection} has {', '.join(needed)} ({retention} {RETENTION_INDEX})"
    )


def run(broker: str, collection: str, echo: Callable[[str], None], complain: Callable[[str], None]) -> int:
    """The command's body: 0 when the server can carry the broker (degraded included), 2 when it is unsafe, 1 when
    it cannot be reached or a check could not finish. A URL that cannot be used, or a server that cannot be reached,
    is one line to `complain` (stderr, as every command's error); the verdicts go to `echo`."""
    try:
        target = connection.parse_broker_url(broker)
    except connection.BrokerURLError as exc:
        complain(f"bb-broker: {exc}")
        return 1
    db = connection.get_database(target, **connection.quick_timeouts(target))
    try:
        db.client.admin.command("ping")
    except PyMongoError as exc:
        complain(f"bb-broker: cannot reach {target.display}: {_describe(exc, target.secrets)}")
        return 1
    echo(f"checking {target.display} (database {target.database})")
    verdicts = diagnose(db, collection=collection, secrets=target.secrets)
    for verdict in verdicts:
        echo(verdict.line())
    unsafe = [v.capability for v in verdicts if v.status == UNSAFE]
    if unsafe:
        echo(f"verdict: unsafe ({', '.join(unsafe)})")
        return 2
    unknown = [v.capability for v in verdicts if v.status == UNKNOWN]
    if unknown:
        echo(f"verdict: unknown ({', '.join(unknown)} could not be checked)")
        return 1
    degraded = [v.capability for v in verdicts if v.status == DEGRADED]
    echo(f"verdict: {'usable, degraded: ' + ', '.join(degraded) if degraded else 'ok'}")
    return 0
