"""The server's time as a process reads it (bb_broker/clock.py): a slow round trip does not skew it."""

from __future__ import annotations

import threading
import time
from datetime import UTC
from typing import Any

from pymongo import MongoClient
from pymongo.database import Database

from bb_broker.clock import ServerClock
from tests.support import wire

#: How long the proxy holds the answer to the one handshake it is told to hold: the request reached the server at
#: once, and its answer (the server's time) came that late, as on a loaded machine.
HELD = 0.6


def test_an_answer_held_on_its_way_back_does_not_make_the_servers_time_early(mongo_url: str, db: Database) -> None:
    hold_next = threading.Event()

    def handshake(answer: dict[str, Any]) -> dict[str, Any]:
        if "localTime" in answer and hold_next.is_set():
            hold_next.clear()
            time.sleep(HELD)
        return answer

    proxy = wire.WireProxy(mongo_url, wire.Profile(name="slow answer", handshake=handshake))
    client: MongoClient = MongoClient(f"mongodb://{proxy.address}", tz_aware=True, heartbeatFrequencyMS=60_000)
    try:
        client.admin.command("ping")  # discovered: the monitors' handshakes are done
        hold_next.set()
        clock = ServerClock(client[db.name])
        clock()  # its readings of the server's time, one of them through the held answer
        assert not hold_next.is_set(), "the proxy held no answer"
        # Read between two readings of the server's own time: a clock taken from the held answer alone reads 0.3 s
        # (half of it) before the first of them. A machine slow between the readings widens the window, never the
        # other way, so the bounds cannot fail for load alone.
        before = db.client.admin.command("hello")["localTime"].astimezone(UTC)
        read_at = clock()
        after = db.client.admin.command("hello")["localTime"].astimezone(UTC)
        assert (before - read_at).total_seconds() < 0.1 and (read_at - after).total_seconds() < 0.1, (
            before,
            read_at,
            after,
        )
        assert clock.uncertainty < HELD / 2  # what the held reading alone would be
    finally:
        client.close()
        proxy.close()
