"""Is a process alive, and is it still the same process? Three answers: True, False, None.

False needs positive proof (no such pid, a zombie, or a different start time); anything
that cannot be told is None, never rounded to False.
"""

from __future__ import annotations

import psutil

# psutil derives start times from boot time plus clock ticks: the same process always gives
# the same figure, a different one differs by at least a tick.
_SAME_START = 1e-3


def process_start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def process_alive(pid: int | None, start_time: float | None) -> bool | None:
    """True if `pid` runs, is not a zombie and (where `start_time` is known) started then."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        status = proc.status()
        created = proc.create_time()
    except psutil.NoSuchProcess:  # ZombieProcess is one: a zombie is proof of death too
        return False
    except psutil.Error:
        return None
    if status == psutil.STATUS_ZOMBIE:
        return False
    if start_time is None:
        return None
    return bool(abs(created - start_time) < _SAME_START)
