"""`escrowctl kill` against one real holder: real programs in real PTYs, ended by the
signals the kernel says are theirs, and nothing else touched (client/kill.py).

Every test leaves a bystander session alone; the module ends by checking it still drains,
its program still runs, and the holder is back at its fd baseline."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from test_cli import deposit, escrowctl

from conftest import OWNER, HolderProcess, PtyChild, spawn_in_pty, start_holder, wait_for
from escrow_client import EscrowClient, kill, platform
from escrow_client.liveness import process_alive, process_name
from escrow_client.protocol import SessionInfo

GRACE = "0.3"  # short: a program that ignores SIGHUP costs the tests this much


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[HolderProcess, PtyChild]]:
    directory = Path(tempfile.mkdtemp(prefix="esc-kill-"))
    os.chmod(directory, 0o700)
    holder = start_holder(directory / "h")
    bystander = spawn_in_pty(["sh", "-c", "echo ready; exec sleep 600"])
    try:
        assert b"ready" in bystander.read_available(until=b"ready")
        holder.client().hand_off("bystander", bystander.master, child_pid=bystander.pid)
        yield holder, bystander
        assert holder.alive(), holder.logs()[-3000:]
        assert state(holder, "bystander") == "draining"
        assert bystander.proc.poll() is None, "the bystander's program was touched"
        assert " event=internal_error " not in holder.logs()
        holder.release_everything()
        holder.wait_fds_at_baseline()
    finally:
        bystander.kill()
        os.close(bystander.master)
        holder.stop()


@pytest.fixture
def holder(shared: tuple[HolderProcess, PtyChild]) -> HolderProcess:
    return shared[0]


def session(holder: HolderProcess, sid: str) -> SessionInfo | None:
    return next((s for s in holder.client().list() if s.id == sid), None)


def state(holder: HolderProcess, sid: str) -> str:
    info = session(holder, sid)
    return "unknown" if info is None else info.state


def ended_by(child: PtyChild, signum: int) -> None:
    assert child.proc.wait(5) == -signum


def sleeper(holder: HolderProcess, pty_children: Callable[..., PtyChild],
            sid: str) -> PtyChild:
    """A draining session whose shell has become `sleep` (kill names what it signals)."""
    child = deposit(holder, pty_children, sid)
    became_sleep(child)
    return child


def became_sleep(child: PtyChild) -> None:
    wait_for(lambda: process_name(child.pid) == "sleep", 5, "the shell to exec sleep")


def hand_off(holder: HolderProcess, child: PtyChild, sid: str,
             child_pid: int | None = None) -> None:
    holder.client().hand_off(sid, child.master,
                             child_pid=child.pid if child_pid is None else child_pid)
    os.close(child.master)
    child.master = -1


def test_kill_ends_a_draining_shell_and_releases_it(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    child = sleeper(holder, pty_children, "plain")
    result = escrowctl(holder.socket, "kill", f"{OWNER}/plain")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"killed {OWNER}/plain: SIGHUP to pid {child.pid} \(sleep\); "
                        r"ended after \d+\.\d s; released\n", result.stdout), result.stdout
    ended_by(child, signal.SIGHUP)
    assert state(holder, "plain") == "released"


def test_a_program_that_ignores_sighup_gets_sigkill_after_the_grace(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    child = pty_children(["sh", "-c", "trap '' HUP; echo ready; while :; do sleep 1; done"])
    assert b"ready" in child.read_available(until=b"ready")
    hand_off(holder, child, "stubborn")
    result = escrowctl(holder.socket, "kill", "--grace", GRACE, f"{OWNER}/stubborn")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        rf"killed {OWNER}/stubborn: SIGHUP to pid {child.pid} \(sh\); not ended after "
        rf"\d+\.\d s; SIGKILL to pid {child.pid} \(sh\); ended after \d+\.\d s; released\n",
        result.stdout), result.stdout
    ended_by(child, signal.SIGKILL)
    assert state(holder, "stubborn") == "released"


def test_a_program_that_writes_without_end_is_still_killed_after_the_grace(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """What it prints is read while it is awaited; the reading never hides the deadline."""
    child = pty_children(["sh", "-c", "trap '' HUP; echo ready; exec yes"])
    assert b"ready" in child.read_available(until=b"ready")
    hand_off(holder, child, "chatty")
    result = escrowctl(holder.socket, "kill", "--grace", GRACE, f"{OWNER}/chatty")
    assert result.returncode == 0, result.stderr
    assert f"SIGKILL to pid {child.pid} (yes)" in result.stdout
    ended_by(child, signal.SIGKILL)
    assert state(holder, "chatty") == "released"


def foreground_child(child: PtyChild) -> int:
    """The pid of the foreground job of `child`'s terminal, once it is not `child`."""
    def other() -> int | None:
        named = platform.terminal_processes(child.master)
        assert named is not None
        return named[1] if named[1] not in (None, child.pid) else None

    return int(wait_for(other, 10, "a foreground job"))


@pytest.mark.parametrize("argv", [
    ["bash", "-c", "echo ready; sleep 100; true"],  # a child in the leader's own group
    ["bash", "--norc", "--noprofile", "-i"],  # a job of its own, in the foreground
], ids=["child", "job"])
def test_a_program_and_its_foreground_child_both_end(
        holder: HolderProcess, pty_children: Callable[..., PtyChild], argv: list[str]) -> None:
    child = pty_children(argv)
    if "-i" in argv:
        os.write(child.master, b"sleep 100\n")
        sleeper = foreground_child(child)
    else:
        assert b"ready" in child.read_available(until=b"ready")
        sleeper = int(wait_for(lambda: next(iter(_children(child.pid)), None), 10, "sleep"))
    hand_off(holder, child, f"fg-{argv[1]}")
    result = escrowctl(holder.socket, "kill", "--grace", GRACE, f"{OWNER}/fg-{argv[1]}")
    assert result.returncode == 0, result.stderr
    assert f"SIGHUP to pid {child.pid} (bash)" in result.stdout
    if "-i" in argv:
        assert f"SIGHUP to pid {sleeper} (sleep)" in result.stdout
    assert "SIGKILL" not in result.stdout
    child.proc.wait(5)
    wait_for(lambda: not _exists(sleeper), 5, "the foreground child to end")


def test_the_pid_the_app_claimed_is_not_touched(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """An app said its program was a process of another terminal: that one lives on."""
    victim = pty_children(["sh", "-c", "echo ready; exec sleep 60"])
    assert b"ready" in victim.read_available(until=b"ready")
    child = pty_children(["sh", "-c", "echo ready; exec sleep 60"])
    assert b"ready" in child.read_available(until=b"ready")
    became_sleep(victim)
    became_sleep(child)
    hand_off(holder, child, "liar", child_pid=victim.pid)
    result = escrowctl(holder.socket, "kill", f"{OWNER}/liar")
    assert result.returncode == 0, result.stderr
    assert f"SIGHUP to pid {child.pid} (sleep)" in result.stdout
    assert (f"the app said its program is pid {victim.pid} (sleep), which is not in this "
            f"terminal's session (led by pid {child.pid}): it was not signalled"
            ) in result.stdout
    ended_by(child, signal.SIGHUP)
    assert victim.proc.poll() is None
    assert b"" == victim.read_available(timeout=0.2)  # its terminal was not hung up either


def test_a_session_held_by_a_custodian_is_refused_and_unchanged(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    child = pty_children(["sh", "-c", "exec sleep 60"])
    with holder.client().custody() as custody:
        custody.deposit("held", child.master, child_pid=child.pid)
        result = escrowctl(holder.socket, "kill", f"{OWNER}/held")
        assert result.returncode == 4, result.stderr
        assert result.stdout == ""
        assert result.stderr.startswith(
            f"escrowctl: {OWNER}/held: not killed: it is held by pid {os.getpid()} (")
        assert "escrowctl attach -d" in result.stderr
        assert result.stderr.endswith("nothing was changed (custody_held)\n")
        assert child.proc.poll() is None
        info = session(holder, "held")
        assert info is not None and (info.state, info.custodian_pid) == ("held", os.getpid())
        custody.release("held")


def test_an_unknown_session_fails_clearly(holder: HolderProcess) -> None:
    before = {(s.id, s.state) for s in holder.client().list()}
    result = escrowctl(holder.socket, "kill", f"{OWNER}/no-such-tab")
    assert result.returncode == 3
    assert result.stdout == ""
    assert result.stderr == (f"escrowctl: {OWNER}/no-such-tab is unknown to the holder: there "
                             "is nothing to kill\n")
    assert {(s.id, s.state) for s in holder.client().list()} == before


def test_a_released_session_has_nothing_to_kill(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    deposit(holder, pty_children, "gone")
    holder.client().release("gone")
    result = escrowctl(holder.socket, "kill", f"{OWNER}/gone")
    assert result.returncode == 3
    assert result.stderr == f"escrowctl: {OWNER}/gone is released: there is nothing to kill\n"


def test_a_session_whose_program_ended_is_only_released(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    child = pty_children(["sh", "-c", "echo bye"])
    assert b"bye" in child.read_available(until=b"bye")
    child.proc.wait(5)
    hand_off(holder, child, "ended")
    wait_for(lambda: state(holder, "ended") == "exited", 5, "exited")
    result = escrowctl(holder.socket, "kill", f"{OWNER}/ended")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"killed {OWNER}/ended: its program had already ended; released\n"
    assert state(holder, "ended") == "released"


def test_a_terminal_with_no_session_on_it_is_refused_as_indeterminate(
        holder: HolderProcess) -> None:
    """Something holds the terminal open but it is nobody's controlling terminal: the
    kernel names no process, so none is signalled, and the session drains on."""
    master, slave = os.openpty()
    proc = subprocess.Popen(["sleep", "60"], stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    try:
        holder.client().hand_off("no-ctty", master, child_pid=proc.pid)
        os.close(master)
        result = escrowctl(holder.socket, "kill", f"{OWNER}/no-ctty")
        assert result.returncode == 4, result.stderr
        assert "nothing was signalled" in result.stderr
        assert result.stderr.endswith("(indeterminate)\n")
        assert proc.poll() is None
        assert state(holder, "no-ctty") == "draining"
        holder.client().release("no-ctty")
    finally:
        proc.kill()
        proc.wait()


def test_the_library_leaks_no_fd_killing_or_refusing(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    client = EscrowClient(OWNER, socket_path=holder.socket)
    client.list()  # whatever a first call sets up for good is set up before counting
    child = sleeper(holder, pty_children, "counted")
    before = platform.open_fd_count()
    killed = kill.kill(client, "counted", grace=0.3)
    assert killed.signalled == [("SIGHUP", child.pid, "sleep")]
    assert platform.open_fd_count() == before
    ended_by(child, signal.SIGHUP)

    with pytest.raises(kill.Refused):
        held = pty_children(["sh", "-c", "exec sleep 60"])
        with client.custody() as custody:
            custody.deposit("counted-held", held.master, child_pid=held.pid)
            before = platform.open_fd_count()
            try:
                kill.kill(client, "counted-held")
            finally:
                assert platform.open_fd_count() == before
                custody.release("counted-held")


def _children(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children()]


def _exists(pid: int) -> bool:
    return process_alive(pid, None) is not False
