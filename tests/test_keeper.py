"""The keeper as users run it (`escrowd` without `--bare`): a real keeper and its holder.

- Only its holder stores fds with it. Any process of the user can send a datagram to the
  keeper's notify socket (`<socket>.notify`); fds one sends there are closed and logged,
  never kept: kept, they would be passed to the next holder as if they were sessions, and
  whatever the sender passed (the read end of a pipe, here) stayed open in the keeper for
  as long as it runs.
- An upgrade whose new code does not start (`escrowd --check` fails) changes nothing: the
  working holder is not stopped and serves on, every session with it. Stopped first, the
  sessions would wait with the keeper for a holder that cannot start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile import read_more_lines
from survival import TICKER, assert_one_stream
from test_survive import kill_serving_holder

import escrowd
from conftest import HolderProcess, PtyChild, wait_for
from escrow_client.liveness import process_alive, process_start_time
from escrowd.fdstore import rights_for


def test_fds_sent_to_the_keeper_by_another_process_are_not_kept(
    make_holder: Callable[..., HolderProcess],
) -> None:
    holder = make_holder(keeper=True)
    r, w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
            stranger.sendmsg([b"FDSTORE=1\nFDNAME=session-stranger\nFDPOLL=0"],
                             rights_for([r]), 0, holder.socket + ".notify")
        os.close(r)
        r = -1
        # The keeper reads every notification sent before its holder died before it starts
        # the next one: what that one is passed is what the keeper kept.
        kill_serving_holder(holder)
        started = holder.log_lines("keeper_started_holder")
        assert len(started) == 2, started
        # The first holder stored its own state file (one fd), nothing else.
        assert " stored_fds=1 " in started[1] + " ", (
            f"the next holder was passed fds a process that is not the holder sent: "
            f"{started[1]}")
        assert not [line for line in holder.log_lines("adopt_refused")
                    if "session-stranger" in line], holder.logs()
        refused = [line for line in holder.log_lines("keeper_refused")
                   if f" sender_pid={os.getpid()} " in line + " "]
        assert len(refused) == 1 and "not from the holder" in refused[0], holder.logs()
        # Nothing holds the pipe's read end open any more: the keeper closed its copy.
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
    finally:
        if r >= 0:
            os.close(r)
        os.close(w)


def test_an_upgrade_whose_check_fails_leaves_the_working_holder_serving(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    tmp_path: Path,
) -> None:
    """The installed code is a copy of escrowd that `python -m escrowd` finds first (the
    keeper runs in its directory). Once the holder runs, the copy is broken as an upgrade
    might leave it: a module imports something not installed. SIGHUP (`escrowctl upgrade`)
    makes the keeper try `escrowd --check`, which fails: the refusal is logged, the same
    holder serves on, and its session drains on without a gap."""
    installed = tmp_path / "installed"
    shutil.copytree(Path(escrowd.__file__).parent, installed / "escrowd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    holder = make_holder(keeper=True, cwd=installed)
    client = holder.client()
    kid = pty_children(TICKER)
    first = read_more_lines(kid.master, b"", 2)
    client.hand_off("tab", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    before = client.status()
    serving_start = process_start_time(before.pid)
    handoff = installed / "escrowd" / "handoff.py"
    handoff.write_text(handoff.read_text() + "\nimport escrowd_dependency_not_installed\n")

    def refusals() -> int:
        return len(holder.log_lines("upgrade_refused"))

    os.kill(holder.pid, signal.SIGHUP)
    wait_for(lambda: refusals() == 1, 15.0, "the keeper to try the upgrade and refuse it")
    # Asked again, it tries again: so the keeper is past the first refusal, and whatever
    # it did after it is done by the time it logs the second.
    os.kill(holder.pid, signal.SIGHUP)
    wait_for(lambda: refusals() == 2, 15.0,
             "the keeper to try the upgrade asked again and refuse it again")
    refusal = holder.log_lines("upgrade_refused")[-1]
    assert "escrowd_dependency_not_installed" in refusal, refusal

    after = client.status()
    assert (after.pid, after.instance) == (before.pid, before.instance), (
        f"the working holder did not serve on after a refused upgrade: {before} -> {after}")
    assert process_alive(before.pid, serving_start) is True
    assert len(holder.log_lines("keeper_started_holder")) == 1, holder.logs()
    assert not holder.log_lines("stopping"), f"the working holder was stopped: {holder.logs()}"
    assert not holder.log_lines("keeper_holder_exited"), holder.logs()
    got = client.retrieve("tab")
    try:
        assert got.confirmed and got.session.replay_gap_at is None, got.session
        assert_one_stream(first, got.replay, read_more_lines(got.fd, b"", 2), None)
    finally:
        os.close(got.fd)
