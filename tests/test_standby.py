"""The keeper's warm standby (docs/design.md §11): the next holder, loaded and waiting with
nothing of a session's, takes over the moment the serving one dies; a standby that fails in
any way costs a fresh exec, as before there were standbys.

Here `escrowd` runs as users run it: the keeper, its holder and its standby, a real process
tree, real SIGKILLs. That the standby served (not a fresh exec) is proven by pid: the pid
that answers `status` after the SIGKILL is the one the keeper logged as its ready standby.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hostile import log_fields, read_more_lines
from installation import make_installation, site_packages
from survival import (
    TICKER,
    assert_all_survived,
    assert_one_stream,
    assert_still_there,
    start_three_sessions,
)
from test_survive import kill_serving_holder

from conftest import HolderProcess, PtyChild, fd_count, wait_for
from escrow_client import protocol
from escrow_client.liveness import process_alive


def standbys(holder: HolderProcess, event: str = "keeper_standby_ready") -> list[int]:
    """The standbys the keeper logged `event` for, in order."""
    return [int(log_fields(line)["standby_pid"]) for line in holder.log_lines(event)]


def ready_standby(holder: HolderProcess, after: int = 0) -> int:
    """The pid of the keeper's ready standby, once there are more than `after` of them."""
    found = wait_for(lambda: standbys(holder)[after:], 30.0, "a ready standby")
    return int(found[-1])


def started_via(holder: HolderProcess) -> list[tuple[int, str]]:
    return [(int(f["holder_pid"]), f["via"]) for f in
            map(log_fields, holder.log_lines("keeper_started_holder"))]


def fd_kinds(pid: int) -> list[str]:
    """What each of a process's fds is, by number, without inode numbers."""
    where = f"/proc/{pid}/fd"
    kinds = []
    for name in sorted(os.listdir(where), key=int):
        try:
            with_inode = os.readlink(f"{where}/{name}")
        except FileNotFoundError:
            continue  # closed meanwhile
        kinds.append(f"{name}:{with_inode.split(':')[0].split(' ')[0]}")
    return kinds


def as_started(kinds: list[str]) -> tuple[list[str], list[str]]:
    """What a holder was given, by number (stdio, LISTEN_FDS, the notify channel: every fd
    before the first the holder opens itself, trio's epoll), and the kinds of what it opened
    since, in any order and without sockets (a client's connection comes and goes, and a
    pidfd or a state file is opened when its session's turn comes)."""
    first_own = next(i for i, kind in enumerate(kinds) if kind.endswith(":anon_inode"))
    return kinds[:first_own], sorted(kind.split(":", 1)[1] for kind in kinds[first_own:]
                                     if not kind.endswith(":socket"))


def settled_fd_kinds(pid: int) -> list[str]:
    """`fd_kinds` once two reads in a row agree (a holder just started opens a few)."""
    last: list[list[str]] = [[]]

    def same() -> list[str] | None:
        now, last[0] = fd_kinds(pid), fd_kinds(pid)
        return now if now == last[0] else None

    return list(wait_for(same, 10.0, f"the fds of {pid} to settle"))


def drained(holder: HolderProcess, pty_children: Callable[..., PtyChild],
            sid: str) -> bytes:
    """A ticker handed off to drain as `sid`; returns what was read of it before."""
    kid = pty_children(TICKER)
    first = read_more_lines(kid.master, b"", 2)
    holder.client().hand_off(sid, kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    return first


def test_the_standby_takes_over_a_sigkill_with_every_session(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    """A draining session, an exited one and one an app holds: the serving holder SIGKILLed,
    the standby's pid answers, with all three adopted and every byte of their replays; it
    held none of their fds while it waited (only its socket to the keeper)."""
    holder = make_holder(keeper=True)
    three = start_three_sessions(holder.client(), pty_children, apps, tmp_path)
    standby = ready_standby(holder)
    assert [k.split(":")[0] for k in fd_kinds(standby)] == ["0", "1", "2", "3"], (
        fd_kinds(standby))
    assert fd_kinds(standby)[3] == "3:socket", fd_kinds(standby)

    after = kill_serving_holder(holder)
    assert after.pid == standby, (after.pid, standby, holder.logs())
    assert after.adopted == 3, after
    assert started_via(holder)[-1] == (standby, "standby"), started_via(holder)
    assert_still_there(three)
    assert_all_survived(three, clean=False)


def test_a_standby_killed_while_it_waits_is_replaced_and_costs_nothing(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    holder = make_holder(keeper=True)
    first = drained(holder, pty_children, "tab")
    client = holder.client()
    before = client.status()
    standby = ready_standby(holder)
    keeper_fds = fd_count(holder.pid)

    os.kill(standby, signal.SIGKILL)
    replaced = ready_standby(holder, after=1)
    assert replaced != standby
    assert process_alive(standby, None) is not True
    assert client.status().instance == before.instance, "the serving holder changed"
    assert fd_count(holder.pid) == keeper_fds, "the keeper's fds changed"
    assert holder.log_lines("keeper_standby_exited"), holder.logs()
    got = client.retrieve("tab")
    try:
        assert got.session.replay_gap_at is None, got.session
        assert_one_stream(first, got.replay, read_more_lines(got.fd, b"", 2), None)
    finally:
        os.close(got.fd)


def test_a_standby_that_dies_taking_over_is_followed_by_an_exec_like_it(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """A standby stopped (SIGSTOP) is sent the takeover, and never takes it: the keeper
    kills it and execs a holder, which adopts every session with its replay; and that holder
    has the same fds, by number and kind, as one a standby became with the same sessions."""
    holder = make_holder(keeper=True)
    firsts = {sid: drained(holder, pty_children, sid) for sid in ("a", "b")}
    standby = ready_standby(holder)
    served = kill_serving_holder(holder)
    assert served.pid == standby and served.adopted == 2
    by_standby = settled_fd_kinds(standby)

    stuck = ready_standby(holder, after=1)
    os.kill(stuck, signal.SIGSTOP)
    os.kill(standby, signal.SIGKILL)

    def by_exec() -> protocol.HolderStatus | None:
        try:
            status = holder.client("escrowctl", timeout=1.0).status()
        except Exception:
            return None
        return status if status.pid not in (standby, stuck) else None

    after = wait_for(by_exec, 15.0, "a holder by exec")
    assert started_via(holder)[-1] == (after.pid, "exec"), started_via(holder)
    assert after.adopted == 2, after
    wait_for(lambda: as_started(fd_kinds(after.pid)) == as_started(by_standby), 5.0,
             f"the exec'd holder's fds {fd_kinds(after.pid)} to be the standby's {by_standby}")
    client = holder.client()
    for sid, first in firsts.items():
        got = client.retrieve(sid)
        try:
            assert_one_stream(first, got.replay, read_more_lines(got.fd, b"", 2),
                              got.session.replay_gap_at)
        finally:
            os.close(got.fd)


def test_no_fd_of_the_keeper_is_left_over_by_takeovers(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    holder = make_holder(keeper=True)
    drained(holder, pty_children, "tab")
    ready_standby(holder)
    keeper_fds = fd_count(holder.pid)
    for n in range(1, 5):
        standby = standbys(holder)[-1]
        assert kill_serving_holder(holder).pid == standby
        ready_standby(holder, after=n)
        assert fd_count(holder.pid) == keeper_fds, f"after takeover {n}"


def test_an_upgrade_leaves_a_standby_of_the_new_code(
    make_holder: Callable[..., HolderProcess], tmp_path: Path,
) -> None:
    """The installed code's version changed, then `escrowctl upgrade`: the holder after it
    runs the new code, and so does the standby that takes over its SIGKILL; the standby of
    the old code was killed, and never served."""
    installed = tmp_path / "installed"
    python = make_installation(installed)
    holder = make_holder(keeper=True, python=str(python))
    old_standby = ready_standby(holder)
    init = site_packages(installed) / "escrowd" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"',
                                             '__version__ = "0.1.0+new"'))
    escrowctl = str(Path(sys.executable).parent / "escrowctl")
    upgraded = subprocess.run([escrowctl, "--socket", holder.socket, "upgrade", "--wait",
                               "60"], capture_output=True, text=True, timeout=90)
    assert upgraded.returncode == 0, upgraded.stderr
    client = holder.client()
    assert client.status().version == "0.1.0+new"
    assert old_standby in standbys(holder, "keeper_standby_killed"), holder.logs()
    assert old_standby not in [pid for pid, _ in started_via(holder)]

    new_standby = ready_standby(holder, after=standbys(holder).index(old_standby) + 1)
    if new_standby == client.status().pid:  # it took over the upgrade: the next one
        new_standby = ready_standby(holder, after=standbys(holder).index(new_standby) + 1)
    after = kill_serving_holder(holder)
    assert (after.pid, after.version) == (new_standby, "0.1.0+new"), (after, holder.logs())


def test_the_keeper_loads_no_event_loop() -> None:
    """`escrowd` is the keeper, a `poll` loop: what it imports to run (the command and the
    keeper, with its standby and trial run) loads neither trio nor the holder's modules,
    which only a holder (or a standby) loads."""
    loaded = subprocess.run(
        [sys.executable, "-I", "-c", "import sys, escrowd.__main__, escrowd.keeper; "
         "print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, cwd="/").stdout.split()
    assert "trio" not in loaded
    assert not {"escrowd.server", "escrowd.serving", "escrowd.adoption",
                "escrowd.fdstore"} & set(loaded), loaded
