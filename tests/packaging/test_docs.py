"""The README and the docs site stay true: options, commands and demo variables match the code, links resolve.

`mkdocs build --strict` itself (a page outside the nav, a broken link or anchor fails it) is `make docs`, which
`make test` runs before the suite, and tests/packaging/test_docs_site.py, which also checks the lists render.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import yaml

from bb_broker.cli import main as bb_broker_command
from bb_broker.jobs.indexes import DEFAULT_RETENTION
from bb_broker.transport.channel import Channel
from bb_broker.transport.transport import Transport
from tests.support.workers import ROOT

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
#: A Markdown link's target, up to an anchor: files only, not URLs (`:`) nor anchors of the same page.
LINK = re.compile(r"\]\(([^)#:]+)(?:#[^)]*)?\)")


def _first_table(text: str) -> dict[str, list[str]]:
    """The first Markdown table in `text`: its first column (unquoted) -> its other cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start:end]
    return {
        cells[0].strip("` "): [c.strip() for c in cells[1:]] for cells in (r.strip("|").split("|") for r in rows[2:])
    }


def _section(text: str, heading: str) -> str:
    """The text under `heading` (a whole line), up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", body, maxsplit=1)[0]


def _nav_pages(node: object) -> set[str]:
    if isinstance(node, str):
        return {node}
    if isinstance(node, list):
        return set().union(*(_nav_pages(item) for item in node))
    if isinstance(node, dict):
        return set().union(*(_nav_pages(value) for value in node.values()))
    return set()


def _spellings(value: object) -> set[str]:
    if isinstance(value, bool):
        return {str(value).lower()}
    if isinstance(value, str):
        return {f'"{value}"'}
    return {repr(value), f"{value:g}"}


def test_the_options_table_is_the_transports_options_with_their_defaults() -> None:
    table = _first_table((DOCS / "reference" / "options.md").read_text())
    ours = [name for name in Channel.from_transport_options if name not in ("body_encoding", "deadletter_queue")]
    assert set(table) == {*ours, "polling_interval"}
    for name in ours:
        shown = re.match(r"`([^`]*)`", table[name][0])[1]
        expected = DEFAULT_RETENTION if name == "retention" else getattr(Channel, name)  # unset: the 7-day default
        assert shown in _spellings(expected), (name, shown, expected)
    assert table["polling_interval"][0] == f"`{Transport.polling_interval}`"


def test_every_link_to_a_file_resolves() -> None:
    for document in (ROOT / "README.md", ROOT / "CHANGELOG.md", *PAGES):
        for target in LINK.findall(document.read_text()):
            assert (document.parent / target).exists(), f"{document.name} links to {target}, which does not exist"


def test_the_readme_is_short_and_its_docs_links_are_pages_of_the_site() -> None:
    assert 150 <= len(README.splitlines()) <= 250
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert {str(page.relative_to(DOCS)) for page in PAGES} == nav, "every page is in the nav, and only pages"
    linked = {Path(target) for target in LINK.findall(README) if target.startswith("docs/")}
    assert {str(target.relative_to("docs")) for target in linked if target.suffix == ".md"} <= nav
    for page in ("performance", "reliability", "conformance", "architecture"):
        assert f"(docs/explanation/{page}.md)" in README
    for page in ("job-document", "lifecycle", "results", "flower", "operating", "troubleshooting", "deploying"):
        assert f"(docs/guides/{page}.md)" in README
    for page in ("cli", "api", "options"):
        assert f"(docs/reference/{page}.md)" in README
    assert "(docs/guides/scale.md)" in README and "(docs/compatibility.md)" in README


def test_the_readme_says_what_it_is_how_to_install_and_the_two_commands() -> None:
    assert "## Why not Kombu's `mongodb://`?" in README
    assert "not published on a package index" in README
    assert "git+" in README and ". .venv/bin/activate" in README
    quick_start = _section(README, "## Quick start")
    assert quick_start.index("bb-broker serve") < quick_start.index("celery -A myapp worker")
    assert "worker_prefetch_multiplier = 1" in quick_start
    commands = _section(README, "## The two commands")
    assert "make demo" in commands and "make test" in commands


def test_the_getting_started_quick_start_runs_the_same_steps() -> None:
    page = (DOCS / "getting-started.md").read_text()
    assert "git+" in page and ". .venv/bin/activate" in page
    quick_start = _section(page, "## Quick start")
    assert quick_start.index("bb-broker serve") < quick_start.index("celery -A myapp worker")
    assert "worker_prefetch_multiplier = 1" in quick_start


def test_the_demo_page_names_every_variable_the_demo_reads() -> None:
    read = set(re.findall(r"os\.environ\.get\(\"(BB_\w+)\"", (ROOT / "celery_app" / "demo.py").read_text()))
    assert {"BB_DEMO_ONCE", "BB_DEMO_KEEP_DATA", "BB_BROKER_URL"} <= read
    demo = _section((DOCS / "getting-started.md").read_text(), "### `make demo`")
    for name in read:
        assert f"`{name}" in demo, f"getting-started.md's demo section does not explain {name}"


def test_the_operating_guide_lists_every_bb_broker_command() -> None:
    table = _first_table(_section((DOCS / "guides" / "operating.md").read_text(), "## The `bb-broker` command"))
    # A row names one command, or two as `pause QUEUE` / `resume QUEUE`.
    listed = {name for command in table for name in re.findall(r"(?:^|/ `)([a-z-]+)", command)}
    assert isinstance(bb_broker_command, click.Group)
    assert set(bb_broker_command.commands) == listed


def test_the_docs_hold_no_dated_run_logs() -> None:
    """Dated runs and history belong in CHANGELOG.md: a page states the current figure and how to reproduce it."""
    for page in PAGES:
        for heading in re.findall(r"(?m)^#+ .*$", page.read_text()):
            assert not re.search(r"\b20\d\d-\d\d-\d\d\b", heading), f"{page.relative_to(DOCS)}: {heading}"
    assert re.search(r"(?m)^## 20\d\d-\d\d-\d\d", (ROOT / "CHANGELOG.md").read_text())


def test_the_architecture_page_names_modules_and_threads_that_exist() -> None:
    # The page as the code is: every module it names is there, every thread it lists is started by the code, and
    # every thread the code starts is in its table.
    page = (ROOT / "docs/explanation/architecture.md").read_text()
    named = set(re.findall(r"`(bb_broker/[\w/]+(?:\.py)?)`", page))
    assert len(named) > 60, named
    assert not [path for path in sorted(named) if not (ROOT / path).exists()]
    table = page.split("## Background threads", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(bb-[\w-]+)` \|", table, re.MULTILINE))
    code = "\n".join(path.read_text() for path in (ROOT / "bb_broker").rglob("*.py"))
    started = set(re.findall(r'start_supervised\(\s*"(bb-[\w-]+)"', code))
    assert started and listed == started
    every_module = {str(path.relative_to(ROOT)) for path in (ROOT / "bb_broker").rglob("*.py")}
    unnamed = {path for path in every_module if path not in named and not path.endswith(("__init__.py", "__main__.py"))}
    rooms = {room.rstrip("/") for room in named}
    assert not [path for path in sorted(unnamed) if not any(path.startswith(f"{room}/") for room in rooms)]
