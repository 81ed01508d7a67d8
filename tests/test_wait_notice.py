"""A wedged holder (SIGSTOPped under its keeper): escrowctl says once, after about a
second, what it waits for, naming the stopped holder's pid; `status` names that holder, not
its keeper; a library caller says nothing; an answer that comes fast is never preceded by
a notice."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli import escrowctl

from conftest import HolderProcess, require_program, start_holder
from escrow_client import EscrowClient, cli, errors, waiting

NOTICE = "escrowctl: waiting for the holder"


@pytest.fixture(scope="module")
def wedged() -> Iterator[HolderProcess]:
    """One keeper and its holder for the module; the holder stopped (SIGSTOP)."""
    directory = Path(tempfile.mkdtemp(prefix="esc-w-"))
    holder = start_holder(directory / "h", keeper=True)
    stopped = holder.serving_pid()
    os.kill(stopped, signal.SIGSTOP)
    try:
        yield holder
    finally:
        os.kill(stopped, signal.SIGCONT)
        holder.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_wait_says_what_it_waits_for_once(wedged: HolderProcess) -> None:
    result = escrowctl(wedged.socket, "--timeout", "1.6", "list")
    assert result.returncode == 1
    assert result.stderr.count(NOTICE) == 1, result.stderr
    assert (f"{NOTICE} (pid {wedged.serving_pid()}, under its keeper pid {wedged.pid}) on "
            f"{wedged.socket} to answer (up to 2 s)...\n") in result.stderr, result.stderr
    assert result.stderr.index(NOTICE) < result.stderr.index("(unresponsive)")


def test_status_names_the_stopped_holder_not_its_keeper(wedged: HolderProcess) -> None:
    result = escrowctl(wedged.socket, "status", "--timeout", "1.2")
    assert result.returncode == 150, result.stdout
    assert (f"  holder pid {wedged.serving_pid()} is not answering (its keeper pid "
            f"{wedged.pid} is alive and holds the socket)") in result.stdout, result.stdout
    assert result.stderr.count(NOTICE) == 1, result.stderr


def test_a_listener_whose_pid_cannot_be_named_is_not_called_pid_0(
        wedged: HolderProcess) -> None:
    """From a pid namespace of its own, the kernel names the holder (in an ancestor one)
    pid 0: that is "not known", and the notice names no pid."""
    unshare = require_program("unshare")
    result = subprocess.run(
        [unshare, "--pid", "--fork", sys.executable, "-m", "escrow_client.cli", "--socket",
         wedged.socket, "--timeout", "1.6", "list"],
        capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count(NOTICE) == 1, result.stderr
    assert f"{NOTICE} on {wedged.socket}" in result.stderr, result.stderr
    assert "pid 0" not in result.stderr + result.stdout


def test_a_library_caller_is_told_nothing(wedged: HolderProcess) -> None:
    code = ("import sys\nfrom escrow_client import EscrowClient, errors\n"
            f"try:\n    EscrowClient('x', socket_path={wedged.socket!r}, timeout=1.5).list()\n"
            "except errors.HolderUnresponsive:\n    sys.exit(7)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=20)
    assert (result.returncode, result.stdout, result.stderr) == (7, "", "")


def test_a_fast_answer_has_no_notice(holder: HolderProcess) -> None:
    for args in (["list"], ["status"]):
        result = escrowctl(holder.socket, *args)
        assert result.returncode == 0, result.stderr
        assert NOTICE not in result.stderr


def test_main_in_process_leaves_no_teller_behind(holder: HolderProcess) -> None:
    assert cli.main(["--socket", holder.socket, "list"]) == 0
    assert waiting._teller is None


def test_nothing_is_told_while_quiet_and_once_after(wedged: HolderProcess,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, as escrowctl registers it: inside `quiet()` (an attached program owns
    the screen) a wait is not told; outside, the first one is, naming the listener."""
    told: list[tuple[str, int | None, float]] = []
    monkeypatch.setattr(waiting, "_told", False)
    waiting.tell_with(lambda *words: told.append(words))
    try:
        client = EscrowClient("x", socket_path=wedged.socket, timeout=1.5,
                              breaker_cooldown=0)
        with waiting.quiet(), pytest.raises(errors.HolderUnresponsive):
            client.list()
        assert told == []
        with pytest.raises(errors.HolderUnresponsive):
            client.list()
        with pytest.raises(errors.HolderUnresponsive):
            client.list()  # a second wait: not told again
        assert [(path, pid) for path, pid, _ in told] == [(wedged.socket, wedged.pid)]
    finally:
        waiting.tell_with(None)
