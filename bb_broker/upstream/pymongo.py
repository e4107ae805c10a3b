"""pymongo's internals bb_broker reads: a change stream's buffered batch (bb_broker/upstream/__init__.py has the
rules)."""

from __future__ import annotations

from typing import Any

#: The releases every function here was checked against (their sources read, the contract tests run on the newest).
CHECKED_AGAINST = "pymongo 4.6.0, 4.8.0, 4.9, 4.20.1"

#: Where a CommandCursor keeps its unread batch: `_data` from pymongo 4.9 (its synchronous/ rewrite), a mangled
#: `__data` before (4.6 to 4.8).
_BATCH_ATTRIBUTES = ("_data", "_CommandCursor__data")


def buffered_changes(stream: Any) -> int | None:
    """Changes the last getMore returned that are not read yet; None when this pymongo does not say.

    pymongo keeps a batch in the stream's command cursor (`ChangeStream._cursor`) and has no public way to ask its
    length. Without it the watcher never paces, which costs getMores, never wake-ups."""
    cursor = getattr(stream, "_cursor", None)
    for name in _BATCH_ATTRIBUTES:
        data = getattr(cursor, name, None)
        if data is not None:
            return len(data)
    return None
