"""Everything that differs between Linux and macOS, in one place (and what a process is,
by its pid, in `processes`: /proc here, psutil there).

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
    from typing import TypeVar


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


_TIOCGSID = 0x5429  # Linux: the session of a pty master's slave (ENOTTY: none)


def terminal_processes(fd: int) -> tuple[int | None, int | None] | None:
    """Whose the terminal of the pty master `fd` is, as the kernel says now: (the session
    id, that is its leader's pid; the foreground process group), None for either it has
    none. None where the platform cannot tell from a master: macOS answers these only for
    a process's own controlling terminal."""
    if sys.platform != "linux":
        return None
    return _ioctl_pid(fd, _TIOCGSID), _ioctl_pid(fd, termios.TIOCGPGRP)


def _ioctl_pid(fd: int, request: int) -> int | None:
    try:
        raw = fcntl.ioctl(fd, request, b"\0\0\0\0")
    except OSError as exc:
        if exc.errno != errno.ENOTTY:  # no session (the leader has ended, or never was)
            raise
        return None
    pid = int(struct.unpack("i", raw)[0])
    return pid if pid > 0 else None


def pin_process(pid: int) -> int | None:
    """A pidfd for `pid` (Linux 5.3+): it names that one process whatever becomes of the
    number, and turns readable when it ends. None where there is none to be had (then the
    caller must make do with the number); ProcessLookupError if no such process."""
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise ProcessLookupError(exc.errno, exc.strerror) from None
        if exc.errno in (errno.ENOSYS, errno.EINVAL):
            return None
        raise


def session_members(sid: int) -> list[int] | None:
    """The pids whose session is `sid` now, by a walk of /proc; None where the platform
    cannot list processes this way (macOS). A number only: pin each and ask again."""
    if sys.platform != "linux":
        return None
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                members.append(int(entry))
        except OSError:
            continue  # ended meanwhile, or not ours to ask
    return members


def signal_pinned(pidfd: int, signum: int) -> None:
    """Send `signum` to the process of a `pin_process` pidfd (ProcessLookupError: it has
    ended)."""
    if sys.platform == "linux":
        import signal

        signal.pidfd_send_signal(pidfd, signum)


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
