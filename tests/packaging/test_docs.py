"""The README stays a true user's guide: its configuration table is the transport's options, its links resolve."""

from __future__ import annotations

import re

from bb_broker.jobs.store import DEFAULT_RETENTION
from bb_broker.transport.channel import Channel, Transport
from tests.support.workers import ROOT

README = (ROOT / "README.md").read_text()


def _table_after(heading: str) -> dict[str, list[str]]:
    """The first Markdown table after `heading`: its first column (unquoted) -> its other cells."""
    section = README.split(heading, 1)[1]
    rows = [line for line in section.split("\n\n", 3)[1:4] if line.startswith("| ")][0].splitlines()
    return {
        cells[0].strip("` "): [c.strip() for c in cells[1:]] for cells in (r.strip("|").split("|") for r in rows[2:])
    }


def _spellings(value: object) -> set[str]:
    if isinstance(value, bool):
        return {str(value).lower()}
    if isinstance(value, str):
        return {f'"{value}"'}
    return {repr(value), f"{value:g}"}


def test_the_configuration_table_is_the_transports_options_with_their_defaults() -> None:
    table = _table_after("## Configuration\n")
    ours = [name for name in Channel.from_transport_options if name not in ("body_encoding", "deadletter_queue")]
    assert set(table) == {*ours, "polling_interval"}
    for name in ours:
        shown = re.match(r"`([^`]*)`", table[name][0])[1]
        expected = DEFAULT_RETENTION if name == "retention" else getattr(Channel, name)  # unset: the 7-day default
        assert shown in _spellings(expected), (name, shown, expected)
    assert table["polling_interval"][0] == f"`{Transport.polling_interval}`"


def test_every_link_to_a_file_resolves() -> None:
    for document in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", document.read_text()):
            assert (document.parent / target).exists(), f"{document.name} links to {target}, which does not exist"
    for name in ("performance", "scale", "reliability"):
        assert f"(docs/{name}.md)" in README


def test_the_readme_says_how_to_install_without_a_package_index() -> None:
    assert "not published on a package index" in README
    assert "git+" in README and ". .venv/bin/activate" in README
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert quick_start.index("bb-broker serve") < quick_start.index("celery -A myapp worker")
    assert "worker_prefetch_multiplier = 1" in quick_start
