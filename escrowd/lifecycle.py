"""Start-up and shut-down of one holder on one socket path (docs/design.md §6).

Order: take the lock, remove a leftover socket (holding the lock proves no holder owns it),
bind and listen (or take the socket systemd passed), write the pidfile atomically, report
ready. The lock is a POSIX record lock held through exactly one fd for the holder's whole
life: closing any other fd on that file would drop it, so nothing else here opens it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from collections.abc import Iterator

from escrow_client import paths
from escrow_client.liveness import process_start_time
from escrow_client.platform import lock_holder_pid

from .log import log


class StartupError(Exception):
    """The holder cannot start; the message tells the user why."""


def take_lock(socket_path: str) -> int:
    """Return the fd that holds `<socket>.lock` for this process's whole life."""
    path = paths.lock_path(socket_path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = lock_holder_pid(fd)
        os.close(fd)
        who = f"pid {owner}" if owner else "another process"
        raise StartupError(
            f"another escrowd ({who}) already serves {socket_path}; not starting a second one"
        ) from None
    return fd


def remove_leftover_socket(socket_path: str) -> None:
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{socket_path} exists and is not a socket; not touching it")
    os.unlink(socket_path)
    log("leftover_removed", path=socket_path, reason="no holder holds the lock")


def bind_socket(socket_path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(socket_path)  # under umask 077: never briefly open to others
        os.chmod(socket_path, 0o600)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {socket_path}: {exc.strerror}") from None
    return sock


@contextlib.contextmanager
def claimed(
    socket_path: str, activated: socket.socket | None = None, under_keeper: bool = False
) -> Iterator[socket.socket]:
    """Claim `socket_path` for this holder and yield its listening socket (`activated`, the
    one the service manager passed, if any); on exit remove the socket file (unless the
    manager owns it) and the pidfile (still under the lock), then drop the lock.

    `under_keeper`: the keeper (escrowd.keeper) holds the lock and the socket and passed
    the listener; the holder only writes the pidfile, and leaves everything to the keeper.
    """
    paths.check_socket_path(socket_path)
    if under_keeper:
        if activated is None:
            raise StartupError("the keeper passed no listening socket")
        try:
            _write_pidfile(socket_path, keeper=True)
            yield activated
        finally:
            activated.close()
        return
    paths.ensure_private_dir(os.path.dirname(socket_path))
    lock_fd = take_lock(socket_path)
    listener: socket.socket | None = activated
    try:
        if listener is None:
            remove_leftover_socket(socket_path)
            listener = bind_socket(socket_path)
        _write_pidfile(socket_path, keeper=False, activated=activated is not None)
        yield listener
    finally:
        if listener is not None:
            listener.close()
            for leftover in (socket_path, paths.pid_path(socket_path)):
                with contextlib.suppress(OSError):
                    if leftover != socket_path or activated is None:
                        os.unlink(leftover)
        os.close(lock_fd)


def _write_pidfile(socket_path: str, keeper: bool, activated: bool = True) -> None:
    pid = os.getpid()
    paths.write_pidfile(socket_path, pid, process_start_time(pid) or 0.0)
    log("listening", socket=socket_path, pid=pid, activated=activated,
        keeper=os.getppid() if keeper else None)
