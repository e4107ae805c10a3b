"""The docs site builds with `mkdocs build --strict`, and every list item written in a page is one on the site."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.workers import ROOT

#: A list item's first line: Python-Markdown reads one as a paragraph's continuation unless it is set off right.
LIST_ITEM = re.compile(r"^ *(?:[-*+]|\d+\.) +\S")


def _list_items(markdown: str) -> int:
    count, fenced = 0, False
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and LIST_ITEM.match(line):
            count += 1
    return count


def test_the_site_builds_strictly_and_renders_every_list_item(tmp_path: Path) -> None:
    site = tmp_path / "site"
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)]
    built = subprocess.run(
        mkdocs, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stdout + built.stderr
    for page in sorted((ROOT / "docs").rglob("*.md")):
        html = (site / page.relative_to(ROOT / "docs")).with_suffix(".html").read_text()
        article = html[html.index("<article") : html.index("</article>")]
        written, rendered = _list_items(page.read_text()), len(re.findall(r"<li\b", article))
        assert rendered >= written, f"{page.name}: {written} list items written, {rendered} on the page"
