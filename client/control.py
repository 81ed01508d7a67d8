"""Which process `escrowctl stop` and `escrowctl upgrade` may signal, proven twice; and
what each does to it.

The holder that answered `status` names itself (its pid) and, when it runs under a keeper,
the keeper (docs/design.md §11). The process to signal is the one that holds the lock (F_GETLK):
the keeper when there is one (it stops, or replaces, its holder), else the holder itself.
Both proofs must agree, or nothing is signalled: a pid named by one witness alone could be
a process that only looks like the holder.

A stop is SIGTERM to that process: a keeper stops its holder, then closes every stored fd.
It is refused, before anything is signalled, for a holder under systemd (which would start
it again), and, unless forced, for one that escrows sessions (they would hang up) or did not
list them in time (it may escrow some). It is over once the process signalled and the holder
are both gone.

An upgrade is SIGHUP to the keeper, or a restart of the systemd unit: either keeps the fds
while the old holder winds up, and the new one adopts them. A holder with no fd store is not
touched: replacing it would drop every session. The upgrade is over once a holder of another
instance answers on the socket.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import errors, liveness, processes, protocol
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
            parent = processes.process_parent(holder_pid)
        except (processes.NoSuchProcess, OSError, ValueError):
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


# --- stop ---------------------------------------------------------------------------------

# Why a stop is refused (`stop_refusal`); nothing is signalled.
UNDER_SYSTEMD = "under_systemd"  # systemd would start the holder again
SESSIONS_UNKNOWN = "sessions_unknown"  # it did not list its sessions: it may escrow some
SESSIONS_ESCROWED = "sessions_escrowed"  # stopping it would drop them (`escrowed`)


def escrowed(verdict: Verdict) -> list[protocol.SessionInfo]:
    """The sessions a stop would drop: those the holder listed in a live state."""
    return [s for s in verdict.sessions or [] if s.state in protocol.LIVE_STATES]


def stop_refusal(verdict: Verdict, force: bool) -> str | None:
    """Why the holder of a `running` verdict may not be stopped (one of the reasons above),
    or None. `force` accepts dropping sessions, never a stop that systemd would undo."""
    if verdict.holder is not None and verdict.holder.fd_store == "systemd":
        return UNDER_SYSTEMD
    if force:
        return None
    if verdict.sessions is None:
        return SESSIONS_UNKNOWN
    if escrowed(verdict):
        return SESSIONS_ESCROWED
    return None


def terminate(who: Target, wait: float) -> bool:
    """SIGTERM to `who.pid`, then wait up to `wait` seconds until it and its holder are both
    gone: True once they are, False if either still runs. ProcessLookupError: it had
    already exited; another OSError (EPERM): this user may not signal it. Either way
    nothing was signalled."""
    holder_started = liveness.process_start_time(who.holder_pid)
    os.kill(who.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while (liveness.process_alive(who.pid, who.start_time) is not False
           or liveness.process_alive(who.holder_pid, holder_started) is not False):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


# --- upgrade ------------------------------------------------------------------------------


class CannotReplace(Exception):
    """The holder cannot be replaced in place; the message says why."""


def replace(who: Target, status: protocol.HolderStatus) -> None:
    """Have the holder that answered `status` replaced by the installed code: SIGHUP to its
    keeper, or `systemctl --user restart` of its unit. CannotReplace if it keeps no fd store
    (nothing is signalled), or the restart failed."""
    if status.fd_store == "keeper":
        os.kill(who.pid, signal.SIGHUP)
    elif status.fd_store == "systemd":
        done = subprocess.run(["systemctl", "--user", "restart", "escrowd.service"],
                              capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise CannotReplace(f"systemctl --user restart escrowd.service failed: "
                                f"{done.stderr.strip()}")
    else:
        raise CannotReplace(
            f"escrowd (pid {who.pid}) keeps no fd store: replacing it would drop every "
            "session it holds. Run escrowd with its keeper (plain `escrowd`) or under "
            "systemd to upgrade in place.")


def new_holder(ask_status: Callable[[], protocol.HolderStatus], before: protocol.HolderStatus,
               wait: float) -> protocol.HolderStatus | None:
    """The `status` of the holder that replaced `before`'s (another instance), asked for
    with `ask_status` until one answers, or None if none did within `wait` seconds. A holder
    that does not answer yet (the old one winding up, the new one starting) is asked again."""
    deadline = time.monotonic() + wait
    while True:
        try:
            after = ask_status()
            if after.instance != before.instance:
                return after
        except errors.EscrowError:
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
