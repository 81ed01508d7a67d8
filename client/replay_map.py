"""Replays by reference, the client's side: reading a handoff's replay from the sealed file
the holder sent with it (docs/design.md §12, PROTOCOL.md §12.8; the holder's side is
escrowd.replay_file).

A retrieve that asked for `replay_file` may get, with a handoff, one more fd (the last) and
`handoff.replay_file`, the range of that file which is the session's replay. The holder
puts the replays of a chunk of handoffs in one file, and each handoff brings its own fd of
it; so one retrieve maps each file once (`ReplayMaps`, by the file's identity) and every
replay is a read-only `memoryview` of that mapping: nothing is copied, and the pages are
read only when the app writes the replay out. The mapping lives as long as a replay of it
does; the fds are closed at once, on every path.

Nothing in the file is believed unchecked, though it comes from a holder of our own uid:
before it is mapped, the file must be sealed against writing, growing and shrinking (so its
bytes cannot change under the mapping, and a shrink cannot turn a read into SIGBUS), and the
range must lie inside it. A file or range that fails is a protocol violation of that
handoff, which is not acked (the holder keeps the session; the others of the retrieve are
taken all the same): never a crash, never a replay that is not the holder's. A sealed file
whose mapping fails (out of address space, or of mappings) is read with pread instead:
a copy, as the frame's would have been, and no session lost for it.
"""

from __future__ import annotations

import mmap
import os

from . import errors, protocol
from .platform import is_sealed


class ReplayMaps:
    """The replay files of one retrieve, each mapped once. Resource handling: holds no fd;
    a mapping is unmapped once no replay (memoryview) of it is left."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], memoryview] = {}

    def take(self, fd: int, where: protocol.ReplayFile) -> memoryview:
        """The replay `where` says, in the file `fd` (a read-only view: no copy; a copy
        if the file cannot be mapped). Closes `fd`, whatever happens. ProtocolViolation
        for a file that is not sealed or cannot be read, and for a range outside it."""
        try:
            if not is_sealed(fd):
                raise errors.ProtocolViolation(
                    "the replay file is not sealed against change: not mapped")
            stat = os.fstat(fd)  # (after the seals: its size can no longer change)
            key = (stat.st_dev, stat.st_ino)
            whole = self._views.get(key)
            if whole is None:
                whole = self._views[key] = _map(fd, stat.st_size)
        finally:
            os.close(fd)
        offset, length = where.offset, where.length
        if not (0 <= offset <= len(whole) and 0 <= length <= len(whole) - offset):
            raise errors.ProtocolViolation(
                f"the replay's range {offset}+{length} is outside its file of "
                f"{len(whole)} bytes")
        return whole[offset : offset + length]


def _map(fd: int, size: int) -> memoryview:
    if size == 0:
        return memoryview(b"")
    try:
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError, OverflowError):
        # Sealed, and still not mapped (out of address space, or of mappings): read it
        # instead, a copy as the frame would have been. Only a file that cannot be read
        # either fails, and then only its handoffs.
        return memoryview(_read(fd, size))
    # The views keep the mapping alive, and it is unmapped when the last is gone.
    return memoryview(mapping)


def _read(fd: int, size: int) -> bytes:
    parts: list[bytes] = []
    done = 0
    try:
        while done < size:
            part = os.pread(fd, size - done, done)
            if not part:
                raise errors.ProtocolViolation(
                    f"the replay file ends at {done} of its {size} bytes")
            parts.append(part)
            done += len(part)
    except OSError as exc:
        raise errors.ProtocolViolation(f"the replay file cannot be read: {exc}") from None
    return b"".join(parts)
