"""How long a `bb-broker` command takes from exec to exit: `--help`, and `status` against the bench's server."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

#: The command, and the most it may take (issue 12: every command used to take 2.5-3.9 s to start).
COMMANDS: dict[str, tuple[list[str], float]] = {
    "bb-broker --help": (["--help"], 0.5),
    "bb-broker status": (["status"], 1.0),
}


def _seconds(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    return time.perf_counter() - started


def measure(broker_url: str, repeat: int) -> dict[str, dict[str, float | bool]]:
    """Median wall-clock seconds of each command over `repeat` runs (after one unmeasured run warms the caches)."""
    program = str(Path(sys.executable).with_name("bb-broker"))
    figures: dict[str, dict[str, float | bool]] = {}
    for name, (args, target) in COMMANDS.items():
        argv = [program, *args] + (["--broker", broker_url] if args[0] != "--help" else [])
        _seconds(argv)
        median = statistics.median(_seconds(argv) for _ in range(repeat))
        figures[name] = {"seconds": round(median, 3), "target": target, "met": median < target}
    return figures


def table(figures: dict[str, dict[str, float | bool]], repeat: int) -> str:
    lines = ["", f"command start to exit (median of {repeat} runs)"]
    for name, figure in figures.items():
        verdict = "met" if figure["met"] else "NOT MET"
        lines.append(f"  {name:<38}{figure['seconds']:>8.2f} s  (target < {figure['target']:g} s)  {verdict}")
    return "\n".join(lines)
