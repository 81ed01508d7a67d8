"""Orphans' exit statuses: what the keeper keeps for the next holder (docs/design.md §16).

A program the holder started is the holder's child; if the holder dies (SIGKILL, a crash)
while the program runs, the program is orphaned. On Linux the keeper is the child
subreaper (PR_SET_CHILD_SUBREAPER), so orphans become its children: at each SIGCHLD it
looks at its children that are not its own holders, standbys or trial runs, and for each
that has ended it first reads its status and start time without reaping it (waitid with
WNOWAIT: the pid cannot be reused meanwhile), keeps them in a small file, and only then
reaps it. So a holder that sees the program's pid gone finds its status there already;
a zombie is reaped by the keeper alone, and a status is written once.

The files are in `<socket>.exits/`, a directory of the user's alone (0700), one per
orphan, named by its pid and start time and holding both with the status (msgpack). A
holder believes one only if the directory and the file are the user's and no one else's,
the file is a small regular file that decodes, and its pid and start time are the
program's (a reused pid started at another time): anything else is not believed, and the
status is `unknown`. A file taken is removed.

Only session programs' statuses are kept: the holder marks each program it starts with an
empty `<pid>-<start time>.watch` there (the same checks: the user's alone, never a link),
and the keeper keeps the status of a marked orphan only, so a burst of other orphans (a
grandchild, a daemon's) writes nothing and cannot push a program's status out. The mark
goes once the program's end is known (reaped by the holder, or its status taken). Past
`_MAX_KEPT` the oldest unmarked leftovers are removed; a marked one never is.

macOS has no subreaper: there, and under systemd without the keeper (the service
manager reaps orphans), nobody keeps a status, and it is `unknown`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from typing import Any

import msgspec

from escrow_client import processes, protocol

from .log import log

_MAX_KEPT = 256
_MAX_FILE = 512  # bytes: a kept status is far smaller
_SAME_START = 0.05  # as escrow_client.liveness
_MARK = ".watch"  # a session program's mark, `<pid>-<start time>.watch`


class Kept(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pid: protocol.Pid
    start_time: float
    status: protocol.ExitStatus


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Kept)


def exits_dir(socket_path: str) -> str:
    return socket_path + ".exits"


# --- the keeper's side -------------------------------------------------------------------


def reap(own: set[int], directory: str) -> None:
    """Reap every ended child of this process not in `own`, keeping its status first."""
    if sys.platform != "linux":  # (no subreaper: no orphans come here)
        return
    try:
        children = processes.children()
    except OSError:  # out of fds, say: looked at again at the next turn (never a crash)
        return
    for pid in children:
        if pid in own:
            continue
        try:
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if ended is None:
            continue
        status = _status(ended)
        try:
            start_time: float | None = processes.process_state(pid)[1]
        except (OSError, ValueError):
            start_time = None
        if status is not None and start_time is not None and marked(directory, pid,
                                                                     start_time):
            try:
                keep(directory, Kept(pid=pid, start_time=start_time, status=status))
            except OSError as exc:
                log("keeper_error", error=repr(exc), reason=f"status of orphan {pid} not kept")
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        log("keeper_orphan_reaped", pid=pid,
            status=None if status is None else status.shell_status())


def _status(ended: Any) -> protocol.ExitStatus | None:
    """An os.waitid_result (Linux only), as an ExitStatus."""
    if ended.si_code == os.CLD_EXITED:
        return protocol.ExitStatus(code=ended.si_status & 0xFF)
    if ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return protocol.ExitStatus(signal=ended.si_status)
    return None


def keep(directory: str, kept: Kept) -> None:
    """Write one kept status (and trim the directory to `_MAX_KEPT`)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    if not _private(directory, stat.S_ISDIR):
        raise PermissionError(f"{directory} is not this user's alone")
    name = os.path.join(directory, f"{kept.pid}-{kept.start_time!r}")
    temporary = f"{name}.new"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, _encoder.encode(kept))
    finally:
        os.close(fd)
    os.replace(temporary, name)
    marks = {_pid_and_start(e.name[:-len(_MARK)]) for e in os.scandir(directory)
             if e.name.endswith(_MARK)}
    leftovers = [e for e in os.scandir(directory)
                 if not e.name.endswith(_MARK) and _pid_and_start(e.name) not in marks]
    leftovers.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime)
    for entry in leftovers[:-_MAX_KEPT]:
        with contextlib.suppress(OSError):
            os.unlink(entry.path)


def marked(directory: str, pid: int, start_time: float) -> bool:
    """Whether the holder marked `pid`, started at `start_time`, as a session's program."""
    return _mark_of(directory, pid, start_time) is not None


def _mark_of(directory: str, pid: int, start_time: float) -> str | None:
    if not _private(directory, stat.S_ISDIR):
        return None
    try:
        names = [n for n in os.listdir(directory)
                 if n.startswith(f"{pid}-") and n.endswith(_MARK)]
    except OSError:
        return None
    for name in names:
        got = _pid_and_start(name[:-len(_MARK)])
        path = os.path.join(directory, name)
        if (got is not None and got[0] == pid and abs(got[1] - start_time) < _SAME_START
                and _private(path, stat.S_ISREG)):
            return path
    return None


def _pid_and_start(name: str) -> tuple[int, float] | None:
    """`<pid>-<start time>` as a file is named, or None."""
    pid, _, start = name.partition("-")
    try:
        return int(pid), float(start)
    except ValueError:
        return None


# --- the holder's side -------------------------------------------------------------------


def mark(directory: str, pid: int, start_time: float) -> None:
    """Mark program `pid`, started at `start_time`, as a session's: its status is kept
    if it is orphaned. OSError if it cannot be (then nobody will keep it)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    if not _private(directory, stat.S_ISDIR):
        raise PermissionError(f"{directory} is not this user's alone")
    name = os.path.join(directory, f"{pid}-{start_time!r}{_MARK}")
    os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def unmark(directory: str | None, pid: int, start_time: float | None) -> None:
    """The program's end is known: its mark goes (and any status kept for it)."""
    if directory is None or start_time is None:
        return
    path = _mark_of(directory, pid, start_time)
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def take(directory: str | None, pid: int, start_time: float | None) -> protocol.ExitStatus | None:
    """The status kept for program `pid` that started at `start_time`, if one is kept and
    believed (see the module's docstring); the file is removed. None otherwise."""
    if directory is None or start_time is None or not _private(directory, stat.S_ISDIR):
        return None
    try:
        names = [n for n in os.listdir(directory)
                 if n.startswith(f"{pid}-") and not n.endswith(_MARK)]
    except OSError:
        return None
    for name in names:
        path = os.path.join(directory, name)
        kept = read(path)
        if kept is not None and kept.pid == pid and abs(kept.start_time - start_time) < _SAME_START:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return kept.status
    return None


def read(path: str) -> Kept | None:
    """A kept status file, if it can be believed (never following a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
                and info.st_mode & 0o077 == 0 and info.st_size <= _MAX_FILE):
            return None
        data = os.read(fd, _MAX_FILE + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse(data)


def parse(data: bytes) -> Kept | None:
    """A kept status's bytes, decoded, or None for anything else."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, ValueError):
        return None


def _private(path: str, kind: object) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return bool(kind(info.st_mode)  # type: ignore[operator]
                and info.st_uid == os.geteuid() and info.st_mode & 0o077 == 0)
