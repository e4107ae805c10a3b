"""The README's quick start, read as a user reads it: its fenced blocks and the shell commands in them."""

from __future__ import annotations

import re
import shlex

from tests.support.workers import ROOT

README = (ROOT / "README.md").read_text()
QUICK_START = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
#: The URL the quick start writes; a test puts its own server's in its place.
README_URL = "bbmongo://127.0.0.1:27017/bountyboard"


def block(after: str, language: str) -> str:
    """The first fenced block of `language` after the text `after` in the quick start."""
    return re.search(rf"{re.escape(after)}.*?```{language}\n(.*?)```", QUICK_START, re.S)[1]


def commands(after: str) -> list[list[str]]:
    """The shell commands of the first `sh` block after `after`, each split as a shell would (comments dropped)."""
    return [shlex.split(line, comments=True) for line in block(after, "sh").splitlines() if line.strip()]


def inline_command(after: str) -> list[str]:
    """The first `inline code` after the text `after` in the quick start, split as a shell would."""
    return shlex.split(re.search(rf"{re.escape(after)}.*?`([^`]+)`", QUICK_START, re.S)[1])
