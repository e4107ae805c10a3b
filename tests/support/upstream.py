"""What the contract tests of bb_broker/upstream/ share: where a broken shape is handled, and how an upstream
function is read."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any


def where(module: ModuleType, function: str) -> str:
    """The end of a contract test's message: the function of bb_broker/upstream/ a moved shape breaks, and the
    releases that module was checked against."""
    path = module.__name__.replace(".", "/") + ".py"
    return f"see {path}:{function} (checked against {module.CHECKED_AGAINST})"


def parameters(function: Any) -> list[str]:
    """The parameter names of an upstream function, under any wrapper of ours (functools.wraps keeps __wrapped__)."""
    return list(inspect.signature(inspect.unwrap(function)).parameters)


def source(obj: Any) -> str:
    return inspect.getsource(inspect.unwrap(obj))
