"""The C client's custody survives the holder, and its journal keeps the scrollback
(client/c/escrow_custody.c, escrow_resume.c, escrow_journal.c; PROTOCOL.md 10.4 and 10.6).

A real C app (the driver's `custody-app`, built with ASan and UBSan, checking at exit that
no fd was left open) deposits a shell printing numbered lines, reads it with
escrow_custody_read, watches escrow_custody_fd in its poll loop and, when it turns
readable, calls escrow_custody_check and then escrow_custody_resume with its back-off,
saying so on stderr. Against a real holder, under a real keeper: SIGKILL the app and its
journal has the scrollback from the first line; SIGKILL the holder and the app takes
custody back by itself; lose the keeper too and it deposits again from its duplicate.

The driver's custody-script drives one custody a call per line, for what must happen in a
given order (client/c/escrow_resume.c): a call that times out keeps the connection, custody
of every other session with it, and its late answer settles it; a session with no duplicate
stays unprotected; the journal's overflow and a write torn by a SIGKILL.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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

from conftest import OWNER, HolderProcess, PtyChild, start_holder, wait_for
from escrow_client import EscrowClient, paths, protocol


class _Driven:
    """A driver process a test started, killed (its pipes closed) at the test's end."""

    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                f.close()


D = TypeVar("D", bound=_Driven)


def _killed_after(started: list[D]) -> Iterator[list[D]]:
    """For a fixture: the list a test's processes go in, each killed at its end."""
    yield started
    for driven in started:
        driven.kill()


class CApp(_Driven):
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


@pytest.fixture
def c_apps() -> Iterator[list[CApp]]:
    yield from _killed_after([])


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


@pytest.mark.parametrize(("magic", "capacity"), [
    (b"ESCROWSF", 65536), (b"ESCROWJL", 65536),
    (b"ESCROWJL", 4096),  # a ring shorter than the data: written within it
    (b"ESCROWJL", 65537), (b"ESCROWJL", 0),  # 0 < capacity <= data size, or not believed
])
def test_a_journal_file_that_fails_the_checks_is_not_mapped_and_the_session_is_escrowed(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],  # noqa: F811
    c_apps: list[CApp], magic: bytes, capacity: int,
) -> None:
    """A holder whose journal file is of another layout (layout 1's magic, an earlier
    holder's state file), or whose message says a ring the file has no room for (PROTOCOL.md
    10.6): the deposit succeeds, without a journal. The right layout is journaled (the same
    script otherwise), in the ring the message says."""
    file = _journal_file(magic)
    journaled = magic == b"ESCROWJL" and 0 < capacity <= 65536

    def serve(conn: socket.socket) -> None:
        greet(conn)
        request = read(conn)
        assert isinstance(request, protocol.Deposit) and request.journal
        layout = protocol.Journal(capacity=capacity, total=0, position=0)
        send(conn, protocol.Deposited(id=request.id, journal=layout), fd=file)
        conn.settimeout(20)
        assert conn.recv(1) == b""  # custody ends as the app does

    holder = fake([serve])
    child = counter(pty_children)
    app = start(c_apps, build, holder.path, "tab", child, journal=True)
    try:
        assert app.next_event("its deposit") == {"event": "deposited", "journaled": journaled}
        app.read_lines(3)
        assert app.end() == 0
        total = int.from_bytes(os.pread(file, 8, 32), "little")
        assert (total > 0) == journaled
        assert os.pread(file, 65536, 4096 + capacity).strip(b"\0") == b""  # past the ring
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


# --- a custody driven line by line (the driver's custody-script) -----------------------------


class Script(_Driven):
    """The driver's custody-script: one custody, a line of stdin per call, a JSON line of
    stdout for each ({"cmd", "code", "id", "protected", "fd"})."""

    def __init__(self, build: Build, socket_path: str, *, timeout: float = 1.0,
                 pass_fds: tuple[int, ...] = ()) -> None:
        argv = [str(build.sanitized), "--timeout", str(timeout), "--socket", socket_path,
                "custody-script"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, pass_fds=pass_fds,
                                     env={**os.environ, **SANITIZER_ENV})

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 15.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"custody-script did not answer within {timeout}s"
        line = self.proc.stdout.readline()
        assert line, f"custody-script ended: {self._stderr()}"
        got: dict[str, Any] = json.loads(line)
        return got

    def call(self, line: str) -> dict[str, Any]:
        self.send(line)
        return self.answer()

    def end(self) -> None:
        """Close stdin: custody ends, and the driver checks that it left no fd open."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        status = self.proc.wait(30)
        err = self._stderr()
        assert "Sanitizer" not in err and "runtime error" not in err, err
        assert status == 0 and "leaked_fds" not in err, err

    def _stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None \
            else ""


@pytest.fixture
def scripts() -> Iterator[list[Script]]:
    yield from _killed_after([])


def script(scripts: list[Script], *args: Any, **kwargs: Any) -> Script:
    scripts.append(Script(*args, **kwargs))
    return scripts[-1]


def _said(got: dict[str, Any], code: str, protected: int, sid: str = "") -> None:
    assert (got["code"], got["protected"]) == (code, protected), got
    if sid:
        assert got["id"] == sid, got


def test_a_timed_out_custody_call_keeps_the_connection_and_its_late_answer_settles(
    build: Build, fake: Callable[..., FakeHolder], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: a custody call that timed out closed its connection, which ended
    custody of every other session on it while the app still read them. Now the connection
    stays open, owed the answer: a late `deposited` read by escrow_custody_check settles s2
    as held; a late refusal of s3, read first by the next call (an update, sent only after
    it), keeps s3 unprotected until a resume deposits it again. One connection throughout,
    and every request in the order the app made them."""
    late_s2, sent_s2, late_s3 = threading.Event(), threading.Event(), threading.Event()
    requests: list[protocol.Request] = []

    def holder(conn: socket.socket) -> None:
        greet(conn)

        def next_request() -> protocol.Request:
            requests.append(read(conn))
            return requests[-1]

        assert isinstance(next_request(), protocol.Deposit)
        send(conn, protocol.Deposited(id="s1"))
        assert isinstance(next_request(), protocol.Deposit)
        assert late_s2.wait(20)
        send(conn, protocol.Deposited(id="s2"))
        sent_s2.set()
        assert isinstance(next_request(), protocol.Deposit)
        assert late_s3.wait(20)
        send(conn, protocol.Error(code="limit", message="too many sessions", id="s3"))
        assert isinstance(next_request(), protocol.Update)
        send(conn, protocol.Updated(id="s1"))
        assert isinstance(next_request(), protocol.Deposit)  # s3, by the resume
        send(conn, protocol.Deposited(id="s3"))
        conn.settimeout(20)
        assert conn.recv(1) == b"", "custody ends only when the app ends it"

    fake_holder = fake([holder])
    pipes = [os.pipe() for _ in range(3)]  # what is deposited: the fake does not look
    try:
        app = script(scripts, build, fake_holder.path,
                     pass_fds=tuple(r for r, _ in pipes))
        _said(app.call(f"deposit s1 {pipes[0][0]}"), "ok", 1)
        _said(app.call(f"deposit s2 {pipes[1][0]}"), "unresponsive", 0)
        late_s2.set()
        assert sent_s2.wait(20)
        _said(app.call("check"), "ok", 1)  # the late deposited: s2 held
        _said(app.call(f"deposit s3 {pipes[2][0]}"), "unresponsive", 0)
        late_s3.set()
        _said(app.call("update s1 80 24"), "ok", 0)  # s3 refused late: kept, not held
        _said(app.call("resume"), "ok", 1)
        app.end()
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
    assert [(type(r).__name__, getattr(r, "id", None)) for r in requests] == [
        ("Deposit", "s1"), ("Deposit", "s2"), ("Deposit", "s3"), ("Update", "s1"),
        ("Deposit", "s3")]


def test_a_holder_stopped_past_the_timeout_never_drains_the_other_sessions(
    build: Build, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild], scripts: list[Script],
) -> None:
    """A real holder SIGSTOPped while s2 is deposited, past the client's timeout, then
    SIGCONTed: s1 stays held by the app the whole time (the holder never saw the connection
    go), and the late `deposited` settles s2 as held: protected again, with no resume."""
    holder = make_holder("--drain-stop-budget", "0.3", "--send-deadline", "0.3")
    kids = [pty_children(["sh", "-c", "exec sleep 600"]) for _ in range(2)]
    app = script(scripts, build, holder.socket, pass_fds=tuple(k.master for k in kids))
    client = holder.client()
    _said(app.call(f"deposit s1 {kids[0].master}"), "ok", 1)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        _said(app.call(f"deposit s2 {kids[1].master}"), "unresponsive", 0)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    wait_for(lambda: held_by(client, "s2", app.proc.pid), 10.0, "s2 deposited, late")
    assert held_by(client, "s1", app.proc.pid), client.list()
    assert select.select([app.proc.stdout], [], [], 0)[0] == []
    _said(app.call("check"), "ok", 1)
    _said(app.call("release s1"), "ok", 1)
    assert state_of(client, "s1") == "released" and held_by(client, "s2", app.proc.pid)
    app.end()
    assert state_of(client, "s2") == "draining"


def test_a_session_retrieved_into_custody_without_a_duplicate_stays_unprotected(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    scripts: list[Script],
) -> None:
    """Found in review: a session retrieved into custody whose duplicate could not be made
    (out of fds) lapsed the custody, and the next resume said protected again while that
    session, held by the app, could not be given to any next holder. Now it stays
    unprotected until the app releases it."""
    kid = pty_children(["sh", "-c", "exec sleep 600"])
    holder.client().hand_off("s1", kid.master, child_pid=kid.pid)
    app = script(scripts, build, holder.socket, timeout=5.0)
    _said(app.call("nofile 1"), "ok", 1)  # room for the master, none for its duplicate
    got = app.call("retrieve s1")
    _said(got, "ok", 0)
    assert got["fd"] >= 3
    _said(app.call("nofile off"), "ok", 0)
    assert held_by(holder.client(), "s1", app.proc.pid)
    _said(app.call("resume"), "system", 0, "s1")
    assert app.call("read s1")["fd"] == -1  # EBADF: read the fd the retrieve gave
    _said(app.call("release s1"), "ok", 0)
    _said(app.call("resume"), "ok", 1)  # released: nothing unprotected is held here
    app.end()


def greet_keep(conn: socket.socket) -> int:
    """Greet as a holder that retrieves into custody; the client's pid from its hello."""
    hello = read(conn)
    assert isinstance(hello, protocol.Hello)
    send(conn, protocol.Welcome(
        version=1, holder_version="fake", pid=1, drain_stop_budget=0.1, send_deadline=0.1,
        ack_deadline=1.0, features=["keep", "journal", "journal_reading", "update"]))
    return int(hello.client.split("pid=")[1])


def session_info(state: str, **fields: Any) -> protocol.SessionInfo:
    return protocol.SessionInfo(owner=OWNER, id="s1", state=state,  # type: ignore[arg-type]
                                deposited_at=1.5, **fields)


@pytest.mark.parametrize("journal", [False, True])
def test_a_retrieve_into_custody_the_restarted_holder_completed_is_deposited_again(
    build: Build, fake: Callable[..., FakeHolder], scripts: list[Script],  # noqa: F811
    journal: bool,
) -> None:
    """Found in review: the holder went away between our ack and its `done`; the next one
    had adopted the handoff, and the ack sent again on a fresh connection completed it
    (out of escrow: ours alone). The C client marked it held all the same, so the resume
    gave it to nobody and said protected. Now the resume deposits it again from the
    duplicate, and only then is the custody protected. A retrieve that asked for a journal
    asks for one again in that deposit (as custody_hold.py's does): it went without one."""
    master, slave = os.openpty()
    file = _journal_file(b"ESCROWJL")
    layout = protocol.Journal(capacity=65536, total=0, position=0) if journal else None
    deposits: list[protocol.Request] = []

    def custody(conn: socket.socket) -> None:
        greet_keep(conn)
        assert read(conn) == protocol.Retrieve(id="s1", keep=True, journal=journal)
        send(conn, protocol.Handoff(handoff_id="h-1", session=session_info("draining"),
                                    replay=b"R\r\n", journal=layout),
             fd=[master, file] if journal else master)
        assert isinstance(read(conn), protocol.Ack)  # then the holder is gone

    def listing(conn: socket.socket) -> None:
        pid = greet_keep(conn)
        assert isinstance(read(conn), protocol.List)
        send(conn, protocol.Sessions(sessions=[session_info(
            "handing_off", handoff_id="h-1", custodian_pid=pid)]))

    def ack_again(conn: socket.socket) -> None:
        greet_keep(conn)
        assert read(conn) == protocol.Ack(id="s1", handoff_id="h-1")
        send(conn, protocol.Done(id="s1"))

    def resume(conn: socket.socket) -> None:
        greet_keep(conn)
        deposits.append(read(conn))
        send(conn, protocol.Deposited(id="s1", journal=layout), fd=file if journal else None)
        conn.settimeout(20)
        assert conn.recv(1) == b"", "custody ends only when the app ends it"

    fake_holder = fake([custody, listing, ack_again, resume])
    try:
        app = script(scripts, build, fake_holder.path)
        got = app.call(f"retrieve s1 {int(journal)}")
        _said(got, "ok", 0)  # ours, and not protected: no holder has it
        assert got["fd"] >= 3
        _said(app.call("resume"), "ok", 1)
        app.end()
    finally:
        os.close(master)
        os.close(slave)
        os.close(file)
    assert [(type(d).__name__, getattr(d, "id", None), getattr(d, "journal", None))
            for d in deposits] == [("Deposit", "s1", journal)]


def test_a_late_done_into_custody_keeps_the_connection_that_holds_the_session(
    build: Build, fake: Callable[..., FakeHolder], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: a retrieve into custody whose `done` came after the client's
    timeout: the list said held by this process, and the client then closed the custody's
    connection, which made a real holder drain the session while the app read it (two
    readers), and still said protected. Now the connection stays open, owed the `done`,
    which the next call reads before it sends anything: the session stays held there."""
    master, slave = os.openpty()
    requests: list[protocol.Request] = []
    holder: list[FakeHolder] = []

    def custody(conn: socket.socket) -> None:
        pid = greet_keep(conn)
        assert read(conn) == protocol.Retrieve(id="s1", keep=True)
        send(conn, protocol.Handoff(handoff_id="h-1", session=session_info("draining"),
                                    replay=b"R\r\n"), fd=master)
        assert isinstance(read(conn), protocol.Ack)
        # Slow: the client asks the list on a fresh connection before `done` is sent.
        asking, _ = holder[0].listener.accept()
        with asking:
            greet_keep(asking)
            assert isinstance(read(asking), protocol.List)
            send(asking, protocol.Sessions(sessions=[session_info("held", custodian_pid=pid)]))
        send(conn, protocol.Done(id="s1"))
        requests.append(read(conn))
        send(conn, protocol.Updated(id="s1"))
        conn.settimeout(20)
        assert conn.recv(1) == b"", "custody ends only when the app ends it"

    holder.append(fake([custody]))
    try:
        app = script(scripts, build, holder[0].path)
        got = app.call("retrieve s1")
        _said(got, "ok", 0)  # owed its `done`: not known yet
        assert got["fd"] >= 3
        _said(app.call("update s1 80 24"), "ok", 1)  # the late done read first
        app.end()
    finally:
        os.close(master)
        os.close(slave)
    assert [type(r).__name__ for r in requests] == ["Update"]


def test_a_lapsed_c_custody_answers_every_call_unavailable_and_sends_nothing(
    build: Build, fake: Callable[..., FakeHolder], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: a lapsed custody refused a retrieve or a reclaim into it with
    ESCROW_CONFIG ("escrow_custody_resume first"), where its deposit said
    ESCROW_UNAVAILABLE: an app that told the two apart took a lapse for its own mistake.
    Now each is ESCROW_UNAVAILABLE, and nothing was sent (the holder hears nothing after
    the deposit)."""
    def custody(conn: socket.socket) -> None:
        greet_keep(conn)
        assert isinstance(read(conn), protocol.Deposit)
        send(conn, protocol.Deposited(id="s1"))  # then the holder is gone

    fake_holder = fake([custody])
    r, w = os.pipe()  # what is deposited: the fake does not look
    try:
        app = script(scripts, build, fake_holder.path, pass_fds=(r,))
        _said(app.call(f"deposit s1 {r}"), "ok", 1)
        wait_for(lambda: app.call("check")["code"] == "unavailable", 10.0, "the lapse")
        _said(app.call("retrieve s2"), "unavailable", 0, "s2")
        _said(app.call("reclaim"), "unavailable", 0)
        _said(app.call(f"deposit s3 {r}"), "unavailable", 0, "s3")
        app.end()
    finally:
        os.close(r)
        os.close(w)


def test_closing_a_lapsed_c_custody_ends_custody_on_the_next_holder(
    build: Build, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild], scripts: list[Script],
) -> None:
    """Found in review: a custody whose holder was SIGKILLed under its keeper, closed
    without a resume, only closed its duplicates: the next holder had adopted the session
    as held by the app's pid, and kept it so, read by nobody, for as long as the app lived.
    Now the close takes custody back, ends it again and confirms with the list: the session
    drains while the app goes on living."""
    holder = make_holder(keeper=True)
    client = holder.client()
    kid = counter(pty_children)
    app = script(scripts, build, holder.socket, timeout=5.0, pass_fds=(kid.master,))
    _said(app.call(f"deposit s1 {kid.master}"), "ok", 1)
    kill_serving_holder(holder)
    wait_for(lambda: app.call("check")["code"] == "unavailable", 10.0, "the lapse")
    assert held_by(client, "s1", app.proc.pid), client.list()  # adopted, waiting for us
    _said(app.call("close"), "ok", 0)
    assert state_of(client, "s1") == "draining", client.list()
    assert app.proc.poll() is None
    app.end()


JOURNAL_RING = 16 * 1024
PIECE = 8192  # the most a torn write can lose


def _lines(n: int) -> bytes:
    """What the driver's `record ID @N` records: lines "R<number>\\n", eight bytes each."""
    return b"".join(b"R%06d\n" % (i % 1000000) for i in range(n // 8))


def _replay_after_sigkill(app: Script, holder: HolderProcess) -> tuple[bytes, int, int]:
    """SIGKILL the app, retrieve s1: its replay, then the bytes lost off its front (the ring
    overflowed) and cut after them so that it starts cleanly."""
    app.proc.kill()
    app.proc.wait()
    client = holder.client()
    wait_for(lambda: state_of(client, "s1") == "draining", 10.0, "custody to end")
    got = client.retrieve("s1")
    os.close(got.fd)
    assert isinstance(got.replay, bytes)
    return got.replay, got.dropped_bytes, got.replay_trimmed


def test_a_c_record_longer_than_the_ring_keeps_its_newest_bytes(
    build: Build, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild], scripts: list[Script],
) -> None:
    """tests/test_journal.py's case through the C writer: of a record longer than the ring
    only its last `capacity` bytes can survive, and after the app's SIGKILL the holder's
    replay is exactly those."""
    holder = make_holder("--ring-bytes", str(JOURNAL_RING))
    kid = pty_children(["sh", "-c", "exec sleep 600"])
    app = script(scripts, build, holder.socket, timeout=5.0, pass_fds=(kid.master,))
    _said(app.call(f"deposit s1 {kid.master} 1"), "ok", 1)
    assert app.call("record s1 old")["fd"] == 0
    assert app.call(f"record s1 @{JOURNAL_RING * 2 + 8}")["fd"] == 0
    replay, dropped, trimmed = _replay_after_sigkill(app, holder)
    newest = _lines(JOURNAL_RING * 2 + 8)[-JOURNAL_RING:]
    assert dropped == len("old") + JOURNAL_RING + 8  # all but the ring's worth, counted
    assert replay == newest[trimmed:] and trimmed <= 8  # from the first whole line


def test_a_c_app_killed_in_the_middle_of_a_write_leaves_no_torn_bytes(
    build: Build, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild], scripts: list[Script],
) -> None:
    """tests/test_journal.py's case through the C writer: the app stored `writing`, copied
    half a piece of X over the oldest bytes, and is SIGKILLed there (the driver stops
    itself between `writing` and `total`). The replay holds no X: the bytes that write may
    have overwritten are dropped, the rest is what was recorded, in order."""
    holder = make_holder("--ring-bytes", str(JOURNAL_RING))
    kid = pty_children(["sh", "-c", "exec sleep 600"])
    app = script(scripts, build, holder.socket, timeout=5.0, pass_fds=(kid.master,))
    _said(app.call(f"deposit s1 {kid.master} 1"), "ok", 1)
    assert app.call("record s1 @32000")["fd"] == 0
    app.call("stop-in-write")
    app.send(f"record s1 x{PIECE}")
    wait_for(lambda: _stopped(app.proc.pid), 10.0, "the driver to stop in its write")
    replay, _, trimmed = _replay_after_sigkill(app, holder)
    assert b"X" not in replay
    assert replay == _lines(32000)[-(JOURNAL_RING - PIECE):][trimmed:] and trimmed <= 8


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "T"
