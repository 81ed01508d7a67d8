"""A session's state file costs resident memory for what is written in it, and nothing for
the slots and ring space never used (DESIGN §11: "sized to the ring limit but backed only
where written").

Incident pinned: opening a state file read its four record slots through the shared
mapping; the two big slots (pages 1 and 65, never written for an ordinary record) are holes,
and a read fault on a hole of a memfd allocates a page: 8 KiB more per session, 12 KiB of
resident memory where 4 KiB (the header page) is written. With 1,000 sessions holding 64 KiB
of replay each, `rss_growth_per_replay` went from 1.17 to 1.29 for it.
"""

from __future__ import annotations

import os
import sys

import pytest

from escrowd.statefile import PAGE, Record, StateFile

FILES = 200


def rss_shmem() -> int:
    """Resident shared memory of this process (memfd pages mapped here), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


@pytest.mark.skipif(sys.platform != "linux", reason="memfd and /proc are Linux's")
def test_a_state_file_is_resident_only_where_written() -> None:
    before = rss_shmem()
    files = [StateFile.create(Record, 1 << 20, "test") for _ in range(FILES)]
    try:
        for i, file in enumerate(files):
            file.write(Record(token=f"{i:032x}", owner="com.example.term", id=f"tab-{i}"))
            file.set_total(0)
        per_file = (rss_shmem() - before) / FILES
        assert per_file <= PAGE + 256, f"{per_file:.0f} bytes resident per state file"
        # Opened again (as a holder adopting it does), still only the header page.
        again = [StateFile(os.dup(f.fd), Record) for f in files[:50]]
        try:
            assert [a.record() for a in again] == [f.record() for f in files[:50]]
            assert (rss_shmem() - before) / FILES <= per_file + 50 * PAGE / FILES
        finally:
            for a in again:
                a.close()
    finally:
        for file in files:
            file.close()
