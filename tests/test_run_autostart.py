"""`escrowctl run` with no holder: it starts one (autostart), says so, and the holder
outlives the run; of two runs racing to start one, only the one whose holder answers
says it started it. Each run is a real escrowctl in a PTY of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from test_cli import escrowctl

from conftest import PtyChild
from escrow_client.liveness import process_alive, process_start_time

ESCROWCTL = str(Path(sys.executable).with_name("escrowctl"))
TIMEOUT = 15.0
STARTED = re.compile(r"escrowctl: started a holder \(pid (\d+)\) on (\S+); it keeps running "
                     r"after this session ends; `escrowctl --socket (\S+) stop` stops it")


def run_in_pty(pty_children: Callable[..., PtyChild], socket: str, sid: str,
               program: str) -> tuple[PtyChild, Callable[[], tuple[int, str]]]:
    child = pty_children([ESCROWCTL, "--socket", socket, "run", "--id", sid, "--",
                          "sh", "-c", program])

    def finish() -> tuple[int, str]:
        out = b""
        while chunk := child.read_available(timeout=TIMEOUT):
            out += chunk
        return child.proc.wait(TIMEOUT), out.decode(errors="replace")

    return child, finish


@pytest.fixture
def started() -> Iterator[list[int]]:
    """The holders the tests' runs started (keeper pids): stopped at teardown."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        start = process_start_time(pid)
        if start is not None and process_alive(pid, start):
            proc = psutil.Process(pid)
            os.kill(pid, signal.SIGTERM)
            proc.wait(TIMEOUT)


def test_run_starts_a_holder_says_so_and_the_holder_outlives_it(
    socket_dir: Path, pty_children: Callable[..., PtyChild], started: list[int],
) -> None:
    socket = str(socket_dir / "auto.sock")
    _, finish = run_in_pty(pty_children, socket, "first", "echo ran-ok; exit 3")
    status, out = finish()
    assert status == 3, out  # the program's, through the session
    match = STARTED.search(out)
    assert match is not None, out
    pid = int(match.group(1))
    started.append(pid)
    assert match.group(2) == match.group(3) == socket
    assert (f"escrowctl: session escrowctl/first; detach with Ctrl-\\, back with "
            f"escrowctl --socket {socket} attach escrowctl/first") in out
    assert out.index("escrowctl: session") < out.index("ran-ok")  # said before attaching

    # The holder outlives the run, and the next run just connects.
    assert psutil.Process(pid).is_running()
    answer = escrowctl(socket, "status", "--json")
    assert answer.returncode == 0, answer.stdout
    _, finish = run_in_pty(pty_children, socket, "second", "exit 0")
    status, out = finish()
    assert status == 0 and "started a holder" not in out, out
    assert "escrowctl: session escrowctl/second" in out


def test_of_two_racing_runs_one_says_it_started_the_holder(
    socket_dir: Path, pty_children: Callable[..., PtyChild], started: list[int],
) -> None:
    socket = str(socket_dir / "race.sock")
    runs = [run_in_pty(pty_children, socket, f"r{i}", "echo ran-ok") for i in range(2)]
    results = [finish() for _, finish in runs]
    assert [status for status, _ in results] == [0, 0], results
    said = [m for _, out in results if (m := STARTED.search(out)) is not None]
    started.extend(int(m.group(1)) for m in said)
    assert len(said) == 1, results
    assert all("ran-ok" in out for _, out in results), results
    answer = escrowctl(socket, "status", "--json")
    assert answer.returncode == 0, answer.stdout
    assert json.loads(answer.stdout)["keeper"] == {"pid": int(said[0].group(1))}


def test_run_without_a_terminal_starts_no_holder(socket_dir: Path) -> None:
    socket = str(socket_dir / "none.sock")
    result = subprocess.run([ESCROWCTL, "--socket", socket, "run", "--", "true"],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 1
    assert "needs a terminal" in result.stderr and "started" not in result.stderr
    assert not os.path.exists(socket)


def test_run_starts_no_holder_where_it_would_be_refused_or_at_anothers_mercy(
    socket_dir: Path, pty_children: Callable[..., PtyChild],
) -> None:
    """A directory the holder would refuse (0755: closed to writes, open to reads) gets
    no chmod advice; a missing one is not made under another user's directory, or under
    one anyone may write to (not sticky): they could rename it away from the holder."""
    from otheruser import other_user

    user = other_user()
    d755, d777, theirs = (socket_dir / n for n in ("d755", "d777", "theirs"))
    for directory, mode in ((d755, 0o755), (d777, 0o777), (theirs, 0o755)):
        directory.mkdir()
        os.chmod(directory, mode)
    os.chown(theirs, user.uid, user.gid)
    cases = [(str(d755 / "e.sock"), f"socket directory {d755} has mode 0755"),
             (str(d777 / "new" / "e.sock"), f"{d777}, where the socket directory "
              f"{d777}/new would be created, has mode 0777"),
             (str(theirs / "new" / "e.sock"), f"{theirs}, where the socket directory "
              f"{theirs}/new would be created, is owned by uid {user.uid}")]
    for socket, reason in cases:
        _, finish = run_in_pty(pty_children, socket, "x", "echo ran-ok")
        status, out = finish()
        assert status == 1, out
        assert f"escrowctl: cannot start a holder there: {reason}" in out, out
        assert "use a socket path in a directory you own" in out, out
        assert "chmod" not in out and "ran-ok" not in out, out
    assert not (d777 / "new").exists() and not (theirs / "new").exists()
    assert os.listdir(d755) == []
