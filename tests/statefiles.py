"""A holder's state files, reached as another process of the same user reaches them: through
/proc/<pid>/fd (a memfd has no other name). What the tests of untrusted stored state write
with: a record forged with a correct CRC, bytes scribbled anywhere, the hot counter set.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from escrowd.statefile import Record, StateFile, newest_record


def state_files(pid: int) -> dict[str, str]:
    """The session state files process `pid` has open, one path each (its mmap holds a
    second fd on each), by the token their newest record names."""
    found: dict[str, str] = {}
    seen: set[tuple[int, int]] = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            if "escrowd:session" not in os.readlink(path):
                continue
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            record = newest_record(fd)
        finally:
            os.close(fd)
        if record is not None:
            found[record.token] = path
    return found


@contextmanager
def opened(path: str) -> Iterator[StateFile[Record]]:
    state = StateFile(os.open(path, os.O_RDWR | os.O_CLOEXEC), Record)
    try:
        yield state
    finally:
        state.close()


def record_of(path: str) -> Record:
    with opened(path) as state:
        record = state.record()
    assert record is not None
    return record


def forge(path: str, **fields: Any) -> None:
    """Write a record with a correct CRC, the newest one with `fields` changed (a field
    may be given any value at all: the holder decodes what it finds by type)."""
    with opened(path) as state:
        record = state.record()
        assert record is not None
        state.write(msgspec.structs.replace(record, **fields))  # (replace checks nothing)


def scribble(path: str, offset: int, data: bytes) -> None:
    """Bytes written at `offset`, header, slots or ring."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def set_total(path: str, total: int) -> None:
    with opened(path) as state:
        state.set_total(total)
