"""Broker URLs, one MongoClient per process, and keeping credentials out of every output."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from pymongo import MongoClient
from pymongo.database import Database
from pymongo.errors import ConfigurationError, InvalidURI
from pymongo.uri_parser import parse_uri
from ulid import ULID

SCHEMES = {"bbmongo": "mongodb", "bbmongo+srv": "mongodb+srv", "mongodb": "mongodb", "mongodb+srv": "mongodb+srv"}
_USERINFO = re.compile(r"^(?P<scheme>[a-z+]+://)(?P<userinfo>[^@/]*)@")


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
    """The URL with its user info masked, safe for logs and errors."""
    match = _USERINFO.match(url)
    if not match:
        return url
    user = match.group("userinfo").split(":", 1)[0]
    return f"{match.group('scheme')}{user}:**@{url[match.end() :]}"


def split_password(url: str) -> tuple[str, str | None]:
    """The URL with its password masked, and the password, so that each can travel where it is safe."""
    match = _USERINFO.match(url)
    if not match or ":" not in match.group("userinfo"):
        return url, None
    return redact_url(url), match.group("userinfo").split(":", 1)[1]


def join_password(url: str, password: str | None) -> str:
    """split_password's inverse: the masked password replaced by the real one."""
    match = _USERINFO.match(url)
    if not password or not match or not match.group("userinfo").endswith(":**"):
        return url
    return f"{match.group('scheme')}{match.group('userinfo')[:-2]}{password}@{url[match.end() :]}"


def client_url(client: Any) -> str:
    """The broker URL, password included, that a Kombu connection's fields stand for.

    Kombu hands the first URL over whole (we parse our own URLs: replica sets, options, +srv), and a failover
    URL from `Connection.switch()` in parts (hostname, port, userid, password, virtual_host): both come here.
    """
    hostname = client.hostname or "localhost"
    if "://" in hostname:
        url = join_password(hostname, client.password)
        prefix = getattr(client, "uri_prefix", None)
        return f"{prefix}+{url}" if prefix and not url.startswith(f"{prefix}+") else url
    userinfo = ""
    if client.userid:
        userinfo = quote(str(client.userid), safe="")
        if client.password:
            userinfo += ":" + quote(str(client.password), safe="")
        userinfo += "@"
    host = f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") and "," not in hostname else hostname
    port = f":{client.port}" if client.port else ""
    return f"bbmongo://{userinfo}{host}{port}/{client.virtual_host or ''}"


def expose_as_kombu_does(client: Any, url: str) -> None:
    """Set a connection's hostname, port, userid, password and virtual_host from our URL as Kombu sets them for
    every other transport (Celery's worker stats and Flower show them); the database, with any ?options, is the
    virtual host. A +srv URL names no host and port: it stays whole, its password masked."""
    scheme, _, rest = url.partition("://")
    if scheme.lower().endswith("+srv"):
        client.hostname, client.password = split_password(url.partition("+")[2])
        return
    match = _USERINFO.match(url)
    userid = password = None
    if match:
        user, _, secret = match.group("userinfo").partition(":")
        userid, password = unquote(user) or None, unquote(secret) or None
        rest = url[match.end() :]
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


def parse_broker_url(url: str) -> BrokerTarget:
    """Turn a `bbmongo://` (or `mongodb://`) URL into a pymongo URI and a database name."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r} must start with bbmongo://, bbmongo+srv://, mongodb:// or mongodb+srv://"
        )
    mongo_uri = f"{SCHEMES[scheme.lower()]}://{rest}"
    try:
        parsed = parse_uri(mongo_uri, validate=True, warn=False, connect_timeout=5)
    except (InvalidURI, ConfigurationError, ValueError) as exc:
        message = scrub(str(exc), _userinfo_secrets(mongo_uri))
        raise BrokerURLError(f"broker URL {redact_url(url)!r} is not a valid MongoDB URI: {message}") from None
    database = parsed.get("database")
    if not database:
        raise BrokerURLError(
            f"broker URL {redact_url(url)!r} must name the database in its path, e.g. bbmongo://localhost:27017/bountyboard"
        )
    return BrokerTarget(mongo_uri, database, _userinfo_secrets(mongo_uri))


def _userinfo_secrets(uri: str) -> tuple[str, ...]:
    match = _USERINFO.match(uri)
    if not match or ":" not in match.group("userinfo"):
        return ()
    raw = match.group("userinfo").split(":", 1)[1]
    return tuple(s for s in {raw, unquote(raw)} if s)


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """Mask any secret that found its way into a message (an exception's text, say)."""
    for secret in secrets:
        text = text.replace(secret, "**")
    return text


_clients: dict[tuple[int, str, tuple[tuple[str, Any], ...]], MongoClient] = {}
_clients_lock = threading.Lock()


def get_database(target: BrokerTarget, **client_options: Any) -> Database:
    """This process's client for the target: pymongo clients must not cross a fork."""
    key = (os.getpid(), target.mongo_uri, tuple(sorted(client_options.items())))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            options = {"appname": "bb_broker", "tz_aware": True, **client_options}
            with _termination_signals_blocked():
                client = _clients[key] = MongoClient(target.mongo_uri, **options)
    return client[target.database]


#: Signals that end a process: the client's background threads must never be the ones to take them.
_TERMINATION_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP}


@contextmanager
def _termination_signals_blocked() -> Iterator[None]:
    # pymongo starts its monitor threads in the constructor and they inherit this mask. A Celery pool process
    # blocks SIGTERM in its main thread while it writes its exit notice to the pool's shared result queue; a
    # second SIGTERM (the parent's, on revoke with terminate) delivered to an unblocked thread killed it mid-write,
    # left that queue's lock held, and wedged every later pool process on its first write.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINATION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _forget_parent_clients() -> None:
    # The parent's sockets (and a lock another thread may have held) belong to the parent.
    global _clients_lock
    _clients.clear()
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_clients)

_owner: tuple[int, str] | None = None


def lease_owner() -> str:
    """This process's identity on the jobs it claims, readable by an operator."""
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{ULID()}")
    return _owner[1]
