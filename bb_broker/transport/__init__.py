"""Kombu's side: the `bbmongo://` transport, its wake-ups and the plumbing traffic apart from `jobs`.

`bb_broker.transport:Transport` is the transport's stable path (Kombu's alias for `bbmongo://`, and a
`broker_transport` setting): served on first use (PEP 562), so that importing the wake-ups or the plumbing alone
does not import the whole transport.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bb_broker.transport.transport import Transport

__all__ = ["Transport"]


def __getattr__(name: str) -> Any:
    if name == "Transport":
        return importlib.import_module(f"{__name__}.transport").Transport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
