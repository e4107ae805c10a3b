"""The embedded development server: SecantusDB, a MongoDB-wire-compatible stand-in (the `embedded` extra)."""

from __future__ import annotations


class EmbeddedServerMissing(RuntimeError):
    """SecantusDB is not installed."""


def daemon_argv(host: str, port: int, data: str, *, auth: bool = False, test_commands: bool = False) -> list[str]:
    """Arguments for SecantusDB's daemon, as `bb-broker serve` and the test suite run it."""
    argv = ["--host", host, "--port", str(port), "--storage-path", data, "--log-level", "WARNING"]
    if auth:
        argv.append("--auth")
    if test_commands:
        argv.append("--enable-test-commands")
    return argv


def run_daemon(argv: list[str]) -> int:
    try:
        from secantus.cli import main
    except ImportError:
        raise EmbeddedServerMissing("the embedded server needs SecantusDB: pip install 'bb-broker[embedded]'") from None
    return main(argv)
