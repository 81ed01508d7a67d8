"""The keeper as users run it (`escrowd` without `--bare`): a real keeper and its holder.

- Only its holder stores fds with it. The two talk over a socketpair made for each holder
  (no path any other process could send to, or a user could remove); and fds that reach
  the keeper from any process but its holder all the same (a child of the holder, say) are
  closed and logged, never kept: kept, they would be passed to the next holder as if they
  were sessions, and stay open in the keeper for as long as it runs.
- An upgrade whose new code does not start (`escrowd --check` fails) changes nothing: the
  working holder is not stopped and serves on, every session with it. Stopped first, the
  sessions would wait with the keeper for a holder that cannot start.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile import read_more_lines
from installation import make_installation, site_packages
from survival import TICKER, assert_one_stream
from test_survive import kill_serving_holder

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import EscrowClient, EscrowError
from escrow_client.liveness import process_alive, process_start_time
from escrowd import keeper
from escrowd.fdstore import rights_for


def test_there_is_no_path_to_the_keeper_but_the_socket(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """Incident pinned: the keeper listened on `<socket>.notify`, a path any process of the
    user could send fds to, and a tmp cleaner (or a user) could remove: removed, the holder
    could no longer ping or store, and the keeper SIGKILLed it 30 s later for a missed
    watchdog. Now the socket directory holds the socket clients use, the lock and the
    pidfile, and no other socket."""
    holder = make_holder(keeper=True)
    directory = Path(holder.socket).parent
    sockets = [p.name for p in directory.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert sockets == ["escrowd.sock"], sockets


def test_fds_a_process_but_the_holder_sends_the_keeper_are_not_kept() -> None:
    """On the holder's own channel, from a process that is not the holder (a forked child
    of it, say): closed, logged, never kept."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    k = keeper.Keeper(listener, [])
    k.channel, holder_end = keeper.channel_pair()
    k.poller.register(k.channel)
    r, w = os.pipe()
    try:
        k.holder = os.getppid()  # anyone but this process
        holder_end.sendmsg([b"FDSTORE=1\nFDNAME=session-stranger\nFDPOLL=0"], rights_for([r]))
        os.close(r)
        r = -1
        k._messages()
        assert k.store == {}, "fds a process but the holder sent were kept"
        # Nothing holds the pipe's read end open any more: the keeper closed its copy.
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
    finally:
        if r >= 0:
            os.close(r)
        os.close(w)
        k._close_channel()
        holder_end.close()
        listener.close()


def test_an_upgrade_whose_check_fails_leaves_the_working_holder_serving(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    tmp_path: Path,
) -> None:
    """The keeper runs an installation of its own (tests/installation.py). Once the holder
    runs, its code is broken as an upgrade might leave it: a module imports something not
    installed. SIGHUP (`escrowctl upgrade`) makes the keeper try `escrowd --check`, which
    fails: the refusal is logged, the same holder serves on, and its session drains on
    without a gap."""
    installed = tmp_path / "installed"
    python = make_installation(installed)
    holder = make_holder(keeper=True, python=str(python))
    client = holder.client()
    kid = pty_children(TICKER)
    first = read_more_lines(kid.master, b"", 2)
    client.hand_off("tab", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    before = client.status()
    serving_start = process_start_time(before.pid)
    handoff = site_packages(installed) / "escrowd" / "handoff.py"
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


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_deposited_means_the_keeper_has_the_fds(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Incident pinned: with the keeper at its fd limit (`prlimit --nofile` on it), deposits
    were answered `deposited` while the keeper logged "a truncated notification" and kept
    nothing: after a holder SIGKILL those shells were gone. Now the keeper answers each
    store, and one it could not take is an error to the app: `limit`, the session not
    kept, the app still holding its terminal. What was deposited before survives."""
    holder = make_holder(keeper=True)
    client = holder.client()
    before = pty_children(TICKER)
    first = read_more_lines(before.master, b"", 2)
    client.hand_off("before", before.master, child_pid=before.pid)
    os.close(before.master)
    before.master = -1
    limits = resource.prlimit(holder.pid, resource.RLIMIT_NOFILE)
    # Room for one fd more, not for a deposit's two.
    resource.prlimit(holder.pid, resource.RLIMIT_NOFILE,
                     (_open_fds(holder.pid) + 1, limits[1]))
    try:
        kid = pty_children(TICKER)
        with pytest.raises(EscrowError) as refused:
            client.hand_off("at-limit", kid.master, child_pid=kid.pid)
        assert refused.value.code == "limit", refused.value
        assert "file descriptor limit" in str(refused.value), refused.value
        assert [s.id for s in client.list()] == ["before"]
        assert read_more_lines(kid.master, b"", 2), "the app no longer reads its terminal"
        assert holder.log_lines("keeper_refused"), holder.logs()
    finally:
        resource.prlimit(holder.pid, resource.RLIMIT_NOFILE, limits)
    kill_serving_holder(holder)
    got = client.retrieve("before")
    try:
        assert_one_stream(first, got.replay, read_more_lines(got.fd, b"", 2),
                          got.session.replay_gap_at)
    finally:
        os.close(got.fd)


def test_a_keeper_that_cannot_start_a_holder_says_why_and_keeps_the_fds(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Incident pinned: with the keeper's hard fd limit lowered, every new holder exited 127
    in a loop, with no reason logged. Now each try says why, and the stored fds stay with
    the keeper (the session's shell lives on) for when a holder can start. (A hard limit
    cannot be raised again without privilege: the keeper is stopped at the end.)"""
    holder = make_holder(keeper=True)
    client = holder.client()
    kid = pty_children(TICKER)
    client.hand_off("tab", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    stored = _open_fds(holder.pid)
    # Below what a holder needs for the fds it is passed (3 + listener + stored + channel).
    resource.prlimit(holder.pid, resource.RLIMIT_NOFILE, (4, 4))
    try:
        os.kill(client.status().pid, signal.SIGKILL)
        wait_for(lambda: len(holder.log_lines("keeper_cannot_start_holder")) >= 2, 15.0,
                 "the keeper to say, at each try, why it cannot start a holder")
        line = holder.log_lines("keeper_cannot_start_holder")[-1]
        assert "fd limit of 4" in line and "retry_in=" in line, line
        assert not [e for e in holder.log_lines("keeper_holder_exited")
                    if " code=127 " in e + " "], holder.logs()
        assert kid.proc.poll() is None, "the session's shell did not live on"
        # The keeper still holds the session's fds (its own, less the channel to the dead
        # holder): nothing was closed for want of a holder.
        assert _open_fds(holder.pid) >= stored - 1
    finally:
        holder.proc.terminate()
        holder.proc.wait(30)


def _answers(client: EscrowClient) -> bool:
    try:
        client.status()
    except EscrowError:
        return False
    return True
