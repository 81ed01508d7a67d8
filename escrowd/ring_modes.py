"""The terminal modes in force where a session's replay starts (docs/design.md §12).

A replay is the ring's contents, oldest first; the terminal it is written to must first be
put into the modes that were in force at its first byte, set by bytes the ring no longer
holds (escrowd.modes reads them, and makes the preamble). That state is the one to keep:
the state at the ring's *end* is of no use to a replay, which sets it again itself.

So the scanner here lags: it has read the stream up to byte number `scanned` (a total, as
the ring counts), and knows the modes in force there. Bytes from `scanned` on are still in
the ring's storage, and are read only when they are about to leave it:
- before a read or an append writes over the slots they are in (the ring, full or not,
  writes over the bytes `capacity` before the new ones). The bytes a read may overwrite are
  known before it, the number it will overwrite only after: what is at risk is copied out
  first if it holds an ESC (a memchr) or ends a pending sequence, and the part that was
  overwritten is read from that copy after the read. Bytes with no ESC change no mode:
  nothing is copied, and `scanned` just moves on (a flood of plain text costs a `find` a
  read);
- before the ring grows (its new layout keeps the held bytes only), skips bytes (they were
  never stored: the modes they set are not known), or restarts;
- when a replay is cut from the ring: up to its first byte (`replay_start`).
A ring that never wrapped is never read at all, and each byte is read at most once.

Exact: the modes at a replay's first byte, given every byte since the session was deposited
passed through the ring (drained, or journaled by its app), up to the one rule escrowd.modes
bends (a control byte inside a sequence). Approximate, and said so where the bytes are lost:
- bytes the holder never had: what the app read before it deposited the session, or while
  it held it without a journal (the modes are those in force when it took the session back,
  which is right for a program that stays in its modes), or that left an app's journal
  before the holder copied it (`skip`): whatever those bytes set is not known;
- after a holder restart: the modes are stored in the session's record (escrowd.statefile,
  checked by escrowd.bounds), written when they differ from those recorded, at most once per
  turn of the drain loop. A
  holder killed before that write, or a record whose position lies before the ring's oldest
  byte (bytes delivered or dropped since), resumes from the ring's oldest byte with the
  modes last recorded, and the one read a kill may tear (`Ring.adopt`) is not looked at.
"""

from __future__ import annotations

from typing import Protocol, TypedDict

from .modes import Modes, Scanner
from .statefile import DATA_OFFSET, Record, StateFile

# How far past a read's bytes the search for an ESC looks ahead (`RingModes._first_esc`).
_AHEAD = 64 * 1024


class Stored(Protocol):
    """What the tracker reads of a ring (escrowd.ring.Ring)."""

    capacity: int
    state: StateFile[Record]

    @property
    def total(self) -> int: ...
    @property
    def size(self) -> int: ...
    def position(self, total: int) -> int: ...


class ModesRecord(TypedDict):
    """The fields of a state record that say which modes a replay starts in."""

    modes: list[int]
    modes_pending: bytes
    modes_at: int


class RingModes:
    """One ring's scanner, `scanned` bytes into its stream. `dirty` once the modes (or a
    pending sequence) changed since they were last recorded (`stored`)."""

    __slots__ = ("_ring", "scanner", "scanned", "dirty", "_recorded", "_clean_to")

    def __init__(self, ring: Stored) -> None:
        self._ring = ring
        self.scanner = Scanner()
        self.scanned = ring.total
        self.dirty = False
        self._recorded: tuple[list[int], bytes] | None = None  # as `stored` last gave them
        # The stored bytes from `scanned` up to this number hold no ESC (see `_first_esc`).
        self._clean_to = self.scanned

    # --- bytes about to leave the storage ------------------------------------------------

    def save(self, upto: int) -> bytes | None:
        """A read is about to overwrite the stored bytes before number `upto` (some of
        them: how many, only the read knows): a copy of those not read yet, or None when
        there are none or they change nothing (no ESC, and no sequence pending). (This runs
        at every read: the common path is kept short.)"""
        start = self.scanned
        if upto <= start:
            return None
        if not self.scanner.pending:
            if upto <= self._clean_to:
                return None
            self._clean_to = self._first_esc(max(start, self._clean_to), upto + _AHEAD)
            if upto <= self._clean_to:
                return None
        ring = self._ring
        cap = ring.capacity
        a = DATA_OFFSET + ring.position(start)
        b = a + upto - start
        view = ring.state.memory.view
        end = DATA_OFFSET + cap
        if b <= end:
            return view[a:b].tobytes()
        return view[a:end].tobytes() + view[DATA_OFFSET : b - cap].tobytes()

    def _first_esc(self, start: int, limit: int) -> int:
        """The number of the first stored byte from `start` on that is an ESC, or where the
        search stopped without one: at `limit`, or at the newest byte. One memchr over many
        reads' worth of bytes, which are stored and read from here on in order, so that
        plain text does not pay for one at every read."""
        ring = self._ring
        limit = min(limit, ring.total)
        if limit <= start:
            return start
        cap = ring.capacity
        a = ring.position(start)
        count = limit - start
        memory = ring.state.memory
        first = min(count, cap - a)
        found = memory.find(27, DATA_OFFSET + a, DATA_OFFSET + a + first)
        if found >= 0:
            return start + found - DATA_OFFSET - a
        if first < count:
            found = memory.find(27, DATA_OFFSET, DATA_OFFSET + count - first)
            if found >= 0:
                return start + first + found - DATA_OFFSET
        return limit

    def overwritten(self, saved: bytes | None, upto: int) -> None:
        """The write is done: the bytes before number `upto` are gone (`saved` is what
        `save` returned before it)."""
        count = upto - self.scanned
        if count <= 0:
            return
        if saved is not None and self.scanner.feed(saved, 0, count):
            self.dirty = True
        self.scanned = upto

    def catch_up(self, upto: int) -> None:
        """Read the stored bytes from `scanned` up to number `upto` (they are leaving, or a
        replay starts there)."""
        start, ring = self.scanned, self._ring
        if upto <= start:
            return
        cap = ring.capacity
        a = ring.position(start)
        count = upto - start
        view = ring.state.memory.view
        first = min(count, cap - a)
        # Copied out: a memoryview has no `find`, which the scanner runs on (a memcpy).
        changed = self.scanner.feed(view[DATA_OFFSET + a : DATA_OFFSET + a + first].tobytes())
        if first < count:
            changed |= self.scanner.feed(view[DATA_OFFSET : DATA_OFFSET + count - first].tobytes())
        self.dirty |= changed
        self.scanned = upto

    def appending(self, data: memoryview, upto: int) -> None:
        """`data` is about to be put in, over the stored bytes before number `upto`."""
        if self._ring.capacity:
            self.catch_up(upto)
        else:
            self.unstored(bytes(data), len(data))

    def unstored(self, data: bytes | bytearray, count: int) -> None:
        """`count` bytes of `data` were read with no storage to keep them (a ring the budget
        gave nothing): read now, as nothing holds them."""
        if self.scanner.feed(data, 0, count):
            self.dirty = True
        self.scanned += count

    def lost(self, resume_at: int) -> None:
        """The bytes up to number `resume_at` are not known (never stored, or stored and not
        to be believed): go on from there, with the modes as they were."""
        if self.scanner.pending:
            self.scanner.lose()
            self.dirty = True
        self.scanned = self._clean_to = resume_at

    # --- where a replay starts -------------------------------------------------------------

    def replay_start(self, head: bytes) -> Modes:
        """The modes in force at the first byte of a replay that starts `len(head)` bytes
        into the ring's contents (`head`, the bytes cut before it). The ring's oldest byte
        is where the stream is read to, for good: no replay starts before it again."""
        oldest = self._ring.total - self._ring.size
        self.catch_up(oldest)
        if self.scanned < oldest:  # (a lost stretch that ended past the oldest byte)
            self.lost(oldest)
        if not head:
            return self.scanner.modes.copy()
        scanner = self.scanner.copy()
        scanner.feed(head)
        return scanner.modes

    # --- the record ------------------------------------------------------------------------

    def stored(self) -> ModesRecord:
        """The record's fields for these modes (and they are recorded from here)."""
        self.dirty = False
        modes, pending = self.scanner.modes.stored(), self.scanner.pending
        self._recorded = (modes, pending)
        return {"modes": modes, "modes_pending": pending, "modes_at": self.scanned}

    def to_record(self) -> bool:
        """Whether the modes (or a pending sequence) differ from those last recorded: a
        full-screen program hides its cursor and shows it again at every redraw, which
        changes nothing a record keeps. (Not `dirty` any more if they do not.)"""
        if not self.dirty:
            return False
        if (self.scanner.modes.stored(), self.scanner.pending) == self._recorded:
            self.dirty = False
            return False
        return True

    def restore(self, modes: list[int], pending: bytes, at: int) -> None:
        """Take up what a record says (its fields checked by escrowd.bounds), for an adopted
        ring. A record made before the ring's oldest byte (bytes delivered or dropped
        since) is read on from the oldest byte: what came between is not known."""
        restored = Modes.from_stored(modes)
        oldest = self._ring.total - self._ring.size
        if restored is None or not Scanner.valid_pending(pending):
            restored, pending, at = Modes(), b"", oldest  # (checked already: never)
        self.scanner = Scanner(restored, pending)
        self.scanned = self._clean_to = at
        if at < oldest:
            self.lost(oldest)
