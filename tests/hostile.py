"""Helpers for the hostile-input tests (bad input, fuzzing, slow peers, logs).

A *bystander* is a real session that the hostile tests must leave untouched: a child in a
real PTY printing numbered lines (L1, L2, ...) every 10 ms, handed off to the holder and
draining in the background. After any amount of abuse it must still be draining, its
buffer still growing, and in the end its replay plus live output must be L1, L2, ... with
no gap and no repeat.

Everything here talks to a real holder process over real sockets.
"""

from __future__ import annotations

import array
import os
import select
import shlex
import socket
import stat
import time
from typing import Any

import msgspec
import psutil
from rawclient import RawClient

from conftest import OWNER, HolderProcess, PtyChild, spawn_in_pty, wait_for
from escrow_client import EscrowClient, fdpass, protocol

SESSION_FDS = 2  # one session costs the holder: its PTY master and its state file (the
# drain loop's one readiness set is made as the holder starts: in the baseline)
COUNTER = "i=0; while [ $i -lt 1000000 ]; do i=$((i+1)); echo L$i; sleep 0.01; done"
BYSTANDER = "bystander"


# --- raw bytes on the wire --------------------------------------------------------------------


def frame(body: bytes) -> bytes:
    """A frame around any body at all."""
    return protocol.HEADER.pack(len(body)) + body


def mp(obj: Any) -> bytes:
    """A MessagePack body for any object (a dict that is not a valid message, say)."""
    return msgspec.msgpack.encode(obj)


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send `data`, with `fds` (any number) riding on its first byte."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    view = memoryview(data)
    sent = sock.sendmsg([view], anc, socket.MSG_NOSIGNAL)
    view = view[sent:]
    while view:
        view = view[sock.send(view, socket.MSG_NOSIGNAL):]


def answers_until_eof(raw: RawClient, timeout: float = 5.0) -> list[protocol.Response]:
    """Every frame the holder sends until it closes the connection (fds it sent are closed)."""
    raw.sock.settimeout(timeout)
    answers: list[protocol.Response] = []
    while True:
        try:
            body, fds = fdpass.recv_frame(raw.sock, 256 << 20)
        except (EOFError, ConnectionResetError):
            return answers
        fdpass.close_fds(fds)
        answers.append(protocol.decode_response(body))


def expect_error(raw: RawClient, code: str) -> protocol.Error:
    reply, fd = raw.receive()
    assert fd is None
    assert isinstance(reply, protocol.Error), reply
    assert reply.code == code, reply
    assert reply.message, "an error names its reason"
    return reply


def expect_closed(raw: RawClient, timeout: float = 5.0) -> None:
    """The holder ends the connection (with no further frame)."""
    rest = answers_until_eof(raw, timeout)
    assert rest == [], f"expected the holder to close, got {rest}"


def expect_still_serving(raw: RawClient) -> None:
    """The same connection still answers a request."""
    raw.send(protocol.Status())
    reply, _ = raw.receive()
    assert isinstance(reply, protocol.HolderStatus), reply


def log_fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in shlex.split(line))


def holder_status(holder: HolderProcess) -> protocol.HolderStatus:
    """A status call on a fresh connection: the holder is alive and serving."""
    assert holder.alive(), holder.logs()[-3000:]
    with RawClient(holder.socket, timeout=5.0) as raw:
        raw.hello(owner="status.check")
        raw.send(protocol.Status())
        reply, _ = raw.receive()
    assert isinstance(reply, protocol.HolderStatus), reply
    assert reply.pid == holder.pid
    return reply


def wait_fds(holder: HolderProcess, sessions: int, connections: int = 0,
             timeout: float = 5.0) -> None:
    """The holder's open fds come back to its baseline plus those of the `sessions` it
    holds (each SESSION_FDS) and of the `connections` open to it (one each)."""
    want = holder.baseline_fds + SESSION_FDS * sessions + connections
    wait_for(lambda: holder.fd_count() == want, timeout,
             f"holder fds back to {want} (baseline {holder.baseline_fds} + {sessions} "
             f"session(s) + {connections} connection(s)); now {holder.fd_count()}")


# --- what an idle holder costs ---------------------------------------------------------------


def holder_activity(holder: HolderProcess) -> tuple[float, int]:
    """What the holder has used so far: CPU seconds (user + system, every thread), and how
    many times a thread of it went to sleep waiting for something (voluntary context
    switches). A holder that wakes up periodically adds one per wake-up."""
    cpu = psutil.Process(holder.pid).cpu_times()
    waits = 0
    for task in os.listdir(f"/proc/{holder.pid}/task"):
        try:
            with open(f"/proc/{holder.pid}/task/{task}/status") as f:
                waits += next(int(line.split()[1]) for line in f
                              if line.startswith("voluntary_ctxt_switches:"))
        except FileNotFoundError:
            pass  # a thread that ended while we looked
    return cpu.user + cpu.system, waits


def assert_idle(holder: HolderProcess, seconds: float = 1.0, max_cpu: float = 0.03,
                max_wakeups: int | None = 3) -> None:
    """While nothing is asked of it for `seconds`, the holder uses at most `max_cpu` seconds
    of CPU and (unless None) wakes up at most `max_wakeups` times (a few, for the tail of
    whatever came just before)."""
    cpu_before, waits_before = holder_activity(holder)
    time.sleep(seconds)  # the behaviour under test: what the holder does with nothing to do
    cpu_after, waits_after = holder_activity(holder)
    cpu, wakeups = cpu_after - cpu_before, waits_after - waits_before
    assert cpu <= max_cpu, f"the holder used {cpu:.3f}s of CPU in {seconds}s with nothing to do"
    if max_wakeups is not None:
        assert wakeups <= max_wakeups, (
            f"the holder woke up {wakeups} times in {seconds}s with nothing to do")


# --- numbered output --------------------------------------------------------------------------


def numbered_lines(data: bytes) -> list[int]:
    *complete, _partial = data.split(b"\r\n")
    numbers = []
    for line in complete:
        assert line.startswith(b"L") and line[1:].isdigit(), f"unexpected line {line!r}"
        numbers.append(int(line[1:]))
    return numbers


def assert_gap_free_from_1(data: bytes) -> None:
    numbers = numbered_lines(data)
    assert numbers, "no complete line"
    for expected, got in enumerate(numbers, start=1):
        assert got == expected, f"line {expected} expected, got L{got}: a gap or a repeat"


def read_more_lines(fd: int, data: bytes, more: int, timeout: float = 10.0) -> bytes:
    out = bytearray(data)
    want = len(numbered_lines(data)) + more
    deadline = time.monotonic() + timeout
    while len(numbered_lines(bytes(out))) < want:
        left = deadline - time.monotonic()
        assert left > 0, f"no {more} more lines within {timeout}s"
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 65536)
            assert chunk, "end of file on a live master"
            out += chunk
    return bytes(out)


# --- the bystander ----------------------------------------------------------------------------


class Bystander:
    """A draining session (a real PTY child printing numbered lines) that must stay untouched."""

    def __init__(self, holder: HolderProcess, sid: str = BYSTANDER, owner: str = OWNER) -> None:
        self.holder = holder
        self.sid = sid
        self.child: PtyChild = spawn_in_pty(["sh", "-c", COUNTER])
        self.client: EscrowClient = holder.client(owner)
        try:
            self.client.hand_off(sid, self.child.master, child_pid=self.child.pid, label="sh")
        finally:
            os.close(self.child.master)
            self.child.master = -1
        self.wait_buffered(len(b"L1\r\nL2\r\n"))

    def info(self) -> protocol.SessionInfo:
        info = next((s for s in self.client.list() if s.id == self.sid), None)
        assert info is not None, f"{self.sid} is gone from the list"
        return info

    def wait_buffered(self, at_least: int) -> protocol.SessionInfo:
        def check() -> protocol.SessionInfo | None:
            info = self.info()
            assert info.state == "draining", info
            return info if info.buffered_bytes >= at_least else None

        return wait_for(check, 10.0, f"{self.sid} draining with >= {at_least} bytes")

    def assert_draining_and_growing(self) -> None:
        before = self.info()
        assert before.state == "draining", before
        assert before.dropped_bytes == 0, before
        self.wait_buffered(before.buffered_bytes + 1)

    def take_back_and_check(self) -> bytes:
        """Retrieve it: the replay is L1, L2, ... with no gap, and live output follows on."""
        got = self.client.retrieve(self.sid)
        try:
            assert got.confirmed
            assert got.session.state == "draining", got.session
            assert got.dropped_bytes == 0
            assert os.isatty(got.fd)
            assert_gap_free_from_1(read_more_lines(got.fd, got.replay, 3))
        finally:
            os.close(got.fd)
        return got.replay

    def stop(self) -> None:
        self.child.kill()


def check_unharmed(holder: HolderProcess, bystander: Bystander | None, sessions: int) -> None:
    """After some bad input: the holder answers status, the bystander is still draining and
    growing, and the holder's fd count is back to baseline plus the `sessions` it holds."""
    holder_status(holder)
    if bystander is not None:
        bystander.assert_draining_and_growing()
    wait_fds(holder, sessions)


# --- a peer of another uid --------------------------------------------------------------------


NOBODY = 65534


def connect_as(uid: int, holder: HolderProcess) -> tuple[bytes, bool]:
    """Fork a child that drops to `uid` and connects to the holder, sending nothing; return
    what it read and whether the holder then closed the connection. Needs root.

    The socket's directory is 0700 and the socket 0600, so for the length of the call they
    are opened up: the holder must refuse the peer by its credentials (SO_PEERCRED), not
    rely on file permissions."""
    directory = os.path.dirname(holder.socket)
    parent = os.path.dirname(directory)
    modes = {path: stat.S_IMODE(os.stat(path).st_mode) for path in (parent, directory,
                                                                    holder.socket)}
    r, w = os.pipe()
    try:
        os.chmod(parent, 0o711)
        os.chmod(directory, 0o711)
        os.chmod(holder.socket, 0o666)
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                s.connect(holder.socket)  # and sends nothing: the holder answers first
                got = b""
                try:
                    while chunk := s.recv(65536):
                        got += chunk
                    closed = b"1"
                except ConnectionResetError:
                    closed = b"1"
                except TimeoutError:
                    closed = b"0"
                os.write(w, closed + got)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        w = -1
        out = b""
        while chunk := os.read(r, 65536):
            out += chunk
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child could not connect"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        for path, mode in modes.items():
            os.chmod(path, mode)
    return out[1:], out[:1] == b"1"
