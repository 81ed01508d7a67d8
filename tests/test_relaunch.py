"""Relaunch: an app process dies (or exits on purpose) and a fresh process takes its terminal
back with nothing lost, nothing twice, the same child, and input still reaching it.

The "app" is a real separate Python process using `escrow_client`; its child is a real bash
in a real PTY printing a numbered line every 20 ms. Every byte the app read is written to a
capture file before it reads again, so app capture + replay + live output is the whole
stream, and its line numbers must run 1, 2, 3, ... with no gap and no repeat.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import OWNER, HolderProcess, wait_for
from escrow_client import CustodyHeld, EscrowClient, Retrieved

# The child: a numbered line every ~20 ms; a line of input is echoed back as GOT:<line>
# (`read -t` is the 20 ms pause, so input is noticed within one tick).
LOOP = (
    'i=0; while :; do i=$((i+1)); echo "L$i"; '
    'if read -r -t 0.02 line; then echo "GOT:$line"; fi; done'
)

# Bytes the app lets pile up, unread, in the kernel before it reports it is parked: so the
# holder has something to drain into the replay once the app is gone.
PENDING_BEFORE_PARK = 60

APP = r"""
import fcntl, json, os, signal, struct, subprocess, sys, termios, time
from escrow_client import EscrowClient

sock, owner, sid, mode, workdir, loop, pending_before_park = sys.argv[1:8]
pending_before_park = int(pending_before_park)
capture = os.open(os.path.join(workdir, "captured"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

def status(**fields):
    tmp = os.path.join(workdir, "status.tmp")
    with open(tmp, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, os.path.join(workdir, "status"))

master, slave = os.openpty()
attrs = termios.tcgetattr(slave)
attrs[3] &= ~termios.ECHO  # input is not echoed: the only output is the child's own
termios.tcsetattr(slave, termios.TCSANOW, attrs)

def controlling_tty():
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)

child = subprocess.Popen(["bash", "-c", loop], stdin=slave, stdout=slave, stderr=slave,
                         preexec_fn=controlling_tty, close_fds=True)
os.close(slave)
seen = bytearray(b"\n")

def read_until(n):
    # Read (blocking) until line L<n> is complete; every byte is on disk before the next read.
    while (b"\nL%d\r\n" % n) not in seen:
        chunk = os.read(master, 4096)
        os.write(capture, chunk)
        seen.extend(chunk)

def pending():
    return struct.unpack("i", fcntl.ioctl(master, termios.FIONREAD, b"\0\0\0\0"))[0]

read_until(5)
client = EscrowClient(owner, socket_path=sock)
if mode == "crash":
    custody = client.custody()  # stays open until the process dies
    custody.deposit(sid, master, child_pid=child.pid, label="bash")
    status(phase="deposited", child_pid=child.pid)
    read_until(15)  # still the reader: the holder does not touch the fd while we live
    while pending() < pending_before_park:  # stop reading; let output pile up
        time.sleep(0.005)
    status(phase="parked", child_pid=child.pid, captured=len(seen) - 1)
    while True:
        signal.pause()  # until SIGKILL
else:
    read_until(15)
    client.hand_off(sid, master, child_pid=child.pid, label="bash")
    os.close(master)  # never read our copy again once custody is over
    status(phase="handed_off", child_pid=child.pid, captured=len(seen) - 1)
    child.returncode = 0  # the child lives on in the holder; do not warn about it at exit
    sys.exit(0)
"""


def _start_app(
    holder: HolderProcess, workdir: Path, mode: str, sid: str
) -> subprocess.Popen[bytes]:
    with open(workdir / "app.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", APP, holder.socket, OWNER, sid, mode, str(workdir), LOOP,
             str(PENDING_BEFORE_PARK)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )


def _status(workdir: Path, app: subprocess.Popen[bytes], phase: str) -> dict[str, Any] | None:
    if app.poll() is not None and phase != "handed_off":
        raise AssertionError(f"app exited early ({app.returncode}): "
                             f"{(workdir / 'app.log').read_text()}")
    try:
        status: dict[str, Any] = json.loads((workdir / "status").read_text())
    except FileNotFoundError:
        return None
    return status if status.get("phase") == phase else None


def line_numbers(stream: bytes) -> list[int]:
    """The L-numbers of every complete line in `stream` (a partial last line is ignored)."""
    numbers = []
    for raw in stream.split(b"\n")[:-1]:
        line = raw.rstrip(b"\r")
        if line.startswith(b"GOT:"):
            continue
        match = re.fullmatch(rb"L(\d+)", line)
        assert match, f"unexpected line {line!r} in the stream"
        numbers.append(int(match.group(1)))
    return numbers


def assert_contiguous(numbers: list[int]) -> None:
    for index, number in enumerate(numbers):
        expected = index + 1
        assert number == expected, (
            f"line {index}: got L{number}, expected L{expected} "
            f"({'a line repeated' if number < expected else 'lines lost'}); "
            f"around it: {numbers[max(0, index - 3):index + 3]}"
        )


def read_live(fd: int, until: bytes | None = None, min_line: int = 0,
              timeout: float = 5.0) -> bytes:
    """Read `fd` until `until` appears and the last complete L-line is >= min_line."""
    out = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        numbers = re.findall(rb"L(\d+)\r?\n", bytes(out))
        done = (until is None or until in out) and (numbers and int(numbers[-1]) >= min_line)
        if done:
            return bytes(out)
        left = deadline - time.monotonic()
        assert left > 0, f"timed out reading the live fd; got {bytes(out[-200:])!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            out += os.read(fd, 65536)


def retrieve_when_custody_ends(client: EscrowClient, sid: str) -> Retrieved:
    """Retry `custody_held` until the holder has noticed the app is gone."""
    attempts = 0

    def attempt() -> Retrieved | None:
        nonlocal attempts
        attempts += 1
        try:
            return client.retrieve(sid)
        except CustodyHeld as exc:
            assert exc.code == "custody_held"
            return None

    got: Retrieved = wait_for(attempt, 10.0, f"retrieve of {sid} once custody ends")
    print(f"  retrieve attempts until custody ended: {attempts}")
    return got


def check_relaunch(workdir: Path, got: Retrieved, child_pid: int, expect_state: str) -> None:
    """Contiguity of capture + replay + live, same child, and input still reaches it."""
    captured = (workdir / "captured").read_bytes()
    assert got.confirmed
    assert got.session.state == expect_state
    assert got.dropped_bytes == 0
    assert got.session.child_pid == child_pid, "the retrieved session is not the app's shell"
    assert got.session.child_alive is True
    assert os.isatty(got.fd)

    before = line_numbers(captured + got.replay)
    live = read_live(got.fd, min_line=before[-1] + 10 if before else 10)
    # Input written to the retrieved master reaches the same child.
    os.write(got.fd, b"hello-escrow\n")
    live += read_live(got.fd, until=b"GOT:hello-escrow\r\n")
    # The live read may end mid-line; that is fine, line_numbers ignores a partial tail.
    stream = captured + got.replay + live
    numbers = line_numbers(stream)
    assert_contiguous(numbers)
    assert b"GOT:hello-escrow\r\n" in live
    app_lines = len(line_numbers(captured))
    replay_lines = len(line_numbers(captured + got.replay)) - app_lines
    print(f"\n  lines seen: {len(numbers)} (app read {app_lines} lines / {len(captured)} B, "
          f"replay {replay_lines} lines / {len(got.replay)} B, live "
          f"{len(numbers) - app_lines - replay_lines} lines / {len(live)} B)")
    print(f"  bytes replayed: {len(got.replay)}")


def _kill_pid(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_relaunch_after_sigkill(holder: HolderProcess, tmp_path: Path) -> None:
    """Incident: the app crashed (SIGKILL, no cleanup) with its sessions in custody; the
    relaunched app must get each shell back, same pid and alive, with every line the app had
    not read yet in the replay or still in the kernel, none lost and none twice, and typing
    must still reach the shell."""
    app = _start_app(holder, tmp_path, "crash", "tab-1")
    child_pid: int | None = None
    got: Retrieved | None = None
    try:
        parked = wait_for(lambda: _status(tmp_path, app, "parked"), 10.0, "the app to park")
        child_pid = parked["child_pid"]
        client = holder.client()
        (info,) = [s for s in client.list() if s.id == "tab-1"]
        assert info.state == "held" and info.custodian_pid == app.pid
        assert info.buffered_bytes == 0

        app.send_signal(signal.SIGKILL)
        app.wait(10)
        assert app.returncode == -signal.SIGKILL
        got = retrieve_when_custody_ends(client, "tab-1")
        assert len(got.replay) >= PENDING_BEFORE_PARK, "the unread output was not replayed"
        check_relaunch(tmp_path, got, child_pid, "draining")
    finally:
        if app.poll() is None:
            app.kill()
        app.wait()
        if got is not None:
            os.close(got.fd)
        _kill_pid(child_pid)


def test_relaunch_after_planned_hand_off(holder: HolderProcess, tmp_path: Path) -> None:
    """Incident: an app updating itself hands its sessions off and exits normally; the new
    instance must get the same shell back with the output written in between, contiguous
    with what the old instance showed, and typing must still reach the shell."""
    app = _start_app(holder, tmp_path, "hand_off", "tab-2")
    child_pid: int | None = None
    got: Retrieved | None = None
    try:
        app.wait(10)
        assert app.returncode == 0, (tmp_path / "app.log").read_text()
        status = _status(tmp_path, app, "handed_off")
        assert status is not None
        child_pid = status["child_pid"]
        client = holder.client()

        def drained_some() -> bool:
            (info,) = [s for s in client.list() if s.id == "tab-2"]
            assert info.state == "draining"
            return info.buffered_bytes >= PENDING_BEFORE_PARK

        wait_for(drained_some, 5.0, "the holder to drain some output")
        got = client.retrieve("tab-2")
        check_relaunch(tmp_path, got, child_pid, "draining")
    finally:
        if app.poll() is None:
            app.kill()
        app.wait()
        if got is not None:
            os.close(got.fd)
        _kill_pid(child_pid)
