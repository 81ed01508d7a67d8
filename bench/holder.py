"""What the bench scripts share: a real holder to measure, and a few small helpers.

Imported as a sibling (`from holder import BenchHolder`): the scripts run as
`python bench/X.py`, which puts bench/ on sys.path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import psutil

from escrow_client import EscrowClient, EscrowError, paths

READY_TIMEOUT = 30.0  # a cold start on a loaded CI machine can take seconds


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             pause: float = 0.002) -> Any:
    """Poll `condition` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(pause)


class BenchHolder:
    """The holder under test: `escrowd` started on a socket in a temporary directory (its
    log in there, or at `log_path`), or, given `socket_path`, one already serving it, which
    is used as it is and never stopped. Ready (answering `status`) once constructed.

    By default the bare holder (`escrowd --bare`: one process, no fd store unless `env`
    names a $NOTIFY_SOCKET). With `keeper`, `escrowd` as users run it: the keeper (`proc`)
    and the holder it runs as its child, which is the process that serves (`pid`, named by
    the pidfile `<socket>.pid`) and the one `kill_serving` SIGKILLs."""

    def __init__(self, socket_path: str | None = None, args: Sequence[str] = (),
                 log_path: str | None = None, name: str = "bench", keeper: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.directory: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: str | None = None
        self.keeper = keeper
        self.startup_s = 0.0  # from exec to answering `status`; 0 for someone else's
        if socket_path is not None:
            self.socket = socket_path
            self.admin = EscrowClient(f"bench.{name}.admin", socket_path=socket_path)
            self.admin.status()  # someone else's holder: it answers now, or never
            return
        self.directory = tempfile.mkdtemp(prefix=f"esc-{name}-")
        self.socket = os.path.join(self.directory, "escrowd.sock")
        self.log_path = log_path or os.path.join(self.directory, "escrowd.log")
        self.admin = EscrowClient(f"bench.{name}.admin", socket_path=self.socket)
        start = time.perf_counter()
        with open(self.log_path, "wb") as log:
            bare = [] if keeper else ["--bare"]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "escrowd", *bare, "--socket", self.socket, *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        try:
            proc = self.proc
            # A fine poll: run.py reports this start-up time.
            wait_for(lambda: proc.poll() is not None or self._answers(), READY_TIMEOUT,
                     "the holder to answer status", pause=0.001)
            if proc.poll() is not None:
                raise RuntimeError(f"escrowd exited with {proc.returncode}")
            self.startup_s = time.perf_counter() - start
        except BaseException:
            self.stop()  # neither the process nor its directory outlives a failed start
            raise

    def _answers(self) -> bool:
        try:
            self.admin.status()
            return True
        except EscrowError:
            return False

    @property
    def pid(self) -> int:
        """The process that serves: the holder (under the keeper, its current child)."""
        assert self.proc is not None, "someone else's holder: its pid is not ours to read"
        if not self.keeper:
            return self.proc.pid
        pid = wait_for(self.serving_pid, READY_TIMEOUT, "a holder under the keeper")
        return int(pid)

    @property
    def keeper_pid(self) -> int:
        assert self.proc is not None and self.keeper, "no keeper of ours"
        return self.proc.pid

    def serving_pid(self) -> int | None:
        """The pid the pidfile names, if that process runs now, started when the pidfile
        says, and (under the keeper) is the keeper's child; else None (no holder serves:
        the keeper is between two holders, or the holder is still starting)."""
        assert self.proc is not None, "someone else's holder: its pid is not ours to read"
        if not self.keeper:
            return self.proc.pid if self.proc.poll() is None else None
        record = paths.read_pidfile(self.socket)
        if record is None:
            return None
        try:
            proc = psutil.Process(record.pid)
            if proc.ppid() != self.proc.pid or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            if record.start_time and abs(proc.create_time() - record.start_time) > 0.01:
                return None  # the pid was reused (the pidfile is a dead holder's)
        except psutil.Error:
            return None
        return record.pid

    def kill_serving(self) -> int | None:
        """SIGKILL the serving holder (under the keeper, which starts the next one), if one
        runs now; returns its pid, or None when none did."""
        pid = self.serving_pid()
        if pid is None:
            return None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def keeper_fds(self) -> int:
        """The keeper's open fds (its own, and every fd in its store), less the socket it
        keeps to each waiting standby (escrowd.standby: one comes a second after a holder
        is ready, and goes when it serves, so a count taken at any moment may have one)."""
        pid = self.keeper_pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            standbys = max(0, len(f.read().split()) - 1)  # every child but the serving one
        return len(os.listdir(f"/proc/{pid}/fd")) - standbys

    def alive(self) -> bool:
        """The holder (under the keeper: the keeper, which keeps a holder running)."""
        if self.proc is not None:
            return self.proc.poll() is None
        return self._answers()

    def client(self, owner: str) -> EscrowClient:
        # A long timeout: the bench loads the holder far beyond what an app would.
        return EscrowClient(owner, socket_path=self.socket, timeout=30.0)

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def settled_fds(self, want: int, timeout: float = 5.0) -> int:
        """The holder's open fd count (from `status`), once it equals `want` or after
        `timeout` (a dead or finished client's connection may still be closing)."""
        deadline = time.monotonic() + timeout
        while True:
            count = self.admin.status().open_fds or 0
            if count == want or time.monotonic() > deadline:
                return count
            time.sleep(0.01)

    def log_count(self, event: str) -> int | None:
        """Lines of the holder's log for `event`; None when the log is not ours."""
        if self.log_path is None:
            return None
        with open(self.log_path, errors="replace") as log:
            return sum(1 for line in log if f" event={event} " in line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> BenchHolder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# --- the soaks' live shells -----------------------------------------------------------------

# The child: a numbered line, then a pause of $0 seconds (`read -t` is a builtin: no fork
# per line), so that a reader can check that the output runs on with no gap.
NUMBERED_LINES = 'i=0; while :; do i=$((i+1)); echo "L$i"; read -r -t "$0" _; done'


def spawn_numbered_shell(interval: float) -> tuple[int, subprocess.Popen[bytes]]:
    """A bash printing `L1`, `L2`, ... every `interval` seconds on a new PTY whose slave is
    its controlling terminal (as a real terminal's shell); returns (master, process)."""
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~termios.ECHO  # nothing but the shell's own output
    termios.tcsetattr(slave, termios.TCSANOW, attrs)

    def controlling_tty() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(["bash", "-c", NUMBERED_LINES, f"{interval:.4f}"], stdin=slave,
                            stdout=slave, stderr=slave, preexec_fn=controlling_tty,
                            close_fds=True)
    os.close(slave)
    return master, proc


def read_until(fd: int, done: Callable[[bytearray], bool], timeout: float) -> bytes:
    """Read `fd` until `done(data so far)` is true, EOF or an error, or the timeout."""
    out = bytearray()
    deadline = time.monotonic() + timeout
    while not done(out):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return bytes(out)


def end_shell(proc: subprocess.Popen[bytes], master: int) -> None:
    """Kill a shell (if still running), reap it, and close our copy of its master."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    with contextlib.suppress(OSError):  # already closed
        os.close(master)
