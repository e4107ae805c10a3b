"""Broker URLs, one MongoClient per process, and keeping credentials out of every output."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any
from urllib.parse import quote, quote_plus, unquote, unquote_plus

import bson
import pymongo
from bson.codec_options import DatetimeConversion
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import ConfigurationError, InvalidURI, PyMongoError
from pymongo.uri_parser import parse_uri
from ulid import ULID

from bb_broker.forks import reset_in_child

SCHEMES = {"bbmongo": "mongodb", "bbmongo+srv": "mongodb+srv", "mongodb": "mongodb", "mongodb+srv": "mongodb+srv"}
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
#: What follows the user info in a URL pymongo reads: hosts (`host[:port]`, `[v6][:port]`, comma-separated), then
#: `/database` and `?options`, none of them holding an `@` outside an option's value.
_HOST = r"(?:\[[0-9a-f:.%a-z]*\]|[^\s:/?#@\[\],]+)(?::\d*)?"
_AFTER_USERINFO = re.compile(
    rf"^(?:{_HOST}(?:,{_HOST})*)?(?:/[^?#@/]*)?(?:\?(?P<options>[^#]*))?$", re.IGNORECASE | re.DOTALL
)
#: Characters a password must have percent-encoded: written as they are, pymongo reads another URL.
_DELIMITERS = "/?#@"
#: URI options whose value is a credential (the URI options spec's sensitive options), masked whole.
SECRET_OPTIONS = frozenset({"tlscertificatekeyfilepassword", "proxypassword", "proxyusername"})
#: authMechanismProperties that are no secret (pymongo's list); every other one's value (AWS_SESSION_TOKEN) is.
_PUBLIC_MECHANISM_PROPERTIES = frozenset(
    {"SERVICE_NAME", "SERVICE_HOST", "SERVICE_REALM", "CANONICALIZE_HOST_NAME", "ENVIRONMENT", "TOKEN_RESOURCE",
     "ALLOWED_HOSTS"}
)  # fmt: skip
_OPTION_SEPARATOR = re.compile(r"([&;])")


@cache
def _known_options() -> frozenset[str]:
    from pymongo import common

    names = {*common.URI_OPTIONS_VALIDATOR_MAP, *common.URI_OPTIONS_DEPRECATION_MAP}
    names.update(alias for aliases in common.URI_OPTIONS_ALIAS_MAP.values() for alias in aliases)
    return frozenset(name.lower() for name in names)


def _reads_as_options(options: str | None, known: frozenset[str]) -> bool:
    if options is None:
        return True
    pairs = [pair.partition("=") for pair in re.split(r"[&;]", options) if pair]
    return all(equals and key.lower() in known for key, equals, _ in pairs)


def _split_userinfo(url: str) -> tuple[str, str | None, str]:
    """The scheme (with `://`), the user info (None when there is none) and the rest of a URL.

    A password written unescaped may hold `@`, `/`, `?`, `#` or `:`, so the user info ends at the first `@` after
    which the rest reads as hosts, database and known options, with no `@` before its first `/` (an `@` inside an
    option's value after the database, `/db?appname=a@b`, stays in the options); when no reading fits, at the last
    `@`, which masks the most.
    """
    scheme = _SCHEME.match(url)
    if not scheme:
        return "", None, url
    body = url[scheme.end() :]
    ats = [index for index, char in enumerate(body) if char == "@"]
    if not ats:
        return scheme.group(), None, body
    known = _known_options()
    for end in [-1, *ats]:  # -1: no user info at all
        if "@" in body[end + 1 :].partition("/")[0]:
            continue  # pymongo takes the last `@` before the first `/` for the end of the user info: so must we
        rest = _AFTER_USERINFO.match(body[end + 1 :])
        if rest and _reads_as_options(rest.group("options"), known):
            return (scheme.group(), None, body) if end < 0 else (scheme.group(), body[:end], body[end + 1 :])
    return scheme.group(), body[: ats[-1]], body[ats[-1] + 1 :]


#: What reads as a scheme at the start of text that is no URL (a space before it, one slash): kept when shown.
_LOOSE_SCHEME = re.compile(r"^\s*[a-z][a-z0-9+.-]*:/+", re.IGNORECASE)


def _split_loosely(text: str) -> tuple[str, str | None, str]:
    """For text _split_userinfo reads no scheme in (` bbmongo://u:pw@h/db`, `u:pw@h/db`, `bbmongo:/u:pw@h`): what
    reads as a scheme, everything before the last `@` after it as the user info (user and password alike: which
    is which cannot be told), and the rest."""
    prefix = _LOOSE_SCHEME.match(text)
    start = prefix.end() if prefix else 0
    userinfo, at, rest = text[start:].rpartition("@")
    return (text[:start], userinfo, rest) if at else (text[:start], None, text[start:])


def _mask_options(rest: str) -> str:
    """The hosts, database and options with every credential among the options replaced by `**`."""
    head, question, options = rest.partition("?")
    if not question:
        return rest
    pieces = _OPTION_SEPARATOR.split(options)
    for index in range(0, len(pieces), 2):
        key, equals, value = pieces[index].partition("=")
        if not equals:
            continue
        if key.lower() in SECRET_OPTIONS:
            pieces[index] = f"{key}=**"
        elif key.lower() == "authmechanismproperties":
            masked = [
                f"{name}:**" if name.strip().upper() not in _PUBLIC_MECHANISM_PROPERTIES else f"{name}:{setting}"
                for name, _, setting in (prop.partition(":") for prop in unquote_plus(value).split(","))
            ]
            pieces[index] = f"{key}={','.join(masked)}"
    return f"{head}?{''.join(pieces)}"


def _option_secrets(rest: str) -> list[str]:
    """The text of each credential among a URL's options, as written and decoded."""
    found: list[str] = []
    _, question, options = rest.partition("?")
    for pair in re.split(r"[&;]", options) if question else ():
        key, _, value = pair.partition("=")
        if key.lower() in SECRET_OPTIONS:
            found += [value, unquote_plus(value)]
        elif key.lower() == "authmechanismproperties":
            for spelling in {value, unquote(value), unquote_plus(value)}:  # pymongo decodes it with unquote_plus
                for name, _, setting in (prop.partition(":") for prop in spelling.split(",")):
                    if name.strip().upper() not in _PUBLIC_MECHANISM_PROPERTIES:
                        found += [setting, quote(setting, safe=""), quote_plus(setting)]
    return found


def url_secrets(url: str) -> tuple[str, ...]:
    """Every secret a URL holds (its password, credentials among its options), each as written and decoded."""
    scheme, userinfo, rest = _split_userinfo(url)
    if scheme:
        passwords = [userinfo.split(":", 1)[1]] if userinfo is not None and ":" in userinfo else []
    else:  # no URL: its user info whole (which part is the password cannot be told), and what follows its first `:`
        _, userinfo, rest = _split_loosely(url)
        passwords = [userinfo, userinfo.partition(":")[2]] if userinfo else []
    found = _option_secrets(rest)
    for password in passwords:
        found += [password, unquote(password), unquote_plus(password)]
    # The longest first: a secret that holds another is masked whole.
    return tuple(sorted({secret for secret in found if secret}, key=len, reverse=True))


class BrokerURLError(ValueError):
    """The broker URL cannot name a MongoDB database."""


@dataclass(frozen=True)
class BrokerTarget:
    mongo_uri: str = field(repr=False)
    database: str
    secrets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def display(self) -> str:
        return redact_url(self.mongo_uri)


def redact_url(url: str) -> str:
    """The URL as written with its password and any credential among its options masked, safe for logs and errors."""
    scheme, userinfo, rest = _split_userinfo(url)
    if not scheme:  # no URL (a space before it, a slash missing): its user info masked whole, if it has any
        prefix, loose, rest = _split_loosely(url)
        return scrub(url, url_secrets(url)) if loose is None else f"{prefix}**@{_mask_options(rest)}"
    shown = _mask_options(rest)
    if userinfo is None:
        return f"{scheme}{shown}"
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}{user}:**@{shown}" if colon else f"{scheme}{user}@{shown}"


def split_password(url: str) -> tuple[str, str | None]:
    """The URL with its password masked, and the password, so that each can travel where it is safe."""
    scheme, userinfo, rest = _split_userinfo(url)
    if userinfo is None or ":" not in userinfo:
        return url, None
    user, _, password = userinfo.partition(":")
    return f"{scheme}{user}:**@{rest}", password


_MASKED_PASSWORD = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:]*):\*\*@", re.IGNORECASE)


def join_password(url: str, password: str | None) -> str:
    """split_password's inverse: the masked password replaced by the real one."""
    match = _MASKED_PASSWORD.match(url)
    if not password or not match:
        return url
    return f"{match.group('scheme')}{match.group('user')}:{password}@{url[match.end() :]}"


def client_url(client: Any) -> str:
    """The broker URL, password included, that a Kombu connection's fields stand for.

    Kombu hands the first URL over whole (we parse our own URLs: replica sets, options, +srv), and a failover
    URL from `Connection.switch()` in parts (hostname, port, userid, password, virtual_host): both come here.
    """
    hostname = client.hostname or "localhost"
    if "://" in hostname:
        password = str(client.password or "")
        # A URL with a credential among its options travels whole in the password field (expose_as_kombu_does).
        url = password if "://" in password and redact_url(password) == hostname else join_password(hostname, password)
        prefix = getattr(client, "uri_prefix", None)
        return f"{prefix}+{url}" if prefix and not url.startswith(f"{prefix}+") else url
    userinfo = ""
    if client.userid:
        userinfo = quote(str(client.userid), safe="")
        if client.password:
            userinfo += ":" + quote(str(client.password), safe="")
        userinfo += "@"
    host = f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") and "," not in hostname else hostname
    # A host list carries its ports in itself: the port field is Kombu's default, which a clone fills in
    port = f":{client.port}" if client.port and "," not in hostname else ""
    return f"bbmongo://{userinfo}{host}{port}/{client.virtual_host or ''}"


def expose_as_kombu_does(client: Any, url: str) -> None:
    """Set a connection's hostname, port, userid, password and virtual_host from our URL as Kombu sets them for
    every other transport (Celery's worker stats and Flower show them); the database, with any ?options, is the
    virtual host. A +srv URL names no host and port: it stays whole, its password masked."""
    scheme, _, rest = url.partition("://")
    if _option_secrets(_split_userinfo(url)[2]):
        # Celery's worker stats and Flower show these fields (all but the password): a credential among the options
        # (AWS_SESSION_TOKEN, tlsCertificateKeyFilePassword) has no field of its own, so the URL is shown whole and
        # masked, and travels whole in the password field, which Kombu and Celery keep secret.
        client.hostname, client.password = redact_url(url), url
        return
    if scheme.lower().endswith("+srv"):
        client.hostname, client.password = split_password(url.partition("+")[2])
        return
    _, userinfo, after = _split_userinfo(url)
    userid = password = None
    if userinfo is not None:
        user, _, secret = userinfo.partition(":")
        userid, password = unquote(user) or None, unquote(secret) or None
        rest = after
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    hosts, path = rest[:cut], rest[cut:].removeprefix("/")
    host, port = hosts, None
    if "," not in hosts:
        head, colon, tail = hosts.rpartition(":")
        if colon and tail.isdigit() and (not head.startswith("[") or head.endswith("]")):
            host, port = head, int(tail)
        host = host.strip("[]")
    client.hostname, client.port, client.userid, client.password = host, port, userid, password
    client.virtual_host = path or None


def transport_url(url: str) -> str:
    """A broker URL as the CLI takes it (bbmongo:// or mongodb://) as a Celery app's broker: Kombu answers mongodb://
    with a transport of its own, which writes its messages to a `messages` collection and no job."""
    scheme, sep, rest = url.partition("://")
    ours = {mongo: name for name, mongo in SCHEMES.items() if name.startswith("bb")}.get(scheme.lower())
    return f"{ours}://{rest}" if sep and ours else url


def parse_broker_url(url: str) -> BrokerTarget:
    """Turn a `bbmongo://` (or `mongodb://`) URL into a pymongo URI and a database name."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r} must start with bbmongo://, bbmongo+srv://, mongodb:// or mongodb+srv://"
        )
    mongo_uri = f"{SCHEMES[scheme.lower()]}://{rest}"
    _, userinfo, _ = _split_userinfo(url)
    if userinfo is not None and (any(char in _DELIMITERS for char in userinfo) or userinfo.count(":") > 1):
        # pymongo would read another URL, and its error can quote a piece of the password as a host or database.
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r}: its user name or password holds a character a URL must have "
            "percent-encoded ('@', ':', '/', '?' or '#'): encode them with urllib.parse.quote_plus"
        )
    try:
        parsed = parse_uri(mongo_uri, validate=True, warn=False, connect_timeout=5)
    except (InvalidURI, ConfigurationError, ValueError) as exc:
        message = scrub(str(exc), url_secrets(mongo_uri))
        raise BrokerURLError(f"broker URL {redact_url(url)!r} is not a valid MongoDB URI: {message}") from None
    except OSError:  # pymongo's check that a TLS file can be read: _unusable_tls_file says which, and why
        parsed = parse_uri(mongo_uri, validate=False, warn=False, connect_timeout=5)
    if (problem := _unusable_tls_file(parsed["options"])) is not None:
        raise BrokerURLError(f"broker URL {redact_url(url)!r}: {scrub(problem, url_secrets(mongo_uri))}")
    if parsed["options"].get("w") == 0:
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r}: w=0 sends writes unacknowledged, and every claim, settle and refusal is"
            " read from a write's answer: leave w out, or use w=1 or w=majority"
        )
    database = parsed.get("database")
    if parsed.get("collection"):
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r}: a database name cannot contain '.' (MongoDB would read it as collection"
            f" {parsed['collection']!r} of database {database!r})"
        )
    if not database:
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r} must name the database in its path, e.g. bbmongo://localhost:27017/bountyboard"
        )
    if forbidden := sorted(set(database) & set(DATABASE_NAME_FORBIDDEN)):
        # pymongo's URI parser lets these through and refuses them at the first Database it makes, far from the URL.
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r}: a database name cannot contain {', '.join(map(repr, forbidden))}"
        )
    return BrokerTarget(mongo_uri, database, url_secrets(mongo_uri))


#: The characters MongoDB refuses in a database name (on every platform it runs on; Windows refuses more).
DATABASE_NAME_FORBIDDEN = '/\\. "$\x00'

#: The TLS files a URL may name, and what each must hold.
_TLS_FILES = {
    "tlsCertificateKeyFile": "a PEM certificate and its private key (its password in tlsCertificateKeyFilePassword)",
    "tlsCRLFile": "a PEM certificate revocation list",
    "tlsCAFile": "a PEM certificate of an authority",
}


def _unusable_tls_file(options: dict[str, Any]) -> str | None:
    """Why a TLS file the URL names cannot be used, in words (None when each can): loaded as pymongo loads them when
    it makes a client, where a missing file or one that holds no certificate raised a bare ssl.SSLError or OSError
    from deep inside it. A key's password is given when the URL has one: an encrypted key without one is refused
    here rather than have OpenSSL ask for it on a worker's terminal."""
    import ssl

    named = {name.lower(): value for name, value in options.items()}
    files = [(name, named[name.lower()]) for name in _TLS_FILES if named.get(name.lower())]
    if files and str(named.get("tls", named.get("ssl", ""))).lower() == "false":
        return f"tls=false, but it names {', '.join(name for name, _ in files)}: set tls=true, or remove them"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    password = str(named.get("tlscertificatekeyfilepassword") or "")
    for name, path in files:
        try:
            if name == "tlsCertificateKeyFile":
                context.load_cert_chain(path, password=lambda: password)
            else:
                context.load_verify_locations(path)
        except ssl.SSLError as exc:
            return f"its {name} {path!r} is not {_TLS_FILES[name]}" + (f" ({exc.reason})" if exc.reason else "")
        except OSError as exc:
            return f"its {name} {path!r} cannot be read: {exc.strerror or exc}"
    return None


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """Mask any secret that found its way into a message (an exception's text, say)."""
    for secret in secrets:
        text = text.replace(secret, "**")
    return text


def scrub_value(value: Any, secrets: tuple[str, ...]) -> Any:
    """`scrub` through a value's strings: dict keys and items, list and tuple items, an exception's args."""
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {scrub_value(key, secrets): scrub_value(item, secrets) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(scrub_value(item, secrets) for item in value)
    if isinstance(value, BaseException):  # a pickled result's exception
        value.args = scrub_value(value.args, secrets)
    return value


#: Seconds the cleanup a stopping process does (release its jobs, give back a batch, drop its reply queues) may
#: wait for the server: what it cannot do in that time, the stale sweep and the TTL indexes finish.
SHUTDOWN_PATIENCE = 5.0

_stopping = threading.Event()
_gone_at_shutdown = threading.Event()


def begin_shutdown() -> None:
    """The worker was told to stop: from now on a server that stops answering is not waited for again."""
    _stopping.set()


def shutting_down() -> bool:
    """True once this process's worker was told to stop (begin_shutdown)."""
    return _stopping.is_set()


def server_gone_at_shutdown() -> bool:
    """True once a call of a stopping process ran out of patience: the server is gone, later calls need not try."""
    return _gone_at_shutdown.is_set()


_patience = threading.local()  # the monotonic time the innermost shutdown_patience block of a thread ends


@contextmanager
def shutdown_patience() -> Iterator[None]:
    """Bound the server calls inside to SHUTDOWN_PATIENCE (nothing, once the server was found gone at shutdown)."""
    patience = 0.001 if server_gone_at_shutdown() else SHUTDOWN_PATIENCE
    outer = getattr(_patience, "ends", None)
    _patience.ends = min(time.monotonic() + patience, outer if outer is not None else float("inf"))
    try:
        with pymongo.timeout(patience):
            yield
    except PyMongoError as exc:
        if exc.timeout and _stopping.is_set():
            _gone_at_shutdown.set()
        raise
    finally:
        _patience.ends = outer


def out_of_patience() -> bool:
    """True inside a shutdown_patience block whose time is up: a call tried again there fails at once, unsent."""
    ends = getattr(_patience, "ends", None)
    return ends is not None and time.monotonic() >= ends


_clients: dict[tuple[int, str, tuple[tuple[str, Any], ...]], MongoClient] = {}
_clients_lock = threading.Lock()


#: An operator's tool (Flower's broker check, its Jobs and Broker tabs) answers within seconds when the server is down.
QUICK_TIMEOUTS = {"serverSelectionTimeoutMS": 5000, "connectTimeoutMS": 5000}


def quick_timeouts(target: BrokerTarget) -> dict[str, int]:
    """QUICK_TIMEOUTS, but for those the URL sets itself (the URL's win)."""
    in_url = target.mongo_uri.lower()
    return {name: ms for name, ms in QUICK_TIMEOUTS.items() if f"{name.lower()}=" not in in_url}


#: How often (ms) pymongo's monitors look at the server from a worker's pool process, where pymongo's default is
#: every 10 s, two `hello`s each time. A pool process's client serves its clock (a read a minute) and the rare settle
#: it writes itself (its relay refused it): at 10 s its monitors were a quarter of an idle worker's cost to the
#: server, 0.2 operations a second per pool process. A failed command still has pymongo look again at once.
POOL_PROCESS_HEARTBEAT_MS = 60_000

#: The client options of every client this process makes (unless its URL sets them): in_a_pool_process's.
_process_client_options: dict[str, Any] = {}


def in_a_pool_process() -> None:
    """This process is a worker's pool process (Celery's worker_process_init): its clients, made from now on, have
    its monitoring (POOL_PROCESS_HEARTBEAT_MS)."""
    _process_client_options["heartbeatFrequencyMS"] = POOL_PROCESS_HEARTBEAT_MS


def get_database(target: BrokerTarget, **client_options: Any) -> Database:
    """This process's client for the target: pymongo clients must not cross a fork."""
    key = (os.getpid(), target.mongo_uri, tuple(sorted(client_options.items())))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            in_url = target.mongo_uri.lower()  # the URL's own options win
            process = {name: v for name, v in _process_client_options.items() if f"{name.lower()}=" not in in_url}
            options = {"appname": "bb_broker", "tz_aware": True, **process, **client_options}
            client = _clients[key] = new_client(target.mongo_uri, **options)
    return client[target.database]


#: How every client of ours decodes what it reads: a document written by another program may hold what BSON allows
#: and Python does not, a string whose bytes are not UTF-8 or a date before year 1 or after 9999, and pymongo's
#: defaults raise InvalidBSON on it (for the whole reply: a list of 100 jobs, a claim's answer). Such text is read
#: with U+FFFD in place of each bad byte, such a date as the nearest one Python holds (9999-12-31, 0001-01-01), so
#: that every reader, which copes with text and dates, shows and counts the job. A claim must not run a job whose
#: message was read altered: it reads its job with strict_text (see jobs/claiming.py).
LENIENT_DECODING: dict[str, Any] = {"unicode_decode_error_handler": "replace", "datetime_conversion": "DATETIME_CLAMP"}


def strict_text(collection: Collection) -> Collection:
    """`collection`, but reading a string whose bytes are not UTF-8 as InvalidBSON rather than with U+FFFD in it."""
    return collection.with_options(
        codec_options=collection.codec_options.with_options(unicode_decode_error_handler="strict")
    )


#: How a reader that writes back what it read decodes (the stale sweep's read of lost jobs): text whose bytes are not
#: UTF-8 as lone surrogates (surrogateescape), which as_read writes back as the same bytes; a date outside years 1 to
#: 9999 as its exact milliseconds (DatetimeMS), which a filter matches and a write keeps. LENIENT_DECODING would
#: copy U+FFFD and the clamped date into the database, and a filter on either finds no job.
EXACT_DECODING = {
    "unicode_decode_error_handler": "surrogateescape",
    "datetime_conversion": DatetimeConversion.DATETIME_AUTO,
}


def exact_reads(collection: Collection) -> Collection:
    """`collection`, read with EXACT_DECODING: each value as its bytes were, for writing back (with as_read)."""
    return collection.with_options(codec_options=collection.codec_options.with_options(**EXACT_DECODING))


def as_read(doc: Mapping[str, Any]) -> RawBSONDocument:
    """`doc` (a filter, a document to write) as BSON, each string read by EXACT_DECODING written back as its bytes
    were, in nested documents too: bson.encode refuses a lone surrogate. Dates as DatetimeMS need nothing more."""
    elements = b"".join(_element_as_read(name, value) for name, value in doc.items())
    return RawBSONDocument(struct.pack("<i", len(elements) + 5) + elements + b"\x00")


def _element_as_read(name: str, value: Any) -> bytes:
    key = name.encode("utf-8", "surrogateescape") + b"\x00"
    if isinstance(value, str):
        text = value.encode("utf-8", "surrogateescape") + b"\x00"
        return b"\x02" + key + struct.pack("<i", len(text)) + text
    if isinstance(value, Mapping) and not isinstance(value, RawBSONDocument):
        return b"\x03" + key + as_read(value).raw
    encoded = bson.encode({"v": value})  # int32 size, type byte, "v\0", the value, the document's closing 0
    return encoded[4:5] + key + encoded[7:-1]


def new_client(uri: str, **options: Any) -> MongoClient:
    """A MongoClient whose background threads never take a signal that ends the process (see below), decoding with
    LENIENT_DECODING: every client bb_broker, its CLI and the demo make is made here."""
    with stop_signals_blocked():
        return MongoClient(uri, **{**LENIENT_DECODING, **options})


#: Signals that end a process: only its main thread may take them.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP}


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block STOP_SIGNALS in this thread meanwhile: threads started inside inherit the mask and keep it.

    The kernel hands a process-directed signal to any thread that does not block it. Taken by a background
    thread, it did harm twice: a Celery pool process blocks SIGTERM in its main thread while it writes its exit
    notice to the pool's shared result queue, and a second SIGTERM (the parent's, on revoke with terminate) taken
    by a pymongo monitor thread killed it mid-write, left that queue's lock held, and wedged every later pool
    process on its first write; and on CPython 3.11 a Ctrl-C taken by a background thread while the main thread
    blocked it (making a client) never reached Python's handler, so `make demo` went on running (1 stop in 15
    under load). Blocked in every thread but the main one, the signal waits for the main thread."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _forget_parent_clients() -> None:
    # The parent's sockets (and a lock another thread may have held) belong to the parent.
    global _clients_lock
    _clients.clear()
    _clients_lock = threading.Lock()


reset_in_child(_forget_parent_clients)

_owner: tuple[int, str] | None = None


def lease_owner() -> str:
    """This process's identity on the jobs it claims, readable by an operator."""
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{ULID()}")
    return _owner[1]
