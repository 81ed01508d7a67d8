"""The holder's side of a journal (docs/design.md §12): an app that holds a session records what it
reads into a journal file, and the holder copies it into the session's replay when custody
ends.

The journal file (escrow_client.journal has its layout) is made for the session when an app
asks for a journal, and is the only file an app is ever sent: the holder's own state file,
its records and its ring, no app maps. So nothing an app writes, by mistake or on purpose,
is believed until it is checked, and nothing it writes after custody ended is read at all.

The rule that makes the hand-over lose and duplicate nothing: the app writes the journal
only while it holds custody, the holder its ring only once custody has ended (a session's
drain starts there, `Session.start_drain`, after `end`). Every byte comes off the terminal
once, read either by the app (and recorded) or by the holder (and drained), so the replay
has each byte once, in the order the terminal gave them.

At `end` the holder reads the journal's counters once and checks them: a `total` out of
bounds copies nothing; `writing` above `total` (the app died inside a write) drops the
oldest bytes that write may have overwritten; `reading` set (the app died inside a read)
or a counter that makes no sense marks a gap. What the journal holds is then put into the
ring as if it had been read (bytes that left the journal's ring before are counted as
dropped), the journal file is closed and taken out of the fd store. A holder killed in the
middle of that copy (`journal_copying` in the record) leaves a ring that cannot be told
whole: the next holder empties it (a gap marks where) and copies the journal again.

`journal_from` and `journal_ranges` (in the session's record, so they survive a holder
restart) say which bytes of the replay the app recorded: `replay_journaled` counts them.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import sys
import tempfile
import zlib
from typing import Protocol

from escrow_client import protocol
from escrow_client.journal import (
    COUNTERS,
    DATA_OFFSET,
    FIXED,
    LAYOUT_VERSION,
    MAGIC,
    MAX_WRITE,
    TOTAL_OFFSET,
    unmap,
)

from .fdstore import FdStore, journal_name
from .ring import Budget, Ring

# A counter at or past this is not believed (no terminal prints 4 EiB).
_MAX_TOTAL = 1 << 62


class JournalFile:
    """One session's journal file, mapped. Resource handling: owns `fd` and the mapping;
    `close()` releases both and gives the ring's storage back to the budget."""

    def __init__(self, fd: int, capacity: int, budget: Budget) -> None:
        """Map a journal file whose ring has `capacity` bytes, storage the caller has
        counted in `budget`. The caller gives up `fd`, also on error (OSError, or
        ValueError: not such a file)."""
        try:
            if capacity <= 0 or os.fstat(fd).st_size != DATA_OFFSET + capacity:
                raise ValueError("not the journal file its record describes")
            self._mm = mmap.mmap(fd, DATA_OFFSET + capacity, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.capacity = fd, capacity
        self._budget = budget
        self.store_name: str | None = None  # the name the store keeps it under, if it does
        view = memoryview(self._mm)
        self.data = view[DATA_OFFSET:]
        self._counters = view[TOTAL_OFFSET : TOTAL_OFFSET + 8 * COUNTERS].cast("Q")
        view.release()

    @classmethod
    def create(cls, capacity: int, budget: Budget,
               private_dir: str | None = None) -> JournalFile:
        """A new, empty journal (sparse) whose ring has `capacity` bytes, granted already
        (its storage is counted from here)."""
        if sys.platform == "linux":
            fd = os.memfd_create("escrowd:journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        else:  # macOS: an unlinked file in the holder's private (0700) directory
            fd, path = tempfile.mkstemp(prefix=".journal-", dir=private_dir)
            os.unlink(path)
        try:
            os.ftruncate(fd, DATA_OFFSET + capacity)
            if sys.platform == "linux":
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            header = bytearray(FIXED.pack(MAGIC, LAYOUT_VERSION, 0, DATA_OFFSET, capacity))
            crc = zlib.crc32(bytes(header[16:]), zlib.crc32(bytes(header[:12])))
            struct.pack_into("=I", header, 12, crc)
            os.pwrite(fd, header, 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, capacity, budget)

    @classmethod
    def adopt(cls, fd: int, capacity: int, budget: Budget, store_name: str) -> JournalFile:
        """The journal file a stopped holder left in the store under `store_name`, whose
        ring its record says has `capacity` bytes (the file's own header is the app's to
        write: not believed)."""
        file = cls(fd, capacity, budget)
        budget.take(capacity)
        file.store_name = store_name
        return file

    def counters(self) -> tuple[int, int, int]:
        """`total`, `writing`, `reading`, as the app last wrote them (not yet checked)."""
        counters = self._counters
        return int(counters[0]), int(counters[1]), int(counters[2])

    def close(self) -> None:
        """Unmap, close, give the storage back (idempotent)."""
        if getattr(self, "fd", -1) >= 0:
            self._budget.give_back(self.capacity)
        unmap(self, ("data", "_counters"))


class Journaled(Protocol):
    """What the hand-over reads and changes of a session (escrowd.session.Session): its
    ring, the journal file it has, and the totals its record keeps."""

    token: str
    store: FdStore
    private_dir: str | None
    ring: Ring
    journal: JournalFile | None
    journal_from: int | None
    journal_copying: bool
    journal_ranges: list[tuple[int, int]]
    gap_totals: list[int]

    def persist(self, clean: bool = False) -> None: ...

    def log(self, event: str, **fields: object) -> None: ...


def grant(session: Journaled) -> tuple[protocol.Journal, int] | None:
    """A journal for the app that holds `session`: where it writes, and the journal file
    to send it (its own, if it journals already: a resume). None if no ring storage can be
    had for one. The holder must not be draining the session."""
    file = session.journal
    if file is None:
        ring = session.ring
        capacity = ring.budget.grant(ring.limit)
        if capacity == 0:
            return None
        try:
            file = JournalFile.create(capacity, ring.budget, session.private_dir)
        except OSError as exc:  # out of fds or memory: escrowed all the same, no journal
            ring.budget.give_back(capacity)
            session.log("journal_refused", error=repr(exc))
            return None
        session.journal = file
        # A copy for the store, so that a holder killed while the app journals can hand it
        # over again. Not waited for: the session is escrowed either way, and a journal
        # the next holder does not find is a marked gap, never a loss of the session.
        name = journal_name(session.token)
        if session.store.store_nowait(name, [file.fd]):
            file.store_name = name
    total = file.counters()[0]
    layout = protocol.Journal(capacity=file.capacity, total=total,
                              position=total % file.capacity)
    return layout, file.fd


def begin(session: Journaled) -> None:
    """The app holds the session and writes its journal from now on."""
    if session.journal_from is None:
        session.journal_from = session.ring.total
        session.persist()


def end(session: Journaled) -> None:
    """Custody ended: copy what the app recorded into the replay (see the module's
    docstring), and let go of the journal file."""
    start = session.journal_from
    if start is None:
        return
    ring, file = session.ring, session.journal
    if file is None:
        # Lost (a holder restarted, and the store did not have it): what the app recorded
        # is not known. Say so where it would have been.
        session.gap_totals.append(ring.total)
        session.journal_from = None
        session.persist()
        session.log("journal_end", recorded=None, reason="the journal file is lost")
        return
    skip, data, torn, doubt = _what_to_copy(file, ring.total)
    if not session.journal_copying:
        session.journal_copying = True
        session.persist()  # a kill from here on: the next holder copies it all again
    else:
        # The last holder was killed inside this copy: which of the ring's bytes are whole
        # cannot be told (a part may be in place, uncounted, over its oldest bytes). It
        # starts empty, where the copy began, and says so.
        ring.restart(start)
        session.gap_totals = [t for t in session.gap_totals if t < start] + [start]
    ring.skip(skip)
    ring.append(data)
    data.release()
    if torn or doubt:
        session.gap_totals.append(ring.total)
    if ring.total > start:
        session.journal_ranges.append((start, ring.total))
    session.journal_from = None
    session.journal_copying = False
    journaled(session, ring.total - ring.size)  # forgets ranges no longer in the ring
    session.persist()
    session.log("journal_end", recorded=ring.total - start, torn_write=torn,
                doubt=doubt or None)
    close_journal(session)


def close_journal(session: Journaled) -> None:
    """Let go of the session's journal file (the holder's copy and the store's)."""
    if session.journal is not None:
        if session.journal.store_name is not None:
            session.store.remove(session.journal.store_name)
        session.journal.close()
        session.journal = None


def _what_to_copy(file: JournalFile, ours: int) -> tuple[int, memoryview, bool, str]:
    """From the journal's counters, checked (`ours`: the ring's own count, which they add
    to): how many bytes that left its ring are only counted, the bytes it holds (oldest
    first; the caller releases the view), whether the app died inside a write (torn), and
    any other doubt to mark (a reason, or "")."""
    total, writing, reading = file.counters()
    cap = file.capacity
    if ours + total >= _MAX_TOTAL:
        return 0, memoryview(b""), False, f"a journal counter out of bounds ({total})"
    doubt = "a read was in flight" if reading else ""
    torn = writing > total
    in_flight = min(writing - total, MAX_WRITE) if torn else 0
    if writing < total:
        doubt = "the journal's counters disagree"
    held = min(total, cap)
    # The oldest bytes a write in flight may have overwritten are not taken.
    suspect = min(held, max(0, held + in_flight - cap))
    held -= suspect
    start = (total - held) % cap
    if start + held <= cap:
        data = file.data[start : start + held]
    else:
        data = memoryview(b"".join((file.data[start:cap], file.data[: held - (cap - start)])))
    return total - held, data, torn, doubt


def journaled(session: Journaled, replay_from: int) -> int:
    """How many bytes of a replay that starts at byte number `replay_from` the app
    recorded. Ranges wholly before the ring's oldest byte are forgotten."""
    ranges = [(a, b) for a, b in session.journal_ranges if b > replay_from]
    if len(ranges) != len(session.journal_ranges):
        session.journal_ranges = ranges
    return sum(b - max(a, replay_from) for a, b in ranges)
