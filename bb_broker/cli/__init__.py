"""The `bb-broker` command (`main`): the console script, and `celery bb-broker` (pyproject.toml's entry points)."""

from bb_broker.cli.jobs import main

__all__ = ["main"]
