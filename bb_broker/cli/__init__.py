"""The `bb-broker` command (`main`): the console script, and `celery bb-broker` (pyproject.toml's entry points)."""

from bb_broker.cli.main import main

__all__ = ["main"]
