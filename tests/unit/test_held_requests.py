"""The jobs a worker's lease keeper keeps fresh (bb_broker.worker.startup._HeldRequests), from Celery's own request
sets: a run whose pool process has ended keeps none, whatever the pool puts in a request's `worker_pid`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from celery.worker import state as worker_state

from bb_broker.jobs.payloads import JOB_ID_HEADER
from bb_broker.worker.startup import _HeldRequests


class Held:
    """What the lease keeper reads of a Celery request (Celery's active set holds its requests weakly: each is kept
    in a local while it is in there)."""

    def __init__(self, job_id: str, worker_pid: Any) -> None:
        self.request_dict, self.worker_pid, self.task = {JOB_ID_HEADER: job_id}, worker_pid, None


def request(job_id: str, worker_pid: Any) -> Held:
    return Held(job_id, worker_pid)


@pytest.fixture
def started() -> Iterator[set[Any]]:
    """Celery's set of the requests the worker's pool took, emptied after each test."""
    yield worker_state.active_requests
    worker_state.active_requests.clear()
    worker_state.reserved_requests.clear()


def an_ended_process() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: no such process any more
    return child.pid


def test_a_run_whose_pool_process_ended_keeps_no_lease_and_the_others_keep_theirs(started: set[Any]) -> None:
    running, gone, waiting = request("running", os.getppid()), request("gone", an_ended_process()), request("w", None)
    started.update([running, gone])
    worker_state.reserved_requests.add(waiting)
    held = _HeldRequests(forks=True)
    assert sorted(held.reserved()) == ["running", "w"]
    assert held.started() == ["running"]


def test_a_green_pools_greenlet_id_is_no_pid_to_judge(started: set[Any]) -> None:
    # eventlet and gevent put id(greenlet) in worker_pid: os.kill raised OverflowError, and the lease keeper's
    # thread with it, so that no lease of the worker was kept fresh.
    green, huge = request("green", id(object())), request("huge", 2**70)  # kept: Celery's set holds them weakly
    started.update([green, huge])
    assert sorted(_HeldRequests(forks=False).reserved()) == ["green", "huge"]
    assert sorted(_HeldRequests(forks=True).reserved()) == ["green", "huge"]
