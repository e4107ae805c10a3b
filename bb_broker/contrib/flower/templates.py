"""The pages the plugin serves through Flower's template loader: our templates, and Flower's with our parts spliced
in (the broker banner in the base template every page extends, the Jobs and Schedules links in the navigation bar,
the Paused column in the Broker tab)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import tornado.web

logger = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parent / "templates"
#: The Jobs page's script, and the chart library it draws with (uPlot, vendored: operators' networks often have no
#: way to a CDN).
STATIC = Path(__file__).resolve().parent / "static"
OUR_TEMPLATES = ("bb_jobs.html", "bb_job.html", "bb_post.html", "bb_progress.html", "bb_schedules.html")

#: Where the Jobs link goes in Flower's navbar.html, and the Broker tab's row and header ends in broker.html: each
#: found as Flower 2.0, 2.1 and 2.2 write them (indentation, a class, the cell's formatting differ).
NAVBAR_ANCHOR = re.compile(r"Broker</a>\s*</li>")
NAVBAR_LINK = """
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'jobs' %} active{% end %}" href="{{ reverse_url('jobs') }}"
            {% if active_tab == 'jobs' %}aria-current="page"{% end %}>Jobs</a>
        </li>
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'schedules' %} active{% end %}" href="{{ reverse_url('schedules') }}"
            {% if active_tab == 'schedules' %}aria-current="page"{% end %}>Schedules</a>
        </li>"""
BROKER_HEADER_ANCHOR = re.compile(r"<th[^>]*>Idle since</th>")
BROKER_CELL_ANCHOR = re.compile(r"[^\n]*queue\.get\('idle_since'[^\n]*?</td>")
BROKER_HEADER = "\n          <th>Paused</th>"
BROKER_CELL = "\n          <td>{{ ('paused by ' + str(queue.get('pausedBy'))) if queue.get('paused') else '—' }}</td>"


#: Where the banner goes in Flower's base template, the first found (Flower 2.1 and 2.2's main element; 2.0's alert
#: container), and the banner (escaped, as every value the template shows).
BANNER_ANCHORS = (b'<main class="app-content" id="main-content">', b'<div id="alert-container"></div>')
BANNER = b"""
{% from bb_broker.contrib.flower.health import broker_banner %}{% set bb_broker_banner = broker_banner(handler) %}
{% if bb_broker_banner %}
<div class="alert alert-danger m-3" role="alert" id="bb-broker-error">{{ bb_broker_banner }}</div>
{% end %}
"""


def template_source(root: str, name: str) -> bytes | None:
    """The source of one of our templates, or of one of Flower's (from its template directory `root`) with our part:
    the base template every page extends with the broker banner, the navigation bar with the Jobs and Schedules
    links, the Broker tab with the Paused column; None for any other template, and for one of Flower's that lacks
    the place of our part (it is shown as Flower has it, and one line says so). Flower's template loader asks this
    first for each template (bb_broker.upstream.flower.install_template_loader)."""
    if name in OUR_TEMPLATES:
        return (TEMPLATES / name).read_bytes()
    if name == "base.html":
        source = (Path(root) / name).read_bytes()
        anchor = banner_anchor(source)
        if anchor is None:
            _say_missing("its broker banner")
            return None
        return source.replace(anchor, anchor + BANNER, 1)
    if name == "navbar.html":
        text = (Path(root) / name).read_text()
        link = NAVBAR_ANCHOR.search(text)
        if link is None:
            _say_missing("the Jobs and Schedules links")
            return None
        return _after(link, NAVBAR_LINK, text).encode()
    if name == "broker.html":
        text = (Path(root) / name).read_text()
        header = BROKER_HEADER_ANCHOR.search(text)
        if header is None or BROKER_CELL_ANCHOR.search(text) is None:
            # A header without its cells would shift every column after it: neither, then.
            _say_missing("the Paused column")
            return None
        text = _after(header, BROKER_HEADER, text)
        cell = BROKER_CELL_ANCHOR.search(text)
        assert cell is not None  # found above, and the header's addition is before it
        return _after(cell, BROKER_CELL, text).encode()
    return None


def banner_anchor(base_template: bytes) -> bytes | None:
    """The first of BANNER_ANCHORS in Flower's base.html, or None (a release that moved them)."""
    return next((anchor for anchor in BANNER_ANCHORS if anchor in base_template), None)


def _after(found: re.Match[str], addition: str, template: str) -> str:
    return template[: found.end()] + addition + template[found.end() :]


def _say_missing(what: str) -> None:
    # Tornado loads a template once per process: said once, when Flower first shows the page.
    logger.warning("this Flower's templates have no place bb_broker knows for %s: they are not shown", what)


def static_version(name: str) -> str:
    """A hash of the static file `name`, for its URL's `v=`: Tornado's StaticFileHandler lets browsers keep a URL with
    one for years, and a new bb_broker's script gets a URL of its own, never the old one from a browser's cache."""
    version = tornado.web.StaticFileHandler.get_version({"static_path": str(STATIC)}, name)
    if version is None:
        raise FileNotFoundError(STATIC / name)  # a package without it is broken: say which file, not a bad page
    return version
