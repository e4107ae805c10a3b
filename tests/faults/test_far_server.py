"""A server further away than a new channel's first look at it (bb_broker/transport/channel.py `_check_reachable`)."""

from __future__ import annotations

import time
from typing import Any

from kombu import Connection
from pymongo.database import Database

from bb_broker.transport.channel import REACHABLE_SLICE
from tests.support import wire

#: Every answer this late: a round trip longer than the first look, as from another continent or a loaded machine.
FAR = REACHABLE_SLICE + 0.1


def test_a_channel_opens_on_a_server_further_away_than_its_first_look(mongo_url: str, db: Database) -> None:
    # pymongo refuses, without sending it, a command whose time left is under the round trip it measured: a ping
    # given one look each time was refused until the connect timeout, and the worker exited at its start.
    def late(answer: dict[str, Any]) -> dict[str, Any]:
        time.sleep(FAR)
        return answer

    proxy = wire.WireProxy(mongo_url, wire.Profile(name="far away", handshake=late, answer=late))
    try:
        # A connect timeout of 30 s: the looks (0.25, 0.5, 1, 2, 4, 8 s) have room on a loaded machine.
        with Connection(f"bbmongo://{proxy.address}/{db.name}", connect_timeout=30) as connection:
            queue = connection.SimpleQueue("far")
            queue.put({"from": "far away"})
            message = queue.get(timeout=30)
            message.ack()
            assert message.payload == {"from": "far away"}
            queue.close()
    finally:
        proxy.close()
