"""The state file (escrowd.statefile), in-process, on real memfds: what a holder adopting a
session after a SIGKILL may believe of it, and what it must refuse.

A SIGKILL cannot be aimed at one store of a record write, so what a killed writer leaves is
made here by hand in the file's bytes (the layout is the module docstring's: a 64-byte fixed
header, then record slots, each a sequence number, a payload length and a CRC-32 before the
payload), and the file is opened again as an adopting holder opens it: a second StateFile
on a copy of its fd.

Behaviours pinned:
- a record torn mid-write (the first half of a new record in an old slot, under the new
  sequence number) is not believed: the record before it stands, not a mix of the two, which
  would give a restarted holder a session with one record's name and another's ring layout;
- each record goes to a slot other than the newest valid one, so a newest record damaged
  later (a flipped byte) still leaves the one before it readable, never none at all (the
  session would be refused and its terminal lost);
- the fixed header's checksum covers the data size: a header damaged where nothing else
  looks is refused, not mapped with a ring of the wrong size.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from escrow_client.journal import FIXED
from escrowd.statefile import _SLOT_HEAD, _SLOTS, CorruptState, Record, StateFile

OWNER = "com.example.term"
TOKEN = uuid.uuid4().hex
DATA_SIZE = 64 * 1024


def record(n: int) -> Record:
    """The nth record a holder wrote for one session. Every one encodes to the same length
    and shape: only `label` (near the start) and `instance` (near the end) differ."""
    return Record(token=TOKEN, owner=OWNER, id="tab", label=f"label {n}", state="draining",
                  capacity=16 * 1024, instance=f"{n}" * 32)


@pytest.fixture
def state() -> Iterator[StateFile[Record]]:
    file = StateFile.create(Record, DATA_SIZE, "test")
    yield file
    file.close()


def open_again(file: StateFile[Record]) -> Record | None:
    """What a holder adopting the file reads in it."""
    again = StateFile(os.dup(file.fd), Record)
    try:
        return again.record()
    finally:
        again.close()


def slot_seqs(file: StateFile[Record]) -> list[int]:
    """The sequence number in each slot's head (0: never written)."""
    return [_SLOT_HEAD.unpack(os.pread(file.fd, _SLOT_HEAD.size, offset))[0]
            for offset, _ in _SLOTS]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_record_torn_mid_write_is_not_believed(state: StateFile[Record]) -> None:
    state.write(record(1))
    state.write(record(2))
    seqs = slot_seqs(state)
    assert 1 in seqs, "the second record was written over the first"
    offset, size = _SLOTS[seqs.index(1)]  # where the third record must go
    old = os.pread(state.fd, size, offset)
    state.write(record(3))
    assert slot_seqs(state)[_SLOTS.index((offset, size))] == 3, "not written over the first"
    new = os.pread(state.fd, size, offset)
    # Killed half-way through the payload: the new head, the new payload's first half, and
    # after it what the first record left there.
    _, length, _ = _SLOT_HEAD.unpack_from(new)
    cut = _SLOT_HEAD.size + length // 2
    os.pwrite(state.fd, old[cut:], offset + cut)
    torn = new[_SLOT_HEAD.size:cut] + old[cut:_SLOT_HEAD.size + length]
    # The torn bytes are a well-formed record of their own (the third's label, the first's
    # instance): only the checksum can tell that it was never written whole.
    mixed = msgspec.msgpack.decode(torn, type=Record)
    assert mixed not in (record(1), record(2), record(3))

    assert open_again(state) == record(2), "a torn record was believed"


def test_a_record_never_overwrites_the_newest_valid_one(state: StateFile[Record]) -> None:
    for n in (1, 2, 3):
        state.write(record(n))
    seqs = slot_seqs(state)
    offset, _ = _SLOTS[seqs.index(max(seqs))]
    # One flipped byte in the newest record's payload: it fails its checksum.
    at = offset + _SLOT_HEAD.size + 10
    byte = os.pread(state.fd, 1, at)[0]
    os.pwrite(state.fd, bytes([byte ^ 0x01]), at)

    assert open_again(state) == record(2), "the record before the newest was not kept"


def test_the_header_checksum_covers_the_data_size(state: StateFile[Record]) -> None:
    state.write(record(1))
    magic, version, crc, data_offset, size = FIXED.unpack(os.pread(state.fd, FIXED.size, 0))
    assert size == DATA_SIZE
    # A smaller data area still fits the file: nothing but the checksum can catch it.
    os.pwrite(state.fd, FIXED.pack(magic, version, crc, data_offset, size // 2), 0)
    before = open_fds()
    try:
        opened = StateFile(os.dup(state.fd), Record)
    except CorruptState as exc:
        refusal = str(exc)
    else:
        opened.close()
        pytest.fail(f"a header whose data size was changed was accepted ({opened.size} bytes)")
    assert "checksum" in refusal, refusal
    assert open_fds() == before, "the refused file's fd was left open"
