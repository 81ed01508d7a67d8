"""The escrow outlives the holder (DESIGN §11): its serving process SIGKILLed under the
keeper, every session comes back as it was.

Incident pinned: SIGKILL of the holder hung up every draining shell (exit 129), threw away
an exited session's replay, and the holder started again listed nothing; a session an app
still held lost its protection without anyone being told.

Here `escrowd` runs as users run it: the keeper and its holder, a real process tree. Three
sessions live through the holder's SIGKILL (tests/survival.py): one draining (a shell
printing numbered lines every 20 ms), one exited with a 200 KB tail, and one held by a live
app that reads it. tests/test_systemd_escrow.py does the same under a real systemd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from survival import assert_all_survived, assert_still_there, start_three_sessions

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import paths, protocol


def serving_pid(holder: HolderProcess) -> int:
    record = paths.read_pidfile(holder.socket)
    assert record is not None
    return record.pid


def kill_serving_holder(holder: HolderProcess) -> protocol.HolderStatus:
    """SIGKILL the process that answers, and wait for the keeper's next one to answer with
    what it adopted."""
    before = holder.client("escrowctl").status()
    os.kill(before.pid, signal.SIGKILL)

    def restarted() -> protocol.HolderStatus | None:
        try:
            status = holder.client("escrowctl", timeout=1.0).status()
        except Exception:
            return None
        return status if status.instance != before.instance else None

    after = wait_for(restarted, 15.0, "the keeper's next holder to answer")
    assert after.keeper_pid == before.keeper_pid == holder.pid
    assert after.unclean_restarts == before.unclean_restarts + 1
    return after


def test_every_kind_of_session_survives_the_holders_sigkill(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    holder = make_holder(keeper=True)
    three = start_three_sessions(holder.client(), pty_children, apps, tmp_path)

    after = kill_serving_holder(holder)
    assert after.adopted == 3, after
    assert_still_there(three)
    assert_all_survived(three, clean=False)


def test_status_shows_the_pair(make_holder: Callable[..., HolderProcess]) -> None:
    """escrowctl status --json names both processes: the holder that answers and its
    keeper, which holds the lock."""
    holder = make_holder(keeper=True)
    result = subprocess.run([str(Path(sys.executable).parent / "escrowctl"), "--socket",
                             holder.socket, "status", "--json"], capture_output=True,
                            text=True, timeout=30)
    shown = json.loads(result.stdout)
    assert result.returncode == 0 and shown["state"] == "running"
    assert shown["pid"] == serving_pid(holder)
    assert shown["holder"]["keeper_pid"] == holder.pid == shown["keeper"]["pid"]
    assert shown["evidence"]["lock_holder_pid"] == holder.pid
    assert shown["holder"]["fd_store"] == "keeper"
