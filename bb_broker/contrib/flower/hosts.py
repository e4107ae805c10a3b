"""The `Host` names a Flower answers: without a login, only those it serves, against DNS rebinding.

A page of another site can drive a Flower on the operator's machine without being another site to the browser: its
name (evil.example) is made to resolve to 127.0.0.1, so the page and its requests share one origin,
`http://evil.example:PORT`. It reads /jobs for the XSRF token, and posts with `Origin` and `Host` that agree; every
cross-site check passes. The `Host` it sends is the one thing it cannot choose: its own name. So a Flower that asks
nobody for credentials answers a request only when its `Host` names this Flower:

* a loopback name: `localhost`, 127.0.0.0/8, ::1;
* the `--address` Flower listens on, unless that is every interface (`0.0.0.0`, `::`, or none given);
* a name listed in `--allowed_hosts` (FLOWER_ALLOWED_HOSTS, `allowed_hosts` in flowerconfig.py).

Any other `Host` gets a 403 and one plain line before any handler runs, reads included: Flower's pages, its API, its
static files, the Jobs tab. A name is never resolved to check it (that is what the attacker controls).

With a login (basic auth or OAuth) a rebound page has no credentials (the browser keeps them per origin), so every
`Host` is answered, unless `--allowed_hosts` is given: then the same names, and only those, with a login too.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator
from typing import Any

import tornado.web
from tornado import httputil
from tornado.options import options as tornado_options

#: What `--address` is when Flower listens on every interface: no one name of the machine.
EVERY_INTERFACE = frozenset({"", "0.0.0.0", "::"})
#: A host name as a Host header carries it: DNS labels (letters, digits, `-`, `_`), or an IP address.
HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")
#: How much of a refused Host the refusal repeats.
SHOWN = 200


def host_name(host: str) -> str:
    """The name in a `Host` header, an `--address` or an `--allowed_hosts` entry: lower case, without its port, the
    brackets of an IPv6 address, or a final dot (`Localhost.:5555` is `localhost`, `[::0:1]:5555` is `::1`)."""
    host = host.strip().lower()
    if host.startswith("["):
        name = host[1:].partition("]")[0]
    elif _ip(host) is not None:  # an IPv6 address without brackets: its colons are not a port's
        name = host
    else:
        name, _port = httputil.split_host_and_port(host)
    address = _ip(name)
    return str(address) if address is not None else name.removesuffix(".")  # an address in one spelling


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """`localhost`, an address of 127.0.0.0/8, ::1 or ::ffff:127.x.x.x (a name from host_name)."""
    if name == "localhost":
        return True
    address = _ip(name)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address is not None and address.is_loopback


def _entries(entries: Iterable[str]) -> Iterator[tuple[str, str]]:
    """Each entry of `--allowed_hosts` (an entry may list several, comma-separated) and its name."""
    for entry in entries:
        for text in str(entry).split(","):
            if text.strip():
                yield text.strip(), host_name(text)


def _is_host_name(name: str) -> bool:
    return _ip(name) is not None or HOST_NAME.fullmatch(name) is not None


def check_allowed_hosts(entries: Iterable[str]) -> None:
    """ValueError naming the first entry of `--allowed_hosts` that is not a host name (a URL, a path, a pattern)."""
    for text, name in _entries(entries):
        if not _is_host_name(name):
            raise ValueError(
                f"--allowed_hosts: {text[:SHOWN]!r} is not a host name (give names such as flower.example.com or "
                "10.0.0.5, without scheme or path)"
            )


def served_names(options: Any) -> frozenset[str]:
    """The names besides loopback's that a Flower with these options answers: its --address (unless every
    interface) and its --allowed_hosts. An entry that is not a host name matches no Host (`bb-broker flower`
    refuses to start with one: check_allowed_hosts)."""
    names = {name for _text, name in _entries(getattr(options, "allowed_hosts", None) or []) if _is_host_name(name)}
    address = host_name(str(getattr(options, "address", "") or ""))
    if address not in EVERY_INTERFACE:
        names.add(address)
    return frozenset(names)


def checks_host(options: Any) -> bool:
    """Whether a Flower with these options checks Host: always without a login; with one, when --allowed_hosts is
    given."""
    logged_in = bool(getattr(options, "basic_auth", None) or getattr(options, "auth", None))
    return not logged_in or bool(getattr(options, "allowed_hosts", None))


def refusal_for(application: Any, request: httputil.HTTPServerRequest) -> type[tornado.web.RequestHandler] | None:
    """The handler that answers a request whose Host this Flower does not serve (ForeignHostRefused), or None to let
    Flower's own routing answer it (upstream_flower.install_host_check calls this for every request)."""
    options = getattr(application, "options", None)
    if options is None or not checks_host(options):
        return None
    name = host_name(request.host)
    if is_loopback(name) or name in served_names(options):
        return None
    return ForeignHostRefused


class ForeignHostRefused(tornado.web.RequestHandler):
    """403 and one plain line, for any method and path: no handler of Flower's or ours runs."""

    def check_xsrf_cookie(self) -> None:
        pass  # refused whatever it carries: the answer below, not a complaint about its token

    def prepare(self) -> None:
        self.set_status(403)
        self.set_header("Content-Type", "text/plain; charset=UTF-8")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.finish(
            f"refused: Host {self.request.host[:SHOWN]!r} is not a name this Flower serves (localhost, 127.0.0.1, "
            "::1, its --address, or one listed in --allowed_hosts / FLOWER_ALLOWED_HOSTS)\n"
        )


def define_options() -> None:
    """`--allowed_hosts` among Flower's options (Tornado's global options, which Flower parses: FLOWER_ALLOWED_HOSTS
    and `allowed_hosts` in flowerconfig.py too); calling it twice changes nothing."""
    if "allowed_hosts" not in tornado_options:
        tornado_options.define(
            "allowed_hosts",
            type=str,
            multiple=True,
            default=[],
            help="bb_broker: the host names Flower answers besides localhost, 127.0.0.1, ::1 and its --address "
            "(without a login every other Host is refused; with one, only these when given)",
        )
