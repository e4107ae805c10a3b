"""How long a `bb-broker` command takes from exec to exit: `--help`, and `status` against the bench's server."""

from __future__ import annotations

import resource
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


def _run(argv: list[str]) -> tuple[float, float]:
    """Wall-clock seconds, and the CPU seconds (user + system) the command used: the part load does not inflate."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(broker_url: str, repeat: int) -> dict[str, dict[str, float | bool]]:
    """Medians of each command over `repeat` runs (after one unmeasured run warms the caches)."""
    program = str(Path(sys.executable).with_name("bb-broker"))
    figures: dict[str, dict[str, float | bool]] = {}
    for name, (args, target) in COMMANDS.items():
        argv = [program, *args] + (["--broker", broker_url] if args[0] != "--help" else [])
        _run(argv)
        runs = [_run(argv) for _ in range(repeat)]
        wall = statistics.median(run[0] for run in runs)
        cpu = statistics.median(run[1] for run in runs)
        figures[name] = {
            "seconds": round(wall, 3),
            "cpu_seconds": round(cpu, 3),
            "target": target,
            "met": wall < target,
        }
    return figures


def table(figures: dict[str, dict[str, float | bool]], repeat: int) -> str:
    lines = ["", f"command start to exit, wall clock and CPU (median of {repeat} runs)"]
    for name, figure in figures.items():
        verdict = "met" if figure["met"] else "NOT MET"
        lines.append(f"  {name:<30}{figure['seconds']:>6.2f} s  cpu {figure['cpu_seconds']:.2f} s  "
                     f"(target < {figure['target']:g} s)  {verdict}")  # fmt: skip
    return "\n".join(lines)
