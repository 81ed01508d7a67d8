"""Trust runs both ways (docs/design.md §8, §10): a client talks only to its own user's holder.

Another local user who gets to the socket path first (say by squatting
`/tmp/escrowd-<uid>/` before the victim's first holder starts) must never receive a PTY
master: whoever holds a master can type into the shell behind it, which is code execution
as the victim. So before a client sends a single byte, it checks:

1. the socket's directory, by `lstat` (a symlink is not followed, and is refused): a real
   directory, owned by the client's uid, not writable by group or others (tmux's rule for
   `/tmp/tmux-<uid>`); and, once connected,
2. the listening peer's uid (SO_PEERCRED / LOCAL_PEERCRED): the client's own.

A failure is `Forbidden`, naming the path, what was found and what was expected. Every
OSError on the way is turned into an `EscrowError` here, once (`connect_error`).
"""

from __future__ import annotations

import errno
import os
import socket
import stat

from . import advice, errors
from .platform import peer_credentials

# The errnos of a socket path that cannot work whatever runs: a configuration error, so
# autostart does not try to start a holder there.
_BAD_PATH = {errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP}
_DENIED = {errno.EACCES, errno.EPERM}
_NOTHING_THERE = {errno.ENOENT, errno.ECONNREFUSED}


def connect_error(exc: OSError, socket_path: str) -> errors.EscrowError:
    """The client's exception for an OSError met while reaching the holder on
    `socket_path` (looking at its directory, or connecting), with what to do next."""
    reason = exc.strerror or str(exc)
    if exc.errno in _NOTHING_THERE:
        wrong = advice.not_a_socket(socket_path)
        if wrong is not None:
            # No holder can ever listen there: a configuration error (autostart won't try).
            return errors.EscrowConfigError(wrong)
        return errors.HolderUnavailable(f"no holder is listening on {socket_path} ({reason}); "
                                        f"{advice.start_holder(socket_path)}")
    if exc.errno in _DENIED:
        return errors.Forbidden(f"permission denied reaching {socket_path} ({reason}); "
                                f"{advice.own_directory(socket_path)}")
    if exc.errno in _BAD_PATH or exc.errno is None:
        # errno None: Python's own "AF_UNIX path too long".
        return errors.EscrowConfigError(f"cannot use the socket path {socket_path} ({reason}); "
                                        f"{advice.own_directory(socket_path)}")
    return errors.HolderUnavailable(f"cannot reach the holder on {socket_path} ({reason})")


def check_socket_dir(socket_path: str) -> None:
    """Raise unless the directory of `socket_path` is a real directory owned by this uid
    and closed to writes by group and others. A missing directory raises
    HolderUnavailable (nothing can be listening there; a holder started by this user
    creates it 0700)."""
    directory = os.path.dirname(socket_path) or "."
    if os.path.isdir(socket_path):
        # Said before anything about the directory above it: a directory where the socket
        # should be is the mistake, and the directory above may be no business of the user's.
        raise errors.EscrowConfigError(advice.not_a_socket(socket_path) or socket_path)
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise connect_error(exc, socket_path) from None
    except ValueError as exc:  # an embedded NUL
        raise errors.EscrowConfigError(f"cannot use the socket path {socket_path!r} ({exc})"
                                       ) from None
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        raise errors.Forbidden(
            f"the socket directory {directory} is a symlink (to {_readlink(directory)}), "
            "expected a real directory: refusing to talk to a holder there; "
            + advice.own_directory(socket_path)
        )
    if not stat.S_ISDIR(st.st_mode):
        raise errors.Forbidden(
            f"the socket directory {directory} is not a directory, expected a directory "
            "owned by you: refusing to talk to a holder there; "
            + advice.own_directory(socket_path)
        )
    if st.st_uid != uid:
        raise errors.Forbidden(
            f"the socket directory {directory} is owned by uid {st.st_uid}, expected your "
            f"own uid {uid}: another user could be listening there; refusing to talk to it; "
            + advice.own_directory(socket_path)
        )
    if st.st_mode & 0o022:
        raise errors.Forbidden(
            f"the socket directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}, "
            "writable by group or others, expected no write access for them: anyone "
            "could have put a socket there; refusing to talk to it; "
            + advice.open_directory(socket_path, st.st_mode, st.st_uid)
        )


def check_peer(sock: socket.socket, socket_path: str) -> int | None:
    """Raise Forbidden unless the process listening on the connected `sock` runs as this
    uid; its pid (None where the kernel does not name it). Nothing has been sent when this
    is called."""
    try:
        pid, peer_uid = peer_credentials(sock)
    except OSError as exc:
        raise errors.Forbidden(
            f"cannot tell who listens on {socket_path} ({exc.strerror or exc}): refusing "
            "to send it anything"
        ) from None
    uid = os.getuid()
    if peer_uid != uid:
        who = f"pid {pid}" if pid else "the process"
        raise errors.Forbidden(
            f"{who} listening on {socket_path} runs as uid {peer_uid}, expected your own "
            f"uid {uid}: refusing to send it anything"
        )
    return pid or None  # 0: a listener in an ancestor pid namespace, unnamed here


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"
