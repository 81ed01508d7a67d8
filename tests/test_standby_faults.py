"""The keeper's warm standby when things go wrong (docs/design.md §11): a standby or holder
that freezes before it serves, a standby whose keeper died while it started, a standby
that died with the holder and cannot be reaped at once, a holder that died in the middle
of an upgrade. In each, the keeper gets to a serving holder with every session by itself,
and nothing serves the socket path without them.

Real processes throughout. To freeze a process before any of its code runs, the escrow runs
from an installation of its own (tests/installation.py) with a `.pth` file that stops, with
SIGSTOP, the first process started with a given variable once a mark file exists (`Freezer`);
a zombie its parent cannot reap yet is one a tracer holds (`Tracer`: PTRACE_SEIZE, and
the tracer never waits).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from hostile import log_fields, read_more_lines
from installation import make_installation, site_packages
from survival import assert_one_stream
from test_standby import drained, ready_standby, started_via

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import protocol


def state(pid: int) -> str | None:
    """A process's state letter (R, S, T, Z...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def dead(pid: int) -> bool:
    return state(pid) in (None, "Z", "X")


class Freezer:
    """An installation whose next process started with `variable` in its environment stops
    itself (SIGSTOP) before it runs anything, once `arm` is called: once only."""

    def __init__(self, where: Path, variable: str) -> None:
        self.python = make_installation(where)
        self.mark = where / "freeze-next"
        site = site_packages(where)
        (site / "freeze_next.py").write_text(textwrap.dedent(f"""\
            import os, signal
            if os.environ.get({variable!r}):
                try:
                    os.unlink({str(self.mark)!r})
                except OSError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGSTOP)
            """))
        (site / "freeze_next.pth").write_text("import freeze_next\n")

    def arm(self) -> None:
        self.mark.write_text("")

    def fired(self) -> bool:
        return not self.mark.exists()


def stopped(pid: int) -> bool:
    return state(pid) == "T"


def last_pid(holder: HolderProcess, event: str, field: str) -> int | None:
    lines = holder.log_lines(event)
    return int(log_fields(lines[-1])[field]) if lines else None


def serving(holder: HolderProcess, not_pids: tuple[int, ...]) -> protocol.HolderStatus | None:
    try:
        status = holder.client("escrowctl", timeout=1.0).status()
    except Exception:
        return None
    return status if status.pid not in not_pids else None


def assert_ticks_on(holder: HolderProcess, sid: str, first: bytes) -> None:
    got = holder.client().retrieve(sid)
    try:
        assert_one_stream(first, got.replay, read_more_lines(got.fd, b"", 2),
                          got.session.replay_gap_at)
    finally:
        os.close(got.fd)


def test_a_holder_frozen_before_ready_is_killed_and_the_next_serves(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    tmp_path: Path,
) -> None:
    """The standby stopped, the serving holder SIGKILLed: the holder exec'd instead stops
    itself before it runs (as SIGSTOP or a freezer would). The keeper kills it once its
    deadline to be READY is out, and the next one serves the session. Before, the keeper
    watched a holder only once it was ready, and the escrow hung for good."""
    freezer = Freezer(tmp_path / "installed", "LISTEN_FDS")
    # A shorter deadline to be ready than the default 30 s, still ample for a holder here.
    holder = make_holder("--ready-deadline", "6", keeper=True, python=str(freezer.python))
    first = drained(holder, pty_children, "tab")
    os.kill(ready_standby(holder), signal.SIGSTOP)
    freezer.arm()
    before = holder.client("escrowctl").status()
    os.kill(before.pid, signal.SIGKILL)
    frozen = wait_for(lambda: freezer.fired() and started_via(holder)[-1][0] != before.pid
                      and started_via(holder)[-1][0], 20.0, "a holder exec'd to stop itself")
    wait_for(lambda: stopped(frozen), 10.0, "the exec'd holder to stop itself")
    after = wait_for(lambda: serving(holder, (before.pid, frozen)), 90.0,
                     "the next holder to serve")
    kills = [log_fields(line) for line in holder.log_lines("keeper_kill")]
    assert [(int(k["holder_pid"]), "not ready" in k["reason"]) for k in kills] == [
        (frozen, True)], holder.logs()
    assert dead(frozen)
    assert after.adopted == 1, after
    assert_ticks_on(holder, "tab", first)


def test_a_standby_frozen_taking_over_is_killed_and_a_holder_execd(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """A ready standby stopped (SIGSTOP), the serving holder SIGKILLed, and nobody else does
    a thing: the standby never says it took the takeover, the keeper kills it, and a holder
    it execs adopts the session. (The kernel queues the whole takeover whether or not the
    standby reads it: a takeover sent is not one taken.)"""
    holder = make_holder(keeper=True)
    first = drained(holder, pty_children, "tab")
    stuck = ready_standby(holder)
    os.kill(stuck, signal.SIGSTOP)
    before = holder.client("escrowctl").status()
    os.kill(before.pid, signal.SIGKILL)
    after = wait_for(lambda: serving(holder, (before.pid, stuck)), 20.0, "a holder by exec")
    assert started_via(holder)[-1] == (after.pid, "exec"), started_via(holder)
    assert (stuck, "standby") not in started_via(holder)
    assert after.adopted == 1, after
    assert last_pid(holder, "keeper_standby_failed", "standby_pid") == stuck, holder.logs()
    wait_for(lambda: dead(stuck), 5.0, "the stopped standby to be killed")
    assert_ticks_on(holder, "tab", first)


def test_a_standby_whose_keeper_died_as_it_started_touches_nothing(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    tmp_path: Path,
) -> None:
    """The keeper SIGKILLed while its standby starts (stopped before it runs, here), the
    holder stopped too so that nothing has the lock: the standby, its parent gone, exits
    at once, without taking the lock or the socket path, and the holder with the session
    serves on alone on that path. Before, it ran as `escrowd --bare`: it took the lock,
    replaced the socket and listed nothing, the holder with the sessions unreachable."""
    freezer = Freezer(tmp_path / "installed", "ESCROWD_STANDBY_FD")
    holder = make_holder(keeper=True, python=str(freezer.python))
    first = drained(holder, pty_children, "tab")
    serving_pid = holder.client().status().pid
    freezer.arm()
    standby = wait_for(lambda: last_pid(holder, "keeper_started_standby", "standby_pid"),
                       30.0, "a standby to start")
    wait_for(lambda: stopped(standby), 10.0, "the standby to stop itself")
    socket_inode = os.stat(holder.socket).st_ino
    try:
        os.kill(serving_pid, signal.SIGSTOP)
        holder.proc.kill()
        holder.proc.wait(10)
        os.kill(standby, signal.SIGCONT)
        wait_for(lambda: dead(standby), 20.0, "the orphaned standby to exit")
        assert os.stat(holder.socket).st_ino == socket_inode
        os.kill(serving_pid, signal.SIGCONT)
        assert [s.id for s in holder.client().list()] == ["tab"]
        assert holder.client().status().pid == serving_pid
        wait_for(lambda: holder.log_lines("keeper_gone"), 10.0, "the holder to serve alone")
        assert_ticks_on(holder, "tab", first)
    finally:
        for pid in (standby, serving_pid):
            if not dead(pid):
                os.kill(pid, signal.SIGKILL)


class Tracer:
    """A process that holds `pid` traced (PTRACE_SEIZE: it runs on as before) and never
    waits for it: once it dies, its parent cannot reap it until the tracer is gone."""

    def __init__(self, pid: int) -> None:
        code = textwrap.dedent(f"""\
            import ctypes, sys
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.ptrace(0x4206, {pid}, None, None) != 0:  # PTRACE_SEIZE
                sys.exit(ctypes.get_errno())
            print("seized", flush=True)
            sys.stdin.read()
            """)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "seized\n", self.proc.wait()

    def release(self) -> None:
        self.proc.kill()
        self.proc.communicate()


def test_a_standby_that_dies_with_the_holder_and_cannot_be_reaped_costs_an_exec(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """The ready standby dies first (its socket's EOF read by the keeper) and cannot be
    reaped yet (a tracer holds its zombie, as a standby in D state or frozen would not die
    at once); then the holder is SIGKILLed. The keeper's takeover fails on the dead socket,
    it execs a holder at once that adopts the session, and reaps the standby once it can.
    Before, the keeper raised KeyError (the socket unregistered twice), waited out a back-off
    and never reaped the standby; or waited for it, blocked, with no holder at all."""
    holder = make_holder(keeper=True)
    first = drained(holder, pty_children, "tab")
    standby = ready_standby(holder)
    tracer = Tracer(standby)
    try:
        os.kill(standby, signal.SIGKILL)
        wait_for(lambda: state(standby) == "Z", 10.0, "the standby to die")
        # The keeper has read the EOF once it has answered a signal sent after it.
        interrupts = len(holder.log_lines("keeper_interrupt"))
        os.kill(holder.pid, signal.SIGINT)
        wait_for(lambda: len(holder.log_lines("keeper_interrupt")) > interrupts, 10.0,
                 "the keeper to answer SIGINT")
        before = holder.client("escrowctl").status()
        os.kill(before.pid, signal.SIGKILL)
        after = wait_for(lambda: serving(holder, (before.pid, standby)), 15.0,
                         "a holder by exec")
        assert started_via(holder)[-1] == (after.pid, "exec"), started_via(holder)
        assert after.adopted == 1, after
        assert not holder.log_lines("keeper_error"), holder.logs()
        assert state(standby) == "Z"
    finally:
        tracer.release()
    wait_for(lambda: state(standby) is None, 10.0, "the keeper to reap the standby")
    assert last_pid(holder, "keeper_standby_reaped", "standby_pid") == standby
    assert_ticks_on(holder, "tab", first)


def test_an_upgrade_whose_old_holder_died_first_stops_no_new_one(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    tmp_path: Path,
) -> None:
    """An upgrade's trial run passed, and the old holder died before the standby of the new
    code was ready: the holder exec'd in its place (of the new code) is not stopped when
    that standby is ready, and the next upgrade is not ignored. Before, the keeper SIGTERMed
    the new holder, or ignored every later SIGHUP."""
    installed = tmp_path / "installed"
    freezer = Freezer(installed, "ESCROWD_STANDBY_FD")
    holder = make_holder(keeper=True, python=str(freezer.python))
    first = drained(holder, pty_children, "tab")
    old_standby = ready_standby(holder)
    old = holder.client().status()
    init = site_packages(installed) / "escrowd" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"',
                                             '__version__ = "0.1.0+new"'))
    freezer.arm()
    os.kill(holder.pid, signal.SIGHUP)
    new_standby = wait_for(lambda: (last_pid(holder, "keeper_started_standby", "standby_pid")
                                    not in (None, old_standby)) and last_pid(
        holder, "keeper_started_standby", "standby_pid"), 30.0, "a standby of the new code")
    wait_for(lambda: stopped(new_standby), 10.0, "the new standby to stop itself")
    os.kill(old.pid, signal.SIGKILL)
    new = wait_for(lambda: serving(holder, (old.pid, new_standby)), 15.0, "a holder by exec")
    assert (new.version, new.adopted) == ("0.1.0+new", 1), new

    os.kill(new_standby, signal.SIGCONT)
    wait_for(lambda: new_standby in [int(log_fields(line)["standby_pid"]) for line in
                                     holder.log_lines("keeper_standby_ready")],
             30.0, "the new standby to be ready")
    interrupts = len(holder.log_lines("keeper_interrupt"))
    os.kill(holder.pid, signal.SIGINT)  # answered after the turn that saw the standby ready
    wait_for(lambda: len(holder.log_lines("keeper_interrupt")) > interrupts, 10.0,
             "the keeper to answer SIGINT")
    assert not holder.log_lines("keeper_stopping_holder"), holder.logs()
    assert holder.client().status().instance == new.instance

    init.write_text(init.read_text().replace('"0.1.0+new"', '"0.1.0+newer"'))
    escrowctl = str(Path(sys.executable).parent / "escrowctl")
    upgraded = subprocess.run([escrowctl, "--socket", holder.socket, "upgrade", "--wait",
                               "60"], capture_output=True, text=True, timeout=90)
    assert upgraded.returncode == 0, (upgraded.stderr, holder.logs())
    assert holder.client().status().version == "0.1.0+newer"
    assert_ticks_on(holder, "tab", first)


def test_a_keeper_killed_mid_takeover_leaves_the_standby_serving_what_came(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """140 sessions (more than one batch of 253 fds); the keeper SIGKILLed as it sends the
    second batch (strace's fault injection, at its third sendmsg), after the serving
    holder's SIGKILL. The keeper's copies of every fd died with it: the standby serves the
    sessions whose fds came, alone on the socket path. Before, it closed every fd it had
    received and exited, and those sessions were gone."""
    holder = make_holder(keeper=True)
    client = holder.client()
    slaves = []
    try:
        for n in range(140):
            master, slave = os.openpty()
            slaves.append(slave)
            client.hand_off(f"s{n}", master)
            os.close(master)
        standby = ready_standby(holder)
        serving_pid = client.status().pid
        trace = subprocess.Popen(
            ["strace", "-qq", "-o", "/dev/null", "-p", str(holder.pid), "-e", "trace=sendmsg",
             "-e", "inject=sendmsg:error=EIO:signal=KILL:when=3"], stderr=subprocess.PIPE)
        try:
            wait_for(lambda: state(holder.pid) == "t" or _traced(holder.pid), 10.0,
                     "strace to attach to the keeper")
            os.kill(serving_pid, signal.SIGKILL)
            holder.proc.wait(15)
            assert holder.proc.returncode == -signal.SIGKILL
        finally:
            trace.kill()
            trace.communicate()
        after = wait_for(lambda: serving(holder, (serving_pid,)), 15.0, "the standby to serve")
        assert after.pid == standby, after
        listed = {s.id for s in holder.client().list()}
        # Cut short: the first batch (the listener, the holder's restart counts and 125
        # sessions whole, the master of one more, adopted without its record).
        assert 125 <= len(listed) < 140 and listed <= {f"s{n}" for n in range(140)}, listed
    finally:
        for pid in (last_pid(holder, "keeper_started_standby", "standby_pid"),):
            if pid is not None and not dead(pid):
                os.kill(pid, signal.SIGKILL)
        for slave in slaves:
            os.close(slave)


def _traced(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f)
