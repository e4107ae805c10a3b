"""The pages the plugin serves through Flower's template loader: our templates, and Flower's with our parts spliced
in (the broker banner in the base template every page extends, the Jobs and Schedules links in the navigation bar,
the Paused column in the Broker tab)."""

from __future__ import annotations

from pathlib import Path

import tornado.web

TEMPLATES = Path(__file__).resolve().parent / "templates"
#: The Jobs page's script, and the chart library it draws with (uPlot, vendored: operators' networks often have no
#: way to a CDN).
STATIC = Path(__file__).resolve().parent / "static"
OUR_TEMPLATES = ("bb_jobs.html", "bb_job.html", "bb_post.html", "bb_progress.html", "bb_schedules.html")

#: Where the Jobs link goes in Flower's navbar.html, and the Broker tab's row and header ends in broker.html.
NAVBAR_ANCHOR = "Broker</a>\n        </li>"
NAVBAR_LINK = """
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'jobs' %} active{% end %}" href="{{ reverse_url('jobs') }}"
            {% if active_tab == 'jobs' %}aria-current="page"{% end %}>Jobs</a>
        </li>
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'schedules' %} active{% end %}" href="{{ reverse_url('schedules') }}"
            {% if active_tab == 'schedules' %}aria-current="page"{% end %}>Schedules</a>
        </li>"""
BROKER_HEADER_ANCHOR = '<th class="broker-secondary-column">Idle since</th>'
BROKER_CELL_ANCHOR = "{% raw format_value(queue.get('idle_since')) %}</td>"
BROKER_HEADER = "\n          <th>Paused</th>"
BROKER_CELL = "\n          <td>{{ ('paused by ' + str(queue.get('pausedBy'))) if queue.get('paused') else '—' }}</td>"


#: Where the banner goes in Flower's base template, and the banner (escaped, as every value the template shows).
BANNER_ANCHOR = b'<main class="app-content" id="main-content">'
BANNER = b"""
{% from bb_broker.contrib.flower.health import broker_banner %}{% set bb_broker_banner = broker_banner(handler) %}
{% if bb_broker_banner %}
<div class="alert alert-danger m-3" role="alert" id="bb-broker-error">{{ bb_broker_banner }}</div>
{% end %}
"""


def template_source(root: str, name: str) -> bytes | None:
    """The source of one of our templates, or of one of Flower's (from its template directory `root`) with our part:
    the base template every page extends with the broker banner, the navigation bar with the Jobs and Schedules
    links, the Broker tab with the Paused column; None for any other template, and for a Broker tab that lacks either
    of the column's anchors (it is shown as Flower has it). Flower's template loader asks this first for each
    template (bb_broker.upstream.flower.install_template_loader)."""
    if name in OUR_TEMPLATES:
        return (TEMPLATES / name).read_bytes()
    if name == "base.html":
        # Should a Flower release move the anchor, its pages show no banner (tests/flower/test_flower.py says so).
        return (Path(root) / name).read_bytes().replace(BANNER_ANCHOR, BANNER_ANCHOR + BANNER, 1)
    if name == "navbar.html":
        text = (Path(root) / name).read_text()
        return text.replace(NAVBAR_ANCHOR, NAVBAR_ANCHOR + NAVBAR_LINK, 1).encode()
    if name == "broker.html":
        text = (Path(root) / name).read_text()
        if BROKER_HEADER_ANCHOR not in text or BROKER_CELL_ANCHOR not in text:
            return None  # a header without its cells shifts every column after it (Flower 2.1 has the header's only)
        text = text.replace(BROKER_HEADER_ANCHOR, BROKER_HEADER_ANCHOR + BROKER_HEADER, 1)
        return text.replace(BROKER_CELL_ANCHOR, BROKER_CELL_ANCHOR + BROKER_CELL, 1).encode()
    return None


def static_version(name: str) -> str:
    """A hash of the static file `name`, for its URL's `v=`: Tornado's StaticFileHandler lets browsers keep a URL with
    one for years, and a new bb_broker's script gets a URL of its own, never the old one from a browser's cache."""
    version = tornado.web.StaticFileHandler.get_version({"static_path": str(STATIC)}, name)
    if version is None:
        raise FileNotFoundError(STATIC / name)  # a package without it is broken: say which file, not a bad page
    return version
