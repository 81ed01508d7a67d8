"""The replay ring: a bounded circular buffer that a PTY master is read into directly.

Bytes go from the kernel into the ring's own storage with `os.readv` (no intermediate
`bytes` objects); when the ring is full the oldest bytes are overwritten and counted in
`dropped`. Storage grows on demand, doubling up to the per-session limit, and every byte of
it is granted by a holder-wide `RingBudget`, so total replay memory is bounded however many
sessions there are. A ring that can get no storage at all still reads: its bytes are
counted as dropped, because a child must never block on a full terminal.
"""

from __future__ import annotations

import os

MIN_CAPACITY = 16 * 1024
_SCRATCH = bytearray(64 * 1024)  # where bytes go that no ring has room for


class RingBudget:
    """The holder-wide cap on ring storage, shared by every session.

    No ring grows past its fair share (the total over the rings alive), so that when many
    sessions flood at once the first ones to ask do not take everything and leave the
    rest with no replay at all. Storage already granted is kept.
    """

    def __init__(self, total_bytes: int) -> None:
        self.total = total_bytes
        self.used = 0
        self.rings = 0

    def grant(self, wanted: int, current: int = 0) -> int:
        fair = self.total // max(1, self.rings)
        granted = max(0, min(wanted, self.total - self.used, fair - current))
        self.used += granted
        return granted

    def give_back(self, amount: int) -> None:
        self.used -= amount


class Ring:
    def __init__(self, limit: int, budget: RingBudget) -> None:
        self.limit = limit
        self._budget = budget
        budget.rings += 1
        self._released = False
        self._buf = bytearray()
        self._view = memoryview(self._buf)  # kept, so a read slices it without a new view
        self._start = 0
        self._size = 0
        self.dropped = 0

    @property
    def size(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def contents(self) -> bytes:
        """Every byte held, oldest first."""
        end = self._start + self._size
        view = self._view
        if end <= len(view):
            return view[self._start : end].tobytes()
        return b"".join((view[self._start :], view[: end - len(view)]))

    def release(self) -> None:
        """Give the storage back to the budget; the ring is empty afterwards."""
        self._budget.give_back(len(self._buf))
        if not self._released:
            self._released = True
            self._budget.rings -= 1
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = self._size = 0

    def read_from(self, fd: int, at_most: int, overwrite: bool) -> int:
        """One `readv` of up to `at_most` bytes from `fd` into the ring.

        With `overwrite` (draining), a full ring drops its oldest bytes to make room. Without
        it (the sweep before a handoff), only free space is filled, and 0 is returned without
        reading when there is none. Returns what `readv` returned; 0 from a read means end of
        file. OSError from the read (EAGAIN, EIO) propagates with nothing changed.
        """
        # Grow first: bytes are dropped only by a ring at its limit (or out of budget).
        # (This runs once per read of a fast child: the common path is kept short.)
        size = self._size
        cap = len(self._buf)
        if size + at_most > cap and cap < self.limit:
            while len(self._buf) < size + at_most and self._grow():
                pass
            cap = len(self._buf)
        if cap == 0:
            if not overwrite:
                return 0
            n = os.readv(fd, [memoryview(_SCRATCH)[: min(at_most, len(_SCRATCH))]])
            self.dropped += n
            return n
        if overwrite:
            room = cap
        else:
            room = cap - size
            if room == 0:
                return 0
        length = at_most if at_most < room else room
        write_at = self._start + size
        if write_at >= cap:
            write_at -= cap
        end = write_at + length
        view = self._view
        if end <= cap:
            n = os.readv(fd, [view[write_at:end]])
        else:
            n = os.readv(fd, [view[write_at:], view[: end - cap]])
        size += n
        if size > cap:  # overwrote the oldest bytes
            overflow = size - cap
            self.dropped += overflow
            self._start = (self._start + overflow) % cap
            size = cap
        self._size = size
        return n

    def _grow(self) -> bool:
        cap = len(self._buf)
        if cap >= self.limit:
            return False
        extra = self._budget.grant(min(self.limit, max(MIN_CAPACITY, cap * 2)) - cap, cap)
        if extra == 0:
            return False
        grown = bytearray(cap + extra)
        grown[: self._size] = self.contents()
        self._buf, self._view, self._start = grown, memoryview(grown), 0
        return True
