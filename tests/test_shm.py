"""A state file's mapping without a second fd (escrowd/shm.py): unmapped only when no view of
it is left, and a view kept past `close` reads zero pages rather than take the holder down.

Each case runs in a child process: a view of unmapped memory would kill the process that
reads it with SIGSEGV, and that must be the child, to be reported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import os, sys
from escrowd.shm import Mapping, new_file
fd = new_file("test", None)
os.ftruncate(fd, 1 << 20)
mapping = Mapping(fd, 1 << 20)
os.close(fd)  # the mapping needs no fd of its own
view = mapping.view
view[100:105] = b"hello"
assert mapping.find(ord("l"), 0, 1 << 20) == 102 and mapping.find(ord("z"), 0, 4096) == -1
kept = view[100:105] if sys.argv[1] == "kept" else None
del view
mapping.close()
mapping.close()  # (idempotent)
print(bytes(kept) if kept is not None else b"none")
"""


@pytest.mark.parametrize(("how", "printed"), [("kept", "b'\\\\x00\\\\x00\\\\x00\\\\x00\\\\x00'"),
                                             ("none", "b'none'")])
def test_a_view_kept_past_close_reads_zeros(how: str, printed: str) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.strip() == printed.replace("\\\\", "\\")


ZERO_PAGES = """
import os, sys
from escrowd.shm import Mapping, new_file
fd = new_file("test", None)
os.ftruncate(fd, 1 << 20)
mapping = Mapping(fd, 1 << 20)
os.close(fd)
address = mapping._address
kept = mapping.view[100:105]
mapping.close()
lines = open("/proc/self/smaps").read().splitlines()
at = next(i for i, line in enumerate(lines)
          if line.startswith("%x-" % address))  # (the range's header line)
flags = next(line for line in lines[at:] if line.startswith("VmFlags:")).split()[1:]
print(lines[at].split()[1], "nr" in flags, bytes(kept))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_the_zero_pages_under_a_kept_view_are_read_only_and_reserve_nothing() -> None:
    """The zero pages put under a view kept past `close` were writable and private, and so
    charged to the commit limit in full: under strict overcommit the replacement could be
    refused, unchecked. They are read-only and MAP_NORESERVE now, which nothing charges."""
    done = subprocess.run([sys.executable, "-c", ZERO_PAGES], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, (done.returncode, done.stderr)
    perms, noreserve, data = done.stdout.split(maxsplit=2)
    assert perms == "r--p" and noreserve == "True", done.stdout
    assert data.strip() == repr(b"\0" * 5)
