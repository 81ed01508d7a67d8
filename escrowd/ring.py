"""The replay ring: a bounded circular buffer in a session's state file, that a PTY master is
read into directly.

Bytes go from the kernel into the shared mapping with `os.readv`; when the ring is full the
oldest bytes are overwritten. Storage grows on demand, doubling up to the per-session limit,
and every byte of it is granted by a holder-wide `RingBudget`, so total replay memory is
bounded however many sessions there are. A ring that can get no storage at all still reads:
its bytes are counted as dropped, because a child must never block on a full terminal.

Where the bytes are is a function of one hot counter, the state file's `total` (every byte
ever read), and the layout in its record (`capacity`, `origin`, `total_at_layout`,
`length_at_layout`): the ring holds the newest `held = min(length, capacity)` bytes, where
`length = length_at_layout + total - total_at_layout`, ending just before position
`(origin + length) % capacity`. A read writes its bytes first and moves `total` after, in
one store; growing copies before it publishes the new layout. So after a SIGKILL at any
instruction, the file still describes bytes that are really there (see `adopt`).

A read can overwrite held bytes only once the ring can grow no more (at its limit, or out
of budget): the layout says so (`saturated`) before the first such read, so that a holder
adopting the file after a kill drops the oldest bytes only when they may really have been
overwritten, never those of a ring that still had room.

Every write tells the ring's `modes` (escrowd.ring_modes) which stored bytes it is about to
write over, so that the terminal modes in force at the oldest byte are known when a replay
is cut from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypedDict

from .ring_budget import Budget, OwnerShare, RingBudget
from .ring_modes import RingModes
from .statefile import MAX_READ, Record, StateFile

__all__ = ["MIN_CAPACITY", "Budget", "HeldBytes", "Layout", "OwnerShare", "Ring", "RingBudget"]

MIN_CAPACITY = 16 * 1024
_SCRATCH = bytearray(64 * 1024)  # where bytes go that no ring has room for


class Layout(TypedDict):
    """Where a ring's bytes are (the fields of its state record that say so)."""

    capacity: int
    origin: int
    total_at_layout: int
    length_at_layout: int
    saturated: bool
    consumed: int
    dropped_base: int


class HeldBytes:
    """Where a ring's bytes are and what it holds, as its layout and hot counter say: the
    reading side of `Ring`, which is the rest."""

    __slots__ = ("_budget", "_data", "capacity", "origin", "total_at_layout",
                 "length_at_layout", "_total", "_length", "saturated", "consumed",
                 "dropped_base")
    _budget: Budget
    _data: memoryview
    capacity: int
    origin: int
    total_at_layout: int
    length_at_layout: int
    _total: int
    _length: int  # length_at_layout + total - total_at_layout
    saturated: bool
    consumed: int
    dropped_base: int

    # --- what is held --------------------------------------------------------------------

    @property
    def budget(self) -> Budget:
        return self._budget

    @property
    def total(self) -> int:
        """Every byte ever read into this ring (held or dropped)."""
        return self._total

    @property
    def size(self) -> int:
        return min(self._length, self.capacity)

    @property
    def dropped(self) -> int:
        """Bytes lost to a full ring, ever."""
        return self._total - self.size - self.consumed

    @property
    def dropped_since_delivery(self) -> int:
        """Bytes lost since the replay was last delivered: what the next replay misses
        at its start."""
        return self.dropped - self.dropped_base

    def contents(self) -> bytes:
        """Every byte held, oldest first."""
        cap, held = self.capacity, self.size
        if held == 0:
            return b""
        end = (self.origin + self._length) % cap
        start = (end - held) % cap
        if start + held <= cap:
            return self._data[start : start + held].tobytes()
        return b"".join((self._data[start:cap], self._data[: end]))

    def layout(self) -> Layout:
        """The fields of a state record that say where the bytes are."""
        return {"capacity": self.capacity, "origin": self.origin,
                "total_at_layout": self.total_at_layout,
                "length_at_layout": self.length_at_layout, "saturated": self.saturated,
                "consumed": self.consumed, "dropped_base": self.dropped_base}

    def position(self, total: int) -> int:
        """Where in `data` the byte numbered `total` goes (0 for a ring with no storage)."""
        if self.capacity == 0:
            return 0
        return (self.origin + self.length_at_layout + total - self.total_at_layout) % self.capacity


class Ring(HeldBytes):
    """A session's replay, in `state.data`. Resource handling: owns `state` (closed by
    `release`). `on_layout` is called after the layout changed (the session persists its
    record then)."""

    __slots__ = ("limit", "_released", "state", "on_layout", "modes")

    def __init__(
        self, limit: int, budget: Budget, state: StateFile[Record] | None = None
    ) -> None:
        self.limit = limit
        self._budget = budget
        budget.rings += 1
        self._released = False
        self.state = state if state is not None else StateFile.create(Record, limit, "ring")
        self._data = self.state.data
        self.capacity = self.origin = self.total_at_layout = self.length_at_layout = 0
        self._total = self.state.total
        self._length = 0  # length_at_layout + total - total_at_layout
        # A read may overwrite held bytes (the ring could not grow enough for it): in the
        # layout before such a read is made.
        self.saturated = False
        # Counted in `total` but neither held nor dropped: delivered by a retrieve into
        # custody (`consume`).
        self.consumed = 0
        self.dropped_base = 0  # `dropped` when the replay was last delivered (`consume`)
        self.on_layout: Callable[[], None] | None = None
        self.modes = RingModes(self)  # the modes at the oldest byte, for a replay's start

    # --- what is delivered, and what an app journaled (escrowd.journal) ------------------

    def consume(self) -> None:
        """Everything held was delivered (a retrieve into custody without a journal): the
        replay starts empty from here, and those bytes are not counted as dropped."""
        self.consumed += self.size
        self._relayout(self.position(self._total), self._total, 0)
        self.dropped_base = self.dropped  # (held is 0 now: what was lost before delivery)

    def append(self, data: memoryview) -> None:
        """Put `data` in as if it had been read from the terminal (a full ring drops its
        oldest bytes), at most MAX_READ bytes at a time and never more than the ring holds
        (a larger chunk would wrap over its own new bytes), each counted once in place."""
        start, end = 0, len(data)
        while start < end:
            n = min(MAX_READ, end - start)
            write_at = self._make_room(n, overwrite=True)
            cap = self.capacity  # (as grown for this chunk)
            if 0 < cap < n:
                n = cap
            chunk = data[start : start + n]
            start += n
            self.modes.appending(chunk, self._total + n - cap)  # the bytes these write over
            if cap:
                first = min(n, cap - write_at)
                self._data[write_at : write_at + first] = chunk[:first]
                if first < n:
                    self._data[: n - first] = chunk[first:]
            self._advance(n)

    def skip(self, count: int) -> None:
        """`count` bytes that are lost (counted, and dropped), after which the ring starts
        empty: what it held before cannot run on into what comes after them."""
        if count > 0:
            self.modes.catch_up(self._total)  # (the new layout maps none of the stored bytes)
            self.restart(self._total + count)

    def restart(self, total: int) -> None:
        """Empty, counting from `total` on: what was held is dropped (a holder that adopts
        a ring whose journal copy a kill cut short cannot tell which of its bytes are
        whole)."""
        self._total = total
        self.state.set_total(total)
        self._relayout(0, total, 0)
        self.modes.lost(total)

    def _relayout(self, origin: int, total: int, length: int) -> None:
        cap = self.capacity
        self.origin = origin % cap if cap else 0
        self.total_at_layout, self.length_at_layout = total, length
        self._length = length
        if self.on_layout is not None:
            self.on_layout()

    # --- reading in ------------------------------------------------------------------------

    def read_from(self, fd: int, at_most: int, overwrite: bool) -> int:
        """One `readv` of up to `at_most` bytes from `fd` into the ring.

        With `overwrite` (draining), a full ring drops its oldest bytes to make room. Without
        it (the sweep before a handoff), only free space is filled, and 0 is returned without
        reading when there is none. Returns what `readv` returned; 0 from a read means end of
        file. OSError from the read (EAGAIN, EIO) propagates with nothing changed.
        """
        if at_most > MAX_READ:
            at_most = MAX_READ
        write_at = self._make_room(at_most, overwrite)
        cap = self.capacity
        if cap == 0:
            if not overwrite:
                return 0
            n = os.readv(fd, [memoryview(_SCRATCH)[: min(at_most, len(_SCRATCH))]])
            self.modes.unstored(_SCRATCH, n)
            self._advance(n)
            return n
        if overwrite:
            room = cap
        else:
            room = cap - self.size
            if room == 0:
                return 0
        count = at_most if at_most < room else room
        end = write_at + count
        data = self._data
        total = self._total
        modes = self.modes
        # Only a read that may write over bytes the modes were not read from yet (a ring
        # that wraps) pays for them: this runs at every read of a fast child.
        at_risk = total + count - cap > modes.scanned
        saved = modes.save(total + count - cap) if at_risk else None
        if end <= cap:
            n = os.readv(fd, [data[write_at:end]])
        else:
            n = os.readv(fd, [data[write_at:cap], data[: end - cap]])
        if at_risk:
            modes.overwritten(saved, total + n - cap)
        # The bytes are in place: now, and only now, the counter moves (see `_advance`).
        self._length += n
        self._total = total = total + n
        self.state.set_total(total)
        return n

    def _make_room(self, at_most: int, overwrite: bool) -> int:
        """Grow so that `at_most` more bytes fit, as far as the limit and the budget allow
        (bytes are dropped only by a ring that can grow no more); if they may overwrite
        held bytes, say so in the layout first. Returns where the next byte goes.
        (This runs once per read of a fast child: the common path is kept short.)"""
        length = self._length
        cap = self.capacity
        held = length if length < cap else cap
        if held + at_most > cap:
            if cap < self.limit:
                while self.capacity < held + at_most and self._grow():
                    pass
                cap, length = self.capacity, self._length
            if overwrite and cap and not self.saturated and held + at_most > cap:
                # This read may overwrite the oldest bytes: the file says so first.
                self.saturated = True
                if self.on_layout is not None:
                    self.on_layout()
        return (self.origin + length) % cap if cap else 0

    def _advance(self, n: int) -> None:
        # The bytes are in place: now, and only now, the counter moves (one 8-byte store).
        self._length += n
        self._total += n
        self.state.set_total(self._total)

    def _grow(self) -> bool:
        """Take more storage from the budget and re-lay the ring out in it. Bytes are
        copied only into space the old layout does not use, and the new layout is
        published after: a kill in between leaves the old layout, whole."""
        cap = self.capacity
        if cap >= self.limit:
            return False
        wanted = min(self.limit, max(MIN_CAPACITY, cap * 2))
        extra = self._budget.grant(wanted - cap, cap)
        if extra == 0:
            return False
        self.modes.catch_up(self._total - self.size)  # the new layout keeps the held bytes
        new_cap = cap + extra
        held = self.size
        end = (self.origin + self._length) % cap if cap else 0
        start = (end - held) % cap if cap else 0
        if held and start + held > cap:
            # Wrapped: its newest part, at [0, end), moves up behind the oldest part.
            if cap + end > new_cap:
                self._budget.give_back(extra)  # not enough room to unwrap: stay as we are
                return False
            self._data[cap : cap + end] = self._data[:end]
        self.capacity, self.origin = new_cap, start
        self.total_at_layout, self.length_at_layout = self._total, held
        self._length = held
        self.saturated = False  # read_from says so again if this was not room enough
        if self.on_layout is not None:
            self.on_layout()
        return True

    # --- adoption --------------------------------------------------------------------------

    def adopt(self, capacity: int, origin: int, total_at_layout: int, length_at_layout: int,
              unclean: bool, saturated: bool = True, consumed: int = 0,
              dropped_base: int = 0) -> int:
        """Take over the layout a state file recorded (a holder starting with stored
        state). After an unclean stop a read may have been in flight: if the layout was
        `saturated` (the ring could grow no more), its bytes may have overwritten the oldest
        ones before the counter moved, so those are dropped. Returns how many bytes that
        dropped."""
        self._budget.take(capacity)
        self.consumed, self.dropped_base = consumed, dropped_base
        self.capacity, self.origin = capacity, origin
        self.total_at_layout, self.length_at_layout = total_at_layout, length_at_layout
        self._total = self.state.total
        self._length = length_at_layout + self._total - total_at_layout
        if not unclean or not saturated or capacity == 0:
            return 0
        held = self.size
        # Only a read that did not fit the free space can have overwritten held bytes.
        suspect = min(held, max(0, held + MAX_READ - capacity))
        if suspect == 0:
            return 0
        end = (origin + self._length) % capacity
        self.origin = (end - (held - suspect)) % capacity
        self.total_at_layout, self.length_at_layout = self._total, held - suspect
        self._length = held - suspect
        return suspect

    def release(self) -> None:
        """Give the storage back to the budget and close the state file (idempotent)."""
        if self._released:
            return
        self._released = True
        self._budget.give_back(self.capacity)
        self._budget.rings -= 1
        self.capacity = self._length = 0
        self._data = memoryview(b"")
        self.state.close()
