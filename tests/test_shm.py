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
