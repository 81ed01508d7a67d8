"""Every failure at connect time is an EscrowError, and a refusal is reported as what it is.

Incidents pinned:
- a permission error on connect escaped as a bare PermissionError (`escrowctl --socket
  <someone else's dir>/escrowd.sock list` printed a traceback; autostart against a squatted
  0700 directory raised PermissionError from `list()`);
- a holder that refused a peer (`forbidden`, `limit`) and closed was reported as
  `unavailable (Broken pipe)`, because the client's hello send failed before it read the
  answer waiting for it;
- `escrowctl stop` printed a traceback for a pid it may not signal.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from otheruser import other_user, squat

from conftest import OWNER, HolderProcess, PtyChild, require_program
from escrow_client import (
    EscrowClient,
    EscrowConfigError,
    EscrowError,
    Forbidden,
    HolderUnavailable,
    LimitReached,
    autostart,
    cli,
    protocol,
    trust,
)
from escrow_client.fdpass import recv_frame

ESCROWCTL = str(Path(sys.executable).parent / "escrowctl")


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="esc-conn-"))
    os.chmod(d, 0o755)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def refused_with(path: str, expected: type[EscrowError]) -> EscrowError:
    """Both a plain client and an autostarting one fail with `expected`, and autostart
    starts nothing for a path that cannot work."""
    before = autostart.spawned
    for client in (EscrowClient(OWNER, socket_path=path),
                   EscrowClient(OWNER, socket_path=path, autostart=True, timeout=1.0)):
        with pytest.raises(expected) as refused:
            client.list()
    assert autostart.spawned == before
    return refused.value


def test_enotdir(base: Path) -> None:
    (base / "file").write_text("")
    error = refused_with(str(base / "file" / "sub" / "escrowd.sock"), EscrowConfigError)
    assert os.strerror(errno.ENOTDIR) in str(error)


def test_eloop(base: Path) -> None:
    (base / "loop").symlink_to(base / "loop")
    error = refused_with(str(base / "loop" / "sub" / "escrowd.sock"), EscrowConfigError)
    assert os.strerror(errno.ELOOP) in str(error)


def test_enametoolong(base: Path) -> None:
    """A name over NAME_MAX, or a path over the 103 bytes a Unix socket address holds:
    refused before anything is tried, naming the limit; `escrowctl` says so in one line,
    and `status` (which looks at the directory itself) gets ENAMETOOLONG as a verdict."""
    for path in (base / ("x" * 300) / "escrowd.sock", base / ("d" * 100) / "escrowd.sock"):
        error = refused_with(str(path), EscrowConfigError)
        assert "103-byte limit" in str(error)
        listing = subprocess.run([ESCROWCTL, "--socket", str(path), "list"],
                                 capture_output=True, text=True, timeout=30)
        assert listing.returncode == 1 and "(config)" in listing.stderr, listing.stderr
        assert "Traceback" not in listing.stderr
    status = subprocess.run([ESCROWCTL, "--socket", str(base / ("x" * 300) / "escrowd.sock"),
                             "status", "--json"], capture_output=True, text=True, timeout=30)
    assert status.returncode == cli.STATUS_EXIT_CODES["indeterminate"], status.stderr
    assert os.strerror(errno.ENAMETOOLONG) in json.loads(status.stdout)["reason"]


def test_a_symlink_or_a_file_where_the_directory_should_be(base: Path) -> None:
    (base / "real").mkdir(mode=0o700)
    (base / "link").symlink_to(base / "real")
    error = refused_with(str(base / "link" / "escrowd.sock"), Forbidden)
    assert "is a symlink" in str(error)
    (base / "file").write_text("")
    error = refused_with(str(base / "file" / "escrowd.sock"), Forbidden)
    assert "is not a directory" in str(error)


LIST_ONCE = textwrap.dedent("""
    import sys
    from escrow_client import EscrowClient, EscrowError
    try:
        EscrowClient("com.example.term", socket_path=sys.argv[1], autostart=True,
                     timeout=1.0).list()
    except EscrowError as exc:
        print(type(exc).__name__, exc.code, exc, sep="|")
""")


def test_eacces(base: Path) -> None:
    """The socket lies below another user's private directory. Run as a process without
    the capabilities that let root pass any permission check (as any other user is), the
    client's look at its socket directory gets EACCES: Forbidden, never PermissionError,
    and autostart starts nothing."""
    setpriv = require_program("setpriv")
    user = other_user()
    squat(base / "theirs", user, 0o700)
    path = str(base / "theirs" / "escrowd" / "escrowd.sock")
    result = subprocess.run(
        [setpriv, "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-c", LIST_ONCE,
         path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    name, code, message = result.stdout.strip().split("|")
    assert (name, code) == ("Forbidden", "forbidden")
    assert os.strerror(errno.EACCES) in message and path in message


def test_eperm_and_every_other_errno_map_to_escrow_errors() -> None:
    """EPERM cannot be made here without a security module; the mapping is checked as such,
    with the rest of the table."""
    path = "/run/user/1000/escrowd/escrowd.sock"
    expected = {
        errno.EPERM: "forbidden", errno.EACCES: "forbidden",
        errno.ENOENT: "unavailable", errno.ECONNREFUSED: "unavailable",
        errno.ENOTDIR: "config", errno.ENAMETOOLONG: "config", errno.ELOOP: "config",
        errno.EIO: "unavailable",
    }
    for number, code in expected.items():
        error = trust.connect_error(OSError(number, os.strerror(number)), path)
        assert isinstance(error, EscrowError) and error.code == code, (number, error)
        assert path in str(error) and os.strerror(number) in str(error)
    # Python's own "AF_UNIX path too long" carries no errno.
    assert trust.connect_error(OSError("AF_UNIX path too long"), path).code == "config"


class RefusingListener:
    """A real listener that answers a connection with one `error` frame and closes at
    once, as the holder does for a peer it refuses, before the client has sent a byte.
    With `welcome_first`, it first reads the hello and welcomes it, then answers the
    error (about session `sid`) before any request comes, and closes."""

    def __init__(self, path: str, code: str, sid: str | None = None,
                 welcome_first: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        self.frame = protocol.encode(protocol.Error(code=code, message=f"refused: {code}",
                                                    id=sid))
        self.welcome_first = welcome_first
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            if self.welcome_first:
                recv_frame(conn, 1 << 20)
                conn.sendall(protocol.encode(protocol.Welcome(
                    version=1, holder_version="0", pid=1, drain_stop_budget=0.5,
                    send_deadline=0.5, ack_deadline=1.0)))
            conn.sendall(self.frame)
        self.closed.set()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("code, error", [("forbidden", Forbidden), ("limit", LimitReached)])
def test_a_refusal_is_reported_as_itself_not_as_a_broken_pipe(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch, code: str, error: type[EscrowError],
) -> None:
    """The listener answers and closes before the client's hello goes out (the client is
    held back only until then, after its trust checks), so the hello's send fails with
    EPIPE. The client reads the answer that was waiting and raises it."""
    path = str(socket_dir / "escrowd.sock")
    listener = RefusingListener(path, code)
    real_check = trust.check_peer

    def check_then_let_the_listener_close_first(sock: socket.socket, where: str) -> None:
        real_check(sock, where)
        assert listener.closed.wait(10)

    monkeypatch.setattr(trust, "check_peer", check_then_let_the_listener_close_first)
    try:
        with pytest.raises(error) as refused:
            EscrowClient(OWNER, socket_path=path).list()
        assert str(refused.value) == f"refused: {code}"
    finally:
        listener.close()


def test_connection_limit_from_a_real_holder_is_limit(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """The same against the real holder: over --max-connections, `limit`, never
    `unavailable`, however the race between its answer and the client's hello goes."""
    holder = make_holder("--max-connections", "1")
    with holder.client().custody():
        for _ in range(20):
            with pytest.raises(LimitReached):
                holder.client().list()


def test_stop_never_prints_a_traceback_for_a_pid_it_may_not_signal(
    holder: HolderProcess, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The holder answers and holds the lock, but this user may not signal its pid (another
    uid's process in a shared pid namespace, say): a refusal with its own exit code, and the
    holder runs on. (os.kill is made to refuse: as root here, nothing else would.)"""
    def refuse(pid: int, signum: int) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(cli.os, "kill", refuse)
    rc = cli.main(["--socket", holder.socket, "stop"])
    err = capsys.readouterr().err
    assert rc == cli.STOP_NOT_PERMITTED == 6
    assert "Traceback" not in err and "you may not signal it" in err
    assert f"pid {holder.pid}" in err and "nothing was signalled" in err
    assert holder.alive()


def test_a_missing_directory_is_nothing_listening(base: Path) -> None:
    """A missing directory is nothing listening (autostart may start a holder there)."""
    with pytest.raises(HolderUnavailable):
        EscrowClient(OWNER, socket_path=str(base / "none" / "escrowd.sock")).list()


def test_a_refusal_about_another_request_is_not_taken_for_this_one(
    socket_dir: Path, pty_children: Callable[..., PtyChild],
) -> None:
    """The answer waiting after a failed send names another session (a late answer to an
    earlier request): it is not this request's answer, so the failure is reported as what
    it is, the holder gone."""
    path = str(socket_dir / "escrowd.sock")
    listener = RefusingListener(path, "exists", sid="tab-A", welcome_first=True)
    kid = pty_children(["sh", "-c", "sleep 30"])
    try:
        custody = EscrowClient(OWNER, socket_path=path).custody()
        assert listener.closed.wait(10)
        with pytest.raises(HolderUnavailable):
            custody.deposit("tab-B", kid.master)
        custody.close()
    finally:
        listener.close()


def test_odd_inputs_are_escrow_errors_or_clean_cli_errors(base: Path) -> None:
    """An embedded NUL in the socket path is a configuration error, not a ValueError; an
    infinite --timeout is refused by the argument parser; `status | head -1` ends without
    a traceback when the reader goes."""
    with pytest.raises(EscrowConfigError):
        EscrowClient(OWNER, socket_path=str(base / "a\0b" / "escrowd.sock")).list()
    result = subprocess.run([ESCROWCTL, "--timeout", "inf", "list"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    piped = subprocess.run(f"{ESCROWCTL} --socket {base}/none/escrowd.sock status | head -c1",
                           shell=True, capture_output=True, text=True, timeout=30)
    assert "Traceback" not in piped.stderr, piped.stderr


def test_autostart_into_a_directory_the_holder_would_refuse_says_why_at_once(
    base: Path,
) -> None:
    """Our own directory, but mode 0755: the client may talk to a holder there, but no
    holder will start there. Autostart says so at once, with the holder's reason, instead
    of waiting out its deadline and reporting nothing listening."""
    directory = base / "open"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    before = autostart.spawned
    started = time.monotonic()
    with pytest.raises(EscrowConfigError) as refused:
        EscrowClient(OWNER, socket_path=str(directory / "escrowd.sock"), autostart=True).list()
    assert "mode 0755" in str(refused.value)
    assert time.monotonic() - started < 1.0 and autostart.spawned == before
