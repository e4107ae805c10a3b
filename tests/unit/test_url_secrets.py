"""Every shape of broker URL a user may write, its password and credential options never shown anywhere."""

from __future__ import annotations

import json
from typing import Any

import kombu
import pytest
from click.testing import CliRunner
from pymongo.uri_parser import parse_uri

from bb_broker.cli import main
from bb_broker.connection import BrokerURLError, parse_broker_url, redact_url, scrub, url_secrets
from tests.support.servers import free_port

#: Two halves no other text of a URL or a message holds: neither may be shown, alone or together.
LEFT, RIGHT = "Lq7left", "Rq7right"

#: Passwords written unescaped, one for each character that ends a URL's user info, host or path, and mixes.
UNESCAPED = [
    "@",
    "/",
    "?",
    "#",
    ":",
    "@?",
    "?@",
    "/@",
    "@/",
    "?/",
    "/?",
    "#@",
    "@:",
    "?=",
    "?appname=x@",
    "@h?w=1",
    "@h:1?w=1@",
]


def url_shapes() -> list[tuple[str, tuple[str, ...]]]:
    """(URL template with {port}, the texts it must never show)."""
    shapes: list[tuple[str, tuple[str, ...]]] = []
    for middle in UNESCAPED:
        password = f"{LEFT}{middle}{RIGHT}"
        shapes += [
            (f"bbmongo://bb:{password}@127.0.0.1:{{port}}/jobsdb", (LEFT, RIGHT)),
            (f"bbmongo://bb:{password}@127.0.0.1:{{port}}", (LEFT, RIGHT)),  # and no database
            (f"bbmongo://bb:{password}@127.0.0.1:{{port}}/jobsdb?appname=a@b", (LEFT, RIGHT)),
            (f"BBMONGO+SRV://bb:{password}@cluster.example.invalid/jobsdb", (LEFT, RIGHT)),
        ]
    encoded = f"{LEFT}%40%2F%3F%23%3A{RIGHT}"  # percent-encoded as it should be: neither form is shown
    shapes.append((f"bbmongo://bb:{encoded}@127.0.0.1:{{port}}/jobsdb", (LEFT, RIGHT)))
    token, key_password = f"{LEFT}Tok/en+=", f"{RIGHT}KeyPw"
    shapes += [
        (
            f"bbmongo://127.0.0.1:{{port}}/jobsdb?authMechanism=MONGODB-AWS"
            f"&authMechanismProperties=AWS_SESSION_TOKEN:{token}",
            (LEFT,),
        ),
        (
            f"bbmongo://AKIAEXAMPLE:{RIGHT}@127.0.0.1:{{port}}/jobsdb?authMechanism=MONGODB-AWS"
            f"&authMechanismProperties=SERVICE_NAME:svc,AWS_SESSION_TOKEN:{token.replace('/', '%2F')}",
            (LEFT, RIGHT),
        ),
        (f"bbmongo://127.0.0.1:{{port}}/jobsdb?tls=true&tlsCertificateKeyFilePassword={key_password}", (RIGHT,)),
        (f"bbmongo://u:{LEFT}@127.0.0.1:{{port}}/jobsdb?tlsCertificateKeyFilePassword={key_password}", (LEFT, RIGHT)),
    ]
    # No URL at all, as a configuration file or a shell leaves it: a space before it, a slash or the scheme missing.
    for middle in ("", "@", "/", ":"):
        password = f"{LEFT}{middle}{RIGHT}"
        shapes += [
            (f" bbmongo://bb:{password}@127.0.0.1:{{port}}/jobsdb", (LEFT, RIGHT)),
            (f"bb:{password}@127.0.0.1:{{port}}/jobsdb", (LEFT, RIGHT)),
            (f"bbmongo:/bb:{password}@127.0.0.1:{{port}}/jobsdb", (LEFT, RIGHT)),
            (f"bbmongo:bb:{password}@127.0.0.1:{{port}}/jobsdb", (LEFT, RIGHT)),
        ]
    return shapes


SHAPES = url_shapes()
IDS = [template.partition("://")[2 if "://" in template else 0].replace("{port}", "P") for template, _ in SHAPES]


def assert_hidden(text: str, hidden: tuple[str, ...]) -> None:
    for secret in hidden:
        assert secret not in text, f"{secret!r} shown in {text!r}"


@pytest.mark.parametrize(("template", "hidden"), SHAPES, ids=IDS)
def test_no_shape_of_url_shows_its_secrets_when_redacted_refused_or_scrubbed(template: str, hidden) -> None:
    url = template.format(port=27017)
    shown = redact_url(url)
    assert_hidden(shown, hidden)
    assert "127.0.0.1" in shown or "cluster.example.invalid" in shown  # the host is still shown
    try:
        target = parse_broker_url(url)
    except BrokerURLError as exc:
        assert_hidden(str(exc), hidden)
        assert "\n" not in str(exc)
    else:
        assert_hidden(target.display, hidden)
        assert_hidden(repr(target), hidden)
    # A message that quotes the URL, or any piece of it, is masked by the secrets the URL is known by.
    assert_hidden(scrub(f"failed with {url} ({url.split('@')[-1]})", url_secrets(url)), hidden)


@pytest.mark.parametrize(("template", "hidden"), [s for s in SHAPES if "+SRV" not in s[0]], ids=[
    i for i, s in zip(IDS, SHAPES, strict=True) if "+SRV" not in s[0]])  # fmt: skip
def test_the_cli_shows_no_shape_of_urls_secrets(template: str, hidden) -> None:
    url = template.format(port=free_port())
    url += ("&" if "?" in url.split("@")[-1] else "?") + "serverSelectionTimeoutMS=300"
    result = CliRunner().invoke(main, ["status", "--broker", url])
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("bb-broker: ")
    assert_hidden(result.output, hidden)


@pytest.mark.parametrize(
    "url",
    [
        f"bbmongo://u:{LEFT}@127.0.0.1:27017/jobsdb?tls=true&tlsCertificateKeyFilePassword={RIGHT}",
        f"bbmongo://127.0.0.1/jobsdb?authMechanism=MONGODB-AWS&authMechanismProperties=AWS_SESSION_TOKEN:{RIGHT}",
        f"bbmongo://u:{LEFT}@h1:1,h2:2/jobsdb?replicaSet=rs&tlsCertificateKeyFilePassword={RIGHT}&tls=true",
    ],
)
def test_kombu_s_connection_fields_show_no_credential_option_and_a_clone_keeps_it(url: str) -> None:
    # Celery's worker stats (`celery inspect stats`, Flower's worker page) show every field but the password.
    conn = kombu.Connection(url)
    assert conn.transport.broker_url == url
    shown = conn.info()
    shown.pop("password")
    assert_hidden(json.dumps(shown, default=str) + conn.as_uri(), (LEFT, RIGHT))
    assert conn.clone().transport.broker_url == url  # Celery's producer pool: the secrets still reach pymongo


@pytest.mark.parametrize(
    "url",
    [
        "bbmongo://user:pass@db1:27017,db2:27017/bountyboard?replicaSet=rs0",
        "bbmongo://h1,h2/jobsdb",
        "bbmongo://user:pass@db1:27017/bountyboard",
        "bbmongo://localhost/jobsdb",
    ],
)
def test_a_clone_of_a_clone_reaches_the_same_servers(url: str) -> None:
    # Celery clones its connections (the producer pool, the event dispatcher); a clone fills in Kombu's default
    # port, which a host list must not get (`db1:27017,db2:27017:27017` is no URL).
    def servers(conn: kombu.Connection) -> tuple[Any, ...]:
        parsed = parse_uri(parse_broker_url(conn.transport.broker_url).mongo_uri)
        return parsed["nodelist"], parsed["database"], parsed["username"], parsed["password"], parsed["options"]

    conn = kombu.Connection(url)
    clone = conn.clone()
    assert servers(clone) == servers(conn)
    assert servers(clone.clone()) == servers(conn)


def test_a_srv_url_is_not_looked_up_when_its_transport_is_made() -> None:
    # Parsing a +srv URL asks DNS: at the transport's construction a DNS blip would be a BrokerURLError, which Kombu
    # and Celery do not retry; the channel parses it, where an unreachable name is a connection error.
    conn = kombu.Connection("bbmongo+srv://u:p@cluster.invalid/jobsdb")
    assert conn.transport.broker_url == "bbmongo+srv://u:p@cluster.invalid/jobsdb"
