"""`Retrieved`: a session taken back from the holder, as the app gets it (docs/design.md §4, §12).

What a retrieve hands over is the PTY master, the replay to write to the emulator before
reading it, and whether the holder confirmed the handoff (`done`). Until `confirmed`, the
fd is not known to be the app's alone: the retrieve path (`retrieve`, `resolve`) settles
that before the app sees it, and closes it rather than make a second reader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import protocol
from .repaint import repaint


@dataclass
class Retrieved:
    """A session taken back. The caller owns `fd` (close-on-exec). To restore the screen:
    reset the emulator, write `replay` to it, then `repaint()`, then read `fd`.

    `confirmed` is True when the holder answered `done`. False means the holder could not
    confirm it (it is gone, which took its copy with it, or it did not answer again): the
    fd is the caller's, and `EscrowClient.list()` tells what the holder thinks later.
    `dropped_bytes` were lost to a full ring before `replay`; `replay_trimmed` more were
    cut so that it starts on a clean boundary (docs/design.md §12); `replay_journaled` of its
    bytes were recorded by the app before (a journal), the rest drained by the holder.
    `restored_modes` names the terminal modes (the alternate screen, a hidden cursor...)
    that `replay` sets first, in a preamble of its first `replay_preamble` bytes, because
    the bytes the program set them with are no longer in it: written after a reset, the
    replay leaves the emulator in the modes the program is in.

    `replay` is bytes, or, from `reclaim_all` on Linux from a holder that sends replays by
    reference, a read-only memoryview of the sealed file it came in
    (escrow_client.replay_map): no copy is made; `os.write` and the other calls that take
    bytes-like objects take it as it is, and `bytes(got.replay)` copies it (at memcpy
    speed). Its bytes never change. The mapping is let go with the last replay of it (and
    holds one fd of its own until then: Python's mmap keeps one).
    """

    fd: int
    session: protocol.SessionInfo
    replay: bytes | memoryview
    dropped_bytes: int
    handoff_id: str
    confirmed: bool
    replay_trimmed: int = 0
    replay_journaled: int = 0
    restored_modes: tuple[str, ...] = ()
    replay_preamble: int = 0
    # A retrieve into custody with a journal: where the app goes on recording (the
    # custody takes these over).
    journal: protocol.Journal | None = None
    journal_fd: int | None = None
    # A retrieve into custody that ended with the holder holding no copy (it restarted
    # meanwhile): the custody deposits it again.
    deposit_again: bool = field(default=False, repr=False)

    def repaint(self) -> None:
        """Make the program on the terminal redraw its screen (see `escrow_client.repaint`)."""
        repaint(self.fd)

    def close(self) -> None:
        """Close what was received: the master and any state file (an abandoned result)."""
        for fd in (self.fd, self.journal_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.journal_fd = -1, None
