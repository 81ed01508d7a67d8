"""Everything that differs between Linux and macOS, in one place.

Only the Linux paths run in this project's test suite. The macOS branches are kept short so
they can be reviewed by eye: macOS has SO_NOSIGPIPE instead of MSG_NOSIGNAL on send, no
MSG_CMSG_CLOEXEC, LOCAL_PEERCRED instead of SO_PEERCRED, and no /proc.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import socket
import struct
import sys
import termios

TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    import psutil

    _T = TypeVar("_T")

IS_LINUX = sys.platform == "linux"
IS_MACOS = sys.platform == "darwin"

# Flags for every send: a peer that hung up gives EPIPE, never a SIGPIPE that kills us.
SEND_FLAGS: int = getattr(socket, "MSG_NOSIGNAL", 0)
# Flags for every recvmsg: received fds are close-on-exec from the moment they exist.
RECV_FLAGS: int = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
# Linux: a datagram socket with this option is told each sender's pid (SCM_CREDENTIALS).
PASSCRED: int | None = getattr(socket, "SO_PASSCRED", None)
# poll() events that say a stream peer has shut down its side (Linux tells it apart from
# unread data with POLLRDHUP; elsewhere POLLHUP is all there is).
PEER_HUNG_UP: int = getattr(select, "POLLRDHUP", 0) | select.POLLHUP

_TIOCGPTN = 0x80045430  # Linux: the pty number of a master; fails on anything else
_TIOCGPTPEER = 0x5441  # Linux 4.13+: an fd for the slave of a master
_SOL_LOCAL = 0  # macOS <sys/un.h>
_LOCAL_PEERCRED = 0x001  # macOS: struct xucred
_LOCAL_PEERPID = 0x002  # macOS: pid_t
# macOS struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups;
# gid_t cr_groups[16]; }: 4 + 4 + 2 (+ 2 padding) + 64 bytes.
_XUCRED = struct.Struct("=IIh2x16I")
_XUCRED_VERSION = 0


def pid_max() -> int:
    """The largest pid this system hands out: Linux says it in /proc (4,194,304 at most);
    macOS's is fixed (99,999)."""
    if IS_LINUX:
        try:
            with open("/proc/sys/kernel/pid_max", "rb") as f:
                return int(f.read().strip() or 0) or 1 << 22
        except (OSError, ValueError):
            return 1 << 22
    return 99_999


def harden_socket(sock: socket.socket) -> None:
    """Make `sock` safe to send on after its peer is gone (macOS has no MSG_NOSIGNAL)."""
    nosigpipe = getattr(socket, "SO_NOSIGPIPE", None)
    if nosigpipe is not None:
        sock.setsockopt(socket.SOL_SOCKET, nosigpipe, 1)


def mark_cloexec(fds: list[int]) -> None:
    """Set FD_CLOEXEC where recvmsg could not do it atomically."""
    if RECV_FLAGS:
        return
    for fd in fds:
        os.set_inheritable(fd, False)


def peer_credentials(sock: socket.socket) -> tuple[int | None, int]:
    """Return (pid or None, uid) of the process at the other end of a Unix socket (for a
    client: the process that made the holder's socket listen)."""
    if sys.platform == "linux":
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
        return pid, uid
    if sys.platform == "darwin":
        uid = xucred_uid(sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, _XUCRED.size))
        pid = struct.unpack("i", sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERPID, 4))[0]
        return pid, uid
    raise OSError(errno.ENOSYS, "peer credentials are not supported on this platform")


def xucred_uid(raw: bytes) -> int:
    """The uid in a macOS `struct xucred` (LOCAL_PEERCRED). A short or unknown-version
    answer is an OSError: a uid that cannot be read must never pass for one."""
    if len(raw) < 8:
        raise OSError(errno.EINVAL, f"LOCAL_PEERCRED returned {len(raw)} bytes")
    version, uid = struct.unpack_from("=II", raw)
    if version != _XUCRED_VERSION:
        raise OSError(errno.EINVAL, f"LOCAL_PEERCRED returned xucred version {version}")
    return int(uid)


def is_pty_master(fd: int) -> bool:
    """True if `fd` is a terminal and, where the platform can tell, the master side of a pty."""
    if not os.isatty(fd):
        return False
    if sys.platform == "linux":
        try:
            fcntl.ioctl(fd, _TIOCGPTN, b"\0\0\0\0")
        except OSError:
            return False  # a slave, or a terminal that is not a pty at all
    return True


def terminal_identity(fd: int) -> tuple[int, int] | None:
    """Which terminal the pty master `fd` is, across devpts instances: None where the
    platform cannot tell.

    The pts number alone is not enough: every devpts instance (a container, toolbox, bwrap)
    counts from 0. On Linux the slave, reached with TIOCGPTPEER and opened O_PATH (which
    does not open the tty, so nothing about the terminal changes), names its devpts
    instance (st_dev) and its number (st_rdev). Kernels before 4.13 lack TIOCGPTPEER:
    there the pts number is all there is, in an instance of its own (-1).
    Any other failure (out of fds, a devpts that was unmounted) is an OSError: the
    terminal cannot be told apart, and a guess could let one terminal in under two ids.
    """
    if sys.platform != "linux":
        return None
    try:
        peer = fcntl.ioctl(fd, _TIOCGPTPEER, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOTTY, errno.EINVAL):
            raise
        number = pty_number(fd)
        return None if number is None else (-1, number)
    try:
        st = os.fstat(peer)
        return (st.st_dev, st.st_rdev)
    finally:
        os.close(peer)


def pty_number(fd: int) -> int | None:
    """The N of /dev/pts/N for a Linux pty master; None where the platform cannot tell."""
    if sys.platform != "linux":
        return None
    try:
        raw = fcntl.ioctl(fd, _TIOCGPTN, b"\0\0\0\0")
    except OSError:
        return None
    return int(struct.unpack("I", raw)[0])


def bytes_readable(fd: int) -> int:
    """How many bytes a read on `fd` can return right now without blocking."""
    raw = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", raw)[0])


def open_fd_count() -> int | None:
    """Open fds of this process, or None where the platform cannot tell cheaply."""
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path)) - 1  # the listing itself holds one
        except OSError:
            continue
    return None


# struct flock: Linux {short l_type, l_whence; off_t l_start, l_len; pid_t l_pid}, macOS
# {off_t l_start, l_len; pid_t l_pid; short l_type, l_whence}.
_FLOCK_LAYOUT = {"linux": "@hhqqi4x", "darwin": "@qqihh"}


def flock_query(platform: str) -> bytes:
    """A `struct flock` asking about a write lock on the whole file, for `platform`."""
    if platform == "linux":
        return struct.pack(_FLOCK_LAYOUT[platform], fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    return struct.pack(_FLOCK_LAYOUT[platform], 0, 0, 0, fcntl.F_WRLCK, os.SEEK_SET)


def flock_holder(platform: str, answer: bytes) -> int | None:
    """The pid in F_GETLK's answer for `platform`, or None if the lock is free."""
    if platform == "linux":
        l_type, _, _, _, l_pid = struct.unpack(_FLOCK_LAYOUT[platform], answer)
    else:
        _, _, l_pid, l_type, _ = struct.unpack(_FLOCK_LAYOUT[platform], answer)
    return None if l_type == fcntl.F_UNLCK else int(l_pid)


def lock_holder_pid(fd: int) -> int | None:
    """The pid holding a conflicting write lock on the whole file `fd`, or None if nobody
    does. F_GETLK takes nothing: it only asks."""
    platform = "linux" if IS_LINUX else "darwin"
    return flock_holder(platform, fcntl.fcntl(fd, fcntl.F_GETLK, flock_query(platform)))


# --- a process, by its pid ------------------------------------------------------------------
#
# Linux reads /proc/<pid>/stat itself, field for field as psutil reads it, so that
# `escrowctl status` and `list` do not import psutil (a quarter of their start: subprocess,
# its namedtuples, its platform module). The answers are psutil's, figure for figure (the
# start time to the bit: pidfiles and the holder's records compare the two), with two
# exceptions. psutil calls a pid gone when its /proc entry is missing, and so does a /proc
# that is not mounted, or one mounted hidepid=2 for another user's process. Here a missing
# entry is proof only once kill(pid, 0) says ESRCH. And psutil calls a process a zombie
# when its stat says `Z`, which it also says of a process whose main thread has exited
# while others run on (the leader waits for them): here it is a zombie only once
# /proc/<pid>/status counts one thread, the leader's. macOS asks psutil, imported here only.

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

# Replays by reference (escrowd.replay_file, escrow_client.replay_map): a sealed memfd on
# Linux. macOS has no memfd, nor seals: there a replay travels in the frame, as it does to a
# client that does not ask.
REPLAY_FILES: bool = IS_LINUX and hasattr(os, "memfd_create")
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1+: no new writable mapping (older kernels: EINVAL)
# What makes a file's bytes fixed for as long as anyone maps it: no write, no growing, no
# shrinking (a mapping of a shrunk file faults with SIGBUS). A seal is never removed, so
# these three are enough, and all a client asks (PROTOCOL.md 12.8). The holder adds
# F_SEAL_SEAL too, so that the set stays as sent; a file without it is as fixed (another
# seal only forbids more).
REPLAY_SEALS: int = (getattr(fcntl, "F_SEAL_WRITE", 0) | getattr(fcntl, "F_SEAL_SHRINK", 0)
                     | getattr(fcntl, "F_SEAL_GROW", 0))
_HOLDER_SEALS: int = REPLAY_SEALS | getattr(fcntl, "F_SEAL_SEAL", 0)
_IOV_MAX = 1024


def sealed_file(name: str, parts: list[memoryview | bytes]) -> int:
    """A new memory file holding `parts` one after another, sealed (REPLAY_SEALS, and
    F_SEAL_SEAL) and open
    read-only: an fd through which nobody can change a byte of it, nor map it writable.
    Linux only (REPLAY_FILES)."""
    if sys.platform != "linux":
        raise OSError(errno.ENOSYS, "no memfd on this platform")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        views = [memoryview(part) for part in parts if len(part)]
        while views:
            written = os.writev(fd, views[:_IOV_MAX])
            while views and written >= len(views[0]):
                written -= len(views.pop(0))
            if written:
                views[0] = views[0][written:]
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _HOLDER_SEALS | _F_SEAL_FUTURE_WRITE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _HOLDER_SEALS)  # a kernel before 5.1
        try:
            # A description of its own, read-only: write, ftruncate and fallocate on it
            # fail for want of write access, whatever the seals.
            readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return fd  # no /proc: the seals alone keep it unchanged
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return readonly


def is_sealed(fd: int) -> bool:
    """`fd` is a file whose bytes and size are fixed for good (REPLAY_SEALS), as a replay
    file must be before its mapping is believed."""
    if sys.platform != "linux":
        return False
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False  # not a sealable file at all
    return seals & REPLAY_SEALS == REPLAY_SEALS
