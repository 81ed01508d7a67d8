"""A process, by its pid: alive or a zombie, when it started, its parent, uids and name.
Linux and macOS differ here as in `platform`, but it is a concern of its own: what the
liveness verdicts, `stop`'s proofs and `attach -d`'s consents rest on.

Linux reads /proc/<pid>/stat itself, field for field as psutil reads it, so that
`escrowctl status` and `list` do not import psutil (a quarter of their start: subprocess,
its namedtuples, its platform module). The answers are psutil's, figure for figure (the
start time to the bit: pidfiles and the holder's records compare the two), with two
exceptions. psutil calls a pid gone when its /proc entry is missing, and so does a /proc
that is not mounted, or one mounted hidepid=2 for another user's process. Here a missing
entry is proof only once kill(pid, 0) says ESRCH. And psutil calls a process a zombie
when its stat says `Z`, which it also says of a process whose main thread has exited
while others run on (the leader waits for them): here it is a zombie only once
/proc/<pid>/status counts one thread, the leader's. macOS asks psutil, imported here only.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

from .platform import IS_LINUX

TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    import psutil

    _T = TypeVar("_T")

_PID_LIMIT = 1 << 31  # pid_t


class NoSuchProcess(Exception):
    """Proof that no process has this pid (a zombie has one, and is not this)."""


def process_state(pid: int) -> tuple[bool, float]:
    """(whether `pid` is a zombie, when it started, in seconds since the epoch as psutil's
    `create_time` says it). NoSuchProcess on proof that there is no such process; OSError
    or ValueError when that cannot be told (another user's process /proc hides, no /proc,
    a pid that is no pid)."""
    if not IS_LINUX:
        return _psutil_state(pid)
    fields = _proc_stat(pid)[1]
    # psutil's arithmetic, in its order: the same process gives the same float.
    return (fields[0] == b"Z" and _threads(pid) == 1,
            float(fields[19]) / _clock_ticks() + _boot_time())


def process_parent(pid: int) -> int:
    """The pid of `pid`'s parent; raises as `process_state` does."""
    if not IS_LINUX:
        return _ask_psutil(pid, lambda p: int(p.ppid()))
    return int(_proc_stat(pid)[1][1])


def signal_if(pid: int, signum: int, still_it: Callable[[], bool]) -> bool:
    """Send `signum` to `pid` if `still_it()` says it is still the process meant, asked once
    a handle on the process is held (Linux: a pidfd), so that a pid reused in between is
    never signalled. False if nothing was sent. Where there is no pidfd (a kernel before
    5.3, a seccomp filter that refuses it), as on macOS: `still_it()`, then kill()."""
    if sys.platform == "linux" and hasattr(os, "pidfd_open"):
        try:
            handle = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            handle = -1
        if handle >= 0:
            try:
                if not still_it():
                    return False
                signal.pidfd_send_signal(handle, signum)
                return True
            except ProcessLookupError:
                return False
            finally:
                os.close(handle)
    if not still_it():
        return False
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def process_uids(pid: int) -> tuple[int, int]:
    """The real and effective uids of `pid`; raises as `process_state` does."""
    if not IS_LINUX:
        return _ask_psutil(pid, lambda p: (int(p.uids().real), int(p.uids().effective)))
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except FileNotFoundError:
        raise NoSuchProcess(pid) from None
    for line in status.splitlines():
        if line.startswith(b"Uid:"):
            real, effective = line.split()[1:3]
            return int(real), int(effective)
    raise ValueError(f"no Uid line in /proc/{pid}/status")


def process_name(pid: int) -> str:
    """The name of `pid` (`escrowctl`, `python3`) as psutil gives it: the kernel's, which is
    cut at 15 bytes, or then the base name of its argv[0] if that starts with it. Raises as
    `process_state` does."""
    if not IS_LINUX:
        return _ask_psutil(pid, lambda p: str(p.name()))
    name = os.fsdecode(_proc_stat(pid)[0])
    if len(name) >= 15:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                data = os.fsdecode(f.read())
        except OSError:
            return name  # psutil too keeps the short name when the full one is not to be had
        sep = "\0" if data.endswith("\0") else " "
        args = data.removesuffix(sep).split(sep)
        if sep == "\0" and len(args) == 1 and " " in data:
            args = data.removesuffix(sep).split(" ")  # a program that rewrote its argv
        if data and os.path.basename(args[0]).startswith(name):
            name = os.path.basename(args[0])
    return name


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux's
    PR_SET_CHILD_SUBREAPER); False where there is no such thing (macOS) or it failed."""
    if not IS_LINUX:
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def children() -> list[int]:
    """The pids of this (single-threaded) process's children, on Linux; [] elsewhere."""
    if not IS_LINUX:
        return []
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children", "rb") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: every process, asked
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if int(_proc_stat(int(name))[1][1]) == me:
                        found.append(int(name))
                except (OSError, ValueError, IndexError):
                    continue
        return found


def _proc_stat(pid: int) -> tuple[bytes, list[bytes]]:
    """The name in /proc/<pid>/stat, and the fields after it (the state first)."""
    if not 0 < pid < _PID_LIMIT:
        raise ValueError(f"{pid} is not a pid")  # kill() would take 0 and -1 for groups
    for _ in range(2):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except (FileNotFoundError, ProcessLookupError):
            # No entry: no such process, or a /proc that does not show it. Only the kernel
            # can tell them apart; if it has the pid, it may have become a zombie between
            # the two calls, which a second read sees.
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise NoSuchProcess(pid) from None
            except PermissionError:
                pass  # alive, another user's, and /proc keeps it from us
            continue
        close = data.rfind(b")")
        fields = data[close + 2:].split()
        if close < 0 or len(fields) < 20:
            raise ValueError(f"/proc/{pid}/stat: {data[:80]!r}")
        return data[data.find(b"(") + 1:close], fields
    raise OSError(errno.ENOENT, f"pid {pid} runs, and /proc/{pid}/stat cannot be read")


def _threads(pid: int) -> int:
    """How many threads `pid` has (its leader, a zombie or not, counts until the last).
    Raises as `process_state` does when that cannot be told."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise NoSuchProcess(pid) from None  # the zombie was reaped meanwhile
        except PermissionError:
            pass
        raise OSError(errno.ENOENT, f"/proc/{pid}/status cannot be read") from None
    raise OSError(errno.EINVAL, f"/proc/{pid}/status has no Threads: line")


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    """The boot time in seconds since the epoch, read at each call as psutil reads it (the
    kernel moves it when the clock is set)."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime"):
                return float(line.strip().split()[1])
    raise OSError(errno.EINVAL, "/proc/stat has no btime line")


def _psutil_state(pid: int) -> tuple[bool, float]:
    import psutil

    # A zombie is psutil's NoSuchProcess (ZombieProcess) here: proof of death too.
    return _ask_psutil(pid, lambda p: (p.status() == psutil.STATUS_ZOMBIE,
                                       float(p.create_time())))


def _ask_psutil(pid: int, question: Callable[[psutil.Process], _T]) -> _T:
    import psutil

    try:
        return question(psutil.Process(pid))
    except psutil.NoSuchProcess:
        raise NoSuchProcess(pid) from None
    except psutil.Error as exc:
        raise OSError(errno.EPERM, str(exc)) from None
