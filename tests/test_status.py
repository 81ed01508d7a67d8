"""`escrowctl status`: every row of docs/design.md §7's verdict table, against real holders.

Each verdict is asked of a real `escrowctl` process. Besides the verdict, every test checks
that status changed nothing: it deletes no socket, pidfile or lock, creates nothing, and
leaves a live holder serving.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import HolderProcess, start_holder, wait_for
from escrow_client import HolderStatus, liveness, paths
from escrow_client.liveness import process_start_time

RUNNING, DEAD, NOT_RUNNING, INDETERMINATE, UNRESPONSIVE = 0, 1, 3, 4, 150


def escrowctl(socket_path: str, *args: str,
              timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "escrow_client.cli", "--socket", socket_path, *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def status_json(socket_path: str, *args: str) -> tuple[int, dict[str, Any]]:
    result = escrowctl(socket_path, "status", "--json", *args)
    assert "Traceback" not in result.stderr, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return result.returncode, report


def snapshot(directory: str) -> dict[str, tuple[int, int, int]]:
    """Every entry of `directory` with its inode, mode and mtime: status must change none."""
    out = {}
    for name in os.listdir(directory):
        st = os.lstat(os.path.join(directory, name))
        out[name] = (st.st_ino, st.st_mode, st.st_mtime_ns)
    return out


def holder_files(sock: str) -> dict[str, tuple[int, int, int]]:
    """The socket, lock and pidfile (the holder's log in the same directory changes)."""
    wanted = {os.path.basename(p) for p in (sock, paths.lock_path(sock), paths.pid_path(sock))}
    return {k: v for k, v in snapshot(os.path.dirname(sock)).items() if k in wanted}


@contextmanager
def stopped(holder: HolderProcess) -> Iterator[None]:
    """SIGSTOP the holder for the block; it is always continued."""
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(holder.pid, signal.SIGCONT)


def take_lock_in_helper(sock: str) -> subprocess.Popen[str]:
    """Start a separate live process that takes `<socket>.lock` the way escrowd does
    (fcntl.lockf) and holds it until `drop_lock(helper)`; return once it holds it."""
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({paths.lock_path(sock)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    helper = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout is not None and helper.stdout.readline() == "locked\n"
    except BaseException:
        drop_lock(helper)
        raise
    return helper


def drop_lock(helper: subprocess.Popen[str]) -> None:
    """The helper exits (its read of stdin returns), and the lock goes with it."""
    if helper.returncode is not None:
        return
    assert helper.stdin is not None and helper.stdout is not None
    helper.stdin.close()
    helper.wait(10)
    helper.stdout.close()


@contextmanager
def lock_taken_by_helper(sock: str) -> Iterator[int]:
    """A separate live process holds `<socket>.lock` for the block. Yields its pid."""
    helper = take_lock_in_helper(sock)
    try:
        yield helper.pid
    finally:
        drop_lock(helper)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- row 1: running -----------------------------------------------------------------------


def test_running(holder: HolderProcess) -> None:
    before = holder_files(holder.socket)
    code, report = status_json(holder.socket)
    assert code == RUNNING
    assert report["state"] == "running"
    assert report["pid"] == holder.pid
    assert report["socket"] == holder.socket
    assert set(report["holder"]) == set(HolderStatus.__struct_fields__)
    assert report["holder"]["pid"] == holder.pid
    ev = report["evidence"]
    assert ev["answered_status"] is True
    assert ev["socket_answer"] == "answered"
    assert ev["socket_peer_pid"] == holder.pid
    assert (ev["lock"], ev["lock_holder_pid"]) == ("held", holder.pid)
    assert ev["pidfile"]["pid"] == holder.pid
    assert ev["pidfile"]["alive"] is True
    assert ev["leftovers"] == []
    assert holder_files(holder.socket) == before

    result = escrowctl(holder.socket, "status")
    assert result.returncode == RUNNING
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"escrowd: running (pid {holder.pid}, version ")
    for label in ("socket", "uptime", "sessions", "buffered"):
        assert any(line.split()[:1] == [label] for line in lines[1:]), result.stdout


def _remove(path: str) -> None:
    os.unlink(path)


def _write(content: bytes) -> Callable[[str], None]:
    def damage(path: str) -> None:
        with open(path, "wb") as f:
            f.write(content)
    return damage


@pytest.mark.parametrize("damage", [
    pytest.param(_remove, id="removed"),
    pytest.param(_write(b""), id="empty"),
    pytest.param(_write(b"12"), id="half-written"),
    pytest.param(_write(b"\x00\xffnot a pidfile\n"), id="garbage"),
    pytest.param(lambda path: _write(f"{dead_pid()}\n12345.0\n".encode())(path),
                 id="names-a-dead-pid"),
])
def test_running_whatever_the_pidfile_says(holder: HolderProcess,
                                           damage: Callable[[str], None]) -> None:
    """Positive proof only: a holder that answers is running, and the pidfile is only ever
    evidence, never a reason to call a live holder dead."""
    pidfile = paths.pid_path(holder.socket)
    damage(pidfile)
    before = holder_files(holder.socket)
    code, report = status_json(holder.socket)
    assert (code, report["state"], report["pid"]) == (RUNNING, "running", holder.pid)
    assert report["evidence"]["pidfile"]["alive"] is not True
    assert os.path.exists(holder.socket), "status must never remove a live holder's socket"
    assert holder_files(holder.socket) == before
    assert holder.alive()
    assert holder.client().status().pid == holder.pid  # and it still serves


# --- row 2: unresponsive ------------------------------------------------------------------


@pytest.mark.parametrize("pidfile_removed", [False, True], ids=["pidfile", "no-pidfile"])
def test_unresponsive_when_stopped(holder: HolderProcess, pidfile_removed: bool) -> None:
    if pidfile_removed:
        os.unlink(paths.pid_path(holder.socket))
    before = holder_files(holder.socket)
    with stopped(holder):
        started = time.monotonic()
        code, report = status_json(holder.socket, "--timeout", "1")
        elapsed = time.monotonic() - started
        after = holder_files(holder.socket)
        text = escrowctl(holder.socket, "--timeout", "0.5", "status")
    assert (code, report["state"], report["pid"]) == (UNRESPONSIVE, "unresponsive", holder.pid)
    assert report["holder"] is None
    ev = report["evidence"]
    assert ev["socket_answer"] == "accepted_no_answer"
    assert (ev["lock"], ev["lock_holder_pid"]) == ("held", holder.pid)
    assert ev["timeout"] == 1.0
    assert elapsed < 5.0, f"status took {elapsed:.1f}s with --timeout 1"
    assert after == before, "status changed the holder's files"
    assert text.returncode == UNRESPONSIVE
    assert text.stdout.startswith(f"escrowd: unresponsive on {holder.socket} (pid {holder.pid})")

    # Continued, it answers again: nothing status did got in its way.
    wait_for(lambda: escrowctl(holder.socket, "status").returncode == RUNNING, 10.0,
             "the continued holder to answer")


# --- row 3: indeterminate (a live lock holder, no serving socket) -------------------------


@pytest.mark.parametrize("socket_file", ["missing", "refuses"])
def test_indeterminate_while_a_live_process_holds_the_lock(socket_dir: Path,
                                                           socket_file: str) -> None:
    """What status sees while a holder starts or stops: the lock taken, no socket
    answering. It must not be `dead` (the lock proves a live holder) nor `not_running`."""
    sock = str(socket_dir / "escrowd.sock")
    if socket_file == "refuses":
        leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        leftover.bind(sock)  # a socket file nobody listens on: connecting is refused
        leftover.close()
    with lock_taken_by_helper(sock) as helper_pid:
        before = snapshot(str(socket_dir))
        code, report = status_json(sock)
        assert snapshot(str(socket_dir)) == before, "status changed the directory"
    assert (code, report["state"], report["pid"]) == (INDETERMINATE, "indeterminate",
                                                      helper_pid)
    ev = report["evidence"]
    assert (ev["lock"], ev["lock_holder_pid"]) == ("held", helper_pid)
    assert ev["socket_answer"] == {"missing": "missing", "refuses": "refused"}[socket_file]
    assert ev["leftovers"] == []


def test_indeterminate_when_a_live_holder_lost_its_socket_file(socket_dir: Path) -> None:
    h = start_holder(socket_dir / "h")
    try:
        os.unlink(h.socket)
        before = holder_files(h.socket)
        code, report = status_json(h.socket)
        assert (code, report["state"], report["pid"]) == (INDETERMINATE, "indeterminate",
                                                          h.pid)
        assert report["evidence"]["socket_answer"] == "missing"
        assert holder_files(h.socket) == before
        assert os.path.exists(paths.pid_path(h.socket))
        assert os.path.exists(paths.lock_path(h.socket))
        assert h.alive()
    finally:
        h.stop()


# --- row 4: dead --------------------------------------------------------------------------


def test_dead_after_sigkill_then_a_new_holder_starts_cleanly(socket_dir: Path) -> None:
    directory = socket_dir / "h"
    first = start_holder(directory)
    second: HolderProcess | None = None
    try:
        first.proc.kill()
        first.proc.wait(10)
        sock, pidfile = first.socket, paths.pid_path(first.socket)
        before = holder_files(sock)
        code, report = status_json(sock)
        assert (code, report["state"], report["pid"]) == (DEAD, "dead", None)
        ev = report["evidence"]
        assert ev["leftovers"] == [sock, pidfile]
        assert ev["lock"] == "free"
        assert ev["socket_answer"] == "refused"
        assert (ev["pidfile"]["pid"], ev["pidfile"]["alive"]) == (first.pid, False)
        assert holder_files(sock) == before, "status must leave the leftovers for escrowd"
        text = escrowctl(sock, "status")
        assert text.returncode == DEAD
        assert text.stdout.startswith(f"escrowd: dead on {sock}")
        assert f"leftover  {sock}, {pidfile}" in text.stdout

        second = start_holder(directory)  # takes the lock, removes the leftovers, serves
        assert second.log_lines("leftover_removed")
        code, report = status_json(sock)
        assert (code, report["state"], report["pid"]) == (RUNNING, "running", second.pid)
        assert report["evidence"]["pidfile"]["pid"] == second.pid
    finally:
        for h in (first, second):
            if h is not None:
                h.stop()


def test_dead_with_only_a_stale_pidfile(socket_dir: Path) -> None:
    sock = str(socket_dir / "escrowd.sock")
    paths.write_pidfile(sock, dead_pid(), 12345.0)
    code, report = status_json(sock)
    assert (code, report["state"]) == (DEAD, "dead")
    assert report["evidence"]["leftovers"] == [paths.pid_path(sock)]
    assert report["evidence"]["socket_answer"] == "missing"
    assert os.path.exists(paths.pid_path(sock))


def test_a_pidfile_naming_a_live_process_rules_out_dead(socket_dir: Path) -> None:
    """Nobody holds the lock and no socket answers, but the pidfile names a process that
    is alive and started when recorded: that is not proof of death."""
    sock = str(socket_dir / "escrowd.sock")
    paths.write_pidfile(sock, os.getpid(), process_start_time(os.getpid()) or 0.0)
    code, report = status_json(sock)
    assert (code, report["state"]) == (INDETERMINATE, "indeterminate")
    assert report["evidence"]["pidfile"]["alive"] is True


# --- row 5: not running -------------------------------------------------------------------


def test_not_running_when_nothing_ever_ran(socket_dir: Path) -> None:
    sock = str(socket_dir / "escrowd.sock")
    code, report = status_json(sock)
    assert (code, report["state"], report["pid"], report["holder"]) == (
        NOT_RUNNING, "not_running", None, None)
    ev = report["evidence"]
    assert (ev["lock"], ev["socket_answer"], ev["leftovers"]) == ("missing", "missing", [])
    assert ev["pidfile"]["exists"] is False
    text = escrowctl(sock, "status")
    assert text.returncode == NOT_RUNNING
    assert text.stdout.startswith(f"escrowd: not running on {sock}")
    assert os.listdir(socket_dir) == [], "status created something"


def test_not_running_after_a_clean_stop_that_leaves_the_socket_file(socket_dir: Path) -> None:
    """Incident pinned: after `systemctl --user stop escrowd.socket escrowd.service`,
    status said `dead` (exit 1), because the socket unit keeps its socket file on purpose
    (RemoveOnStop=no). The holder's clean stop removed its pidfile: a socket file alone,
    refusing, with nobody holding the lock, is `not_running`."""
    sock = str(socket_dir / "escrowd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)  # bound, never listening, closed: a file that refuses, as systemd's
    listener.close()
    code, report = status_json(sock)
    assert (code, report["state"]) == (NOT_RUNNING, "not_running"), report
    assert report["evidence"]["socket_answer"] == "refused"
    assert "clean stop" in report["reason"]
    assert os.path.exists(sock), "status removed the socket file"


# --- row 6: indeterminate (anything else) -------------------------------------------------


def test_indeterminate_when_the_lock_cannot_be_read(socket_dir: Path) -> None:
    sock = str(socket_dir / "escrowd.sock")
    os.mkdir(paths.lock_path(sock))  # (chmod 000 would not stop root from reading it)
    before = snapshot(str(socket_dir))
    code, report = status_json(sock)
    assert (code, report["state"], report["pid"]) == (INDETERMINATE, "indeterminate", None)
    ev = report["evidence"]
    assert ev["lock"] == "unreadable"
    assert "not a regular file" in ev["lock_error"]
    assert snapshot(str(socket_dir)) == before
    text = escrowctl(sock, "status")
    assert text.returncode == INDETERMINATE
    assert "cannot tell who holds the lock" in text.stdout


def test_indeterminate_when_a_socket_without_the_lock_does_not_answer(socket_dir: Path) -> None:
    """Accepting without answering counts as `unresponsive` only under a held lock."""
    sock = str(socket_dir / "escrowd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(sock)
        listener.listen(8)  # accepts into the backlog, never answers
        code, report = status_json(sock, "--timeout", "0.3")
    finally:
        listener.close()
    assert (code, report["state"]) == (INDETERMINATE, "indeterminate")
    assert report["evidence"]["socket_answer"] == "accepted_no_answer"
    assert report["evidence"]["lock"] == "missing"


# --- what changes while status looks -------------------------------------------------------


CHANGES = ["pidfile_appears", "socket_file_appears", "lock_taken", "lock_dropped"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_while_status_looks_is_never_dead_or_not_running(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Incident pinned (issue 9, item 11): a monitor ran `escrowctl status` while a holder
    was starting (or stopping) and was told `dead`, or `not_running`, from evidence it had
    seen only once: a pidfile or socket file that appeared after it first looked, a lock
    free on one side of the socket probe only. Positive proof needs the same evidence on
    both sides of the probe; a change in between is `indeterminate`.

    The change is made by the socket probe itself (the real probe, then a real file or a
    real lock taken or dropped by another process), so it falls exactly between the two
    looks."""
    sock = str(socket_dir / "escrowd.sock")
    helpers: list[subprocess.Popen[str]] = []
    if change == "lock_dropped":
        helpers.append(take_lock_in_helper(sock))
    real_probe = liveness.probe_socket

    def probe_then_change(*args: Any, **kwargs: Any) -> liveness.SocketProbe:
        probe = real_probe(*args, **kwargs)
        assert probe.answer == liveness.MISSING
        if change == "pidfile_appears":
            paths.write_pidfile(sock, dead_pid(), 12345.0)
        elif change == "socket_file_appears":
            bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bound.bind(sock)  # a socket file that refuses: as a holder dead or starting
            bound.close()
        elif change == "lock_taken":
            helpers.append(take_lock_in_helper(sock))
        else:
            drop_lock(helpers[0])
        return probe

    monkeypatch.setattr(liveness, "probe_socket", probe_then_change)
    try:
        verdict = liveness.holder_verdict(sock, timeout=1.0)
    finally:
        for helper in helpers:
            drop_lock(helper)
    assert verdict.state == "indeterminate", (verdict.state, verdict.reason)
    assert verdict.evidence["leftovers"] == []


# --- clean start: two holders at once -----------------------------------------------------


@pytest.mark.parametrize("round_", range(3))
def test_two_holders_started_at_once_end_with_one(socket_dir: Path, round_: int) -> None:
    sock = str(socket_dir / "escrowd.sock")
    logs = [socket_dir / f"escrowd-{i}.log" for i in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for log in logs:  # both started before either is waited for
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "escrowd", "--bare", "--socket", sock],
                    stdin=subprocess.DEVNULL, stdout=f, stderr=f))

        def settled() -> bool:
            exited = [p for p in procs if p.poll() is not None]
            ready = [log for log in logs if " event=ready " in log.read_text()]
            return len(exited) == 1 and len(ready) == 1

        wait_for(settled, 15.0, "one holder serving and the other gone")
        [loser] = [i for i, p in enumerate(procs) if p.poll() is not None]
        winner = procs[1 - loser]
        assert procs[loser].returncode == 1
        message = logs[loser].read_text()
        assert (f"escrowd: another escrowd (pid {winner.pid}) already serves {sock}; "
                "not starting a second one") in message
        code, report = status_json(sock)
        assert (code, report["pid"]) == (RUNNING, winner.pid)
        assert winner.poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait(10)


def test_status_never_hangs_on_a_fifo_or_follows_a_symlink_left_as_a_pidfile(
    socket_dir: Path,
) -> None:
    """A FIFO (or a symlink to one) where the pidfile or the lock file should be: status
    reads neither (O_NONBLOCK, O_NOFOLLOW, regular files only) and answers at once."""
    d = socket_dir / "odd"
    d.mkdir(mode=0o700)
    sock = str(d / "escrowd.sock")
    os.mkfifo(sock + ".pid")
    os.mkfifo(d / "fifo")
    os.symlink(d / "fifo", sock + ".lock")
    started = time.monotonic()
    verdict = liveness.holder_verdict(sock, timeout=1.0)
    assert time.monotonic() - started < 5.0
    assert verdict.state == "indeterminate", verdict
    assert verdict.evidence["pidfile"]["pid"] is None


def test_a_missing_socket_directory_is_not_running_and_nothing_is_touched(
    socket_dir: Path,
) -> None:
    """No directory: nothing can be there. Status says `not_running` without looking for
    files in a directory that someone else could create meanwhile."""
    sock = str(socket_dir / "absent" / "escrowd.sock")
    verdict = liveness.holder_verdict(sock, timeout=1.0)
    assert verdict.state == "not_running" and "nothing exists there" in verdict.reason
    assert not (socket_dir / "absent").exists()
