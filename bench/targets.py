"""What each figure of bench/run.py should be (docs/performance.md): printed in the table's
last column beside the figure, with whether this run met it. A benchmark reports; nothing
here fails a run, because a timed assertion on a shared machine only measures the machine.

A target is a bound on one key of run.py's result: `("<=", 100.0, "ms")` reads "at most
100 ms". Ratios against a baseline of the same run are keys of their own (`..._vs_...`), so
that a target holds on a faster or a slower machine alike.
"""

from __future__ import annotations

from typing import Any

Target = tuple[str, float, str]

TARGETS: dict[str, Target] = {
    "cli_status_vs_python": ("<=", 2.0, "× python -c pass"),
    "cli_list_vs_python": ("<=", 2.0, "× python -c pass"),
    "cli_version_vs_python": ("<=", 2.0, "× python -c pass"),
    "handoff_p50_ms": ("<=", 1.0, " ms"),
    "handoff_p99_ms": ("<=", 5.0, " ms"),
    "reclaim_100_ms": ("<=", 15.0, " ms"),
    "reclaim_1000_ms": ("<=", 100.0, " ms"),
    "reclaim_holder_us_per_session": ("<=", 75.0, " µs"),
    "reclaim_1000_copy_ms": ("<=", 185.0, " ms"),
    "drain_ratio": (">=", 0.9, "× the plain reader"),
    "drain_cpu_ratio": ("<=", 1.5, "× the plain reader"),
    "rss_growth_per_replay": ("<=", 1.1, "× replay"),
    "open_fds_per_session": ("<=", 2.0, ""),
    "idle_cpu_percent": ("<=", 0.2, " %"),
    "startup_ms": ("<=", 250.0, " ms"),
    "cold_start_keeper_ms": ("<=", 250.0, " ms"),
    "restart_1000_ms": ("<=", 150.0, " ms"),
    "standby_rss_mb": ("<=", 40.0, " MiB"),
    "journal_read_overhead": ("<=", 1.1, "× the app's CPU with it off"),
}


def verdict(result: dict[str, Any], key: str) -> str:
    """`≤ 100 ms: met`, `≤ 100 ms: missed`, or "" for a key with no target (or no figure)."""
    target = TARGETS.get(key)
    if target is None or key not in result:
        return ""
    op, bound, unit = target
    value = float(result[key])
    met = value <= bound if op == "<=" else value >= bound
    sign = "≤" if op == "<=" else "≥"
    return f"{sign} {bound:g}{unit}: {'met' if met else 'missed'}"
