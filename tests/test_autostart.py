"""`EscrowClient(autostart=True)` (docs/design.md §8): when nothing answers, the client starts a
detached holder and waits for it; several apps starting at once end with one holder serving
all of them; an autostarted holder goes away by itself once it holds nothing (`--idle-exit`).

Every holder these tests cause to be spawned is found by its socket path (which is unique to
the test) and stopped by pid at teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import EscrowClient, autostart, breaker


def _gone(pid: int) -> bool:
    """No such process, or only its zombie is left (it has exited; its parent has not
    reaped it yet)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _holders_on(socket_path: str) -> list[int]:
    """Pids of live `python -m escrowd` processes started for `socket_path`."""
    pids = []
    for proc in psutil.process_iter():
        try:
            argv = proc.cmdline()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if "escrowd" in argv and "-m" in argv and socket_path in argv:
            pids.append(proc.pid)
    return pids


def _standbys(keeper: int) -> list[int]:
    """The keeper's standbys (escrowd.standby): its children started as one."""
    found = []
    for child in psutil.Process(keeper).children():
        try:
            if "ESCROWD_STANDBY_FD" in _environ(child.pid):
                found.append(child.pid)
        except OSError:
            continue
    return found


def _stays(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll `condition` for `seconds` and fail the moment it is false."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert condition(), f"{what} stopped holding"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def fresh_breaker() -> Iterator[None]:
    """The breaker is process-wide: every test starts and ends with it closed."""
    breaker.reset()
    yield
    breaker.reset()


@pytest.fixture
def auto_socket(socket_dir: Path) -> Iterator[str]:
    """A socket path in a fresh 0700 directory with nothing listening on it. At teardown,
    every holder started for it is stopped by pid (SIGTERM, then SIGKILL)."""
    path = str(socket_dir / "escrowd.sock")
    yield path
    for pid in _holders_on(path):
        try:
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda pid=pid: _gone(pid), 5.0, f"holder {pid} to stop")
        except ProcessLookupError:
            pass
        except AssertionError:
            os.kill(pid, signal.SIGKILL)


def _fd_identities(pid: int) -> set[tuple[int, int]]:
    found = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        found.add((st.st_dev, st.st_ino))
    return found


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [arg.decode() for arg in f.read().split(b"\0") if arg]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.decode().partition("=") for item in f.read().split(b"\0") if item]
    return {key: value for key, _, value in pairs}


def test_autostart_spawns_a_detached_holder(
    auto_socket: str, make_holder: Callable[..., HolderProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Incident pinned: an autostarted holder that shares the app's session, terminal or
    fds dies with the app's terminal (SIGHUP), writes into its output, or keeps the app's
    pipes and sockets open after the app is gone. The first call with nothing listening
    starts a holder and succeeds; the holder leads its own session, has /dev/null for
    stdin/stdout/stderr, holds no fd the app left inheritable (and no more fds than a
    holder started normally), runs with --idle-exit, and did not inherit the app's service
    manager variables (it would otherwise tell the app's systemd unit it is its main pid)."""
    normal = make_holder(keeper=True)
    leak_r, leak_w = os.pipe()
    os.set_inheritable(leak_r, True)
    os.set_inheritable(leak_w, True)
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/escrow-test-notify")
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    try:
        assert not os.path.exists(auto_socket)
        spawned_before = autostart.spawned
        client = EscrowClient(OWNER, socket_path=auto_socket, autostart=True)
        status = client.status()
        pid, keeper = status.pid, status.keeper_pid
        assert status.socket == auto_socket and status.fd_store == "keeper"
        assert keeper is not None and psutil.Process(pid).ppid() == keeper
        assert pid != os.getpid() and pid != normal.serving_pid()

        assert os.getsid(keeper) == keeper, "the keeper leads its own session"
        assert os.getsid(pid) == keeper and os.getsid(pid) != os.getsid(0)
        assert psutil.Process(keeper).ppid() != os.getpid(), "the keeper is the app's child"
        assert autostart.spawned == spawned_before + 1
        for process in (keeper, pid):
            for n in (0, 1, 2):
                assert os.readlink(f"/proc/{process}/fd/{n}") == "/dev/null", f"fd {n}"
            leaked = {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (leak_r, leak_w)}
            assert not leaked & _fd_identities(process), "the app's pipe was inherited"
        wait_for(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= normal.baseline_fds,
                 what=f"autostarted holder's fds ({len(os.listdir(f'/proc/{pid}/fd'))}) "
                 f"no more than a normally started holder's ({normal.baseline_fds})")

        argv = _cmdline(keeper)
        # Isolated, from `/`: the app's directory and environment choose no code.
        assert argv[1:6] == ["-I", "-m", "escrowd", "--socket", auto_socket], argv
        assert "--idle-exit" in argv
        assert float(argv[argv.index("--idle-exit") + 1]) > 0, argv
        assert _cmdline(pid)[1:5] == ["-I", "-m", "escrowd", "--bare"]
        assert os.readlink(f"/proc/{keeper}/cwd") == os.readlink(f"/proc/{pid}/cwd") == "/"

        for process in (keeper, pid):
            env = _environ(process)
            assert env.get("NOTIFY_SOCKET") != "/nonexistent/escrow-test-notify"
            assert env.get("WATCHDOG_PID") != str(os.getpid())
        assert "ESCROWD_STANDBY_FD" not in _environ(pid)
        # The pair, and the standby its keeper starts once the holder serves.
        assert sorted(_holders_on(auto_socket)) == sorted([keeper, pid, *_standbys(keeper)])
    finally:
        os.close(leak_r)
        os.close(leak_w)


APP = textwrap.dedent("""
    import os, sys
    from escrow_client import EscrowClient, autostart
    socket_path, sid, ready = sys.argv[1:4]
    client = EscrowClient("com.example.term", socket_path=socket_path, autostart=True)
    master, slave = os.openpty()
    open(ready, "w").close()
    sys.stdin.buffer.read()  # the barrier: returns when the test closes the pipe's write end
    client.hand_off(sid, master)
    os.close(master)
    os.close(slave)
    print(client.status().pid, autostart.spawned, flush=True)
""")


def test_four_apps_autostarting_at_once_share_one_holder(
    auto_socket: str, socket_dir: Path
) -> None:
    """Incident pinned: apps launched together (a login session restoring four windows) each
    spawned a holder; without the lock they would split the sessions between holders, or
    one holder would remove another's socket. Four app processes released at the same
    instant all hand off their session; exactly one holder is left serving the socket, it
    is the one every app talked to, and it lists all four sessions."""
    barrier_r, barrier_w = os.pipe()
    apps = []
    readies = [socket_dir / f"ready-{n}" for n in range(4)]
    try:
        for n, ready in enumerate(readies):
            apps.append(subprocess.Popen(
                [sys.executable, "-c", APP, auto_socket, f"app-{n}", str(ready)],
                stdin=barrier_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))
        os.close(barrier_r)
        wait_for(lambda: all(r.exists() for r in readies), 15.0, "four apps at the barrier")
        assert not os.path.exists(auto_socket)
        os.close(barrier_w)  # every app's read returns EOF at once
        barrier_w = -1
        results = []
        for app in apps:
            out, err = app.communicate(timeout=30)
            assert app.returncode == 0, err.decode()
            pid, spawned = map(int, out.split())
            results.append((pid, spawned))
    finally:
        for fd in (barrier_r, barrier_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for app in apps:
            if app.poll() is None:
                app.kill()
                app.communicate()

    pids = {pid for pid, _ in results}
    assert len(pids) == 1, f"apps were served by different holders: {results}"
    winner = pids.pop()
    spawns = sum(spawned for _, spawned in results)
    print(f"autostart race: {spawns} holders spawned, one ({winner}) serves")
    assert spawns >= 2, "the apps did not race (only one spawned a holder)"
    # The losers exit on the lock ("another escrowd ... already serves"): one pair is left,
    # the winning holder and its keeper (and the keeper's standby).
    client = EscrowClient(OWNER, socket_path=auto_socket)
    keeper = client.status().keeper_pid or 0
    pair = [winner, keeper]
    wait_for(lambda: sorted(_holders_on(auto_socket)) == sorted(pair + _standbys(keeper)), 10.0,
             f"only the winner left serving (now {_holders_on(auto_socket)})")
    sessions = {s.id: s.state for s in client.list()}
    assert sorted(sessions) == [f"app-{n}" for n in range(4)], sessions
    assert set(sessions.values()) <= {"draining", "exited"}, sessions
    assert client.status().pid == winner


def test_idle_exit_when_nothing_is_held(auto_socket: str) -> None:
    """Incident pinned: every app launch that autostarted a holder left one running
    forever. An autostarted holder with nothing held and no connection exits by itself
    after --idle-exit, cleanly (socket file removed)."""
    client = EscrowClient(OWNER, socket_path=auto_socket, autostart=True,
                          autostart_idle_exit=1.0)
    pid = client.status().pid
    assert "--idle-exit" in _cmdline(pid)
    wait_for(lambda: _gone(pid), 10.0, "the idle holder to exit")
    # Its keeper, which owns the socket file, removes it as it exits after its holder.
    wait_for(lambda: not os.path.exists(auto_socket), 10.0, "the socket file removed")


def test_idle_exit_waits_while_a_session_is_held(
    auto_socket: str, pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: an idle-exit that counted only connections would take escrowed
    sessions down with it (and their children with a hang-up). A holder autostarted by a
    hand-off stays up while the session is escrowed (polled for 2.5× its idle time with no
    connection open), and exits once the session is released."""
    kid = pty_children(["sh", "-c", 'while :; do echo tick; sleep 0.1; done'])
    client = EscrowClient(OWNER, socket_path=auto_socket, autostart=True,
                          autostart_idle_exit=1.0)
    client.hand_off("tab", kid.master, child_pid=kid.pid)  # autostarts the holder
    pid = client.status().pid
    _stays(lambda: not _gone(pid), 2.5, "the holder of an escrowed session")
    assert {s.id: s.state for s in client.list()} == {"tab": "draining"}
    assert not _gone(pid)
    client.release("tab")
    wait_for(lambda: _gone(pid), 10.0, "the holder to exit once nothing is held")
    assert kid.proc.poll() is None, "the child outlived the holder (the app keeps its master)"
