"""What a forked child must not take over from its parent: one at-fork hook running each module's reset."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: The resets a child runs right after the fork, in the order they were registered (a module's, as it is imported).
_resets: list[Callable[[], None]] = []


def reset_in_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Run `reset` in each child this process forks (a pool process): the parent's threads do not follow a fork,
    the locks they held would never be released, its clients' sockets are the parent's. Usable as a decorator."""
    _resets.append(reset)
    return reset


def _after_fork_in_child() -> None:
    for reset in _resets:
        try:
            reset()
        except Exception:  # one module's reset failing leaves the others to do theirs
            logger.exception("bb_broker: resetting %s in a forked child failed", getattr(reset, "__qualname__", reset))


os.register_at_fork(after_in_child=_after_fork_in_child)
