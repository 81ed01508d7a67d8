"""A session's state file costs resident memory for what is written in it, and nothing for
the slots and ring space never used (docs/design.md §11: "sized to the ring limit but backed only
where written").

Incident pinned: opening a state file read its four record slots through the shared
mapping; the two big slots (pages 1 and 65, never written for an ordinary record) are holes,
and a read fault on a hole of a memfd allocates a page: 8 KiB more per session, 12 KiB of
resident memory where 4 KiB (the header page) is written. With 1,000 sessions holding 64 KiB
of replay each, `rss_growth_per_replay` went from 1.17 to 1.29 for it.

Measured in a fresh process (its RssShmem, from /proc/self/status): in the test process,
state files of other tests unmapped by the garbage collector at any moment would blur it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from escrowd.statefile import PAGE

FILES = 200
MEASURE = textwrap.dedent(f"""
    import json, os
    from escrowd.statefile import Record, StateFile

    def rss_shmem():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024

    before = rss_shmem()
    files = [StateFile.create(Record, 1 << 20, "test") for _ in range({FILES})]
    for i, file in enumerate(files):
        file.write(Record(token=f"{{i:032x}}", owner="com.example.term", id=f"tab-{{i}}"))
        file.set_total(0)
    created = rss_shmem() - before
    # Opened again, as a holder adopting them does (in this process: a second mapping).
    again = [StateFile(os.dup(f.fd), Record) for f in files]
    same = all(a.record() == f.record() for a, f in zip(again, files))
    print(json.dumps({{"created": created, "reopened": rss_shmem() - before - created,
                      "same": same}}))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="memfd and /proc are Linux's")
def test_a_state_file_is_resident_only_where_written() -> None:
    done = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True,
                          timeout=60, check=True)
    got = json.loads(done.stdout)
    assert got["same"]
    for what in ("created", "reopened"):
        per_file = got[what] / FILES
        assert per_file <= PAGE + 256, f"{what}: {per_file:.0f} bytes resident per state file"
