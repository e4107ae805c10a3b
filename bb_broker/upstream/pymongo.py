"""pymongo's internals bb_broker reads: a change stream's buffered batch (bb_broker/upstream/__init__.py has the
rules)."""

from __future__ import annotations

from typing import Any

#: The releases every function here was checked against (their sources read, the contract tests run on the newest).
CHECKED_AGAINST = "pymongo 4.9, 4.20.1"


def buffered_changes(stream: Any) -> int | None:
    """Changes the last getMore returned that are not read yet; None when this pymongo does not say."""
    # pymongo keeps a batch in the stream's command cursor and has no public way to ask its length. Without
    # it the watcher never paces, which costs getMores, never wake-ups.
    data = getattr(getattr(stream, "_cursor", None), "_data", None)
    return None if data is None else len(data)
