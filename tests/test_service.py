"""The holder under a service manager: systemd's notify socket and watchdog, and socket
activation the way systemd does it. (The unit files and the LaunchAgent themselves:
test_install_service.py.)

Every holder here is a real `python -m escrowd` process; the notify socket and the activated
listening socket are owned by the test, exactly where systemd would own them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import fdpass
from escrowd import service

# Variables a service manager sets; a test run under systemd must not leak its own into the
# holders it starts.
MANAGER_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                "LISTEN_FDNAMES")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in MANAGER_VARS}
    env.update(extra)
    return env


# --- the notify socket ----------------------------------------------------------------------


def _recv_with_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, ancdata, flags, _ = sock.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
    return data, fdpass.fds_from_ancillary(ancdata, flags)



class NotifySocket:
    """A test-owned $NOTIFY_SOCKET: an AF_UNIX datagram socket, on a path or abstract."""

    def __init__(self, address: str) -> None:
        self.address = address  # as it goes into NOTIFY_SOCKET
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.received: list[dict[str, str]] = []
        self.stored: list[dict[str, str]] = []

    def receive(self, timeout: float = 10.0) -> dict[str, str]:
        """The next datagram about the service (READY, STATUS, WATCHDOG...), as its
        KEY=VALUE lines; fail if none comes within `timeout`. Fd store messages (with the
        fds they carry, closed here) go to `stored` instead: tests/test_fdstore.py is
        about those."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                data, fds = _recv_with_fds(self.sock)
            except TimeoutError:
                raise AssertionError(
                    f"no notify datagram within {timeout}s; got so far: {self.received}"
                ) from None
            message = dict(line.split("=", 1) for line in data.decode().splitlines())
            fdpass.close_fds(fds)
            if "FDSTORE" in message or "FDSTOREREMOVE" in message:
                self.stored.append(message)
                continue
            self.received.append(message)
            return message

    def receive_until(self, condition: Callable[[dict[str, str]], bool],
                      timeout: float = 10.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; notify datagrams so far: {self.received}")
            message = self.receive(left)
            if condition(message):
                return message

    def drain(self) -> list[dict[str, str]]:
        """Whatever is queued now about the service, without waiting."""
        self.sock.setblocking(False)
        got = []
        try:
            while True:
                data, fds = _recv_with_fds(self.sock)
                fdpass.close_fds(fds)
                message = dict(line.split("=", 1) for line in data.decode().splitlines())
                if "FDSTORE" in message or "FDSTOREREMOVE" in message:
                    self.stored.append(message)
                else:
                    got.append(message)
        except BlockingIOError:
            pass
        self.received += got
        return got

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(socket_dir: Path) -> Iterator[NotifySocket]:
    ns = NotifySocket(str(socket_dir / "notify"))
    yield ns
    ns.close()


@pytest.fixture
def abstract_notify_socket() -> Iterator[NotifySocket]:
    ns = NotifySocket(f"@fd-escrow-test-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    yield ns
    ns.close()


def hand_off_child(holder: HolderProcess, pty_children: Callable[..., PtyChild], sid: str,
                   ) -> PtyChild:
    """A shell in a PTY, handed off to the holder (so it is draining); our master is closed."""
    child = pty_children(["sh", "-c", f"echo hi-{sid}; exec cat"])
    assert f"hi-{sid}".encode() in child.read_available(until=f"hi-{sid}".encode())
    holder.client().hand_off(sid, child.master, child_pid=child.pid, label="sh")
    os.close(child.master)
    child.master = -1
    return child


def stop(holder: HolderProcess) -> int:
    holder.proc.send_signal(signal.SIGTERM)
    return holder.proc.wait(15)


def test_notify_ready_status_and_stopping(
    make_holder: Callable[..., HolderProcess], notify_socket: NotifySocket,
    pty_children: Callable[..., PtyChild],
) -> None:
    holder = make_holder(env=clean_env(NOTIFY_SOCKET=notify_socket.address))
    ready = notify_socket.receive()
    assert ready == {
        "READY": "1",
        "MAINPID": str(holder.pid),
        "STATUS": f"serving {holder.socket}: no sessions",
    }

    hand_off_child(holder, pty_children, "tab-1")
    hand_off_child(holder, pty_children, "tab-2")
    wait_for(lambda: all(s.state == "draining" for s in holder.client().list()), 10.0,
             "both sessions draining")
    assert stop(holder) == 0
    stopping = notify_socket.receive()
    assert stopping["STOPPING"] == "1"
    assert stopping["STATUS"] == (
        f"stopping on SIGTERM; was serving {holder.socket}: 2 sessions (2 draining)"
    )
    # Idle means idle: with no watchdog asked for, ready and stopping are all it ever sent.
    assert notify_socket.drain() == []
    assert [list(m) for m in notify_socket.received] == [
        ["READY", "MAINPID", "STATUS"], ["STOPPING", "STATUS"]
    ]


def test_notify_on_an_abstract_socket(
    make_holder: Callable[..., HolderProcess], abstract_notify_socket: NotifySocket,
) -> None:
    holder = make_holder(env=clean_env(NOTIFY_SOCKET=abstract_notify_socket.address))
    ready = abstract_notify_socket.receive()
    assert ready["READY"] == "1" and ready["MAINPID"] == str(holder.pid)
    assert stop(holder) == 0
    assert abstract_notify_socket.receive()["STOPPING"] == "1"


def test_watchdog_pings_and_carries_status_changes(
    make_holder: Callable[..., HolderProcess], notify_socket: NotifySocket,
    pty_children: Callable[..., PtyChild],
) -> None:
    holder = make_holder(
        env=clean_env(NOTIFY_SOCKET=notify_socket.address, WATCHDOG_USEC="200000")
    )
    assert notify_socket.receive()["READY"] == "1"
    wait_for(lambda: holder.log_lines("watchdog"), 5.0, "the watchdog's log line")
    assert "interval=0.100" in holder.log_lines("watchdog")[0]
    # Repeated pings (every WATCHDOG_USEC/2); a ping carries no STATUS= while nothing changed.
    for _ in range(3):
        ping = notify_socket.receive(timeout=5.0)
        assert ping == {"WATCHDOG": "1"}, notify_socket.received

    # A change of what the holder holds rides on the next ping, once.
    hand_off_child(holder, pty_children, "tab-1")
    notify_socket.receive_until(
        lambda m: m.get("STATUS") == f"serving {holder.socket}: 1 session (1 draining)",
        timeout=5.0,
    )
    assert notify_socket.receive(timeout=5.0) == {"WATCHDOG": "1"}
    holder.client().release("tab-1")
    notify_socket.receive_until(
        lambda m: m.get("STATUS") == f"serving {holder.socket}: no sessions", timeout=5.0
    )
    assert all(m.get("WATCHDOG") == "1" for m in notify_socket.received[1:])

    assert stop(holder) == 0
    notify_socket.receive_until(lambda m: m.get("STOPPING") == "1", timeout=5.0)


def test_idle_exit_reports_stopping(
    make_holder: Callable[..., HolderProcess], notify_socket: NotifySocket,
) -> None:
    holder = make_holder("--idle-exit", "1", env=clean_env(NOTIFY_SOCKET=notify_socket.address))
    assert notify_socket.receive()["READY"] == "1"
    stopping = notify_socket.receive()
    assert stopping == {"STOPPING": "1", "STATUS": f"stopping on idle exit; was serving "
                        f"{holder.socket}: no sessions"}
    assert holder.proc.wait(15) == 0


def test_watchdog_meant_for_another_process_is_not_pinged(
    make_holder: Callable[..., HolderProcess], notify_socket: NotifySocket,
) -> None:
    # WATCHDOG_PID names this test process: the variables were inherited, not meant for
    # the holder, so it must not ping (nor wake up for it).
    holder = make_holder(env=clean_env(NOTIFY_SOCKET=notify_socket.address,
                                       WATCHDOG_USEC="200000", WATCHDOG_PID=str(os.getpid())))
    assert notify_socket.receive()["READY"] == "1"
    holder.client().status()  # the holder got past its start-up and served a request
    assert holder.log_lines("watchdog") == []
    assert stop(holder) == 0
    assert notify_socket.receive()["STOPPING"] == "1"
    assert [m for m in notify_socket.received if "WATCHDOG" in m] == []


def test_watchdog_interval_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in MANAGER_VARS:
        monkeypatch.delenv(name, raising=False)
    assert service.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert service.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert service.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getppid()))
    assert service.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "soon", ""):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert service.watchdog_interval() is None


def test_status_line_counts_live_sessions_only() -> None:
    assert service.status_line("/s", {}) == "serving /s: no sessions"
    assert service.status_line("/s", {"released": 3, "handed_off": 2}) == (
        "serving /s: no sessions"
    )
    assert service.status_line("/s", {"draining": 2, "held": 1, "expired": 9}) == (
        "serving /s: 3 sessions (1 held, 2 draining)"
    )
    # One line, whatever the path: a newline would start a new KEY=VALUE field.
    assert "\n" not in service.status_line("/a\nREADY=1", {"exited": 1})


def test_notify_never_blocks_on_a_full_queue(
    monkeypatch: pytest.MonkeyPatch, notify_socket: NotifySocket,
) -> None:
    # A service manager that does not read must not freeze the holder's event loop: once
    # the receiver's queue is full, notify() gives up at once instead of blocking.
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.address)
    results = [service.notify("WATCHDOG=1") for _ in range(5000)]
    assert results[0] is True
    assert False in results
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.address + "-missing")
    assert service.notify("READY=1") is False
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert service.notify("READY=1") is False


# --- socket activation, the way systemd does it ---------------------------------------------

# systemd passes the listening socket as fd 3 with LISTEN_FDS=1 and LISTEN_PID set to the pid
# of the service's own process. This wrapper does the same: it moves the fd it was given to
# 3 and execs escrowd in the same process, so LISTEN_PID is escrowd's pid.
ACTIVATE = r"""
import os, sys
fd, listen_pid, listen_fds = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if fd < 0:
    try:
        os.close(3)  # nothing passed at all
    except OSError:
        pass
elif fd != 3:
    os.dup2(fd, 3)  # inheritable
    os.close(fd)
else:
    os.set_inheritable(3, True)
env = dict(os.environ, LISTEN_FDS=listen_fds,
           LISTEN_PID=str(os.getpid()) if listen_pid == "self" else listen_pid)
os.execve(sys.executable, [sys.executable, "-m", "escrowd", "--bare", *sys.argv[4:]], env)
"""


def activate(directory: Path, passed_fd: int, *args: str, listen_pid: str = "self",
             listen_fds: str = "1", wait_ready: bool = True) -> HolderProcess:
    """Start escrowd on `directory/escrowd.sock` with `passed_fd` handed over as systemd
    would hand over a .socket unit's listening socket (-1: no fd 3 at all)."""
    sock = str(directory / "escrowd.sock")
    log_path = directory / f"escrowd-{uuid.uuid4().hex[:8]}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", ACTIVATE, str(passed_fd), listen_pid, listen_fds,
             "--socket", sock, *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            pass_fds=(passed_fd,) if passed_fd >= 0 else (), env=clean_env(),
        )
    holder = HolderProcess(sock, proc, log_path)
    if wait_ready:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"escrowd exited with {proc.returncode}: {holder.logs()}")
            return " event=ready " in holder.logs()

        wait_for(ready, 15.0, "the activated escrowd to be ready")
    return holder


@pytest.fixture
def activation_dir(socket_dir: Path) -> Path:
    d = socket_dir / "run"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def stopped_at_teardown() -> Iterator[list[HolderProcess]]:
    holders: list[HolderProcess] = []
    yield holders
    for h in holders:
        h.stop()


def listen_like_systemd(path: str) -> socket.socket:
    """What a .socket unit with ListenStream=PATH, SocketMode=0600 sets up."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def round_trip(holder: HolderProcess, pty_children: Callable[..., PtyChild], sid: str) -> None:
    """Hand a shell off, take it back with its replay, and talk to the same shell."""
    child = hand_off_child(holder, pty_children, sid)
    wait_for(lambda: holder.client().list()[0].state == "draining", 10.0, "draining")
    r = holder.client().retrieve(sid)
    try:
        assert r.confirmed and os.isatty(r.fd)
        assert r.session.child_pid == child.pid
        os.write(r.fd, b"ping-" + sid.encode() + b"\n")
        child.master = r.fd
        assert b"ping-" + sid.encode() in child.read_available(until=b"ping-" + sid.encode())
    finally:
        os.close(r.fd)
        child.master = -1


def test_socket_activation_serves_on_the_passed_socket(
    activation_dir: Path, stopped_at_teardown: list[HolderProcess],
    pty_children: Callable[..., PtyChild],
) -> None:
    path = str(activation_dir / "escrowd.sock")
    listener = listen_like_systemd(path)
    inode = os.stat(path).st_ino
    try:
        holder = activate(activation_dir, listener.fileno())
        stopped_at_teardown.append(holder)
        assert "activated=True" in holder.log_lines("listening")[0], holder.logs()
        # It serves on the passed socket: the file systemd bound is the one clients reach.
        assert os.stat(path).st_ino == inode
        assert holder.client().status().pid == holder.pid
        round_trip(holder, pty_children, "tab-1")
        # The passed fd went into the holder's own fd table once, close-on-exec.
        fdinfo = Path(f"/proc/{holder.pid}/fdinfo/3").read_text()
        flags = int(re.search(r"^flags:\s*([0-7]+)$", fdinfo, re.M).group(1), 8)  # type: ignore[union-attr]
        assert flags & os.O_CLOEXEC

        # A clean stop leaves systemd's socket file in place (the manager owns it) and
        # removes the holder's pidfile; systemd's socket goes on listening, and the next
        # holder started on it serves again.
        assert stop(holder) == 0
        assert os.stat(path).st_ino == inode
        assert not os.path.exists(path + ".pid")
        again = activate(activation_dir, listener.fileno())
        stopped_at_teardown.append(again)
        assert holder.client().status().pid == again.pid
        round_trip(again, pty_children, "tab-2")
    finally:
        listener.close()


def test_listen_pid_of_another_process_is_not_ours(
    activation_dir: Path, stopped_at_teardown: list[HolderProcess],
) -> None:
    # LISTEN_* inherited from a parent (LISTEN_PID is not escrowd's pid): fd 3 is not ours,
    # so the holder binds its own socket, as when started by hand.
    path = str(activation_dir / "escrowd.sock")
    listener = listen_like_systemd(path)
    inode = os.stat(path).st_ino
    try:
        holder = activate(activation_dir, listener.fileno(), listen_pid=str(os.getpid()))
        stopped_at_teardown.append(holder)
        assert "activated=False" in holder.log_lines("listening")[0], holder.logs()
        assert os.stat(path).st_ino != inode
        assert holder.client().status().pid == holder.pid
    finally:
        listener.close()


def _regular_file(directory: Path) -> int:
    return os.open(directory / "not-a-socket", os.O_RDWR | os.O_CREAT, 0o600)


def _bound_not_listening(directory: Path) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(directory / "escrowd.sock"))
    return sock.detach()


def _datagram(directory: Path) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(directory / "escrowd.sock"))
    return sock.detach()


def _listening_elsewhere(directory: Path) -> int:
    return listen_like_systemd(str(directory / "other.sock")).detach()


def _tcp_listening(directory: Path) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock.detach()


def _nothing(directory: Path) -> int:
    return -1


def _two_listening(directory: Path) -> int:
    return listen_like_systemd(str(directory / "escrowd.sock")).detach()


@pytest.mark.parametrize(("make_fd", "listen_fds", "message"), [
    (_regular_file, "1", "fd 3 passed by the service manager (LISTEN_FDS=1) is not a socket"),
    (_bound_not_listening, "1", "is a socket that is not listening"),
    (_datagram, "1", "is not a Unix stream socket"),
    (_tcp_listening, "1", "is not a Unix stream socket"),
    (_listening_elsewhere, "1", "other.sock', not to the holder's socket"),
    (_nothing, "1", "fd 3 passed by the service manager (LISTEN_FDS=1) is not open"),
    (_two_listening, "2", "passed 2 fds (LISTEN_FDS=2); escrowd serves on exactly one"),
    (_two_listening, "many", "LISTEN_FDS='many' is not a number of fds"),
])
def test_socket_activation_refuses_what_it_cannot_serve(
    activation_dir: Path, make_fd: Callable[[Path], int], listen_fds: str, message: str,
) -> None:
    fd = make_fd(activation_dir)
    try:
        holder = activate(activation_dir, fd, listen_fds=listen_fds, wait_ready=False)
        rc = holder.proc.wait(15)
    finally:
        if fd >= 0:
            os.close(fd)
    logs = holder.logs()
    print(logs)
    assert rc == 1, logs
    assert "Traceback" not in logs
    line = [ln for ln in logs.splitlines() if ln.startswith("escrowd: ")]
    assert line and message in line[0], logs
    assert " event=ready " not in logs
    assert not os.path.exists(str(activation_dir / "escrowd.sock.pid"))
