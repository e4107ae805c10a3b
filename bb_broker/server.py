"""What the server behind a client can do: probed once per deployment and process, and read by every module here.

MongoDB-compatible engines differ in what they refuse: FerretDB 2 (and Azure's DocumentDB on the same engine)
refuses `hint` on findAndModify and `$changeStream` with code 115 and reports a unique index's refusal as code 1; a
standalone MongoDB refuses change streams with 40573. Learnt by failing, each of those ended every worker at its first
claim. So a channel asks `capabilities(db)` at connect (and any other module at its first need): one probe (a few
commands that change nothing but a scratch collection of their own, dropped at once) says what the deployment offers,
and each missing capability selects its fallback there and then (see FALLBACKS), never a failure at the first use.

The server's error codes the broker acts on live here too, each as a question (`Capabilities.is_unique_refusal`,
`is_too_large`, `is_unrecognised`...), so that no module keeps a list of its own (a unit test holds that).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, TypeGuard

from pymongo import MongoClient
from pymongo.database import Database
from pymongo.errors import (
    ConfigurationError,
    ConnectionFailure,
    DuplicateKeyError,
    InvalidURI,
    OperationFailure,
    PyMongoError,
)
from pymongo.uri_parser import parse_uri
from ulid import ULID

from bb_broker.connection import BrokerURLError, parse_broker_url, redact_url, scrub, url_secrets
from bb_broker.forks import reset_in_child

logger = logging.getLogger(__name__)

#: Server error codes the broker reads, by what they mean.
#: Unauthorized: the user may not run the command (a read-only user's probe of a write learns nothing).
UNAUTHORIZED = 13
#: AuthenticationFailed: the URL's user or password is wrong.
AUTHENTICATION_FAILED = 18
#: BadValue, as a hint naming an index the collection does not have is refused.
BAD_VALUE = 2
#: DuplicateKey and its older spellings: a unique index refused a write (pymongo raises DuplicateKeyError).
DUPLICATE_KEY_CODES = frozenset({11000, 11001, 12582})
#: An update whose document would pass the size limit (BSONObjectTooLarge and kin).
TOO_LARGE_CODES = frozenset({10334, 17419, 17420})
#: An update that cannot apply to one document (BadValue, TypeMismatch): a hand-edited field of the wrong type.
UNAPPLICABLE_UPDATE_CODES = frozenset({2, 14})
#: A command, or an option of it, the server does not implement (CommandNotSupported, CommandNotFound,
#: NotImplemented, IllegalOperation...): what a probe's refusal means.
NOT_IMPLEMENTED_CODES = frozenset({59, 115, 238, 20})
#: An index that exists under the same name with other options (IndexOptionsConflict, IndexKeySpecsConflict).
INDEX_CONFLICT_CODES = frozenset({85, 86})
#: The errors after which the drivers' retryable reads try a read again (a restart, a failover, a router that
#: lost a shard): the server labels a write's, not a read's.
RETRYABLE_READ_CODES = frozenset({6, 7, 63, 89, 91, 134, 150, 189, 262, 9001, 10107, 11600, 11602, 13388, 13435, 13436})
#: Error codes generic enough (InternalError, UnknownError) that a probe's refusal with one is recognised by its
#: message's wording as well: otherwise any internal error would read as a unique index's refusal.
_GENERIC_CODES = frozenset({1, 8})

#: Each capability's name as doctor and the docs say it, and what the broker does without it (and what that costs).
FALLBACKS: dict[str, tuple[str, str]] = {
    "change_streams": (
        "change streams",
        "workers and result waiters poll instead of being woken: a consumer reads its queues every polling_interval "
        "(1 s at most) and at each due time, a get() every `interval` it is given (0.5 s by default)",
    ),
    "hint_find_and_modify": (
        "hint on findAndModify",
        "claims are not hinted: the planner picks the index (the claim's filter and sort match bb_claim), "
        "no extra round trip",
    ),
    "hint_update": ("hint on updates", "writes are not hinted: the planner picks the index, no extra round trip"),
    "hint_find": ("hint on finds", "reads are not hinted: the planner picks the index, no extra round trip"),
    "hint_aggregate": ("hint on aggregates", "counts are not hinted: the planner picks the index"),
    "update_pipelines": (
        "update pipelines",
        "a queue with a concurrency limit claims one job per round trip instead of a batch in two; the stale sweep "
        "and the release at shutdown read the lost jobs, then write each one fenced on what they read (one read and "
        "a bulk write per outcome, whatever their number: a round trip more); forget() reads the task's jobs first",
    ),
    "ttl_indexes": (
        "TTL indexes",
        "succeeded jobs and expired messages are deleted by the workers' periodic sweep; rate counters and the "
        "results of tasks without a job (bb_results) are kept",
    ),
    "retryable_writes": (
        "retryable writes",
        "a write whose answer was lost is repeated by bb_broker itself, fenced on the job's attempt",
    ),
}


@dataclass(frozen=True)
class Capabilities:
    """What one deployment offers, as probed (every flag True where a probe could not tell: a read-only user)."""

    engine: str
    version: str
    topology: str  # "standalone", "replica set" or "sharded"
    change_streams: bool = True
    hint_find_and_modify: bool = True
    hint_update: bool = True
    hint_find: bool = True
    hint_aggregate: bool = True
    update_pipelines: bool = True
    ttl_indexes: bool = True
    retryable_writes: bool = True
    #: How this server reports a unique index's refusal, beside DuplicateKey: (code, the message's first words).
    unique_refusals: frozenset[tuple[int, str]] = frozenset()
    #: For each capability found missing, the server's own words (for doctor and the log).
    refusals: dict[str, str] = field(default_factory=dict, compare=False)

    def hint(self, index: str, command: str) -> dict[str, Any]:
        """The `hint=` keyword for `command` ("findAndModify", "update", "find" or "aggregate", a count's): empty
        where the server refuses hints on that command (the planner then picks the index itself)."""
        allowed = {
            "findAndModify": self.hint_find_and_modify,
            "update": self.hint_update,
            "find": self.hint_find,
            "aggregate": self.hint_aggregate,
        }[command]
        return {"hint": index} if allowed else {}

    def is_unique_refusal(self, exc: BaseException) -> bool:
        """Whether `exc` is a unique index refusing a write, however this server reports it."""
        if isinstance(exc, DuplicateKeyError):
            return True
        if not isinstance(exc, OperationFailure):
            return False
        if exc.code in DUPLICATE_KEY_CODES:
            return True
        return (exc.code or 0, _gist(_errmsg(exc), exc.code)) in self.unique_refusals

    def only_unique_refusals(self, errors: list[dict[str, Any]]) -> bool:
        """Whether every error of a bulk write's `writeErrors` is a unique index's refusal, however this server
        reports it."""
        return all(
            error.get("code") in DUPLICATE_KEY_CODES
            or (error.get("code") or 0, _gist(str(error.get("errmsg", "")), error.get("code"))) in self.unique_refusals
            for error in errors
        )

    def as_duplicate_key(self, exc: OperationFailure) -> OperationFailure:
        """`exc` as the DuplicateKeyError pymongo raises on MongoDB when it is this server's unique refusal."""
        if isinstance(exc, DuplicateKeyError) or not self.is_unique_refusal(exc):
            return exc
        return DuplicateKeyError(_errmsg(exc), exc.code, exc.details)

    def missing(self) -> list[str]:
        """The capabilities this deployment lacks, by their field names (FALLBACKS' keys)."""
        return [f.name for f in fields(self) if f.type == "bool" and not getattr(self, f.name)]

    def describe(self) -> str:
        """One line naming the server: engine, version, topology."""
        return f"{self.engine} {self.version}, {self.topology}"


# --- the errors every module asks about -------------------------------------------------------------------------


def is_too_large(exc: BaseException) -> TypeGuard[OperationFailure]:
    """A write refused because its document would pass the size limit."""
    return isinstance(exc, OperationFailure) and exc.code in TOO_LARGE_CODES


def is_unapplicable_update(exc: BaseException) -> TypeGuard[OperationFailure]:
    """An update that cannot apply to one document: a field of the wrong type, written by hand."""
    return isinstance(exc, OperationFailure) and exc.code in UNAPPLICABLE_UPDATE_CODES


def is_unauthorized(exc: BaseException) -> TypeGuard[OperationFailure]:
    """The user may not run the command."""
    return isinstance(exc, OperationFailure) and exc.code == UNAUTHORIZED


def is_authentication_failure(exc: BaseException) -> TypeGuard[OperationFailure]:
    """The URL's user or password is wrong."""
    return isinstance(exc, OperationFailure) and exc.code == AUTHENTICATION_FAILED


def is_missing_hinted_index(exc: BaseException) -> TypeGuard[OperationFailure]:
    """A hint naming an index the collection does not have (dropped by hand, or the collection with it)."""
    return (
        isinstance(exc, OperationFailure)
        and exc.code == BAD_VALUE
        and "hint" in str((exc.details or {}).get("errmsg", ""))
    )


def too_large_write_error(error: dict[str, Any]) -> bool:
    """Whether one of a bulk write's `writeErrors` is a document that would pass the size limit."""
    return error.get("code") in TOO_LARGE_CODES


def unapplicable_write_error(error: dict[str, Any]) -> bool:
    """Whether one of a bulk write's `writeErrors` is an update that cannot apply to its document (see
    is_unapplicable_update)."""
    return error.get("code") in UNAPPLICABLE_UPDATE_CODES


def unrecognised_write_error(error: dict[str, Any]) -> bool:
    """Whether one of a bulk write's `writeErrors` is a refusal no question here names (see is_unrecognised)."""
    return is_unrecognised(_write_failure(error))


def write_error_words(error: dict[str, Any], secrets: tuple[str, ...] = ()) -> str:
    """One of a bulk write's `writeErrors` in the server's words, as server_words says an error."""
    return server_words(_write_failure(error), secrets)


def _write_failure(error: dict[str, Any]) -> OperationFailure:
    return OperationFailure(str(error.get("errmsg", "")), error.get("code"), error)


def is_not_implemented(exc: BaseException) -> TypeGuard[OperationFailure]:
    """A command or option the server does not implement."""
    return isinstance(exc, OperationFailure) and exc.code in NOT_IMPLEMENTED_CODES


def is_index_conflict(exc: BaseException) -> TypeGuard[OperationFailure]:
    """An index that exists under its name with other options."""
    return isinstance(exc, OperationFailure) and exc.code in INDEX_CONFLICT_CODES


def is_transient(exc: BaseException) -> bool:
    """A failover, a restart or a dropped connection: the same write may be tried again."""
    return isinstance(exc, ConnectionFailure) or (
        isinstance(exc, OperationFailure) and exc.has_error_label("RetryableWriteError")
    )


def passes_with_time(exc: BaseException) -> bool:
    """An error the same command may not meet again soon: a lost connection, or a server's transient answer."""
    if isinstance(exc, ConnectionFailure):
        return True
    return isinstance(exc, OperationFailure) and (is_transient(exc) or exc.code in RETRYABLE_READ_CODES)


def is_unrecognised(exc: BaseException) -> bool:
    """A server's refusal that no question above names and that is no outage: bb_broker cannot act on it but by
    backing off and trying again (jobs/outages.py Refusals), for it must never end a worker nor drop a job's write."""
    if not isinstance(exc, OperationFailure) or passes_with_time(exc):
        return False
    recognised = (is_too_large, is_unapplicable_update, is_not_implemented, is_index_conflict)
    return exc.code not in DUPLICATE_KEY_CODES and not any(question(exc) for question in recognised)


def server_words(exc: PyMongoError, secrets: tuple[str, ...] = ()) -> str:
    """The server's own message and code, one line, credentials masked: what a log line quotes."""
    if isinstance(exc, OperationFailure):
        name = (exc.details or {}).get("codeName")
        code = f"code {exc.code}" + (f" {name}" if name else "")
        return f"{scrub(' '.join(_errmsg(exc).split())[:300], secrets)} ({code})"
    return scrub(" ".join(str(exc).split())[:300], secrets)


#: One server's error inside a ServerSelectionTimeoutError's text: "host:port: what happened".
_SERVER_ERROR = re.compile(r"(?:^|,)(?P<address>[^\s,]+:\d+): (?P<error>.+?)(?=,[^\s,]+:\d+: |$)")
_CONFIGURED_TIMEOUTS = re.compile(r" \(configured timeouts: [^)]*\)")
_GAVE_UP_AFTER = re.compile(r", Timeout: (?P<seconds>[\d.]+)s, Topology Description: .*$", re.S)
_NAME_NOT_RESOLVED = ("Name or service not known", "nodename nor servname", "name resolution", "No address associated")


def describe_failure(exc: PyMongoError, url: str, *, waited: float | None = None) -> str:
    """One line that says in words why talking to the server at `url` failed, with the URL as written, masked;
    `waited` is how long the caller tried, when that is not the one try of `exc`."""
    secrets = url_secrets(url)
    if is_authentication_failure(exc):
        user, database = _auth_identity(url)
        return f"authentication failed for user {user} on database {database}"
    shown = redact_url(url)
    if is_unauthorized(exc):
        user, database = _auth_identity(url)
        if user is None:
            return f"the server at {shown} requires authentication: put user:password@ in the broker URL"
        reason = scrub(str((exc.details or {}).get("errmsg") or "not authorized"), secrets)
        return f"user {user} (database {database}) may not do this on {shown}: {reason}"
    if isinstance(exc, OperationFailure):
        reason = scrub(str((exc.details or {}).get("errmsg") or exc.__class__.__name__), secrets)
        return f"the server at {shown} refused: {_shorten(reason)} (code {exc.code})"
    text = scrub(str(exc), secrets)
    gave_up = _GAVE_UP_AFTER.search(text)
    causes = [
        _cause_in_words(match.group("address"), _CONFIGURED_TIMEOUTS.sub("", match.group("error")))
        for match in _SERVER_ERROR.finditer(text[: gave_up.start()] if gave_up else text)
    ]
    cause = "; ".join(dict.fromkeys(causes)) or _shorten(
        _CONFIGURED_TIMEOUTS.sub("", text[: gave_up.start()] if gave_up else text)
    )
    seconds = round(waited, 1) if waited is not None else float(gave_up.group("seconds")) if gave_up else None
    waited_text = f" (gave up after {seconds:g} s)" if seconds is not None else ""
    return f"cannot reach the server at {shown}: {cause}{waited_text}"


def _cause_in_words(address: str, error: str) -> str:
    host = address.rsplit(":", 1)[0]
    if "Connection refused" in error:
        return f"nothing listens at {address} (connection refused): is the server running?"
    if any(words in error for words in _NAME_NOT_RESOLVED):
        return f"the host name {host} does not resolve"
    if "timed out" in error:
        return f"no answer from {address} (timed out)"
    if "Got response id" in error or "ProtocolError" in error:
        return f"{address} answered, but not as a MongoDB server"
    if "SSL" in error or "certificate" in error.lower() or "TLS" in error:
        return f"TLS with {address} failed: {_shorten(error)}"
    return f"{address}: {_shorten(error)}"


def _shorten(text: str, limit: int = 200) -> str:
    """One line, cut at a word boundary when long."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " …"


def _auth_identity(url: str) -> tuple[str | None, str]:
    """The user a URL logs in as, and the database it authenticates against (authSource, else the path)."""
    try:
        parsed = parse_uri(parse_broker_url(url).mongo_uri, validate=False, warn=False)
    except (BrokerURLError, InvalidURI, ConfigurationError, ValueError):
        return None, "admin"
    options = {name.lower(): value for name, value in parsed["options"].items()}
    database = options.get("authsource") or parsed.get("database") or "admin"
    return parsed.get("username"), database


@contextmanager
def unique_refusals(db: Database) -> Iterator[None]:
    """Inside, a unique index's refusal comes out as pymongo's DuplicateKeyError however the server behind `db`
    reports it (FerretDB's code 1), so that every `except DuplicateKeyError` holds on every engine."""
    try:
        yield
    except OperationFailure as exc:
        converted = exc if isinstance(exc, DuplicateKeyError) else capabilities(db).as_duplicate_key(exc)
        if converted is exc:
            raise
        raise converted from exc


# --- the probe --------------------------------------------------------------------------------------------------


def capabilities(db: Database) -> Capabilities:
    """The capabilities of the deployment behind `db`'s client: probed at the first call, kept for the process and
    the children it forks.

    A server that cannot be reached raises as any command would (the caller's outage handling applies, and the
    next call probes again); nothing is kept from a probe that did not finish."""
    client = db.client
    with _lock:
        known = _probed.get(client)
    if known is not None:
        return known
    found = _probe(db)
    with _lock:
        _probed.setdefault(client, found)
        found = _probed[client]
    if found.missing():
        logger.warning(
            "bb_broker: %s lacks %s; using the fallbacks (bb-broker doctor says what they cost)",
            found.describe(),
            ", ".join(found.missing()),
        )
    return found


#: Per deployment: pymongo's clients compare (and hash) by their seed list, replica set name and SRV host, so the
#: clients one process makes with other options (timeouts, pool sizes) share one probe.
_probed: dict[MongoClient, Capabilities] = {}
_lock = threading.Lock()


def _keep_parent_probes() -> None:
    global _lock
    # A child's clients are its own (connection.py forgets the parent's), but the deployment behind them is the one
    # the parent probed: the parent's clients stay here as keys only (they compare without a round trip), so that each
    # pool process or forked producer does not probe it again (a scratch collection created, written and dropped).
    _lock = threading.Lock()


reset_in_child(_keep_parent_probes)


def _probe(db: Database) -> Capabilities:
    hello = db.client.admin.command("hello")
    try:
        build: dict[str, Any] = db.client.admin.command("buildInfo")
    except OperationFailure:
        build = {}
    refusals: dict[str, str] = {}
    scratch = db[f"bb_probe_{os.getpid()}_{ULID()}"]
    found: dict[str, Any] = {}
    try:
        unique, found["ttl_indexes"] = _probe_indexes(scratch, refusals)
        token = f"bb-probe-{ULID()}"  # matches nothing: no probe below writes a document
        probes = {
            "hint_find_and_modify": lambda: scratch.find_one_and_update(
                {"_id": token}, {"$set": {"p": 1}}, hint="_id_"
            ),
            "hint_update": lambda: scratch.update_one({"_id": token}, {"$set": {"p": 1}}, hint="_id_"),
            "hint_find": lambda: scratch.find_one({"_id": token}, hint="_id_"),
            "hint_aggregate": lambda: scratch.count_documents({"_id": token}, hint="_id_"),
            "update_pipelines": lambda: scratch.update_one({"_id": token}, [{"$set": {"p": 1}}]),
            "change_streams": lambda: _open_change_stream(scratch),
        }
        for name, probe in probes.items():
            found[name] = _offered(name, probe, refusals)
    finally:
        _drop(scratch)
    topology = "sharded" if hello.get("msg") == "isdbgrid" else "replica set" if hello.get("setName") else "standalone"
    return Capabilities(
        engine=_engine(build, db),
        version=str(build.get("version") or "unknown"),
        topology=topology,
        retryable_writes=topology != "standalone" and hello.get("logicalSessionTimeoutMinutes") is not None,
        unique_refusals=unique,
        refusals=refusals,
        **found,
    )


def _offered(name: str, probe: Any, refusals: dict[str, str]) -> bool:
    """Whether the server takes the probe: a refusal says no; a user who may not run it learns nothing (yes)."""
    try:
        probe()
    except OperationFailure as exc:
        if passes_with_time(exc):
            raise  # a failover mid-probe: nothing is learnt, the next call probes again
        if exc.code == UNAUTHORIZED:
            return True
        refusals[name] = server_words(exc)
        return False
    return True


def _probe_indexes(scratch: Any, refusals: dict[str, str]) -> tuple[frozenset[tuple[int, str]], bool]:
    """How the server reports a partial unique index's refusal (the shape of bb_limit_slot and the serial key's), and
    whether it keeps TTL indexes."""
    ttl = _offered("ttl_indexes", lambda: scratch.create_index("expiresAt", expireAfterSeconds=3600), refusals)
    unique_index = {"unique": True, "partialFilterExpression": {"k": {"$exists": True}}, "name": "bb_probe_k"}
    if not _offered("unique_indexes", lambda: scratch.create_index("k", **unique_index), refusals):
        return frozenset(), ttl  # no unique index to learn from (claims cannot hold without: doctor's check says)
    try:
        key = str(ULID())
        scratch.insert_one({"k": key})
        scratch.insert_one({"k": key})
    except DuplicateKeyError:
        return frozenset(), ttl
    except OperationFailure as exc:
        if passes_with_time(exc):
            raise
        if exc.code == UNAUTHORIZED:
            return frozenset(), ttl
        return frozenset({(exc.code or 0, _gist(_errmsg(exc), exc.code))}), ttl
    logger.error("bb_broker: %s accepted a duplicate in a unique index: serial keys and limits cannot hold there",
                 scratch.database.name)  # fmt: skip
    return frozenset(), ttl


def _open_change_stream(scratch: Any) -> None:
    # The database's stream, as the workers' wake-ups and the results' waits open it (a user may hold the privilege
    # on one and not the other).
    with scratch.database.watch([{"$match": {"ns.coll": scratch.name}}], max_await_time_ms=1) as stream:
        stream.try_next()


def _drop(scratch: Any) -> None:
    try:
        scratch.drop()
    except PyMongoError as exc:
        logger.warning("bb_broker: could not drop the probe's collection %s: %s", scratch.full_name, server_words(exc))


#: Host names of the hosted services that tell their engine (their buildInfo reads as MongoDB's).
_HOSTED = {".docdb.amazonaws.com": "Amazon DocumentDB", ".cosmos.azure.com": "Azure Cosmos DB"}
#: A buildInfo field that names a compatible engine's own version: `ferretdbVersion`, `<engine>Version`.
_ENGINE_VERSION = re.compile(r"^(?P<engine>[a-z][a-z0-9]*)Version$", re.IGNORECASE)


def _engine(build: dict[str, Any], db: Database) -> str:
    for host, _ in db.client.topology_description.server_descriptions():
        for suffix, name in _HOSTED.items():
            if host.endswith(suffix):
                return name
    for key, value in build.items():
        match = _ENGINE_VERSION.match(key)
        if match and match.group("engine").lower() not in {"git", "openssl", "javascriptengine"}:
            return f"{match.group('engine')} {value} (MongoDB-compatible)"
        if key.lower() == "ferretdb":
            return "FerretDB"
    return "MongoDB"


def _errmsg(exc: OperationFailure) -> str:
    return str((exc.details or {}).get("errmsg") or exc)


def _gist(message: str, code: int | None) -> str:
    """What identifies a refusal with a generic code: its first three words (index names and values come later)."""
    return " ".join(message.lower().split()[:3]) if code in _GENERIC_CODES else ""
