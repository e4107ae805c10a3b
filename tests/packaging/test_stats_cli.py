"""`bb-broker stats` against a real server: the chart numbers as a table and as JSON."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from click.testing import CliRunner
from pymongo.database import Database

from bb_broker.cli import main


def test_stats_prints_the_intervals_with_work_as_a_table_or_json(broker_url: str, db: Database) -> None:
    done = datetime.now(UTC).replace(second=30, microsecond=0) - timedelta(minutes=3)
    for n, (queue, status, run) in enumerate([("a", "succeeded", 2.0), ("a", "succeeded", 4.0), ("b", "failed", 8.0)]):
        started = done - timedelta(seconds=run)
        db.jobs.insert_one({"_id": f"01J{n:023d}", "queue": queue, "kind": f"app.{queue}", "status": status,
                            "attempts": 1, "runAfter": started - timedelta(seconds=0.5), "startedAt": started,
                            "finishedAt": done, "updatedAt": done})  # fmt: skip
    runner = CliRunner()
    table = runner.invoke(main, ["stats", "--since", "1h", "--broker", broker_url])
    assert table.exit_code == 0, table.output
    header, row = table.output.splitlines()
    assert header.split() == ["FROM", "(UTC)", "SUCCEEDED", "FAILED", "RETRIED", "WAIT", "P50", "WAIT", "P95", "RUN",
                              "P50", "RUN", "P95"]  # fmt: skip
    assert row.split() == [f"{done:%Y-%m-%d}", f"{done:%H:%M}", "2", "1", "0", "0.500", "0.500", "4.000", "8.000"]

    by_queue = runner.invoke(main, ["stats", "--by", "queue", "--queue", "a", "--json", "--broker", broker_url])
    numbers = json.loads(by_queue.output)
    assert list(numbers["series"]) == ["a"] and sum(numbers["series"]["a"]["succeeded"]) == 2
    assert numbers["step"] == 60 and numbers["filter"] == {"queue": "a"}
    too_long = runner.invoke(main, ["stats", "--since", "40d", "--broker", broker_url])
    assert too_long.exit_code == 2 and "too long: at most 31 days" in too_long.output
