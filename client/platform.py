"""Everything that differs between Linux and macOS, in one place.

Only the Linux paths run in this project's test suite. The macOS branches are kept short so
they can be reviewed by eye: macOS has SO_NOSIGPIPE instead of MSG_NOSIGNAL on send, no
MSG_CMSG_CLOEXEC, LOCAL_PEERCRED instead of SO_PEERCRED, and no /proc.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import sys
import termios

IS_LINUX = sys.platform.startswith("linux")
IS_MACOS = sys.platform == "darwin"

# Flags for every send: a peer that hung up gives EPIPE, never a SIGPIPE that kills us.
SEND_FLAGS: int = getattr(socket, "MSG_NOSIGNAL", 0)
# Flags for every recvmsg: received fds are close-on-exec from the moment they exist.
RECV_FLAGS: int = getattr(socket, "MSG_CMSG_CLOEXEC", 0)

_TIOCGPTN = 0x80045430  # Linux: the pty number of a master; fails on anything else
_SOL_LOCAL = 0  # macOS <sys/un.h>
_LOCAL_PEERCRED = 0x001  # macOS: struct xucred
_LOCAL_PEERPID = 0x002  # macOS: pid_t


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
    """Return (pid or None, uid) of the process at the other end of a Unix socket."""
    if IS_LINUX:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
        return pid, uid
    if IS_MACOS:
        # struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]; }
        raw = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, 76)
        uid = struct.unpack_from("I", raw, 4)[0]
        pid = struct.unpack("i", sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERPID, 4))[0]
        return pid, uid
    raise OSError(errno.ENOSYS, "peer credentials are not supported on this platform")


def is_pty_master(fd: int) -> bool:
    """True if `fd` is a terminal and, where the platform can tell, the master side of a pty."""
    if not os.isatty(fd):
        return False
    if IS_LINUX:
        try:
            fcntl.ioctl(fd, _TIOCGPTN, b"\0\0\0\0")
        except OSError:
            return False  # a slave, or a terminal that is not a pty at all
    return True


def pty_number(fd: int) -> int | None:
    """The N of /dev/pts/N for a Linux pty master; None where the platform cannot tell."""
    if not IS_LINUX:
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
_FLOCK = "@hhqqi4x" if IS_LINUX else "@qqihh"


def lock_holder_pid(fd: int) -> int | None:
    """The pid holding a conflicting write lock on the whole file `fd`, or None if nobody
    does. F_GETLK takes nothing: it only asks."""
    if IS_LINUX:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        l_type, _, _, _, l_pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    else:
        query = struct.pack(_FLOCK, 0, 0, 0, fcntl.F_WRLCK, os.SEEK_SET)
        _, _, l_pid, l_type, _ = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    return None if l_type == fcntl.F_UNLCK else int(l_pid)
