"""Shared fixtures: a real escrowd process on a temporary socket, real PTYs, real children.

Nothing here sleeps to synchronise: `wait_for` polls a condition under a deadline.
Every test that uses `holder` also checks fd hygiene at teardown: once every session left is
released, the holder's open fd count must be back to its baseline.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from escrow_client import EscrowClient, EscrowError, paths

OWNER = "com.example.term"


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Under `nohup scripts/test` SIGHUP is ignored, and in a job a shell started in the
# background SIGINT and SIGQUIT are; an ignored signal stays ignored across exec: every
# shell the tests start on a terminal would outlive its hangup, and escrowctl would not
# take Ctrl-C. A handler that does nothing keeps this process deaf to them as asked, while
# its children start with the default, as under a terminal.
for _signum in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_signum) == signal.SIG_IGN:
        signal.signal(_signum, lambda signum, frame: None)


def require_real(component: str, available: bool, how: str) -> None:
    """A test of a real component (a program, root, a second uid) cannot run without it:
    on CI that is a failure, never a skip; elsewhere it is skipped, saying `how` to get it."""
    if available:
        return
    message = f"{component} is needed and missing here: {how}"
    if ON_CI:
        pytest.fail(message)
    pytest.skip(message)


def require_program(name: str) -> str:
    """The path of system program `name` (installed by `scripts/setup --test`)."""
    path = shutil.which(name)
    require_real(name, path is not None, "run scripts/setup --test, which installs it")
    assert path is not None
    return path


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class HolderProcess:
    socket: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    baseline_fds: int = 0
    extra_args: list[str] = field(default_factory=list)
    keeper: bool = False  # proc is the keeper; the holder serving is its child

    @property
    def pid(self) -> int:
        return self.proc.pid

    def serving_pid(self) -> int:
        """The process that answers: the holder (under a keeper, the keeper's child, as
        its pidfile names it: asking the holder would open a connection, an fd more)."""
        if not self.keeper:
            return self.proc.pid
        record = paths.read_pidfile(self.socket)
        assert record is not None, "no pidfile: no holder serves"
        return record.pid

    def logs(self) -> str:
        return self.log_path.read_text()

    def log_lines(self, event: str) -> list[str]:
        return [line for line in self.logs().splitlines() if f" event={event} " in line + " "]

    def fd_count(self) -> int:
        return fd_count(self.serving_pid())

    def client(self, owner: str = OWNER, **kwargs: Any) -> EscrowClient:
        return EscrowClient(owner, socket_path=self.socket, **kwargs)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_fds_at_baseline(self, timeout: float = 5.0) -> None:
        wait_for(lambda: self.fd_count() == self.baseline_fds, timeout,
                 f"holder fds back to baseline {self.baseline_fds} (now {self.fd_count()})")

    def release_everything(self) -> None:
        admin = self.client("escrowctl")
        for info in admin.list(all_owners=True):
            if info.state in ("draining", "exited", "held"):
                try:
                    self.client(info.owner).release(info.id)
                except EscrowError:
                    pass

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_holder(directory: Path, *args: str, env: dict[str, str] | None = None,
                 keeper: bool = False, python: str | None = None) -> HolderProcess:
    """Start `python -m escrowd` on a socket in `directory` and wait until it is ready: the
    bare holder (one process, whose fds the tests count), or with `keeper` the pair as users
    run it (then `pid` is the keeper's). `python`: the interpreter of another installation
    (tests/installation.py), whose code it runs."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = str(directory / "escrowd.sock")
    log_path = directory / "escrowd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [python or sys.executable, "-m", "escrowd", *([] if keeper else ["--bare"]),
             "--socket", sock, *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
        )
    holder = HolderProcess(sock, proc, log_path, extra_args=list(args), keeper=keeper)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"escrowd exited with {proc.returncode}: {holder.logs()}")
        return " event=ready " in holder.logs()

    wait_for(ready, 15.0, "escrowd to be ready")
    holder.baseline_fds = holder.fd_count()
    return holder


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Unix socket paths are short (108 bytes): keep them out of pytest's long tmp paths.
    d = Path(tempfile.mkdtemp(prefix="esc-"))
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_holder(socket_dir: Path) -> Iterator[Callable[..., HolderProcess]]:
    """Start holders with extra arguments; each is checked for fd hygiene and stopped."""
    holders: list[HolderProcess] = []

    def make(*args: str, name: str = "h", env: dict[str, str] | None = None,
             keeper: bool = False, python: str | None = None) -> HolderProcess:
        h = start_holder(socket_dir / f"{name}{len(holders)}", *args, env=env, keeper=keeper,
                         python=python)
        holders.append(h)
        return h

    yield make
    try:
        for h in holders:
            if h.alive():
                h.release_everything()
                h.wait_fds_at_baseline()
    finally:
        for h in holders:
            h.stop()


@pytest.fixture
def holder(make_holder: Callable[..., HolderProcess]) -> HolderProcess:
    return make_holder()


@dataclass
class PtyChild:
    """A child process on the slave side of a fresh PTY; the test holds the master."""

    master: int
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_available(self, timeout: float = 5.0, until: bytes | None = None) -> bytes:
        """Read from the master until `until` appears (or, without it, until quiet)."""
        import select

        out = bytearray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.05 if until is None else 0.2)
            if not ready:
                if until is None and out:
                    break
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            if until is not None and until in out:
                break
        return bytes(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _make_controlling_tty() -> None:
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def spawn_in_pty(argv: list[str], cols: int = 80, rows: int = 24) -> PtyChild:
    """Run `argv` as the session leader of a new PTY, with the slave as its controlling
    terminal (so it gets SIGHUP if the terminal hangs up, as under a real terminal app)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_make_controlling_tty,
        close_fds=True,
    )
    os.close(slave)
    return PtyChild(master, proc)


@pytest.fixture
def pty_children() -> Iterator[Callable[..., PtyChild]]:
    """Spawn children in PTYs; every one is killed and its master closed at teardown."""
    children: list[PtyChild] = []

    def spawn(argv: list[str], **kwargs: int) -> PtyChild:
        child = spawn_in_pty(argv, **kwargs)
        children.append(child)
        return child

    yield spawn
    for child in children:
        child.kill()
        try:
            os.close(child.master)
        except OSError:
            pass


@pytest.fixture
def apps() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (apps, say): every one still running is killed at teardown."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for app in started:
        if app.poll() is None:
            app.kill()
        app.communicate()
