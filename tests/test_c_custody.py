"""The C client's custody survives the holder, and its journal keeps the scrollback
(client/c/escrow_custody.c, escrow_journal.c; PROTOCOL.md 10.4 and 10.6).

A real C app (the driver's `custody-app`, built with ASan and UBSan, checking at exit that
no fd was left open) deposits a shell printing numbered lines, reads it with
escrow_custody_read, watches escrow_custody_fd in its poll loop and, when it turns
readable, calls escrow_custody_check and then escrow_custody_resume with its back-off,
saying so on stderr. Against a real holder, under a real keeper: SIGKILL the app and its
journal has the scrollback from the first line; SIGKILL the holder and the app takes
custody back by itself; lose the keeper too and it deposits again from its duplicate.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile import COUNTER, assert_gap_free_from_1, numbered_lines, read_more_lines
from survival import assert_one_stream
from test_c_client import (
    SANITIZER_ENV,
    Build,
    FakeHolder,
    fake,  # noqa: F401  (a fixture)
    greet,
    read,
    send,
)
from test_c_client import build as build  # noqa: F401  (a fixture)
from test_survive import kill_serving_holder

from conftest import HolderProcess, PtyChild, start_holder, wait_for
from escrow_client import EscrowClient, paths, protocol


class CApp:
    """The driver's custody-app on a PTY child's master; its stderr events read as they come."""

    def __init__(self, build: Build, socket_path: str, sid: str, child: PtyChild,
                 journal: bool = False, forks: bool = False) -> None:
        argv = [str(build.sanitized), "--socket", socket_path, "custody-app", sid,
                str(child.master), str(child.pid), "1" if journal else "0",
                *(["fork"] if forks else [])]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, pass_fds=(child.master,),
                                     env={**os.environ, **SANITIZER_ENV})
        self.out = b""
        self.err = b""
        self.events: list[dict[str, Any]] = []

    def _pump(self, timeout: float) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        fds = [f for f in (self.proc.stdout, self.proc.stderr) if not f.closed]
        ready, _, _ = select.select(fds, [], [], timeout)
        for f in ready:
            chunk = os.read(f.fileno(), 65536)
            if not chunk:
                f.close()
            elif f is self.proc.stdout:
                self.out += chunk
            else:
                self.err += chunk
                *lines, self.err = self.err.split(b"\n")
                for line in lines:
                    assert b"Sanitizer" not in line and b"runtime error" not in line, line
                    if line.startswith(b"{"):
                        self.events.append(json.loads(line))

    def next_event(self, what: str, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.events:
            left = deadline - time.monotonic()
            assert left > 0, f"the C app did not report {what} within {timeout}s: {self.err!r}"
            self._pump(min(left, 0.2))
        return self.events.pop(0)

    def read_lines(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(numbered_lines(self.out)) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"the C app read {len(numbered_lines(self.out))} lines, not {count}"
            self._pump(min(left, 0.2))

    def end(self) -> int:
        """Close its stdin: it ends custody and exits; its exit status (98: an fd leaked)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        deadline = time.monotonic() + 15.0
        assert self.proc.stdout is not None and self.proc.stderr is not None
        while not (self.proc.stdout.closed and self.proc.stderr.closed):  # both at their end
            assert time.monotonic() < deadline, "the C app did not exit"
            self._pump(0.2)
        assert b"leaked_fds" not in self.err
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                f.close()


@pytest.fixture
def c_apps() -> Iterator[list[CApp]]:
    started: list[CApp] = []
    yield started
    for app in started:
        app.kill()


def start(c_apps: list[CApp], *args: Any, **kwargs: Any) -> CApp:
    app = CApp(*args, **kwargs)
    c_apps.append(app)
    return app


def protected_again(app: CApp, what: str, timeout: float = 10.0) -> dict[str, Any]:
    """The app's next event that is not a failed try (it retries with back-off)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the C app did not report {what} within {timeout}s"
        got = app.next_event(what, left)
        if got["event"] != "resume_failed":
            return got


def held_by(client: EscrowClient, sid: str, pid: int) -> bool:
    try:
        return any(s.id == sid and s.state == "held" and s.custodian_pid == pid
                   for s in client.list())
    except Exception:
        return False


def state_of(client: EscrowClient, sid: str) -> str | None:
    return next((s.state for s in client.list() if s.id == sid), None)


def counter(pty_children: Callable[..., PtyChild]) -> PtyChild:
    return pty_children(["sh", "-c", COUNTER])


# --- the journal (PROTOCOL.md 10.6) ---------------------------------------------------------


@pytest.mark.parametrize("journal", [True, False])
def test_after_the_c_apps_sigkill_the_replay_starts_at_the_first_line(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    c_apps: list[CApp], journal: bool,
) -> None:
    """The C app journals what it reads; SIGKILLed, its session drains, and a Python retrieve's
    replay starts at the session's first line and runs on into the live output, every line
    once. Without a journal the replay holds only what came after the app died."""
    child = counter(pty_children)
    app = start(c_apps, build, holder.socket, "tab", child, journal=journal)
    assert app.next_event("its deposit") == {"event": "deposited", "journaled": journal}
    app.read_lines(20)
    app.proc.kill()
    app.proc.wait()
    client = holder.client()
    wait_for(lambda: state_of(client, "tab") == "draining", 10.0, "draining after the kill")
    got = client.retrieve("tab")
    try:
        if journal:
            assert got.replay_journaled > 0
            assert_gap_free_from_1(read_more_lines(got.fd, got.replay, 3))
        else:
            assert got.replay_journaled == 0
            assert numbered_lines(got.replay)[:1] != [1]
    finally:
        os.close(got.fd)


def _journal_file(magic: bytes) -> int:
    """A journal file of the fresh 64 KiB kind but for its magic."""
    fd = os.memfd_create("escrowd:journal", os.MFD_CLOEXEC)
    header = magic + (2).to_bytes(4, "little") + bytes(4) + (4096).to_bytes(8, "little") + (
        65536).to_bytes(8, "little")
    os.ftruncate(fd, 4096 + 65536)
    os.pwrite(fd, header, 0)
    return fd


@pytest.mark.parametrize("magic", [b"ESCROWSF", b"ESCROWJL"])
def test_a_journal_file_that_fails_the_checks_is_not_mapped_and_the_session_is_escrowed(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],  # noqa: F811
    c_apps: list[CApp], magic: bytes,
) -> None:
    """A holder whose journal file is of another layout (layout 1's magic, an earlier
    holder's state file): the deposit succeeds, without a journal. The right layout is
    journaled (the same script otherwise)."""
    file = _journal_file(magic)

    def serve(conn: socket.socket) -> None:
        greet(conn)
        request = read(conn)
        assert isinstance(request, protocol.Deposit) and request.journal
        layout = protocol.Journal(capacity=65536, total=0, position=0)
        send(conn, protocol.Deposited(id=request.id, journal=layout), fd=file)
        conn.settimeout(20)
        assert conn.recv(1) == b""  # custody ends as the app does

    holder = fake([serve])
    child = counter(pty_children)
    app = start(c_apps, build, holder.path, "tab", child, journal=True)
    try:
        assert app.next_event("its deposit") == {
            "event": "deposited", "journaled": magic == b"ESCROWJL"}
        app.read_lines(3)
        assert app.end() == 0
        total = int.from_bytes(os.pread(file, 8, 32), "little")
        assert (total > 0) == (magic == b"ESCROWJL")
    finally:
        os.close(file)


# --- custody that survives the holder (PROTOCOL.md 10.4) ------------------------------------


def test_the_c_app_takes_custody_back_when_the_holder_is_sigkilled_under_the_keeper(
    build: Build, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild], c_apps: list[CApp],
) -> None:
    """The holder's serving process is SIGKILLed; the C app, which made no call, reports
    the lapse, then protection again: the session is held by the app's pid on the next
    holder (resumed, journal and all), and its scrollback is whole after the app's death."""
    holder = make_holder(keeper=True)
    client = holder.client()
    child = counter(pty_children)
    app = start(c_apps, build, holder.socket, "tab", child, journal=True)
    assert app.next_event("its deposit")["journaled"] is True
    wait_for(lambda: held_by(client, "tab", app.proc.pid), 10.0, "the app's custody")
    app.read_lines(5)

    kill_serving_holder(holder)
    lapsed = app.next_event("the lapse once the holder died")
    assert (lapsed["event"], lapsed["code"]) == ("lapsed", "unavailable"), lapsed
    back = protected_again(app, "custody taken back")
    assert back == {"event": "protected"}
    assert held_by(client, "tab", app.proc.pid)
    assert ' reason="custody resumed by its app' in holder.logs()
    seen_before = len(numbered_lines(app.out))
    app.read_lines(seen_before + 5)

    app.proc.kill()
    app.proc.wait()
    wait_for(lambda: state_of(client, "tab") == "draining", 10.0, "draining after the kill")
    got = client.retrieve("tab")
    try:
        assert_one_stream(b"", got.replay, read_more_lines(got.fd, b"", 3),
                          got.session.replay_gap_at)
        assert numbered_lines(got.replay)[:1] == [1]
    finally:
        os.close(got.fd)


def test_after_a_total_loss_the_c_app_deposits_again_from_its_duplicate(
    build: Build, socket_dir: Path, pty_children: Callable[..., PtyChild],
    c_apps: list[CApp],
) -> None:
    """Keeper and holder SIGKILLed (every stored fd gone), a new holder started by hand:
    the C app deposits its session again from the duplicate it kept, held by its pid; then
    it ends custody and exits with no fd left open."""
    directory = socket_dir / "loss"
    first = start_holder(directory, keeper=True)
    second: HolderProcess | None = None
    child = counter(pty_children)
    app = start(c_apps, build, first.socket, "tab", child)
    try:
        assert app.next_event("its deposit")["event"] == "deposited"
        wait_for(lambda: held_by(first.client(), "tab", app.proc.pid), 10.0, "custody")
        record = paths.read_pidfile(first.socket)
        assert record is not None
        os.kill(first.pid, signal.SIGKILL)
        os.kill(record.pid, signal.SIGKILL)
        first.proc.wait()
        assert app.next_event("the lapse")["event"] == "lapsed"
        second = start_holder(directory, keeper=True)
        back = protected_again(app, "its deposit again")
        assert back == {"event": "protected"}
        client = second.client()
        assert held_by(client, "tab", app.proc.pid)
        assert app.end() == 0
        assert app.events[-1] == {"event": "closed"}
        wait_for(lambda: state_of(client, "tab") == "draining", 10.0, "draining once ended")
        client.release("tab")
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_a_forked_child_of_the_c_app_holds_nothing(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    c_apps: list[CApp],
) -> None:
    """A child forked after a journaled deposit calls escrow_custody_close_in_child: it has
    no fd but stdin, stdout and stderr, no journal mapped, and when the app is SIGKILLed
    the session drains while the child lives on."""
    child = counter(pty_children)
    app = start(c_apps, build, holder.socket, "tab", child, journal=True, forks=True)
    assert app.next_event("its deposit") == {"event": "deposited", "journaled": True}
    forked = app.next_event("the forked child's report")
    assert forked["event"] == "child"
    assert (forked["fds"], forked["journal_mapped"]) == ([0, 1, 2], False), forked
    client = holder.client()
    app.proc.kill()
    app.proc.wait()
    wait_for(lambda: state_of(client, "tab") == "draining", 10.0,
             "draining while the forked child lives")
    os.kill(forked["pid"], 0)  # it does live
    assert app.proc.stdin is not None
    app.proc.stdin.close()  # and now it ends
