"""`escrowctl attach -d`: taking a session over from another escrowctl attach or run
(client/takeover.py).

On a real screen (tmux, the panes of test_attach.py): a session in `escrowctl run` in one
pane is taken over from another, then taken back with `attach -d` from the first; the pane
that lets go shows why and its prompt, with its terminal modes as they were. Without a
screen, in a bare PTY: what is never taken over (an app's custody, a consent that cannot be
believed), what a stray SIGUSR1 does (nothing), and the answers of a takeover that cannot
happen (another under way, an attachment that does not let go).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import psutil
import pytest
from test_attach import (
    ESCROWCTL,
    INNER,
    INNER_BASH,
    OUTER,
    RUN_OWNER,
    TIMEOUT,
    Pane,
    escrowctl_in_a_pty,
    screens,  # noqa: F401  (a fixture)
    session,
)
from test_attach import Screens as Screens

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import SessionInfo, liveness, processes, takeover, takeover_note
from escrow_client.attach_signals import Signals


def consenting(holder: HolderProcess, sid: str, other_than: int | None = None) -> int:
    """The pid of the escrowctl attached to `sid` (not `other_than`), once it can be taken
    over."""
    def pid() -> int | None:
        info = session(holder, sid)
        if info is None or not takeover.consented(info) or info.custodian_pid == other_than:
            return None
        return info.custodian_pid

    wait_for(pid, TIMEOUT, f"{sid} to be attached elsewhere, and consent to a takeover")
    found = pid()
    assert found is not None
    return found


def attached_in(pane: Pane, script: str) -> None:
    """Run `script` in `pane`, between two `stty -g` and with its exit status shown."""
    d = pane.server.dir
    pane.line(f"stty -g >{d}/{pane.name}.before; {script}; echo \"rc=$?\"; "
              f"stty -g >{d}/{pane.name}.after")


def let_go(pane: Pane, by: Pane, by_pid: int) -> None:
    """`pane` was taken over by `by`: it says so, exits 0, and has its modes back."""
    tty = by.value("#{pane_tty}")
    pane.wait_text(f"taken over by escrowctl attach -d (pid {by_pid}, {tty})")
    assert pane.wait_line(r"^rc=(\d+)$")[1] == "0"
    pane.wait_prompt(OUTER)
    d = pane.server.dir
    after = d / f"{pane.name}.after"
    wait_for(lambda: after.exists() and after.read_text().endswith("\n"), TIMEOUT, "stty -g")
    assert after.read_text() == (d / f"{pane.name}.before").read_text()


def test_attach_d_takes_a_session_over_from_run_and_from_attach(
    screens: Screens, holder: HolderProcess  # noqa: F811
) -> None:
    a, b = screens.pane("a"), screens.pane("b")
    attached_in(a, f"escrowctl run --id t1 -- {INNER_BASH}")
    a.wait_prompt(INNER)
    info = session(holder, "t1")
    assert info is not None and info.child_pid is not None
    shell = info.child_pid
    first = consenting(holder, "t1")
    a.line("echo 'before'-takeover")

    # b takes it from `run` in a: the replay, then typing reaches the same shell.
    attached_in(b, "escrowctl attach -d escrowctl/t1")
    second = consenting(holder, "t1", other_than=first)
    let_go(a, b, second)
    b.wait_text("before-takeover")
    b.line('echo "on-b:$$"')
    b.wait_line(rf"^on-b:{shell}$")

    # a takes it back from `attach` in b.
    a.line("escrowctl attach -d escrowctl/t1")
    third = consenting(holder, "t1", other_than=second)
    let_go(b, a, third)
    a.line('echo "on-a:$$"')
    a.wait_line(rf"^on-a:{shell}$")
    assert psutil.Process(shell).is_running()
    a.line("exit")
    a.wait_text(f"{RUN_OWNER}/t1 has ended")


# --- without a screen -------------------------------------------------------------------


@pytest.fixture
def usr1_noted() -> Callable[[], list[int]]:
    """SIGUSR1 to this process noted, not fatal, for the test; what came so far."""
    came: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        came.append(signum)

    old = signal.signal(signal.SIGUSR1, note)
    yield lambda: list(came)
    signal.signal(signal.SIGUSR1, old)


def test_an_apps_custody_is_refused_and_the_app_never_signalled(
    holder: HolderProcess, pty_children: Callable[..., PtyChild],
    usr1_noted: Callable[[], list[int]]
) -> None:
    program = pty_children(["sh", "-c", "echo held-here; exec sleep 60"])
    bystander = subprocess.Popen(["sleep", "60"])  # dies of a SIGUSR1
    try:
        with holder.client().custody() as custody:
            custody.deposit("t1", program.master, child_pid=program.pid, label="sh")
            before = session(holder, "t1", OWNER)
            rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", "-d", f"{OWNER}/t1")
            assert rc == 1
            assert f"{OWNER}/t1 is held by pid {os.getpid()} (" in out, out
            assert "it did not agree to be taken over (an app, or an attach whose session " \
                "meta had no room); it must let go; nothing was changed" in out, out

            # A consent in the meta that names another process (one an app copied, say)
            # is none: the process it names is not signalled either.
            start = liveness.process_start_time(bystander.pid)
            custody.update("t1", meta={takeover.KEY: f"{bystander.pid} {start!r}"})
            rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", "-d", f"{OWNER}/t1")
            assert rc == 1 and "did not agree to be taken over" in out, out
            after = session(holder, "t1", OWNER)
            assert after is not None and before is not None
            assert (after.state, after.custodian_pid) == ("held", os.getpid())
            assert b"held-here" in program.read_available(until=b"held-here")  # still ours
            custody.release("t1")
        assert usr1_noted() == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_consent_is_believed_only_of_its_pid_start_time_and_uid(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    me = os.getpid()
    start = liveness.process_start_time(me)

    def info(custodian: int | None, value: str, state: str = "held") -> SessionInfo:
        return SessionInfo(owner=OWNER, id="t1", state=state, custodian_pid=custodian,
                           meta={takeover.KEY: value})

    assert takeover.consented(info(me, f"{me} {start!r}")) == (me, start)
    assert takeover.consented(info(me, f"{me} {start!r}", "draining")) is None
    assert takeover.consented(info(me, f"{me} {(start or 0) + 5!r}")) is None  # reused pid
    assert takeover.consented(info(me, f"{me + 1} {start!r}")) is None  # not the custodian
    assert takeover.consented(info(me, "garbage")) is None
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert takeover.consented(info(me, f"{me} {start!r}")) is None  # another uid's


def escrowctl_attached(pty_children: Callable[..., PtyChild], holder: HolderProcess,
                       sid: str) -> tuple[PtyChild, int]:
    """`escrowctl run` of a `cat` in a PTY of its own, attached and consenting."""
    child = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", sid, "--",
                          "sh", "-c", "echo re''ady; exec cat"])
    assert b"ready" in child.read_available(until=b"ready")
    return child, consenting(holder, sid)


def still_attached(child: PtyChild, holder: HolderProcess, sid: str, pid: int) -> None:
    """Typing still reaches the program, and the session is held by the same escrowctl."""
    os.write(child.master, b"still-here\r")
    assert b"still-here" in child.read_available(until=b"still-here\r\nstill-here")
    info = session(holder, sid)
    assert info is not None and (info.state, info.custodian_pid) == ("held", pid)


def write_note(holder: HolderProcess, note: takeover.Note, mode: int = 0o600) -> str:
    path = takeover.note_path(holder.socket, note.for_pid)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(note), f)
    os.chmod(path, mode)
    return path


def note_for(holder: HolderProcess, pid: int, sid: str, **changes: object) -> takeover.Note:
    start = liveness.process_start_time(pid)
    assert start is not None
    note = takeover.Note(RUN_OWNER, sid, pid, start, os.getpid(),
                         liveness.process_start_time(os.getpid()), "/dev/pts/x",
                         time.time() + 60)
    return dataclasses.replace(note, **changes)  # type: ignore[arg-type]


def test_a_stray_sigusr1_changes_nothing(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child, pid = escrowctl_attached(pty_children, holder, "s1")
    os.kill(pid, signal.SIGUSR1)  # no note at all
    still_attached(child, holder, "s1", pid)
    # Notes it must not believe: for another session, open to others, expired, from a
    # requester that is gone.
    gone = subprocess.Popen(["true"])
    gone.wait()
    info = session(holder, "s1")
    assert info is not None
    inside = takeover.consent_terminal(info)
    assert inside is not None or sys.platform != "linux"
    for note, mode in ((note_for(holder, pid, "other"), 0o600),
                       *([(note_for(holder, pid, "s1", by_terminals=[list(inside)]), 0o600)]
                         if inside else []),
                       (note_for(holder, pid, "s1"), 0o644),
                       (note_for(holder, pid, "s1", expires=time.time() - 1), 0o600),
                       (note_for(holder, pid, "s1", by_pid=gone.pid), 0o600)):
        path = write_note(holder, note, mode)
        os.kill(pid, signal.SIGUSR1)
        still_attached(child, holder, "s1", pid)
        os.unlink(path)
    os.write(child.master, b"\x1c")
    assert b"detached from" in child.read_available(until=b"attach again with")
    assert child.proc.wait(TIMEOUT) == 0


# The program of a `run`: it closes its terminal (the attachment ends, and escrowctl
# releases the session and waits for it), waits for the release, sends escrowctl a
# SIGUSR1 (its pid in the file argv[3] names), and exits 3.
_SIGNALS_ESCROWCTL = """
import json, os, signal, subprocess, sys, time
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the hang-up of its terminal, closed
for fd in (0, 1, 2):
    os.close(fd)
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    out = subprocess.run([sys.argv[1], "--socket", sys.argv[2], "list", "--all", "--json"],
                         capture_output=True, stdin=subprocess.DEVNULL).stdout
    if any(s["id"] == "s3" and s["state"] == "released" for s in json.loads(out or "[]")) \
            and os.path.getsize(sys.argv[3]):
        break
    time.sleep(0.02)
# escrowctl's pid, from the test (the holder started this program: its parent is not it).
os.kill(int(open(sys.argv[3]).read()), signal.SIGUSR1)
sys.exit(3)
"""


def test_a_sigusr1_outside_an_attachment_does_not_kill_escrowctl(
    holder: HolderProcess, pty_children: Callable[..., PtyChild], tmp_path: Path
) -> None:
    pid_file = tmp_path / "escrowctl.pid"
    child = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "s3", "--",
                          sys.executable, "-c", _SIGNALS_ESCROWCTL, ESCROWCTL,
                          holder.socket, str(pid_file)])
    pid_file.write_text(str(child.proc.pid))
    assert child.proc.wait(TIMEOUT) == 3  # not killed by the signal (-SIGUSR1)


def test_a_takeover_under_way_and_one_not_let_go_change_nothing(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    # Budgets that let a --timeout of 1.5 s retrieve (the timeout invariant).
    holder = make_holder("--drain-stop-budget", "0.3", "--send-deadline", "0.3")
    child, pid = escrowctl_attached(pty_children, holder, "s2")
    # Another takeover under way (its requester, this process, runs): told, nothing sent.
    path = write_note(holder, note_for(holder, pid, "s2"))
    rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", "-d", f"{RUN_OWNER}/s2")
    assert rc == 1 and f"is being taken over already by pid {os.getpid()}" in out, out
    assert "(busy)" in out, out
    still_attached(child, holder, "s2", pid)
    # A stale note (its requester gone) is replaced; an attachment that does not let go
    # (stopped) costs the deadline, and nothing changes.
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_note(holder, note_for(holder, pid, "s2", by_pid=gone.pid))
    os.kill(pid, signal.SIGSTOP)
    try:
        rc, out = escrowctl_in_a_pty(pty_children, holder, "--timeout", "1.5", "attach",
                                     "-d", f"{RUN_OWNER}/s2")
    finally:
        os.kill(pid, signal.SIGCONT)  # its SIGUSR1 comes now, with no note left
    assert rc == 1, out
    assert f"waiting for pid {pid} to let go of {RUN_OWNER}/s2" in out, out
    assert f"pid {pid}, attached to {RUN_OWNER}/s2, did not let go within 1.5 s; nothing " \
        "was changed" in out, out
    assert not os.path.exists(path)
    still_attached(child, holder, "s2", pid)
    os.write(child.master, b"\x1c")
    assert b"detached from" in child.read_available(until=b"attach again with")


def test_an_attachment_that_cannot_be_taken_over_leaves_sigusr1_alone() -> None:
    def mine(signum: int, frame: FrameType | None) -> None:
        pass

    old = signal.signal(signal.SIGUSR1, mine)
    try:
        signals = Signals(None, False)  # type: ignore[arg-type]  (no terminal is written)
        with signals.handled():
            assert signal.getsignal(signal.SIGUSR1) is mine
        signals.keyboard_back()
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, old)


# A library caller attached to a session (argv: socket, owner, id), with a SIGUSR1 handler
# of its own: it says when the handler runs, and how the attachment ended.
_LIBRARY_CALLER = """
import signal, sys
from escrow_client import EscrowClient, attach
signal.signal(signal.SIGUSR1, lambda *_: print("mine-ran", flush=True))
client = EscrowClient(sys.argv[2], socket_path=sys.argv[1])
ending = attach.attach(client, sys.argv[3], None)
print("ended:", ending.why, flush=True)
"""


def test_a_library_callers_attachment_does_not_consent_and_keeps_its_sigusr1(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    program = pty_children(["sh", "-c", "echo hi; exec cat"])
    with holder.client(RUN_OWNER).custody() as custody:
        custody.deposit("l1", program.master, child_pid=program.pid)
    app = pty_children([sys.executable, "-c", _LIBRARY_CALLER, holder.socket, RUN_OWNER,
                        "l1"])
    wait_for(lambda: (s := session(holder, "l1")) is not None and s.state == "held"
             and s.custodian_pid == app.pid, TIMEOUT, "the library caller to attach")
    info = session(holder, "l1")
    assert info is not None and takeover.KEY not in info.meta
    rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", "-d", f"{RUN_OWNER}/l1")
    assert rc == 1 and "did not agree to be taken over" in out, out
    os.kill(app.pid, signal.SIGUSR1)  # its own handler runs, even while attached
    assert b"mine-ran" in app.read_available(until=b"mine-ran")
    os.kill(app.pid, signal.SIGTERM)
    assert b"ended: SIGTERM" in app.read_available(until=b"ended: SIGTERM")
    assert app.proc.wait(TIMEOUT) == 0


def _blocked_writing(pid: int) -> bool:
    """`pid` sleeps in a write to a terminal that takes no more (n_tty_write waits)."""
    with open(f"/proc/{pid}/wchan") as f:
        return f.read() == "wait_woken"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/wchan")
def test_an_attachment_blocked_writing_to_a_frozen_terminal_is_taken_over(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    old = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "f1", "--",
                        "sh", "-c", "echo re''ady; read x; exec yes"])
    assert b"ready" in old.read_available(until=b"ready")
    pid = consenting(holder, "f1")
    os.write(old.master, b"go\r")  # and its terminal is never read again
    wait_for(lambda: _blocked_writing(pid), TIMEOUT, "escrowctl to block writing")
    new = pty_children([ESCROWCTL, "--socket", holder.socket, "attach", "-d",
                        f"{RUN_OWNER}/f1"])
    assert old.proc.wait(TIMEOUT) == 0
    consenting(holder, "f1", other_than=pid)
    info = session(holder, "f1")
    assert info is not None and info.child_pid is not None
    os.kill(info.child_pid, signal.SIGKILL)  # `yes`
    os.kill(new.pid, signal.SIGTERM)  # nobody reads its terminal either
    assert new.proc.wait(TIMEOUT) == 0


def test_attach_d_inside_the_session_itself_is_refused(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "n1", "--",
                          "sh", "-c", "echo re''ady; exec sh"])
    assert b"ready" in child.read_available(until=b"ready")
    pid = consenting(holder, "n1")
    os.write(child.master, f"{ESCROWCTL} --socket {holder.socket} attach -d "
             f"{RUN_OWNER}/n1; echo \"rc=$?\"\r".encode())
    told = child.read_available(until=b"rc=1").decode(errors="replace")
    assert f"this terminal is {RUN_OWNER}/n1's own" in told, told
    assert "nothing was changed" in told, told
    os.write(child.master, b"exec cat\r")
    still_attached(child, holder, "n1", pid)
    os.write(child.master, b"\x1c")
    assert b"detached from" in child.read_available(until=b"attach again with")

def test_two_takeovers_at_once_one_ends_up_with_it_and_the_other_is_told(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    old, pid = escrowctl_attached(pty_children, holder, "s4")
    racers = [pty_children([ESCROWCTL, "--socket", holder.socket, "attach", "-d",
                            f"{RUN_OWNER}/s4"]) for _ in range(2)]
    assert old.proc.wait(TIMEOUT) == 0
    assert b"taken over by escrowctl attach -d" in old.read_available(until=b"taken over")
    wait_for(lambda: any(r.proc.poll() is not None for r in racers), TIMEOUT,
             "one takeover to give up")
    (loser,) = [r for r in racers if r.proc.poll() is not None]
    (winner,) = [r for r in racers if r is not loser]
    told = loser.read_available().decode(errors="replace")
    if loser.proc.returncode == 0:
        # It took the session first; the other asked only once it had it, and took it
        # over in turn.
        assert f"taken over by escrowctl attach -d (pid {winner.pid}," in told, told
    else:  # their requests crossed
        assert loser.proc.returncode == 1, told
        assert any(why in told for why in ("is being taken over already", "meanwhile")), told
        assert "nothing was changed" in told, told
    wait_for(lambda: (s := session(holder, "s4")) is not None
             and (s.state, s.custodian_pid) == ("held", winner.pid), TIMEOUT,
             "the winner to hold it")
    still_attached(winner, holder, "s4", winner.pid)
    os.write(winner.master, b"\x1c")
    assert b"detached from" in winner.read_available(until=b"attach again with")


def test_a_takeover_that_times_out_as_the_old_one_lets_go_retrieves_it(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    holder = make_holder("--drain-stop-budget", "0.3", "--send-deadline", "0.3")
    old, pid = escrowctl_attached(pty_children, holder, "d1")
    os.kill(pid, signal.SIGSTOP)
    notes: list[takeover.Note] = []
    write, remove, ttyname = takeover_note.write, takeover_note.remove, os.ttyname

    def recorded(path: str, ref: str, note: takeover.Note) -> tuple[int, int]:
        notes.append(note)
        return write(path, ref, note)

    def slow_ttyname(fd: int) -> str:
        time.sleep(0.5)  # a loaded machine, between the start and the note
        return ttyname(fd)

    def let_go_at_the_deadline(path: str, inode: tuple[int, int] | None) -> None:
        if inode is not None and path == takeover.note_path(holder.socket, pid):
            # The old attachment lets go just as the requester gives up.
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)
            wait_for(lambda: (s := session(holder, "d1")) is not None and s.state != "held",
                     TIMEOUT, "the old attachment to let go")
        remove(path, inode)

    monkeypatch.setattr(takeover_note, "write", recorded)
    monkeypatch.setattr(takeover_note, "remove", let_go_at_the_deadline)
    monkeypatch.setattr(os, "ttyname", slow_ttyname)
    client = holder.client(RUN_OWNER, timeout=1.5)
    told: list[str] = []
    with client.custody() as custody:
        asked = time.time()
        with pytest.raises(takeover.errors.CustodyHeld) as held:
            custody.retrieve("d1", journal=True)
        started = time.time()
        got = takeover.take_over(client, custody, "d1", held.value, asked, told.append)
        os.close(got.fd)
        info = session(holder, "d1")
        assert info is not None and (info.state, info.custodian_pid) == ("held", os.getpid())
    (note,) = notes
    # The requester's own deadline (the ttyname's half second not added to it).
    assert note.expires < started + 1.5 + 0.25
    assert told == [f"escrowctl: waiting for pid {pid} to let go of {RUN_OWNER}/d1 (up to "
                    "1.5 s)"]
    assert "escrowctl" not in capfd.readouterr().err  # a library prints nothing itself
    assert old.proc.wait(TIMEOUT) == 0


def test_a_file_at_the_notes_path_that_is_no_note_is_stale_once_old(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child, pid = escrowctl_attached(pty_children, holder, "e1")
    path = takeover.note_path(holder.socket, pid)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # killed mid-write
    rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", "-d", f"{RUN_OWNER}/e1")
    assert rc == 1 and f"is being taken over already (see {path})" in out, out
    still_attached(child, holder, "e1", pid)
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    new = pty_children([ESCROWCTL, "--socket", holder.socket, "attach", "-d",
                        f"{RUN_OWNER}/e1"])
    assert child.proc.wait(TIMEOUT) == 0
    second = consenting(holder, "e1", other_than=pid)
    assert second == new.pid and not os.path.exists(path)
    os.write(new.master, b"\x1c")
    assert b"detached from" in new.read_available(until=b"attach again with")


def test_a_note_is_removed_only_if_it_is_the_one_written(tmp_path: Path) -> None:
    path = str(tmp_path / "takeover-1")
    Path(path).write_text("")
    st = os.stat(path)
    takeover_note.remove(path, (st.st_dev, st.st_ino + 1))  # another's, in its place
    assert os.path.exists(path)
    takeover_note.remove(path, (st.st_dev, st.st_ino))
    assert not os.path.exists(path)


def test_signal_if_without_pidfds_still_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfds(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")  # ENOSYS: a kernel before 5.3

    monkeypatch.setattr(os, "pidfd_open", no_pidfds, raising=False)
    target = subprocess.Popen(["sleep", "60"])
    try:
        assert not processes.signal_if(target.pid, signal.SIGTERM, lambda: False)
        assert target.poll() is None
        assert processes.signal_if(target.pid, signal.SIGTERM, lambda: True)
        assert target.wait(TIMEOUT) == -signal.SIGTERM
    finally:
        target.kill()
        target.wait()


def test_the_wait_for_a_consent_ends_even_if_the_wall_clock_stands_still(
    holder: HolderProcess, pty_children: Callable[..., PtyChild],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    program = pty_children(["sh", "-c", "exec sleep 60"])
    client = holder.client(RUN_OWNER)
    with client.custody() as app, client.custody() as custody:
        app.deposit("w1", program.master, child_pid=program.pid)
        asked = time.time()
        with pytest.raises(takeover.errors.CustodyHeld) as held:
            custody.retrieve("w1", journal=True)
        info = session(holder, "w1")
        assert info is not None
        now = info.state_since  # stepped back to the moment it was taken, and stopped
        monkeypatch.setattr(takeover.time, "time", lambda: now)
        started = time.monotonic()
        with pytest.raises(takeover.errors.CustodyHeld, match="did not agree"):
            takeover.take_over(client, custody, "w1", held.value, asked)
        assert time.monotonic() - started < TIMEOUT
        monkeypatch.undo()
        app.release("w1")


def test_after_takeovers_the_holder_has_no_more_fds_and_the_meta_is_as_deposited(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    program = pty_children(["sh", "-c", "echo hi; exec cat"])
    meta = {"cwd": "/somewhere", "title": "t"}
    with holder.client(RUN_OWNER).custody() as custody:
        custody.deposit("m1", program.master, child_pid=program.pid, meta=meta)
    wait_for(lambda: (s := session(holder, "m1")) is not None and s.state == "draining",
             TIMEOUT, "the holder to drain it")
    # A count taken between calls may still hold a connection on its way out: "no more
    # than" is the leak's test.
    draining = holder.fd_count()
    child = pty_children([ESCROWCTL, "--socket", holder.socket, "attach", f"{RUN_OWNER}/m1"])
    pid = consenting(holder, "m1")
    fds = holder.fd_count()
    new = pty_children([ESCROWCTL, "--socket", holder.socket, "attach", "-d",
                        f"{RUN_OWNER}/m1"])
    assert child.proc.wait(TIMEOUT) == 0
    child, pid = new, consenting(holder, "m1", other_than=pid)
    wait_for(lambda: holder.fd_count() <= fds, TIMEOUT,
             f"the holder's fds back to {fds} (now {holder.fd_count()})")
    os.write(child.master, b"\x1c")
    assert b"detached from" in child.read_available(until=b"attach again with")
    wait_for(lambda: (s := session(holder, "m1")) is not None and s.state == "draining",
             TIMEOUT, "the holder to drain it again")
    wait_for(lambda: holder.fd_count() <= draining, TIMEOUT,
             f"the holder's fds back to {draining} (now {holder.fd_count()})")
    info = session(holder, "m1")
    assert info is not None and info.meta == meta


def test_an_attach_whose_meta_has_no_room_to_consent_is_not_called_an_app(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    program = pty_children(["sh", "-c", "echo hi; exec cat"])
    with holder.client(RUN_OWNER).custody() as custody:
        custody.deposit("r1", program.master, child_pid=program.pid,
                        meta={f"k{i}": "v" for i in range(32)})
    child = pty_children([ESCROWCTL, "--socket", holder.socket, "attach", f"{RUN_OWNER}/r1"])
    wait_for(lambda: (s := session(holder, "r1")) is not None and s.state == "held"
             and s.custodian_pid == child.pid, TIMEOUT, "escrowctl to attach")
    rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", "-d", f"{RUN_OWNER}/r1")
    assert rc == 1, out
    assert "it did not agree to be taken over (an app, or an attach whose session meta had " \
        "no room)" in out, out
    still_attached(child, holder, "r1", child.pid)
