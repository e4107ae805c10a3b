"""A process forked from one that already talks to the broker (a multiprocessing pool of producers, as Celery's own
test_multiprocess_producer runs, or a worker's pool process that publishes) makes a client of its own, and the
deployment behind it is the one its parent probed: its first publish costs its connection, not a second probe
(a scratch collection created, written and dropped, and a change stream opened) in every child."""

from __future__ import annotations

import multiprocessing
from typing import Any

from celery import Celery
from pymongo import monitoring
from pymongo.database import Database

from tests.support.workers import job, send

#: The producer app the forked children publish with (a fork inherits it).
_app: Celery | None = None
#: In a forked child: its commands, heard from before its first client was made (the pool's initializer).
_heard: _Targets | None = None


class _Targets(monitoring.CommandListener):
    """The command name and collection of each command this process's clients send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        target = event.command.get(event.command_name)
        self.sent.append((event.command_name, target if isinstance(target, str) else "-"))

    def succeeded(self, event: Any) -> None:
        pass

    def failed(self, event: Any) -> None:
        pass


def _listen_in_child() -> None:
    global _heard
    _heard = _Targets()
    monitoring.register(_heard)  # for the clients made from here on: the child's own


def _publish_in_child(n: int) -> tuple[str, list[tuple[str, str]]]:
    # A child may take both publishes (a loaded machine): what this one sent follows what its first sent.
    assert _app is not None and _heard is not None
    before = len(_heard.sent)
    task_id = send(_app, "add", n, n)
    return task_id, _heard.sent[before:]


def test_a_forked_producer_publishes_without_probing_the_server_again(app: Celery, db: Database) -> None:
    global _app
    _app = app
    send(app, "add", 0, 0)  # the parent connects (and probes the deployment)
    try:
        with multiprocessing.get_context("fork").Pool(2, initializer=_listen_in_child) as pool:
            answers = pool.map(_publish_in_child, [1, 2])
    finally:
        _app = None
    for task_id, sent in answers:
        assert job(db, task_id)["status"] == "queued"
        assert ("insert", "jobs") in sent, sent
        probes = [command for command in sent if command[1].startswith("bb_probe_") or command[0] == "buildInfo"]
        assert probes == [], sent
