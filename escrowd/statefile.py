"""A session's state outside the holder process (docs/design.md §11): one shared-memory file with
its replay ring and its metadata, which outlives the holder in the service manager's fd
store (or the keeper's) next to the PTY master. It is the holder's alone: no app is ever
sent it (an app that journals writes a file of its own, escrow_client.journal).

The file (native byte order and sizes: it never leaves the machine):

    page 0   fixed header (64 bytes): magic, layout version, data offset and size, a
             checksum of those, and `total`, the one hot counter: every byte ever read
             into the ring; then record slots 0 and 1 (1,984 bytes each)
    then     record slots 2 and 3 (BIG_SLOT bytes each), for records too big for page 0
    then     the ring's bytes (`data`), `size` of them

Nothing here can be torn by a SIGKILL at any instruction:
- `total` is one aligned 8-byte store, made only after the bytes it counts are in place.
- A record (metadata and the ring's layout) is written into a slot other than the newest
  valid one, with a sequence number and a CRC-32 over it; a reader takes the valid slot
  with the highest sequence number. A record cut short by a kill fails its checksum, and
  the one before it still stands.

The file is created sparse (sized to the ring's limit, backed only where written), so
resident memory follows the replay actually held. On Linux it is a sealed memfd (nobody
can grow or shrink it under a mapping); on macOS an unlinked file in the holder's private
socket directory. It is mapped without a second fd (escrowd.shm).
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import zlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import msgspec

from escrow_client.journal import FIXED as _FIXED
from escrow_client.journal import MAX_WRITE, TOTAL_OFFSET
from escrow_client.protocol import ProgramEnd

from .shm import Mapping, new_file

MAGIC = b"ESCROWSF"
LAYOUT_VERSION = 1

PAGE = 4096
SMALL_SLOT = (PAGE - 64) // 2
BIG_SLOT = 256 * 1024  # a record with 32 meta entries of 1,024 4-byte characters fits
_SLOTS = ((64, SMALL_SLOT), (64 + SMALL_SLOT, SMALL_SLOT),
          (PAGE, BIG_SLOT), (PAGE + BIG_SLOT, BIG_SLOT))
DATA_OFFSET = PAGE + 2 * BIG_SLOT
_SLOT_HEAD = struct.Struct("=QII")  # sequence number, payload length, CRC-32
_SMALL_PAYLOAD = SMALL_SLOT - _SLOT_HEAD.size
# The most one read into the ring may write (a pty read returns at most about 4 KiB):
# after an unclean stop, at most this much of a full ring can have been overwritten
# uncounted. (An app's journal writes are cut to the same size, for the same reason.)
MAX_READ = MAX_WRITE


R = TypeVar("R", "Record", "HolderRecord")


class CorruptState(Exception):
    """A file that is not a state file of this layout, or has no valid record."""


class Record(msgspec.Struct, kw_only=True):
    """What a state file says about its session. New fields get defaults (old files still
    decode); the ring's layout (`capacity`, `origin`, `total_at_layout`, `length_at_layout`,
    `saturated`) maps the hot `total` to where the bytes are (see escrowd.ring)."""

    token: str
    owner: str
    id: str
    label: str = ""
    child_pid: int | None = None
    child_start_time: float | None = None
    cols: int = 0
    rows: int = 0
    meta: dict[str, str] = {}
    state: str = "held"
    deposited_at: float = 0.0
    state_since: float = 0.0
    custodian_pid: int | None = None
    custodian_start_time: float | None = None
    handoff_id: str | None = None
    handoff_peer_pid: int | None = None  # while handing_off: the client that may hold the fd
    saved_flags: int | None = None  # the app's file status flags, restored at handoff
    capacity: int = 0
    origin: int = 0
    total_at_layout: int = 0
    length_at_layout: int = 0
    saturated: bool = False  # the ring could grow no more: a read may overwrite its oldest
    consumed: int = 0  # bytes counted in `total` that a retrieve into custody delivered
    dropped_base: int = 0  # bytes dropped before that delivery
    journal_from: int | None = None  # the app journals from this total on (escrowd.journal)
    journal_capacity: int = 0  # the size of its journal file's ring (0: no journal file)
    journal_copying: bool = False  # its journal is being copied into the ring (custody ended)
    journal_ranges: list[tuple[int, int]] = []  # [from, to) totals an app recorded
    gap_totals: list[int] = []  # byte numbers after which one read may be missing
    record_lost: bool = False  # adopted without a record it could believe (escrowd.adoption)
    started: bool = False  # the holder started the program (escrowd.programs)
    exit_status: ProgramEnd = None  # and it ended so (None: it runs, or was not started)
    # The terminal modes in force at byte number `modes_at`, and a sequence cut there
    # (escrowd.modes, escrowd.ring_modes): what a replay starting there sets first.
    modes: list[int] = []
    modes_pending: bytes = b""
    modes_at: int = 0
    instance: str = ""  # the holder that wrote it
    clean: bool = False  # True only once a holder stopped cleanly after writing it


class HolderRecord(msgspec.Struct, kw_only=True):
    """The holder's own state file (no ring): how often holders restarted on this store
    (None: unknown, since a holder found sessions stored but no count it could believe)."""

    instance: str
    started_at: float
    restarts: int | None = 0
    unclean_restarts: int | None = 0
    clean: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type[msgspec.Struct], msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(kind) for kind in (Record, HolderRecord)
}


class StateFile(Generic[R]):
    """One state file, mapped, whose records are `kind`s. Resource handling: owns `fd` and
    the mapping; `close()` releases both (the file lives on while another process, such as
    the fd store, holds a copy of the fd)."""

    __slots__ = ("fd", "size", "data", "_memory", "_view", "_decoder", "_total", "_slot_seq",
                 "_newest_slot", "_seq")

    def __init__(self, fd: int, kind: type[R]) -> None:
        """Map an existing state file and check its fixed header (CorruptState if it is
        not one). The caller gives up `fd` to this object, also on error."""
        try:
            length = os.fstat(fd).st_size
            if length < DATA_OFFSET:
                raise CorruptState(f"{length} bytes is too short for a state file")
            self._memory: Mapping | None = Mapping(fd, length)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise CorruptState(f"cannot map the state file: {exc}") from None
        self.fd = fd
        self._decoder: msgspec.msgpack.Decoder[R] = _decoders[kind]
        self._view = view = self._memory.view
        self.data = self._total = view[:0]  # (until the header is checked)
        try:
            magic, version, crc, data_offset, size = _FIXED.unpack_from(view, 0)
            if magic != MAGIC:
                raise CorruptState("not a state file (bad magic)")
            if version != LAYOUT_VERSION:
                raise CorruptState(f"state file layout {version}, not {LAYOUT_VERSION}")
            if crc != _fixed_crc(view[:TOTAL_OFFSET].tobytes()):
                raise CorruptState("the state file's header fails its checksum")
            if data_offset != DATA_OFFSET or data_offset + size > length:
                raise CorruptState("the state file's data area does not fit the file")
        except BaseException:
            self.close()
            raise
        self.size = int(size)
        self.data = view[DATA_OFFSET : DATA_OFFSET + self.size]
        self._total = view[TOTAL_OFFSET : TOTAL_OFFSET + 8].cast("Q")
        self._slot_seq = [-1] * len(_SLOTS)  # each slot's sequence number (-1: none valid)
        self._newest_slot: int | None = None
        self._seq = self._scan()

    @classmethod
    def create(cls, kind: type[R], size: int, name: str,
               private_dir: str | None = None) -> StateFile[R]:
        """A new, empty state file with a data area of `size` bytes (sparse)."""
        fd = new_file(name, private_dir)
        try:
            os.ftruncate(fd, DATA_OFFSET + size)
            if sys.platform == "linux":
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            header = bytearray(_FIXED.size)
            _FIXED.pack_into(header, 0, MAGIC, LAYOUT_VERSION, 0, DATA_OFFSET, size)
            os.pwrite(fd, header, 0)
            header += bytes(TOTAL_OFFSET - len(header))
            os.pwrite(fd, struct.pack("=I", _fixed_crc(bytes(header))), 12)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, kind)

    @property
    def memory(self) -> Mapping:
        """The whole file, mapped: `data` is at DATA_OFFSET in it (and `find` is a memchr,
        which a memoryview has not: escrowd.ring_modes)."""
        assert self._memory is not None, "the state file is closed"
        return self._memory

    # --- the hot counter -------------------------------------------------------------------

    @property
    def total(self) -> int:
        return int(self._total[0])

    def set_total(self, total: int) -> None:
        """One aligned 8-byte store: a kill leaves the old value or the new, never half."""
        self._total[0] = total

    # --- records -----------------------------------------------------------------------------

    def record(self) -> R | None:
        """The newest valid record, or None if none was ever written. Read from its slot
        each time (rarely: a holder that adopts the file, or checks itself): a holder keeps
        thousands of state files, and a copy of each record in memory was half a KB."""
        if self._newest_slot is None:
            return None
        found = _read_slot(self.fd, self._newest_slot, self._decoder)
        return found[1] if found is not None else None

    def write(self, record: R) -> None:
        """Write `record` into a slot that does not hold the newest valid one, then it is
        the newest. A kill at any point leaves either record readable."""
        payload = _encoder.encode(record)
        newest = self._newest_slot
        if newest in (0, 1) and len(payload) <= _SMALL_PAYLOAD:
            target = 1 - newest  # the usual case, said short: it runs at every change
        else:
            fits = [i for i, (_, size) in enumerate(_SLOTS)
                    if i != newest and _SLOT_HEAD.size + len(payload) <= size]
            if not fits:
                raise ValueError(f"a record of {len(payload)} bytes does not fit a slot")
            # Prefer page 0 (already resident), and the slot written longest ago.
            target = min(fits, key=lambda i: (i >= 2, self._slot_seq[i]))
        seq = self._seq + 1
        offset, _ = _SLOTS[target]
        head_at, body_at = offset, offset + _SLOT_HEAD.size
        self._view[body_at : body_at + len(payload)] = payload
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("=QI", seq, len(payload))))
        _SLOT_HEAD.pack_into(self._view, head_at, seq, len(payload), crc)
        self._seq, self._newest_slot = seq, target
        self._slot_seq[target] = seq

    def _scan(self) -> int:
        """The newest valid record's sequence number (0: none), its slot in `_newest_slot`;
        fills `_slot_seq` with the sequence number of every valid slot."""
        best = 0
        for i, seq, _ in _valid_slots(self.fd, self._decoder):
            self._slot_seq[i] = seq
            if seq > best:
                best = seq
                self._newest_slot = i
        return best

    def close(self) -> None:
        """Unmap and close (idempotent). Views handed out (`data`) must not be used after."""
        for view in (self.data, self._total):
            try:
                view.release()
            except BufferError:  # in use right now: the mapping is not unmapped under it
                pass
        memory, self._memory = self._memory, None
        if memory is not None:
            memory.close()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def newest_record(fd: int) -> Record | None:
    """The newest whole record in the slots of `fd`, read without mapping it and whatever
    its fixed header says (a header an app or a bug overwrote leaves the records readable):
    for a name to give a session whose file cannot be believed. None if there is none."""
    best: tuple[int, Record | None] = (0, None)
    for _, seq, record in _valid_slots(fd, _decoders[Record]):
        if seq > best[0]:
            best = (seq, record)
    return best[1]


def _valid_slots(fd: int, decoder: msgspec.msgpack.Decoder[R]) -> Iterator[tuple[int, int, R]]:
    """(slot, sequence number, record) of every slot of `fd` holding a whole record."""
    for i in range(len(_SLOTS)):
        try:
            found = _read_slot(fd, i, decoder)
        except OSError:
            return
        if found is not None:
            yield i, found[0], found[1]


def _read_slot(fd: int, i: int, decoder: msgspec.msgpack.Decoder[R]) -> tuple[int, R] | None:
    """(sequence number, record) of slot `i` of `fd`, if it holds a whole record."""
    offset, size = _SLOTS[i]
    # Read with pread, not through the mapping: a slot never written is a hole, and
    # touching it through a shared mapping would allocate a page of memory (two per
    # session, for the big slots) just to read zeros.
    head = os.pread(fd, _SLOT_HEAD.size, offset)
    if len(head) < _SLOT_HEAD.size:
        return None
    seq, length, crc = _SLOT_HEAD.unpack(head)
    if seq == 0 or length > size - _SLOT_HEAD.size:
        return None
    payload = os.pread(fd, length, offset + _SLOT_HEAD.size)
    if zlib.crc32(payload, zlib.crc32(struct.pack("=QI", seq, length))) != crc:
        return None  # torn, or never finished
    try:
        return seq, decoder.decode(payload)
    except msgspec.DecodeError:
        return None


def _fixed_crc(head: bytes) -> int:
    """CRC-32 of the fixed header's static fields (`head` is its first TOTAL_OFFSET bytes:
    everything but the CRC itself and the hot counter)."""
    return zlib.crc32(head[16:TOTAL_OFFSET], zlib.crc32(head[:12]))
