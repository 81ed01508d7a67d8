"""Which process `escrowctl stop` and `escrowctl upgrade` may signal, proven twice.

The holder that answered `status` names itself (its pid) and, when it runs under a keeper,
the keeper (DESIGN §11). The process to signal is the one that holds the lock (F_GETLK):
the keeper when there is one (it stops, or replaces, its holder), else the holder itself.
Both proofs must agree, or nothing is signalled: a pid named by one witness alone could be
a process that only looks like the holder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from . import liveness
from .liveness import Verdict


class NotProven(Exception):
    """The process to signal could not be proven; the message says why."""


@dataclass(frozen=True)
class Target:
    pid: int  # what to signal: the keeper, or a bare holder
    start_time: float | None
    holder_pid: int
    keeper: bool  # True: `pid` is the keeper of `holder_pid`


def target(verdict: Verdict) -> Target:
    """The process that owns the holder on `verdict.socket` (see the module's docstring);
    NotProven unless the verdict is `running` and every witness agrees."""
    status, holder_pid = verdict.holder, verdict.pid
    if verdict.state != "running" or status is None or holder_pid is None:
        raise NotProven(f"it is {verdict.state} ({verdict.reason})")
    lock_pid = verdict.evidence.get("lock_holder_pid")
    keeper = status.keeper_pid
    if keeper is not None:
        try:
            parent = psutil.Process(holder_pid).ppid()
        except (psutil.Error, OSError):
            parent = None
        if lock_pid != keeper or parent != keeper:
            raise NotProven(f"the holder (pid {holder_pid}) names its keeper pid {keeper}, "
                            f"but the lock is held by {_who(lock_pid)} and the holder's "
                            f"parent is {_who(parent)}")
        pid = keeper
    elif lock_pid != holder_pid:
        raise NotProven(f"it says it is pid {holder_pid}, but the lock is held by "
                        f"{_who(lock_pid)}")
    else:
        pid = holder_pid
    if pid == os.getpid():
        raise NotProven("that is this very process")
    return Target(pid, liveness.process_start_time(pid), holder_pid, keeper is not None)


def _who(pid: int | None) -> str:
    return f"pid {pid}" if pid is not None else "nobody known"
