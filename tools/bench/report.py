"""Reduce repeated rounds to medians and same-round ratios, judge the targets, print a table and one JSON line."""

from __future__ import annotations

import statistics
from typing import Any

#: What a metric is called in the table, its unit, and whether more is better.
METRICS: list[tuple[str, str, str]] = [
    ("drain_tps", "drain throughput", "tasks/s"),
    ("drain_tps_celery_prefetch", "  with Celery's prefetch (4)", "tasks/s"),
    ("drain_tps_events", "drain, task events on + a monitor", "tasks/s"),
    ("drain_tps_events_celery_prefetch", "  with Celery's prefetch (4)", "tasks/s"),
    ("events_read_per_task", "  task events the monitor read", "per task"),
    ("publish_tps", "publish throughput", "tasks/s"),
    ("idle_latency_p50_ms", "enqueue→start idle p50", "ms"),
    ("idle_latency_p95_ms", "enqueue→start idle p95", "ms"),
    ("load_latency_p50_ms", "enqueue→start under load p50", "ms"),
    ("load_latency_p95_ms", "enqueue→start under load p95", "ms"),
    ("ping_saturated_p50_ms", "ping a saturated worker p50", "ms"),
    ("ping_saturated_p95_ms", "ping a saturated worker p95", "ms"),
    ("ping_saturated_unanswered", "  pings unanswered in the timeout", "probes"),
    ("ping_idle_unanswered", "  idle worker never answered ping", "1 = so"),
    ("ops_per_task", "server ops per task, under load", "ops"),
    ("ops_per_task_with_probes", "  with latency probes in the window", "ops"),
    ("publish_ops_per_task", "  of which publishing", "ops"),
    ("ops_per_task_celery_prefetch", "  with Celery's prefetch (4)", "ops"),
    ("round_trips_per_task", "server round trips per task, under load", "requests"),
    ("round_trips_per_task_celery_prefetch", "  with Celery's prefetch (4)", "requests"),
    ("ops_per_task_events", "server ops per task, events drain", "ops"),
    ("ops_per_task_events_celery_prefetch", "  with Celery's prefetch (4)", "ops"),
    ("server_cpu_ms_per_task", "server CPU per task, under load", "ms"),
    ("server_cpu_ms_per_task_events", "server CPU per task, events drain", "ms"),
    ("server_cpu_ms_per_task_events_celery_prefetch", "  with Celery's prefetch (4)", "ms"),
    ("worker_cpu_ms_per_task", "worker CPU per task, drain (main + pool)", "ms"),
    ("worker_pool_cpu_ms_per_task", "  of which the pool processes", "ms"),
    ("worker_cpu_ms_per_task_celery_prefetch", "  with Celery's prefetch (4)", "ms"),
    ("worker_pool_cpu_ms_per_task_celery_prefetch", "  of which the pool processes", "ms"),
    ("worker_cpu_ms_per_task_paced", "worker CPU per task, 100 tasks/s (main + pool)", "ms"),
    ("worker_pool_cpu_ms_per_task_paced", "  of which the pool processes", "ms"),
    # Under the pace (a loaded machine, a starved server), a worker spends more per task: not an equal pace then.
    ("paced_tps", "  the pace it kept (100 sent a second)", "tasks/s"),
    ("paced_load_average", "  the machine's load average (1 min) after it", "load"),
    ("idle_ops_per_s", "idle server ops/s (1 worker)", "ops/s"),
    ("worker_rss_mb", "worker RSS (main + pool)", "MB"),
]

#: The flow-control rounds: bbmongo:// with every task unique, and with a concurrency limit it never reaches.
FLOW_CONTROL = ("bbmongo_unique", "bbmongo_limited")

#: Same-round ratios: (numerator broker, denominator broker, metric).
RATIOS = [
    ("bbmongo", "mongodb", "drain_tps"),
    ("bbmongo", "mongodb", "drain_tps_celery_prefetch"),
    ("bbmongo", "mongodb", "drain_tps_events"),
    ("bbmongo", "mongodb", "drain_tps_events_celery_prefetch"),
    ("bbmongo", "mongodb", "publish_tps"),
    ("bbmongo", "mongodb", "idle_latency_p50_ms"),
    ("bbmongo", "mongodb", "ops_per_task"),
    ("bbmongo", "mongodb", "ops_per_task_celery_prefetch"),
    ("bbmongo", "mongodb", "round_trips_per_task"),
    ("bbmongo", "mongodb", "round_trips_per_task_celery_prefetch"),
    ("bbmongo", "mongodb", "ops_per_task_events"),
    ("bbmongo", "mongodb", "idle_ops_per_s"),
    ("bbmongo", "mongodb", "ping_saturated_p50_ms"),
    ("bbmongo", "redis", "drain_tps"),
    ("bbmongo", "redis", "drain_tps_celery_prefetch"),
    ("bbmongo", "redis", "drain_tps_events"),
    ("bbmongo", "redis", "drain_tps_events_celery_prefetch"),
    ("bbmongo", "redis", "publish_tps"),
    ("bbmongo", "redis", "idle_latency_p50_ms"),
    ("bbmongo", "redis", "ping_saturated_p50_ms"),
    ("bbmongo", "redis", "worker_cpu_ms_per_task"),
    ("bbmongo", "redis", "worker_pool_cpu_ms_per_task"),
    ("bbmongo", "redis", "worker_cpu_ms_per_task_celery_prefetch"),
    ("bbmongo", "redis", "worker_pool_cpu_ms_per_task_celery_prefetch"),
    ("bbmongo", "redis", "worker_cpu_ms_per_task_paced"),
    ("bbmongo", "redis", "worker_pool_cpu_ms_per_task_paced"),
    ("bbmongo", "mongodb", "worker_cpu_ms_per_task"),
    ("bbmongo", "mongodb", "worker_cpu_ms_per_task_celery_prefetch"),
    ("bbmongo_results", "mongodb_results", "drain_tps"),
    ("bbmongo_results", "mongodb_results", "ops_per_task"),
    ("bbmongo_results", "mongodb_results", "ops_per_task_celery_prefetch"),
    ("bbmongo_results", "bbmongo", "ops_per_task"),
    # Without change streams (issue 43): what polling costs an idle worker, and its enqueue→start.
    ("bbmongo_polling", "bbmongo", "idle_latency_p50_ms"),
    ("bbmongo_polling", "bbmongo", "idle_ops_per_s"),
    ("bbmongo_polling", "bbmongo", "drain_tps"),
    *(
        (flow, "bbmongo", metric)
        for flow in FLOW_CONTROL
        for metric in ("drain_tps", "drain_tps_celery_prefetch", "ops_per_task", "ops_per_task_celery_prefetch")
    ),
]


def _value(figures: dict[str, Any], metric: str) -> float | None:
    if metric == "worker_rss_mb":
        rss = figures.get("worker_rss_bytes")
        return None if rss is None else rss / 2**20
    value = figures.get(metric)
    return None if value is None else float(value)


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric, _, _ in METRICS:
        values = [v for v in (_value(r, metric) for r in rounds) if v is not None]
        if values:
            out[metric] = statistics.median(values)
    return out


def round_ratios(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Each round's own ratio: both figures measured minutes apart, not runs apart."""
    out: dict[str, list[float]] = {}
    for top, bottom, metric in RATIOS:
        pairs = zip(rounds.get(top, []), rounds.get(bottom, []), strict=False)
        values = [a / b for a, b in ((_value(x, metric), _value(y, metric)) for x, y in pairs) if a and b]
        if values:
            out[f"{top}/{bottom} {metric}"] = values
    return out


def ratios(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """The median over rounds of each round's own ratio."""
    return {key: statistics.median(values) for key, values in round_ratios(rounds).items()}


def targets(med: dict[str, dict[str, float]], rat: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The issue's targets for bbmongo://, each with the figure it was judged on."""
    bb = med.get("bbmongo", {})
    bb_results = med.get("bbmongo_results", {})
    checks = {
        "drain >= 1.5x mongodb:// (prefetch 1)": (rat.get("bbmongo/mongodb drain_tps"), lambda v: v >= 1.5),
        "drain >= 1.5x mongodb:// (prefetch 4)": (
            rat.get("bbmongo/mongodb drain_tps_celery_prefetch"),
            lambda v: v >= 1.5,
        ),
        "drain, events on, >= 1.5x mongodb:// (prefetch 1)": (
            rat.get("bbmongo/mongodb drain_tps_events"),
            lambda v: v >= 1.5,
        ),
        "drain, events on, >= 1.5x mongodb:// (prefetch 4)": (
            rat.get("bbmongo/mongodb drain_tps_events_celery_prefetch"),
            lambda v: v >= 1.5,
        ),
        "idle enqueue->start p50 <= 10 ms": (bb.get("idle_latency_p50_ms"), lambda v: v <= 10),
        "idle enqueue->start p95 <= 150 ms": (bb.get("idle_latency_p95_ms"), lambda v: v <= 150),
        "server ops per task <= 3 (prefetch 1)": (bb.get("ops_per_task"), lambda v: v <= 3),
        "server ops per task <= 3 (prefetch 4)": (bb.get("ops_per_task_celery_prefetch"), lambda v: v <= 3),
        "idle worker <= 1 ops/s": (bb.get("idle_ops_per_s"), lambda v: v <= 1),
        "publish >= 1.0x mongodb://": (rat.get("bbmongo/mongodb publish_tps"), lambda v: v >= 1.0),
        "saturated worker answers ping, p95 < 1000 ms": (bb.get("ping_saturated_p95_ms"), lambda v: v < 1000),
        "server ops per task, results on, <= 3 (prefetch 1)": (bb_results.get("ops_per_task"), lambda v: v <= 3),
        # What a task costs on the worker (issue 25): against Redis in the same round.
        "worker CPU per task <= 1.15x redis:// (prefetch 4)": (
            rat.get("bbmongo/redis worker_cpu_ms_per_task_celery_prefetch"),
            lambda v: v <= 1.15,
        ),
        "worker CPU per task <= 1.3x redis:// (prefetch 1)": (
            rat.get("bbmongo/redis worker_cpu_ms_per_task"),
            lambda v: v <= 1.3,
        ),
        "server ops per task <= 2.5 (prefetch 1)": (bb.get("ops_per_task"), lambda v: v <= 2.5),
        "server ops per task <= 2.0 (prefetch 4)": (bb.get("ops_per_task_celery_prefetch"), lambda v: v <= 2.0),
        # A settle's share: a bulk of settles is one round trip, and each of its statements an op to the server.
        "server round trips per task <= 2.5 (prefetch 1)": (bb.get("round_trips_per_task"), lambda v: v <= 2.5),
        "server round trips per task <= 2.0 (prefetch 4)": (
            bb.get("round_trips_per_task_celery_prefetch"),
            lambda v: v <= 2.0,
        ),
        "server ops per task, results on, <= 2.5 (prefetch 1)": (
            bb_results.get("ops_per_task"),
            lambda v: v <= 2.5,
        ),
        "server ops per task, results on, <= 2.0 (prefetch 4)": (
            bb_results.get("ops_per_task_celery_prefetch"),
            lambda v: v <= 2.0,
        ),
        "drain >= 1.0x mongodb:// (prefetch 1)": (rat.get("bbmongo/mongodb drain_tps"), lambda v: v >= 1.0),
        "drain >= 1.0x mongodb:// (prefetch 4)": (
            rat.get("bbmongo/mongodb drain_tps_celery_prefetch"),
            lambda v: v >= 1.0,
        ),
    }
    # Flow control (issue 23): unique keys on every task, and a limit never reached, cost no drain and no operation.
    for flow in FLOW_CONTROL:
        for prefetch, suffix in (("1", ""), ("4", "_celery_prefetch")):
            checks[f"{flow} drain >= 0.95x bbmongo:// (prefetch {prefetch})"] = (
                rat.get(f"{flow}/bbmongo drain_tps{suffix}"),
                lambda v: v >= 0.95,
            )
            checks[f"{flow} ops per task <= 1.02x bbmongo:// (prefetch {prefetch})"] = (
                rat.get(f"{flow}/bbmongo ops_per_task{suffix}"),
                lambda v: v <= 1.02,
            )
    return {
        name: {"value": None if value is None else round(value, 3), "met": value is not None and ok(value)}
        for name, (value, ok) in checks.items()
    }


def events_errors(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
    """Each broker's events-on drains that stalled or whose monitor failed, by round: reported, not hidden."""
    out: dict[str, list[str]] = {}
    for name, figures in rounds.items():
        failed = [f"round {r['round'] + 1}: {r['events_error']}" for r in figures if r.get("events_error")]
        if failed:
            out[name] = failed
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def table(
    med: dict[str, dict[str, float]],
    servers: dict[str, str],
    rat: dict[str, float],
    tgt: dict,
    spread: dict[str, list[float]] | None = None,
    errors: dict[str, list[str]] | None = None,
) -> str:
    names = list(med)
    width = max(len(label) for _, label, _ in METRICS) + 8
    lines = ["", f"{'median of rounds':<{width}}" + "".join(f"{n + ':// ':>20}" for n in names)]
    for metric, label, unit in METRICS:
        cells = "".join(f"{_fmt(med[n].get(metric)):>20}" for n in names)
        lines.append(f"{label + ' (' + unit + ')':<{width}}{cells}")
    lines.append("  (server ops: MongoDB's serverStatus opcounters, all summed; for Redis, commands processed)")
    lines.append("")
    for name in names:
        lines.append(f"  {name}:// ran on {servers[name]}")
    for name, failed in (errors or {}).items():
        lines.append("")
        lines.append(f"  {name}:// with task events on, not measured:")
        lines += [f"    {line}" for line in failed]
    lines.append("")
    lines.append("same-round ratios (median over rounds, and the lowest and highest round)")
    for key, value in rat.items():
        values = (spread or {}).get(key, [])
        span = f"  ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else ""
        lines.append(f"  {key:<52}{value:>8.2f}x{span}")
    lines.append("")
    lines.append("targets (bbmongo://)")
    for name, result in tgt.items():
        lines.append(f"  {name:<52}{_fmt(result['value']):>10}  {'met' if result['met'] else 'NOT MET'}")
    return "\n".join(lines)
