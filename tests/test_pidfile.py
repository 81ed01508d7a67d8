"""The holder writes its pidfile only into its own directory, and never through a symlink
(docs/design.md §6).

Incident pinned: the pidfile's temp file was opened with `open(temp, "w")` (it follows
symlinks, no O_EXCL), and a holder under a keeper never looked at its directory again.
With a socket directory whose parent another user could write, she swapped the directory
for one of hers holding symlinks at the temp file's names (`escrowd.sock.pid.<pid>.tmp`,
for the pids to come), and the victim's next holder wrote its pid through one of them
into a file of the victim's. Here a real second user does that under a real keeper; the
victim's file is untouched, and the holder says why it does not start there.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from otheruser import OtherUser, other_user, system_python

from conftest import wait_for
from escrow_client import EscrowClient, EscrowError


@pytest.fixture
def user() -> OtherUser:
    return other_user()


@pytest.fixture
def parent() -> Iterator[Path]:
    """A directory others may write (and not sticky): the parent of the socket directory."""
    base = Path(tempfile.mkdtemp(prefix="esc-pid-"))
    os.chmod(base, 0o755)
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    yield shared
    shutil.rmtree(base, ignore_errors=True)


SWAP = textwrap.dedent("""
    import os, sys
    parent, victim_file, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.rename(os.path.join(parent, "escrowd"), os.path.join(parent, "moved"))
    os.mkdir(os.path.join(parent, "escrowd"), 0o777)
    os.chmod(os.path.join(parent, "escrowd"), 0o777)
    for pid in range(first, first + count):
        os.symlink(victim_file, os.path.join(parent, "escrowd", f"escrowd.sock.pid.{pid}.tmp"))
""")


def test_a_swapped_socket_directory_gets_no_write_through_its_symlinks(
    user: OtherUser, parent: Path, tmp_path: Path,
) -> None:
    precious = tmp_path / "precious"
    precious.write_text("the victim's own file\n")
    directory = parent / "escrowd"
    directory.mkdir(mode=0o700)
    sock = str(directory / "escrowd.sock")
    log_path = tmp_path / "escrowd.log"
    with open(log_path, "wb") as log:
        keeper = subprocess.Popen([sys.executable, "-m", "escrowd", "--socket", sock],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        client = EscrowClient("com.example.term", socket_path=sock, timeout=2.0)
        serving = wait_for(lambda: _pid(client), 15.0, "the keeper's holder").pid
        last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
        swapped = subprocess.run(
            [system_python(), "-c", SWAP, str(parent), str(precious), str(last + 1), "400"],
            user=user.uid, group=user.gid, extra_groups=[], capture_output=True, text=True,
            timeout=30)
        assert swapped.returncode == 0, swapped.stderr
        os.kill(serving, signal.SIGKILL)  # the keeper starts the next holder in her directory

        def untouched() -> bool:
            assert precious.read_text() == "the victim's own file\n", \
                "the holder wrote through another user's symlink"
            return True

        wait_for(lambda: untouched() and "refusing to use it" in log_path.read_text(), 15.0,
                 "the next holder to refuse the swapped directory")
    finally:
        keeper.send_signal(signal.SIGTERM)
        keeper.wait(30)


def _pid(client: EscrowClient) -> object:
    try:
        return client.status()
    except EscrowError:
        return None
