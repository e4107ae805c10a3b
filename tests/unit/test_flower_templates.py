"""The pages bb_broker.contrib.flower.templates splices its parts into, as the Flower releases it supports ship them."""

from __future__ import annotations

import re
from pathlib import Path

import tornado.template

from bb_broker.contrib.flower.templates import template_source

#: The queue table of Flower 2.1.0's broker.html: its row shows `idle_since` with a default (2.2 formats it), which
#: the Paused cell's anchor finds as well.
FLOWER_2_1_QUEUE_TABLE = """<table id="queue-table">
  <thead>
    <tr>
      <th>Queue</th>
      <th class="broker-secondary-column">Messages</th>
      <th class="broker-secondary-column">Idle since</th>
    </tr>
  </thead>
  <tbody>
    {% for queue in queues %}
    <tr>
      <td>{{ queue['name'] }}</td>
      <td class="broker-secondary-column">{{ queue.get('messages', 'N/A') }}</td>
      <td class="broker-secondary-column">{{ queue.get('idle_since', 'N/A') }}</td>
    </tr>
    {% end %}
  </tbody>
</table>
"""

#: A release whose header has the Paused header's anchor and whose row has no `idle_since` cell to go after.
NO_IDLE_CELL_QUEUE_TABLE = FLOWER_2_1_QUEUE_TABLE.replace("{{ queue.get('idle_since', 'N/A') }}", "{{ queue['idle'] }}")


def rendered(tmp_path: Path, table: str) -> bytes:
    (tmp_path / "broker.html").write_text(table)
    source = template_source(str(tmp_path), "broker.html") or (tmp_path / "broker.html").read_bytes()
    return tornado.template.Template(source, "broker.html").generate(
        queues=[{"name": "reports", "messages": 3, "idle": "-", "paused": True, "pausedBy": "alice"}]
    )


def test_flower_2_1s_broker_tab_shows_the_paused_column_in_line(tmp_path: Path) -> None:
    page = rendered(tmp_path, FLOWER_2_1_QUEUE_TABLE)
    assert len(re.findall(rb"<th\b", page)) == len(re.findall(rb"<td\b", page)) == 4, page.decode()
    assert b"<th>Paused</th>" in page and b"<td>paused by alice</td>" in page, page.decode()


def test_a_broker_tab_without_the_paused_cells_anchor_keeps_its_columns_in_line(tmp_path: Path) -> None:
    page = rendered(tmp_path, NO_IDLE_CELL_QUEUE_TABLE)
    headers = re.findall(rb"<th\b", page)
    cells = re.findall(rb"<td\b", page)
    assert len(headers) == len(cells) == 3, page.decode()  # a Paused header over no cell shifted the row's columns
