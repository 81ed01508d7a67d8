"""`escrowctl stop [--force]`, run as a real process against real holders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import OWNER, HolderProcess, PtyChild, start_holder, wait_for
from escrow_client import paths

STOPPED, REFUSED, NOT_RUNNING, CANNOT_TELL = 0, 1, 3, 4


def escrowctl(socket_path: str, *args: str,
              timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "escrow_client.cli", "--socket", socket_path, *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def status(socket_path: str) -> tuple[int, str]:
    result = escrowctl(socket_path, "status", "--json")
    return result.returncode, json.loads(result.stdout)["state"]


def escrowed_child(holder: HolderProcess, pty_children: Callable[..., PtyChild],
                   sid: str) -> PtyChild:
    """A child in a PTY, handed off to the holder (draining); the test's master is closed,
    so the holder's copy is the terminal's only master."""
    child = pty_children(["sh", "-c", f"echo hi-{sid}; exec sleep 60"])
    assert f"hi-{sid}".encode() in child.read_available(until=f"hi-{sid}".encode())
    holder.client().hand_off(sid, child.master, child_pid=child.pid, label="sh")
    os.close(child.master)
    child.master = -1
    return child


def assert_stopped_cleanly(holder: HolderProcess) -> None:
    assert holder.proc.wait(10) == 0, holder.logs()
    assert not os.path.lexists(holder.socket), "a clean stop removes the socket file"
    assert not os.path.lexists(paths.pid_path(holder.socket)), "and the pidfile"
    assert status(holder.socket) == (NOT_RUNNING, "not_running")  # the lock file stays


def test_stop_refuses_while_sessions_are_escrowed(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    escrowed_child(holder, pty_children, "tab-1")  # draining
    held = pty_children(["sleep", "60"])
    with holder.client().custody() as custody:
        custody.deposit("tab-2", held.master, child_pid=held.pid)  # held: the app reads it
        result = escrowctl(holder.socket, "stop")
        assert result.returncode == REFUSED, result.stderr
        assert result.stdout == ""
        assert f"not stopping escrowd (pid {holder.pid}): 2 session(s) escrowed" in result.stderr
        listed = [line.strip() for line in result.stderr.splitlines()[1:]]
        assert sorted(listed) == [f"{OWNER}/tab-1 draining", f"{OWNER}/tab-2 held"]
        assert "Traceback" not in result.stderr
    assert holder.alive()
    assert status(holder.socket) == (STOPPED, "running")


def test_stop_force_stops_a_holder_with_sessions(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child = escrowed_child(holder, pty_children, "tab-1")
    result = escrowctl(holder.socket, "stop", "--force")
    assert result.returncode == STOPPED, result.stderr
    assert result.stdout == (f"stopped escrowd (pid {holder.pid}) on {holder.socket}; "
                             "dropped 1 escrowed session(s)\n")
    assert_stopped_cleanly(holder)
    # What --force warns about: the terminal hung up, and its shell got SIGHUP.
    wait_for(lambda: child.proc.poll() is not None, 10.0, "the escrowed child to hang up")
    assert child.proc.returncode == -signal.SIGHUP


def test_stop_with_no_sessions_escrowed(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    escrowed_child(holder, pty_children, "tab-1")
    holder.client().release("tab-1")  # a tombstone is not an escrowed session
    result = escrowctl(holder.socket, "stop")
    assert result.returncode == STOPPED, result.stderr
    assert result.stdout == f"stopped escrowd (pid {holder.pid}) on {holder.socket}\n"
    assert result.stderr == ""
    assert_stopped_cleanly(holder)
    assert os.path.exists(paths.lock_path(holder.socket))


def test_stop_without_a_holder(socket_dir: Path) -> None:
    sock = str(socket_dir / "escrowd.sock")
    result = escrowctl(sock, "stop")
    assert result.returncode == NOT_RUNNING
    assert result.stderr == (f"escrowctl: no holder is running on {sock} (not running); "
                             "nothing to stop\n")
    assert os.listdir(socket_dir) == []


def test_stop_after_a_crash_leaves_the_leftovers(socket_dir: Path) -> None:
    h = start_holder(socket_dir / "h")
    try:
        h.proc.kill()
        h.proc.wait(10)
        result = escrowctl(h.socket, "stop", "--force")
        assert result.returncode == NOT_RUNNING
        assert "(dead); nothing to stop" in result.stderr
        assert os.path.lexists(h.socket) and os.path.lexists(paths.pid_path(h.socket))
    finally:
        h.stop()


def test_stop_never_signals_a_holder_that_does_not_answer(holder: HolderProcess) -> None:
    """No answer, no proof of what it is: even --force signals nothing."""
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        result = escrowctl(holder.socket, "stop", "--force", "--timeout", "0.5")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert result.returncode == CANNOT_TELL
    assert "it is unresponsive" in result.stderr
    assert "nothing was signalled" in result.stderr
    # A SIGTERM sent while it was stopped would be acted on now; it keeps serving instead.
    assert holder.client().status().pid == holder.pid
    assert holder.alive()
