"""The house's size rule (issue 46): rooms a newcomer can read. The import rules are `lint-imports` (make lint)."""

from __future__ import annotations

import ast

from tests.support.workers import ROOT

#: Lines a module, or a class, of bb_broker may have: past it, a room holds more than one concern.
MOST_LINES = 700


def test_no_module_and_no_class_of_bb_broker_is_over_700_lines() -> None:
    too_long = []
    for path in sorted((ROOT / "bb_broker").rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > MOST_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno + 1 > MOST_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name}")
    assert not too_long
