"""The note of a takeover request (client/takeover.py): what `escrowctl attach -d` leaves
in the holder's socket directory (the user's own, 0700) before it sends SIGUSR1, for the
attachment asked to read and believe, or not.

    write    whole, to a file of the requester's own (`takeover-PID.REQUESTER.new`, 0600,
             created exclusively), then linked to `takeover-PID`: a reader never sees half
             a note, and a note there is never replaced. One there already is another
             takeover under way (Busy), unless it is stale: then it is removed (that very
             inode, as read) and the link tried again, once.
    read     only a regular file of this uid, open to nobody else, not followed if a
             link, with every field of a Note, of its type.
    stale    positive proof that its takeover is over: expired, or its writer gone. A
             file there that is no note (left by a requester killed mid-write, before
             notes were linked whole) is stale once a few seconds old.
    remove   the requester removes its note when it is done, whatever happened: the
             inode it linked, never another's put there since.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from dataclasses import dataclass

from . import errors, liveness

_NOTE_BYTES = 4096
_NO_NOTE_STALE = 5.0  # seconds: a file at a note's path that is no note, left by a crash


def note_path(socket_path: str, pid: int) -> str:
    return os.path.join(os.path.dirname(socket_path), f"takeover-{pid}")


@dataclass(frozen=True)
class Note:
    """A takeover request, as written: for whom (the session, the attachment's pid and
    start time) and by whom (pid, start time, terminal's name and the terminals of its
    stdin, stdout and stderr as [st_dev, st_rdev]), until when (Unix time)."""

    owner: str
    id: str
    for_pid: int
    for_start: float
    by_pid: int
    by_start: float | None
    by_tty: str
    expires: float
    by_terminals: list[list[int]] = dataclasses.field(default_factory=list)

    def stale(self) -> bool:
        """Positive proof that its takeover is over: expired, or its writer gone."""
        return self.expires <= time.time() \
            or liveness.process_alive(self.by_pid, self.by_start) is False


Inode = tuple[int, int]  # (st_dev, st_ino): this very file


def write(path: str, ref: str, note: Note) -> Inode:
    """Put the note at `path`, whole (written to a file of this process's own, then
    linked: never replacing one); Busy if another takeover's note is there and not
    stale. The note's inode, for `remove`."""
    body = json.dumps(dataclasses.asdict(note)).encode()
    temp = f"{path}.{os.getpid()}.new"
    try:
        remove(temp, None)  # left by a process killed here that had this pid
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise errors.EscrowError(f"cannot ask for {ref}: {temp}: {exc.strerror}") from None
    try:
        try:
            os.write(fd, body)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        for _ in range(2):
            try:
                os.link(temp, path, follow_symlinks=False)
                return st.st_dev, st.st_ino
            except FileExistsError:
                found = _read(path)
                other = found[0] if found else None
                if found is not None and _stale(*found):
                    remove(path, found[1])
                    continue
                by = f" by pid {other.by_pid}" if other is not None else f" (see {path})"
                raise errors.Busy(f"{ref} is being taken over already{by}; nothing was "
                                  "changed", note.id) from None
            except OSError as exc:
                raise errors.EscrowError(f"cannot ask for {ref}: {path}: "
                                         f"{exc.strerror}") from None
        raise errors.Busy(f"{ref} is being taken over already; nothing was changed",
                          note.id)
    finally:
        remove(temp, None)


def _stale(note: Note | None, inode: Inode, mtime: float) -> bool:
    if note is None:  # a requester killed mid-write (before notes were linked whole)
        return time.time() - mtime > _NO_NOTE_STALE
    return note.stale()


def read(path: str) -> Note | None:
    found = _read(path)
    return found[0] if found else None


def _read(path: str) -> tuple[Note | None, Inode, float] | None:
    """What is at `path`, if it is a file this user wrote for nobody else to read: a
    regular file (not followed if a link), owned by this uid, mode 0600 or less; with
    the Note in it if it has every field of one, of its type; its inode and mtime."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                or st.st_mode & 0o077:
            return None
        data = os.read(fd, _NOTE_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _parse(data), (st.st_dev, st.st_ino), st.st_mtime


def _parse(data: bytes) -> Note | None:
    try:
        fields = json.loads(data)
        note = Note(**fields)
    except (ValueError, TypeError):
        return None
    types: dict[str, type | tuple[type, ...]] = {
        "owner": str, "id": str, "for_pid": int, "for_start": float, "by_pid": int,
        "by_start": (float, type(None)), "by_tty": str, "expires": float,
        "by_terminals": list}
    if not all(isinstance(getattr(note, k), t) for k, t in types.items()) \
            or not 0 < note.by_pid < 1 << 31 or not 0 < note.for_pid < 1 << 31 \
            or not all(isinstance(t, list) and len(t) == 2
                       and all(isinstance(n, int) for n in t) for t in note.by_terminals):
        return None
    return note


def remove(path: str, inode: Inode | None) -> None:
    """Remove the file at `path` (only if it is still `inode`, when given)."""
    try:
        if inode is not None:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) != inode:
                return
        os.unlink(path)
    except FileNotFoundError:
        pass
