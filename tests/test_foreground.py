"""escrowd in the foreground of a terminal (`scripts/holder`, the tour's first step).

Incident pinned: Ctrl-C in that terminal dropped every session without a word (the log said
`flushed sessions=1 ... keeper_stopped`, the shell was gone), while `escrowctl stop` refused
the same without `--force`. Now an interrupt with sessions escrowed keeps them all and says
how to stop for real; with none, it stops as before. Closing that terminal keeps escrowd
serving, and its log goes on in `<socket>.log`, where a user can find it.

Here escrowd runs as the session leader of a real PTY the test owns, and the test types
Ctrl-C into it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import PtyChild, spawn_in_pty, wait_for
from escrow_client import EscrowClient, EscrowError, HolderStatus

BIN = Path(sys.executable).parent


def _screen(term: PtyChild, until: bytes, timeout: float = 10.0) -> bytes:
    """What the terminal shows, read until `until` appears (fails saying so otherwise)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while until not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"the terminal never showed {until!r}: {seen[-2000:]!r}"
        if select.select([term.master], [], [], left)[0]:
            try:
                seen += os.read(term.master, 65536)
            except OSError:
                break
    return seen


def _serving(client: EscrowClient) -> int | None:
    try:
        return client.status().pid
    except EscrowError:
        return None


def test_ctrl_c_with_sessions_keeps_them_and_says_how_to_stop(
    socket_dir: Path, pty_children: Callable[..., PtyChild],
) -> None:
    sock = str(socket_dir / "fg" / "escrowd.sock")
    term = spawn_in_pty([str(BIN / "escrowd"), "--socket", sock], cols=200)
    try:
        client = EscrowClient("com.example.term", socket_path=sock)
        holder = wait_for(lambda: _serving(client), 15.0, "escrowd to serve")
        _screen(term, b"event=ready")
        kid = pty_children(["sh", "-c", "exec sleep 600"])
        client.hand_off("tab", kid.master, child_pid=kid.pid)
        os.close(kid.master)
        kid.master = -1

        os.write(term.master, b"\x03")  # Ctrl-C, typed
        shown = _screen(term, b"escrowctl stop --force")
        assert b"event=keeper_interrupt sessions=1" in shown, shown
        assert _serving(client) == holder, "the holder was stopped or replaced by Ctrl-C"
        assert [s.state for s in client.list()] == ["draining"]
        assert kid.proc.poll() is None, "the shell lost its terminal"

        # The terminal goes away: escrowd serves on, and logs to <socket>.log.
        os.close(term.master)
        term.master = -1
        log_file = Path(sock + ".log")
        wait_for(lambda: _serving(client) is not None and log_file.exists(), 20.0,
                 "escrowd to serve on, logging to its socket's .log file")
        client.release("tab")
        wait_for(lambda: "event=state" in log_file.read_text(), 10.0,
                 "the release to be logged in the file")
        assert log_file.stat().st_mode & 0o777 == 0o600
        wait_for(lambda: kid.proc.poll() is not None, 10.0, "the released shell to end")
    finally:
        pid = _serving(EscrowClient("escrowctl", socket_path=sock, timeout=1.0))
        if term.proc.poll() is None:
            term.proc.send_signal(signal.SIGTERM)
        term.proc.wait(30)
        if pid is not None:  # (the holder exits with its keeper)
            wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 15.0, "the holder to end")
        if term.master >= 0:
            os.close(term.master)


def test_ctrl_c_with_nothing_escrowed_stops(socket_dir: Path) -> None:
    sock = str(socket_dir / "fg" / "escrowd.sock")
    term = spawn_in_pty([str(BIN / "escrowd"), "--socket", sock], cols=200)
    try:
        client = EscrowClient("com.example.term", socket_path=sock)
        wait_for(lambda: _serving(client), 15.0, "escrowd to serve")
        _screen(term, b"event=ready")
        os.write(term.master, b"\x03")
        _screen(term, b"event=keeper_stopped")
        assert term.proc.wait(15) == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()
        os.close(term.master)


def test_a_closed_terminal_whose_shell_passes_the_hangup_on_is_no_upgrade(
    socket_dir: Path, pty_children: Callable[..., PtyChild],
) -> None:
    """Found in review: escrowd started from an interactive shell, its terminal closed: the
    shell passes SIGHUP on to its jobs (keeper and holder alike), the holder died of it and
    the keeper took its own SIGHUP for `escrowctl upgrade`. Now the holder ignores it, and
    the keeper sees its terminal hung up: the same holder serves on, nothing restarted."""
    sock = str(socket_dir / "fg" / "escrowd.sock")
    # A session leader that passes the hangup on to its process group, as bash does.
    term = spawn_in_pty(["sh", "-c", f"trap 'kill -HUP 0' HUP; {BIN / 'escrowd'} --socket "
                         f"{sock} & wait; wait"], cols=200)
    try:
        client = EscrowClient("com.example.term", socket_path=sock)
        first = wait_for(lambda: _status(client), 15.0, "escrowd to serve")
        kid = pty_children(["sh", "-c", "exec sleep 600"])
        client.hand_off("tab", kid.master, child_pid=kid.pid)
        os.close(term.master)
        term.master = -1
        log_file = Path(sock + ".log")
        wait_for(lambda: log_file.exists() and "keeper_terminal_gone" in log_file.read_text(),
                 15.0, "the keeper to see its terminal gone")
        after = _status(client)
        assert after is not None and after.instance == first.instance, (
            "the holder was replaced when the terminal closed")
        assert "event=upgrade" not in log_file.read_text()
        client.release("tab")
    finally:
        status = _status(EscrowClient("escrowctl", socket_path=sock, timeout=1.0))
        if status is not None and status.keeper_pid:
            os.kill(status.keeper_pid, signal.SIGTERM)
            wait_for(lambda: _status(client) is None, 15.0, "escrowd to stop")
        term.kill()
        if term.master >= 0:
            os.close(term.master)


def _status(client: EscrowClient) -> HolderStatus | None:
    try:
        return client.status()
    except EscrowError:
        return None
