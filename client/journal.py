"""The journal: an app records what it reads from a held session, so that after a crash the
replay holds everything the session printed, before the crash and after (docs/design.md §12).

When a journal is asked for, the holder sends with `deposited` (or `handoff`) a journal
file of the session's own: a fixed header, three counters and a ring, nothing else. It is
the app's to write while it holds custody; when custody ends the holder copies what it
holds into the session's replay (escrowd.journal) and never reads it again, so nothing the
app writes there (before or after) can reach the holder's own records. This is the one
definition of the layout both sides read (PROTOCOL.md section 10.6), native byte order:

    bytes  0..32   magic "ESCROWJL", layout version (2), a checksum (CRC-32, unused by
                   the writer), data offset (4096), data size (the ring's capacity)
    bytes 32..40   `total`: every byte ever put into the ring
    bytes 40..48   `writing`: what `total` becomes once the write in flight is in place
    bytes 48..56   `reading`: `total` + 1 while a read from the terminal is in flight whose
                   bytes are not recorded yet, else 0
    4096..         the ring: the byte numbered `t` is at `data_offset + t % capacity`

A write stores `writing`, copies the bytes, then stores `total` (each one aligned 8-byte
store). An app killed in between leaves `writing` above `total`; the holder then knows
that up to that many of the oldest bytes may have been overwritten, and drops them, rather
than replaying torn output. Writes are cut to `MAX_WRITE` bytes so that is little. An app
killed with `reading` set may have taken bytes off the terminal that never reached the
ring: the holder marks a gap there (it drops nothing: the ring was not touched). Counters
the holder cannot believe (out of bounds, or going back) are a marked gap, never a crash.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import threading

from . import protocol

MAGIC = b"ESCROWJL"
LAYOUT_VERSION = 2
FIXED = struct.Struct("=8sIIQQ")  # magic, version, crc of the rest, data offset, data size
TOTAL_OFFSET = 32  # `total`, `writing`, then `reading`: 8-byte aligned
COUNTERS = 3
DATA_OFFSET = 4096
MAX_WRITE = 8 * 1024


class JournalError(Exception):
    """The file the holder sent is not a journal file this writer understands."""


class JournalWriter:
    """Appends to one session's journal. Resource handling: owns `fd` (the journal file) and
    its mapping from construction (also when it raises) until `close()`. Thread-safe:
    `record` and `close` may be called from different threads. `read_marker`: the holder
    reads the `reading` counter (its `welcome.features` has `journal_reading`)."""

    def __init__(self, fd: int, journal: protocol.Journal, read_marker: bool = True) -> None:
        self._lock = threading.Lock()
        self.read_marker = read_marker
        self._reads = 0  # reads in flight (several threads may read): marked while any is
        self._lost = False  # a read ended by an exception after which its bytes may be gone
        self._map(fd, journal)

    def remap(self, fd: int, journal: protocol.Journal, read_marker: bool = True) -> None:
        """Go on writing in another mapping (a holder that restarted handed the journal file
        over again, or a new one), for a holder that reads the `reading` mark or not: no
        record falls between the two, nor is counted twice. Takes `fd` as the constructor
        does; raises JournalError (closed) as it does."""
        with self._lock:
            self.read_marker = read_marker
            self._unmap()
            self._map(fd, journal)

    def _map(self, fd: int, journal: protocol.Journal) -> None:
        try:
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise JournalError(f"cannot map the journal file: {exc}") from None
        self.fd = fd
        if len(self._mm) < DATA_OFFSET:
            self._unmap()
            raise JournalError("the holder sent a file too short for a journal")
        magic, version, _, data_offset, size = FIXED.unpack_from(self._mm, 0)
        if (magic != MAGIC or version != LAYOUT_VERSION or data_offset != DATA_OFFSET
                or not 0 < journal.capacity <= size or data_offset + size > len(self._mm)):
            self._unmap()
            raise JournalError("the holder sent a journal file of another layout "
                               f"(layout {version}; this writer knows {LAYOUT_VERSION})")
        view = memoryview(self._mm)
        self._data: memoryview | None = view[data_offset : data_offset + journal.capacity]
        self._counters: memoryview | None = (
            view[TOTAL_OFFSET : TOTAL_OFFSET + 8 * COUNTERS].cast("Q"))
        view.release()
        self.capacity = journal.capacity
        # Where the byte numbered `total` goes: the holder said where the byte numbered
        # `journal.total` goes; bytes recorded since (through an earlier mapping) moved it.
        # We are the only writer from here on: our count is the file's.
        self._total = int(self._counters[0])
        self._position = (journal.position + self._total - journal.total) % self.capacity
        if self._reads or self._lost:
            self._counters[2] = self._total + 1  # (a new file: the mark goes on in it)

    def record(self, data: bytes | bytearray | memoryview, read: bool = False) -> None:
        """Append `data`: the newest `capacity` bytes of everything recorded are kept.
        `read`: these are the bytes of the read marked in flight (`read` clears the mark
        once they are in place)."""
        n = len(data)
        with self._lock:
            if read:
                self._reads -= 1
            ring, counters, cap = self._data, self._counters, self.capacity
            if ring is None or counters is None:
                return  # closed: custody has ended, the holder is the writer now
            if n <= MAX_WRITE and self._position + n <= cap:
                # The common case (a pty read is at most a few KiB), kept short: it runs
                # once per read of the app.
                pos, total = self._position, self._total + n
                counters[1] = total
                ring[pos : pos + n] = data
                counters[0] = self._total = total
                self._position = (pos + n) % cap
            else:
                self._record_in_parts(memoryview(data).cast("B"), ring, counters, cap)
            if read:
                self._unmark(counters)

    def read(self, fd: int, size: int) -> bytes:
        """`os.read(fd, size)` that records what it read. OSError (EAGAIN, EIO) as os.read,
        with nothing recorded.

        The read is marked in flight (`reading`) before it starts and the mark cleared
        once its bytes are recorded, so that a crash in between leaves a gap marked where
        they are missing. Waiting for the terminal first (poll) would mark only reads that
        cannot block, but costs a pty reader a quarter more CPU (bench/run.py, the
        journal): so only for a holder that does not read the mark."""
        if not self.read_marker:
            return self._read_when_readable(fd, size)
        with self._lock:
            if self._counters is None:
                marked = False
            else:
                self._reads += 1
                self._counters[2] = self._total + 1
                marked = True
        if not marked:
            return os.read(fd, size)  # closed: custody ended; nothing is recorded
        try:
            data = os.read(fd, size)  # outside the lock: `close` must not wait for output
        except OSError:
            with self._lock:  # nothing was read
                self._reads -= 1
                if self._counters is not None:
                    self._unmark(self._counters)
            raise
        except BaseException:
            # (KeyboardInterrupt, say) maybe just after the read returned: what it read may
            # be lost, so the mark stays for good.
            with self._lock:
                self._reads -= 1
                self._lost = True
            raise
        recorded = False
        try:
            self.record(data, read=True)
            recorded = True
        finally:
            if not recorded:  # interrupted on the way: what it read may be lost
                with self._lock:
                    self._lost = True
                    if self._counters is not None:
                        self._counters[2] = self._total + 1
        return data

    def _unmark(self, counters: memoryview) -> None:
        if self._reads == 0 and not self._lost:
            counters[2] = 0

    def _read_when_readable(self, fd: int, size: int) -> bytes:
        """`read` for a holder that does not read the `reading` mark: the bytes go from
        the terminal straight into the ring once poll says the read cannot block, inside
        one write (`writing` covers them)."""
        if os.get_blocking(fd):
            # Wait for the terminal outside the lock: `close` must not wait for output.
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll()
        with self._lock:
            ring, counters, cap = self._data, self._counters, self.capacity
            if ring is None or counters is None:
                return os.read(fd, size)  # closed: custody ended; nothing is recorded
            pos, total = self._position, self._total
            room = min(size, MAX_WRITE, cap - pos)
            counters[1] = total + room  # what may land over the oldest bytes, if we die
            try:
                n = os.readv(fd, [ring[pos : pos + room]])
            except BaseException:
                counters[1] = total
                raise
            counters[0] = self._total = total + n
            counters[1] = total + n
            self._position = (pos + n) % cap
            return ring[pos : pos + n].tobytes()

    def _record_in_parts(self, view: memoryview, ring: memoryview, counters: memoryview,
                         cap: int) -> None:
        total, pos = self._total, self._position
        if len(view) > cap:  # what would be overwritten at once is only counted
            skip = len(view) - cap
            counters[1] = counters[0] = total = total + skip
            pos = (pos + skip) % cap
            view = view[skip:]
        for start in range(0, len(view), MAX_WRITE):
            chunk = view[start : start + MAX_WRITE]
            n = len(chunk)
            counters[1] = total + n
            first = min(n, cap - pos)
            ring[pos : pos + first] = chunk[:first]
            if first < n:
                ring[: n - first] = chunk[first:]
            total += n
            counters[0] = total
            pos = (pos + n) % cap
        self._total, self._position = total, pos

    def close_after_fork(self) -> None:
        """`close`, in a forked child: the lock may have been held by a thread of the
        parent, which does not exist here."""
        self._lock = threading.Lock()
        try:
            self.close()
        except BufferError:
            # A thread of the parent was inside `read` at the fork: its buffer export came
            # along and the mapping cannot be unmapped here. Forget it (it goes with this
            # process); the fd is closed all the same.
            self._data = self._counters = None
            self.__dict__.pop("_mm", None)
            if getattr(self, "fd", -1) >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)

    def close(self) -> None:
        """Stop writing and unmap (idempotent)."""
        with self._lock:
            self._unmap()

    def _unmap(self) -> None:
        unmap(self, ("_data", "_counters"))
        self._data = self._counters = None


def unmap(owner: object, views: tuple[str, ...]) -> None:
    """Release `owner`'s memoryviews named `views`, then its mapping (`_mm`), then close its
    `fd` (idempotent): what every holder of a mapped file here does to let go of it."""
    for name in views:
        held = owner.__dict__.pop(name, None)
        if held is not None:
            held.release()
    mm = owner.__dict__.pop("_mm", None)
    if mm is not None:
        mm.close()
    if getattr(owner, "fd", -1) >= 0:
        fd, owner.fd = owner.fd, -1  # type: ignore[attr-defined]
        os.close(fd)
