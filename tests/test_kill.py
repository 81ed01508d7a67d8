"""`escrowctl kill` against one real holder: real programs in real PTYs, ended by the
signals the kernel says are theirs, and nothing else touched (client/kill.py).

Every test leaves a bystander session alone; the module ends by checking it still drains,
its program still runs, and the holder is back at its fd baseline."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from otheruser import other_user
from test_cli import deposit, escrowctl

from conftest import (
    OWNER,
    HolderProcess,
    PtyChild,
    require_program,
    require_real,
    spawn_in_pty,
    start_holder,
    wait_for,
)
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


def test_a_handed_off_session_is_said_to_be_the_apps(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    child = deposit(holder, pty_children, "taken")
    got = holder.client().retrieve("taken")
    try:
        result = escrowctl(holder.socket, "kill", f"{OWNER}/taken")
        assert result.returncode == 3
        assert result.stderr == (f"escrowctl: {OWNER}/taken was handed off to an app, which "
                                 "holds it now: close it there\n")
        assert child.proc.poll() is None
    finally:
        os.close(got.fd)


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

    held_open = pty_children(["sh", "-c", "exec sleep 60"])
    wait_for(lambda: process_name(held_open.pid) == "sleep", 5, "sleep")
    slave = os.open(os.readlink(f"/proc/{held_open.pid}/fd/0"), os.O_RDWR | os.O_NOCTTY)
    try:
        hand_off(holder, held_open, "counted-open")
        before = platform.open_fd_count()
        with pytest.raises(kill.NotEnded) as raised:
            kill.kill(client, "counted-open", grace=0.1)
        assert raised.value.code == "held_open"
        assert platform.open_fd_count() == before
    finally:
        os.close(slave)
    client.release("counted-open")


def _children(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children()]


def _exists(pid: int) -> bool:
    return process_alive(pid, None) is not False


def _sleep_running(parent: int, argument: str) -> int:
    """The pid of the `sleep ARGUMENT` under `parent`, once there is one."""
    def found() -> int | None:
        return next((p.pid for p in psutil.Process(parent).children(recursive=True)
                     if p.cmdline() == ["sleep", argument]), None)

    return int(wait_for(found, 10, f"sleep {argument}"))


@pytest.mark.parametrize("line", [
    "(trap '' HUP; exec sleep 301) &",  # a background job the shell's hangup misses
    "sleep 100 | (trap '' HUP; exec sleep 301)",  # a pipeline member ignoring it
], ids=["background", "pipeline"])
def test_a_process_of_the_session_that_keeps_the_terminal_gets_sigkill(
        holder: HolderProcess, pty_children: Callable[..., PtyChild], line: str) -> None:
    """The shell ends on SIGHUP, but a process that ignores it holds the terminal still:
    that is not the end, and it gets SIGKILL after the grace."""
    child = pty_children(["bash", "--norc", "--noprofile", "-i"])
    os.write(child.master, line.encode() + b"\n")
    stubborn = _sleep_running(child.pid, "301")
    wait_for(lambda: psutil.Process(stubborn).status() == "sleeping"
             and signal.SIGHUP in _ignored(stubborn), 5, "HUP ignored")
    sid = f"keeps-{'bg' if '&' in line else 'pipe'}"
    hand_off(holder, child, sid)
    result = escrowctl(holder.socket, "kill", "--grace", GRACE, f"{OWNER}/{sid}")
    assert result.returncode == 0, result.stderr
    assert f"SIGHUP to pid {child.pid} (bash)" in result.stdout
    assert f"SIGKILL to pid {stubborn} (sleep)" in result.stdout, result.stdout
    wait_for(lambda: not _exists(stubborn), 5, "the process that kept the terminal to end")
    assert state(holder, sid) == "released"


def test_a_terminal_held_open_from_outside_the_session_is_not_called_ended(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """Its program ends, but a process of another session (this one) holds the slave: it
    is not signalled, and kill says so with exit 6; the session drains on."""
    child = pty_children(["sh", "-c", "echo ready; exec sleep 60"])
    assert b"ready" in child.read_available(until=b"ready")
    became_sleep(child)
    slave = os.open(os.readlink(f"/proc/{child.pid}/fd/0"), os.O_RDWR | os.O_NOCTTY)
    try:
        hand_off(holder, child, "held-open")
        result = escrowctl(holder.socket, "kill", "--grace", GRACE, f"{OWNER}/held-open")
        assert result.returncode == 6, result.stderr
        assert result.stdout == ""
        assert result.stderr.startswith(
            f"escrowctl: {OWNER}/held-open: not ended: SIGHUP to pid {child.pid} (sleep); "
            "not ended after "), result.stderr
        assert result.stderr.endswith("(escrowctl release hangs it up) (held_open)\n")
        ended_by(child, signal.SIGHUP)
        assert state(holder, "held-open") == "draining"
    finally:
        os.close(slave)
    holder.client().release("held-open")


STALE_FOREGROUND = r"""
import fcntl, json, os, signal, subprocess, sys, termios, time
from escrow_client import EscrowClient, kill, platform
socket_path, owner = sys.argv[1:3]
master, slave = os.openpty()
r, w = os.pipe()
leader = os.fork()
if leader == 0:
    os.close(master); os.setsid(); fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    job = os.fork()
    if job == 0:
        os.setpgid(0, 0)
        os._exit(0)
    try:
        os.setpgid(job, job)
    except OSError:
        pass
    os.tcsetpgrp(slave, job)  # a foreground job, as a shell gives it
    os.waitpid(job, 0)  # reaped, and the terminal not taken back (yet)
    os.write(w, b"%d\n" % job)
    signal.signal(signal.SIGTTOU, signal.SIG_DFL)
    while True:
        signal.pause()
os.close(slave)
job = int(os.read(r, 100))
assert platform.terminal_processes(master) == (leader, job)
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(job - 1))  # another terminal's program takes the number: a pid wrap, forced
bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
client = EscrowClient(owner, socket_path=socket_path)
client.hand_off("stale-fg", master, child_pid=leader)
os.close(master)
killed = kill.kill(client, "stale-fg", grace=0.3)
_, status = os.waitpid(leader, 0)
try:
    bystander.wait(0.5)  # what a wrong SIGHUP would do, given the time to
except subprocess.TimeoutExpired:
    pass
print(json.dumps({"job": job, "bystander": bystander.pid, "leader": leader,
                  "leader_signal": os.WTERMSIG(status), "signalled": killed.signalled,
                  "notes": killed.notes, "bystander_running": bystander.poll() is None}))
"""


def test_a_stale_foreground_group_whose_number_another_session_took_is_not_signalled(
        holder: HolderProcess) -> None:
    """In a pid namespace of its own, where the number can be handed on at will."""
    require_real("root (a pid namespace, ns_last_pid)", os.geteuid() == 0,
                 "run the suite as root, as CI does")
    unshare = require_program("unshare")
    result = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", STALE_FOREGROUND,
         holder.socket, OWNER], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["bystander"] == outcome["job"]
    assert outcome["leader_signal"] == signal.SIGHUP
    assert [s[:2] for s in outcome["signalled"]] == [["SIGHUP", outcome["leader"]]], outcome
    assert outcome["notes"] == [
        f"process group {outcome['job']}, which its terminal names, was not signalled: its "
        "leader has ended, or is not of the terminal's session"], outcome
    assert outcome["bystander_running"], outcome
    assert state(holder, "stale-fg") == "released"


ANOTHER_USERS_FOREGROUND = r"""
import os, signal, sys
setpriv, uid, gid, redirect = sys.argv[1:5]
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
job = os.fork()
if job == 0:
    os.setpgid(0, 0)
    os.execv(setpriv, [setpriv, "--reuid", uid, "--regid", gid, "--clear-groups", "sh", "-c",
                       "trap '' HUP; echo ready; exec sleep 302" + redirect])
try:
    os.setpgid(job, job)
except OSError:
    pass  # it has done so itself, and gone on to exec
os.tcsetpgrp(0, job)
signal.signal(signal.SIGTTOU, signal.SIG_DFL)
os.execvp("sleep", ["sleep", "303"])
"""


def _another_users_job(pty_children: Callable[..., PtyChild],
                       redirect: str) -> tuple[PtyChild, int]:
    """A session leader of ours whose foreground job is the other user's `sleep`."""
    user = other_user()
    child = pty_children([sys.executable, "-c", ANOTHER_USERS_FOREGROUND,
                          require_program("setpriv"), str(user.uid), str(user.gid), redirect])
    assert b"ready" in child.read_available(until=b"ready")
    job = foreground_child(child)
    wait_for(lambda: process_name(child.pid) == "sleep" and process_name(job) == "sleep", 5,
             "both to exec sleep")
    return child, job


def _kill_without_cap_kill(holder: HolderProcess, sid: str) -> subprocess.CompletedProcess[str]:
    """`escrowctl kill` as this uid (root) without CAP_KILL: another user's process is not
    its to signal."""
    return subprocess.run(
        [require_program("setpriv"), "--bounding-set", "-kill", "--inh-caps", "-kill",
         sys.executable, "-m", "escrow_client.cli", "--socket", holder.socket, "kill",
         "--grace", GRACE, f"{OWNER}/{sid}"], capture_output=True, text=True, timeout=20)


def test_another_users_process_is_told_the_rest_is_done_and_the_outcome_is_real(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """The foreground job is another user's and ignores SIGHUP; kill may not signal it
    (escrowctl runs without CAP_KILL): the leader still gets its SIGHUP and ends, every step
    is said, and the exit is 5 with the session escrowed."""
    child, job = _another_users_job(pty_children, "")
    try:
        hand_off(holder, child, "others")
        result = _kill_without_cap_kill(holder, "others")
        assert result.returncode == 5, result.stderr
        assert result.stdout == ""
        assert re.fullmatch(
            rf"escrowctl: {OWNER}/others: not ended: SIGHUP to process group {job} \(sleep\) "
            rf"not permitted: it is another user's; SIGHUP to pid {child.pid} \(sleep\); "
            r"not ended after \d+\.\d s; "
            rf"SIGKILL to pid {job} \(sleep\) not permitted: it is another user's; "
            rf"pid {job} \(sleep\) still running \d+\.\d s after the first signal: the "
            r"holder drains the session again \(running\)\n", result.stderr), result.stderr
        ended_by(child, signal.SIGHUP)
        assert _exists(job)
        assert state(holder, "others") == "draining"
    finally:
        os.kill(job, signal.SIGKILL)
    wait_for(lambda: not _exists(job), 5, "the other user's job to end")
    holder.client().release("others")


def test_another_users_process_that_lets_go_of_the_terminal_is_ended_and_told(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """Not permitted to signal it, but it holds no fd of the terminal: once the leader ends
    the terminal hangs up, so the session is ended (exit 0), and that process is told."""
    child, job = _another_users_job(pty_children, " </dev/null >/dev/null 2>&1")
    try:
        hand_off(holder, child, "others-gone")
        result = _kill_without_cap_kill(holder, "others-gone")
        assert result.returncode == 0, result.stderr
        assert re.fullmatch(
            rf"killed {OWNER}/others-gone: SIGHUP to process group {job} \(sleep\) not "
            rf"permitted: it is another user's; SIGHUP to pid {child.pid} \(sleep\); ended "
            rf"after \d+\.\d s; released; pid {job} \(sleep\), another user's, still runs, "
            r"no longer on the terminal\n", result.stdout), result.stdout
        ended_by(child, signal.SIGHUP)
        assert state(holder, "others-gone") == "released"
    finally:
        os.kill(job, signal.SIGKILL)


def _ignored(pid: int) -> set[int]:
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("SigIgn:"))
    bits = int(mask.split()[1], 16)
    return {n for n in range(1, 64) if bits >> (n - 1) & 1}
