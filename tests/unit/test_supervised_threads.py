"""bb_broker's background threads are supervised: a loop that dies is logged with its name, counted, run again."""

from __future__ import annotations

import logging
import threading

import pytest
from prometheus_client import REGISTRY, generate_latest

from bb_broker import threads
from bb_broker.ops import metrics_endpoint


def test_a_supervised_loop_that_dies_is_logged_counted_and_run_again(caplog: pytest.LogCaptureFixture) -> None:
    name = "bb-test-supervised"
    runs: list[int] = []
    done = threading.Event()

    def loop() -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise TypeError("unhashable type: 'list'")
        done.set()

    with caplog.at_level(logging.ERROR, logger="bb_broker.threads"):
        thread = threads.start_supervised(name, loop)
        assert done.wait(60), "the loop was not run again"
        thread.join(60)
    assert len(runs) == 3 and not thread.is_alive()  # it returned: a loop that ends is not restarted
    deaths = [record for record in caplog.records if name in record.getMessage()]
    assert len(deaths) == 2 and all("unhashable" in (record.exc_text or "") for record in deaths)
    assert REGISTRY.get_sample_value("bb_broker_thread_restarts_total", {"thread": name}) == 2
    served = generate_latest(metrics_endpoint.registry_for(_NoJobs())).decode()
    assert f'bb_broker_thread_restarts_total{{thread="{name}"}} 2.0' in served


class _NoJobs:
    def statuses(self) -> dict[str, int]:
        return {"queued": 0, "running": 0, "failed": 0}
