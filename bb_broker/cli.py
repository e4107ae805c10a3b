"""The `bb-broker` command: run the embedded server and read the jobs collection."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click
from pymongo.errors import PyMongoError

from . import connection, embedded
from .store import JobStore

DEFAULT_BROKER = "bbmongo://localhost:27017/bountyboard"


def _store(broker: str) -> tuple[JobStore, connection.BrokerTarget]:
    target = connection.parse_broker_url(broker)
    # An operator's command answers within seconds when the server is down.
    db = connection.get_database(target, serverSelectionTimeoutMS=5000, connectTimeoutMS=5000)
    return JobStore(db, secrets=target.secrets), target


def _fail(message: str) -> None:
    click.echo(f"bb-broker: {message}", err=True)
    sys.exit(1)


broker_option = click.option(
    "--broker",
    default=lambda: os.environ.get("BB_BROKER_URL", DEFAULT_BROKER),
    show_default="$BB_BROKER_URL or " + DEFAULT_BROKER,
    help="bbmongo:// or mongodb:// URL; its path names the database.",
)


@click.group()
def main() -> None:
    """Operate bb_broker, the Celery broker that keeps every task as a MongoDB `jobs` document."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=27017, show_default=True, type=int)
@click.option("--data", default="./bb-data", show_default=True, help="Data directory, or :memory:.")
def serve(host: str, port: int, data: str) -> None:
    """Run the embedded MongoDB-compatible server (SecantusDB) for development and demos."""
    try:
        sys.exit(embedded.run_daemon(embedded.daemon_argv(host, port, data)))
    except embedded.EmbeddedServerMissing as exc:
        _fail(str(exc))


@main.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(broker: str, as_json: bool) -> None:
    """Jobs per status."""
    try:
        store, target = _store(broker)
        counts = store.statuses()
    except connection.BrokerURLError as exc:
        _fail(str(exc))
    except PyMongoError as exc:
        _fail(_unreachable(exc, store_target=locals().get("target")))
    if as_json:
        click.echo(json.dumps(counts))
    else:
        for name, count in counts.items():
            click.echo(f"{name:<10} {count}")


def _unreachable(exc: PyMongoError, store_target: Any) -> str:
    where = store_target.display if store_target is not None else "the broker"
    detail = connection.scrub(str(exc).splitlines()[0], store_target.secrets if store_target else ())
    return f"cannot read jobs from {where}: {type(exc).__name__}: {detail[:300]}"


@main.command("flower", context_settings={"ignore_unknown_options": True})
@click.option("-A", "--app", "celery_app", required=True, help="The Celery app, as `celery -A` takes it.")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower_command(celery_app: str, flower_args: tuple[str, ...]) -> None:
    """Run Flower (`celery -A APP flower FLOWER_ARGS...`) with a Broker tab showing each queue's jobs."""
    try:
        from . import flower as _adapter  # noqa: F401  (importing it gives Flower's Broker tab bbmongo://)
    except ImportError as exc:
        _fail(f"Flower is not installed ({exc}): pip install 'bb_broker[flower]'")
    from celery.bin.celery import celery

    celery.main(args=["-A", celery_app, "flower", *flower_args], prog_name="celery", auto_envvar_prefix="CELERY")


if __name__ == "__main__":
    main()
