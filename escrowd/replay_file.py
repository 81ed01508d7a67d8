"""Replays by reference: the replays of a chunk of handoffs in one sealed file, instead of in
their frames (docs/design.md §12, PROTOCOL.md §12.8).

A `handoff` carries its replay as bytes in its frame: the holder copies the ring into a
bytes object, the encoder copies that into the frame, the kernel copies the frame into the
socket and out again, and the client's decoder copies it once more. For an app that takes
back a thousand sessions at launch, those copies were most of the time it waited. A client
that asks for `replay_file` (a Linux client of a holder whose `welcome.features` says
"replay_file") gets instead, with each handoff of a chunk of a retrieve, one more fd: a
memory file holding the replays of the whole chunk, one after another, and the range of it
that is this session's (`handoff.replay_file`). The holder copies each replay once, from
its ring into that file, in the kernel; the client maps it and reads in place.

Step by step, for each chunk of a retrieve (escrowd.handoff, step 3):

1. Each handoff's replay is cut as for the frame (the trim, the modes' preamble) but kept
   as views of the ring's storage (`add`): nothing is copied yet, and nothing awaits until
   step 2 is done, so no drain can write the ring meanwhile (every drain of the chunk is
   stopped anyway).
2. `seal` writes them all into a new memfd (one writev), seals it against writing, growing
   and shrinking, and opens it again read-only (escrow_client.platform.sealed_file). So the
   replay an app was given never changes under it: not when the session drains again (the
   app's custody ended, its ack never came, it crashed), not when the holder resumes it
   after a restart, not by the app's own hand. And nothing the app could have written is
   ever read by the holder: it never looks at the file again.
3. The file rides on every handoff of the chunk that has a replay (an empty one stays in
   the frame), as the last fd; the holder's own copy is closed once the chunk is sent, or
   could not be (`close`, on every path): the kernel keeps what is queued for the client,
   and drops it if the client dies before taking it.

Where the file cannot be made (macOS has no memfd; the holder is out of fds or memory), the
chunk's replays go in their frames, as they do to a client that does not ask (`inline`): a
replay by reference is only ever a faster way to the same bytes.
"""

from __future__ import annotations

import os

from escrow_client import protocol
from escrow_client.platform import REPLAY_FILES, sealed_file

from .log import log
from .ring import Ring


class ChunkReplays:
    """The replays of one chunk's handoffs, on their way into one replay file.

    Resource handling: owns `fd` once `seal` made it (closed by `close`); the views `add`
    took of the rings are let go by `seal` and `close`."""

    def __init__(self) -> None:
        self._parts: list[memoryview | bytes] = []
        # Where each replay starts in the file: its first part, and how many it has.
        self._pieces: dict[int, tuple[int, int]] = {}
        self.size = 0
        self.fd = -1

    def add(self, parts: list[memoryview | bytes]) -> protocol.ReplayFile | None:
        """Take one replay (its parts, in order: views of a ring, a preamble) for the file;
        where it will be, or None for an empty replay (it stays in the frame)."""
        length = sum(len(part) for part in parts)
        if length == 0:
            return None
        self._pieces[self.size] = (len(self._parts), len(parts))
        self._parts.extend(parts)
        where = protocol.ReplayFile(offset=self.size, length=length)
        self.size += length
        return where

    def seal(self) -> int | None:
        """Write every replay taken into a new sealed file, read-only: its fd (the caller
        attaches it to each handoff whose `replay_file` is set, and calls `close` once the
        chunk is sent). None when nothing was taken, or the file cannot be made: then
        `inline` gives each replay for its frame."""
        if self.size == 0 or not REPLAY_FILES:
            return None
        try:
            self.fd = sealed_file("escrowd:replays", self._parts)
        except OSError as exc:
            log("replay_file_failed", reason=str(exc) or type(exc).__name__,
                replay_bytes=self.size)
            return None
        self._parts, self._pieces = [], {}
        return self.fd

    def inline(self, where: protocol.ReplayFile) -> bytes:
        """The replay at `where`, as bytes for its frame (the file could not be made)."""
        first, count = self._pieces[where.offset]
        return b"".join(self._parts[first : first + count])

    def close(self) -> None:
        """Let go of the ring views and close the holder's copy of the file (idempotent)."""
        self._parts, self._pieces = [], {}
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def segments(ring: Ring) -> list[memoryview]:
    """Every byte `ring` holds, oldest first, in place (`ring.contents()` without the copy):
    one view of its storage, or two where the bytes wrap around its end. Valid until the
    ring next changes."""
    held = ring.size
    if held == 0:
        return []
    cap, data = ring.capacity, ring.state.data
    start = ring.position(ring.total - held)
    if start + held <= cap:
        return [data[start : start + held]]
    return [data[start:cap], data[: start + held - cap]]
