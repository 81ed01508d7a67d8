"""Where the holder lives on disk: its socket, lock file and pidfile.

Shared by the holder (which creates them) and the client and `escrowctl` (which only read
them). Nothing here deletes anything.
"""

from __future__ import annotations

import os
import stat

SOCKET_ENV = "ESCROW_SOCKET"
# sockaddr_un.sun_path is 108 bytes on Linux and 104 on macOS, including the trailing NUL.
MAX_SOCKET_PATH = 103


class PathError(Exception):
    """A socket path or its directory cannot be used safely; the message says why."""


# Literally /tmp, never $TMPDIR: on macOS $TMPDIR differs between a GUI app, a shell and a
# LaunchAgent of the same user, and they must all find the same holder (tmux's answer too,
# with the same strict checks on the directory: see trust.py).
SHARED_TMP = "/tmp"


def default_socket_path() -> str:
    """`$ESCROW_SOCKET`, else `$XDG_RUNTIME_DIR/escrowd/escrowd.sock`, else
    `/tmp/escrowd-<uid>/escrowd.sock`."""
    return os.environ.get(SOCKET_ENV) or standard_socket_path()


def standard_socket_path() -> str:
    """The default without `$ESCROW_SOCKET`: the path to suggest when that one is unusable."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "escrowd", "escrowd.sock")
    return os.path.join(SHARED_TMP, f"escrowd-{os.getuid()}", "escrowd.sock")


def resolve_socket_path(path: str | None) -> str:
    return os.path.abspath(path or default_socket_path())


def lock_path(socket_path: str) -> str:
    return socket_path + ".lock"


def pid_path(socket_path: str) -> str:
    return socket_path + ".pid"


def ensure_private_dir(directory: str) -> None:
    """Create `directory` 0700 if missing; refuse one owned by another user, open to
    group or others, or not a real directory."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise PathError(f"cannot create socket directory {directory}: {exc.strerror}") from None
    _check_private(os.lstat(directory), directory)


def _check_private(st: os.stat_result, directory: str) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise PathError(f"socket directory {directory} is not a directory (a symlink?)")
    if st.st_uid != os.getuid():
        raise PathError(
            f"socket directory {directory} is owned by uid {st.st_uid}, not by you "
            f"(uid {os.getuid()}): refusing to use it"
        )
    if st.st_mode & 0o077:
        # No chmod advised: the directory may be one others use (/run, a home).
        raise PathError(
            f"socket directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}, open to "
            "group or others: refusing to use it (choose a --socket in a directory of your "
            "own, closed to others)"
        )


def refusal(directory: str) -> str | None:
    """Why a holder would refuse `directory` as it is now; None if it would use it, or it
    does not exist (the holder creates it: see `creation_hazard`)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at socket directory {directory}: {exc.strerror}"
    try:
        _check_private(st, directory)
    except PathError as exc:
        return str(exc)
    return None


def creation_hazard(directory: str) -> str | None:
    """Why `directory`, missing, must not be created: its nearest existing ancestor is
    writable by group or others without the sticky bit, or owned by another user than this
    one or root, who could then rename the new directory away (or put another in its
    place). None if it exists or is safe to create."""
    path = os.path.abspath(directory)
    while True:
        try:
            st = os.stat(path)
            break
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        except OSError:
            return None  # creating it fails on its own, and says why
    if path == os.path.abspath(directory):
        return None
    if st.st_uid not in (0, os.getuid()):
        return (f"{path}, where the socket directory {directory} would be created, is owned "
                f"by uid {st.st_uid}, who could move it away")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"{path}, where the socket directory {directory} would be created, has mode "
                f"{stat.S_IMODE(st.st_mode):04o}: writable by others, who could move it away")
    return None


def check_socket_path(path: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise PathError(
            f"socket path is {len(os.fsencode(path))} bytes, over the {MAX_SOCKET_PATH}-byte "
            f"limit of a Unix socket address: {path}"
        )


class PidRecord:
    """What a pidfile says: a value, equal to another with the same fields. (Not a
    dataclass: `escrowctl` reads this module at every start, and `dataclasses` imports
    `inspect`, a few milliseconds of it.)"""

    __slots__ = ("pid", "start_time")

    def __init__(self, pid: int, start_time: float) -> None:
        self.pid = pid
        self.start_time = start_time

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PidRecord):
            return NotImplemented
        return (self.pid, self.start_time) == (other.pid, other.start_time)

    def __hash__(self) -> int:
        return hash((self.pid, self.start_time))

    def __repr__(self) -> str:
        return f"PidRecord(pid={self.pid!r}, start_time={self.start_time!r})"


def write_pidfile(socket_path: str, pid: int, start_time: float) -> None:
    """Write `<socket>.pid` atomically (temp file and rename): a reader sees the old file,
    the new one, or none; never half of one.

    Everything is done relative to the socket directory, opened once and checked through
    that fd (a real directory, ours, closed to group and others): another user who can
    write its parent may have swapped it for a directory of hers, or a symlink, since the
    holder last looked. The temp file is made new (O_EXCL) and never through a symlink,
    so nothing of the user's is ever written in its place. PathError says why not."""
    directory, final = os.path.split(pid_path(socket_path))
    try:
        dir_fd = os.open(directory or ".",
                         os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PathError(f"cannot open socket directory {directory} (a symlink?): "
                        f"{exc.strerror}") from None
    try:
        _check_private(os.fstat(dir_fd), directory)
        temp = f"{final}.{pid}.tmp"
        try:
            os.unlink(temp, dir_fd=dir_fd)  # ours, from an earlier holder with this pid
        except FileNotFoundError:
            pass
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{pid}\n{start_time!r}\n")
        os.replace(temp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def read_pidfile(socket_path: str) -> PidRecord | None:
    """The recorded pid and start time, or None if the file is missing, empty or malformed."""
    try:
        # Never a FIFO to hang on, a device to open, or a symlink to follow.
        fd = os.open(pid_path(socket_path),
                     os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fields = os.read(fd, 256).decode("ascii").split()
        return PidRecord(int(fields[0]), float(fields[1]))
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)

