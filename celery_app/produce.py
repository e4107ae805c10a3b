"""A demo producer: sends a mix of the example tasks every few seconds, as an application would."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from celery import Task

from celery_app.tasks import add, always_fails, flaky, long_running

#: One task in this many rounds fails for good, so the demo shows every status without drowning in failures.
FAIL_EVERY = 5


def send_round(number: int) -> list[str]:
    """Publish one round of tasks; returns the names of the tasks sent."""
    calls: list[tuple[Task, tuple[object, ...]]] = [
        (add, (number, number + 1)),
        (flaky, (f"round {number}",)),
        (long_running, (1 + number % 3,)),
    ]
    if number % FAIL_EVERY == 0:
        calls.append((always_fails, (f"round {number}",)))
    for task, args in calls:
        task.delay(*args)
    return [task.name for task, _ in calls]


def _non_negative(cast: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = cast(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
        return value

    parse.__name__ = cast.__name__  # argparse names the type in its error message
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m celery_app.produce", description=__doc__)
    parser.add_argument("--every", type=_non_negative(float), default=5.0, metavar="SECONDS",
                        help="pause between rounds (default: 5)")  # fmt: skip
    parser.add_argument("--count", type=_non_negative(int), default=0, metavar="N",
                        help="stop after N rounds; 0 runs until stopped (default: 0)")  # fmt: skip
    parser.add_argument("--heartbeat", type=Path, metavar="PATH",
                        help="touch this file after each round, for a container healthcheck")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `docker stop` sends SIGTERM: end as cleanly as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    number = 0
    try:
        while True:
            sent = send_round(number)
            print(f"produce: round {number}: {', '.join(name.rsplit('.', 1)[-1] for name in sent)}", flush=True)
            if args.heartbeat is not None:
                args.heartbeat.touch()
            number += 1
            if args.count and number >= args.count:
                return 0
            time.sleep(args.every)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
