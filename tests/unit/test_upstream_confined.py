"""No private name of an upstream package that bb_broker/upstream/ reads or patches is spelled anywhere else in
bb_broker: the rest of the code goes through the functions there (bb_broker/upstream/__init__.py has the rules)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bb_broker"
UPSTREAM = PACKAGE / "upstream"


def private_names_read(module: Path) -> set[str]:
    """The underscored names a module of bb_broker/upstream/ reads of its upstream: attributes (`x._name`, or a
    string naming one, as getattr takes it), imports (`from celery import _state`) and `__dict__`; not the names it
    defines itself."""
    tree = ast.parse(module.read_text())
    read: set[str] = set()
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            read.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_\w+", node.value):
            read.add(node.value)  # a name read by getattr
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            read.update(alias.name for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    return {
        name
        for name in read - defined
        if isinstance(name, str) and name.startswith("_") and (not name.endswith("__") or name == "__dict__")
    }


def owns(text: str, name: str) -> bool:
    """Whether a module assigns an attribute of that name to its own objects (`self._reader = ...`): a name of its
    own that happens to be spelled as an upstream's is, on `self` only."""
    return re.search(rf"self\.{re.escape(name)}\b[^=\n]*=(?!=)", text) is not None


def test_every_private_upstream_name_is_spelled_only_in_bb_broker_upstream() -> None:
    listed = {name: module.name for module in UPSTREAM.glob("*.py") for name in private_names_read(module)}
    # The reads each module is known to make: a listing that finds nothing would pass any code.
    assert {"_next_event", "_orig_minute", "__dict__", "_data", "_encoders", "_rlock"} <= set(listed), sorted(listed)
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if UPSTREAM in path.parents:
            continue
        text = path.read_text()
        for name, module in sorted(listed.items()):
            spelling = re.compile(rf"(?<!\w){re.escape(name)}\b")
            own = re.compile(rf"self\.{re.escape(name)}\b") if owns(text, name) else None
            for line, row in enumerate(text.splitlines(), 1):
                if spelling.search(own.sub("", row) if own else row):
                    spelled.append(f"{path.relative_to(PACKAGE.parent)}:{line} spells {name} (upstream/{module})")
    assert not spelled, "call the function of bb_broker/upstream/ that reads it instead:\n" + "\n".join(spelled)
