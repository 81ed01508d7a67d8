"""The circuit breaker: a wedged holder costs an app one timeout, not one per call.

Per socket path and process-wide. Only a call that *timed out* opens it (a refusal or an
error answer is an answer). While open, calls to that path fail fast with
HolderUnresponsive. It closes when the cool-down has passed, or at once when the socket file
is replaced (a new holder bound it: a different inode).
"""

from __future__ import annotations

import os
import threading
import time

DEFAULT_COOLDOWN = 60.0

_lock = threading.Lock()
_open: dict[str, tuple[float, tuple[int, int] | None]] = {}  # path -> (until, socket identity)


def _identity(socket_path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(socket_path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def trip(socket_path: str, cooldown: float = DEFAULT_COOLDOWN) -> None:
    """A call to `socket_path` timed out: fail fast for `cooldown` seconds."""
    if cooldown <= 0:
        return
    with _lock:
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


def reset(socket_path: str | None = None) -> None:
    """Close the breaker for one path, or for every path."""
    with _lock:
        if socket_path is None:
            _open.clear()
        else:
            _open.pop(socket_path, None)
