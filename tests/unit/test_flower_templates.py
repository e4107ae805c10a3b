"""The pages bb_broker.contrib.flower.templates splices its parts into, as the Flower releases it supports ship them."""

from __future__ import annotations

import re
from pathlib import Path

import tornado.template

from bb_broker.contrib.flower.templates import template_source

#: The queue table of Flower 2.1.0's broker.html: its header has the anchor the Paused header goes after, its row
#: not the one the Paused cell goes after (2.2 changed how the row shows `idle_since`).
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


def test_a_broker_tab_without_the_paused_cells_anchor_keeps_its_columns_in_line(tmp_path: Path) -> None:
    (tmp_path / "broker.html").write_text(FLOWER_2_1_QUEUE_TABLE)
    source = template_source(str(tmp_path), "broker.html") or (tmp_path / "broker.html").read_bytes()
    page = tornado.template.Template(source, "broker.html").generate(
        queues=[{"name": "reports", "messages": 3, "paused": True, "pausedBy": "alice"}]
    )
    headers = re.findall(rb"<th\b", page)
    cells = re.findall(rb"<td\b", page)
    assert len(headers) == len(cells) == 3, page.decode()  # a Paused header over no cell shifted the row's columns
