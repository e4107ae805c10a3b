"""`bb-broker` and a server: run the embedded one (serve), check whether one can carry the broker (doctor),
serve the metrics of its jobs (serve-metrics)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import click

from bb_broker.cli.common import Command, broker_option, collection_option, fail, job_store


@click.command(cls=Command)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=27017, show_default=True, type=click.IntRange(1, 65535))
@click.option("--data", default="./bb-data", show_default=True, type=click.Path(), help="Data directory, or :memory:.")
def serve(host: str, port: int, data: str) -> None:
    """Run the embedded MongoDB-compatible server (SecantusDB) for development and demos."""
    from bb_broker import embedded

    try:
        with socket.create_server((host, port)):
            pass  # free now; the server binds it next
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        fail(f"cannot listen on {host}:{port}: {reason} (another server there? choose --port)")
    if data != ":memory:":
        _check_data_directory(data)
    where = "in memory: gone when the server stops" if data == ":memory:" else f"in {Path(data).resolve()}"
    announce = [
        f"listening on {host}:{port}; broker URL bbmongo://{_connectable(host)}:{port}/bountyboard",
        f"data {where}",
        "stop it with Ctrl-C (or SIGTERM)",
    ]
    threading.Thread(target=_announce_when_listening, args=(host, port, announce), daemon=True).start()
    try:
        sys.exit(embedded.run_daemon(embedded.daemon_argv(host, port, data)))
    except embedded.EmbeddedServerMissing as exc:
        fail(str(exc))


def _check_data_directory(data: str) -> None:
    """Make the data directory, or fail in one line naming why it cannot be used (the server's own start would end
    in a traceback)."""
    if Path(data).exists() and not Path(data).is_dir():
        fail(f"cannot use --data {data}: it is not a directory")
    try:
        Path(data).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot use --data {data}: {os.strerror(exc.errno) if exc.errno else exc}")
    if not os.access(data, os.W_OK | os.X_OK):
        fail(f"cannot use --data {data}: {os.strerror(13)}")


def _connectable(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)


def _announce_when_listening(host: str, port: int, lines: list[str]) -> None:
    """Say where the server is once it accepts connections (it prints nothing of its own)."""
    address = _connectable(host).strip("[]")
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                break
        except OSError:
            time.sleep(0.1)
    for line in lines:
        click.echo(f"bb-broker: {line}")


@click.command("serve-metrics", cls=Command)
@broker_option
@collection_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9808, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
def serve_metrics(broker: str, collection: str, host: str, port: int) -> None:
    """Serve /metrics (Prometheus) and /statuses (the statuses() JSON) until stopped."""
    from bb_broker.ops import metrics_endpoint

    with job_store(broker, collection, keep_open=True) as store:
        store.statuses()  # a collection that cannot be read fails here, in one line, not at each scrape
    try:
        server = metrics_endpoint.make_metrics_server(store, host, port)
    except (OSError, ValueError) as exc:  # a busy port, or a PROMETHEUS_MULTIPROC_DIR that does not exist
        fail(f"cannot serve metrics on {host}:{port}: {exc}")
    click.echo(f"bb-broker: serving /metrics and /statuses on http://{host}:{server.server_port}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@click.command(cls=Command)
@broker_option
@collection_option
def doctor(broker: str, collection: str) -> None:
    """Check whether a server can carry the broker safely: one verdict per capability; exit 2 when unsafe."""
    from bb_broker.ops import doctor as checks  # imported here: the other commands do not pay for it

    sys.exit(checks.run(broker, collection, echo=click.echo, complain=lambda line: click.echo(line, err=True)))
