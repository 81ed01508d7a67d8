"""The circuit breaker: a wedged holder costs an app one timeout, not one per call.

Per socket path and process-wide. Only a call that *timed out* opens it (a refusal or an
error answer is an answer). While open, calls to that path fail fast with
HolderUnresponsive. It closes when the cool-down has passed, or at once when a new holder
took the path: the socket file was replaced, or the pidfile names another holder.

A replaced socket file cannot be told by its inode number alone: ext4 hands a freed inode
number straight back, so a holder that removes a leftover socket and binds a new one very
often gets the same (st_dev, st_ino). The change time and the pidfile (pid and start time)
tell them apart; the pidfile also changes when a service manager restarts the holder on a
socket it keeps (socket activation), where the socket file stays the same.
"""

from __future__ import annotations

import os
import threading
import time

from . import paths

DEFAULT_COOLDOWN = 60.0

_lock = threading.Lock()
# Who serves a path: the socket file (device, inode, change time) and the pidfile's record.
Identity = tuple[tuple[int, int, int] | None, paths.PidRecord | None]

_open: dict[str, tuple[float, Identity]] = {}  # path -> (until, identity when it opened)
_paid: dict[str, int] = {}  # path -> timeouts paid since the last reset


def _identity(socket_path: str) -> Identity:
    try:
        st = os.stat(socket_path)
    except OSError:
        return (None, paths.read_pidfile(socket_path))
    return ((st.st_dev, st.st_ino, st.st_ctime_ns), paths.read_pidfile(socket_path))


def trip(socket_path: str, cooldown: float = DEFAULT_COOLDOWN) -> None:
    """A call to `socket_path` timed out: fail fast for `cooldown` seconds."""
    with _lock:
        _paid[socket_path] = _paid.get(socket_path, 0) + 1
        if cooldown <= 0:
            return
        _open[socket_path] = (time.monotonic() + cooldown, _identity(socket_path))


def open_for(socket_path: str) -> float | None:
    """Seconds left on an open breaker for `socket_path`, or None if calls may go ahead."""
    with _lock:
        entry = _open.get(socket_path)
        if entry is None:
            return None
        until, identity = entry
        left = until - time.monotonic()
        if left <= 0 or _identity(socket_path) != identity:
            del _open[socket_path]
            return None
        return left


def timeouts_paid(socket_path: str) -> int:
    """How many calls to `socket_path` timed out (each one paid a whole timeout) since the
    last `reset`. Fast failures of an open breaker are not counted."""
    with _lock:
        return _paid.get(socket_path, 0)


def reset(socket_path: str | None = None) -> None:
    """Close the breaker for one path, or for every path, and forget its timeouts paid."""
    with _lock:
        if socket_path is None:
            _open.clear()
            _paid.clear()
        else:
            _open.pop(socket_path, None)
            _paid.pop(socket_path, None)


def untrip(socket_path: str) -> None:
    """Take back one timeout that was no wedged holder's (a wait asking after a restarting
    holder, which answers late while it adopts): the breaker shuts, one fewer paid."""
    with _lock:
        _open.pop(socket_path, None)
        if _paid.get(socket_path, 0) > 0:
            _paid[socket_path] -= 1
