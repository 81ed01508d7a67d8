"""How `escrowctl` writes what it shows: sizes, durations, a liveness answer, JSON."""

from __future__ import annotations

# A process's liveness (True, False, or None: cannot tell) in a table cell.
ALIVE = {True: "yes", False: "no", None: "?"}


def size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def print_json(value: object) -> None:
    import json  # only --json needs it

    print(json.dumps(value, indent=2, sort_keys=False))
