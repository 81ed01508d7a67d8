"""What a custody keeps of each session, so that it can give it again (docs/design.md §11).

For every session deposited (or retrieved) into custody, the app keeps: the `deposit`
request that put it in escrow (updated as its size and meta change), a duplicate of its
master (one extra fd per session), and, with a journal, the writer that records what the
app reads into the session's replay. A holder that restarts is given each of them again
(resumed, or deposited again) from this.

A journal belongs to the holder that handed out its file: each `deposited` answer maps the
file it carried (the same writer, remapped, so nothing recorded is lost), and an answer
with none stops the writer, since that holder will not read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import protocol
from .channel import Channel
from .fdpass import close_fds
from .journal import JournalError, JournalWriter
from .retrieved import Retrieved


@dataclass
class Kept:
    """A deposited session: the request that deposited it, our duplicate of its master,
    and its journal if it has one."""

    deposit: protocol.Deposit
    fd: int
    journal: JournalWriter | None = None
    pending: bool = False  # sent, never answered: escrowed or not, it is not known yet

    @classmethod
    def retrieved(cls, result: Retrieved, journal: bool, marks: bool) -> Kept:
        """A session retrieved into custody, kept as if deposited (with `journal` asked),
        taking over the journal the handoff gave (`marks`: see `read_marker`)."""
        info = result.session
        deposit = protocol.Deposit(id=info.id, label=info.label, child_pid=info.child_pid,
                                   cols=info.cols, rows=info.rows, meta=info.meta,
                                   journal=journal)
        kept = cls(deposit, os.dup(result.fd))
        if result.journal is not None and result.journal_fd is not None:
            fd, result.journal_fd = result.journal_fd, None
            try:
                kept.journal = JournalWriter(fd, result.journal, marks)
            except JournalError:
                pass
        return kept

    def set_journal(self, reply: protocol.Response, fds: list[int], marks: bool) -> None:
        """Map the journal file a `deposited` carried (replacing an earlier mapping: a new
        holder may have given a new file). Without one, the session has no journal."""
        layout = reply.journal if isinstance(reply, protocol.Deposited) else None
        writer = self.journal
        try:
            if layout is not None and fds:
                if writer is not None:
                    writer.remap(fds.pop(0), layout, marks)  # the same writer: none lost
                else:
                    writer = JournalWriter(fds.pop(0), layout, marks)
            elif writer is not None:
                writer.close()  # no journal on this holder: we must not write that ring
                writer = None
        except JournalError:
            writer = None  # escrowed all the same; only the journal is off
        close_fds(fds)
        self.journal = writer

    def stop_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    def close(self) -> None:
        self.stop_journal()
        os.close(self.fd)


def read_marker(channel: Channel | None) -> bool:
    """Whether the holder on `channel` reads a journal's `reading` mark (section 10.6)."""
    return channel is not None and "journal_reading" in channel.welcome.features
