"""The C client takes sessions back into custody, many at once (client/c/
escrow_retrieve_many.c), and reclaims them all at launch (client/c/escrow_reclaim.c), and
repaints (client/c/escrow_repaint.c).

Through the test driver (built by tests/test_c_client.py, sanitized, with its check at exit
that no fd was left open) against a real holder with real shells: a reclaim into custody
takes every session and they stay held by the driver's pid; SIGKILLed right after, nothing
is lost, and with a journal what it read after the reclaim is not lost either; custody_held
is retried while the old app exits and reported at once when another live process holds
the session; the report tells a lost escrow from an empty one; a hundred sessions come back
over one connection. A scripted fake holder gives what a real one will not on cue: a
non-terminal in a handoff, a `done` that never comes, `ack_late`, and a session held by a
zombie that the holder has not yet seen hang up.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hostile import COUNTER, assert_gap_free_from_1, read_more_lines
from test_c_client import SANITIZER_ENV, Build, FakeHolder, greet, read, run_c, send
from test_c_client import build as build  # noqa: F401  (a fixture)
from test_c_client import fake as fake  # noqa: F401  (a fixture)
from test_survive import kill_serving_holder

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import protocol

SLEEPER = ["sh", "-c", "echo up; sleep 60"]


def states(holder: HolderProcess) -> dict[str, protocol.SessionInfo]:
    return {s.id: s for s in holder.client().list() if s.state != "handed_off"}


def report_of(err: str) -> dict[str, Any]:
    (line,) = [json.loads(x) for x in err.splitlines() if x.startswith('{"report"')]
    report: dict[str, Any] = line["report"]
    return report


@dataclass
class Holding:
    """A driver that has reclaimed (or retrieved) into custody and holds it until its stdin
    closes."""

    proc: subprocess.Popen[bytes]
    lines: list[dict[str, Any]]

    def report(self) -> dict[str, Any]:
        (line,) = [x for x in self.lines if "report" in x]
        report: dict[str, Any] = line["report"]
        return report

    def end(self) -> tuple[int, str]:
        """Close its stdin: custody ends; its exit status and the rest of its stderr."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        rest = self.proc.stderr.read().decode(errors="replace")
        status = self.proc.wait(30)
        assert "leaked_fds" not in rest and "Sanitizer" not in rest, rest
        return status, rest


def hold_c(build: Build, socket_path: str, *args: str, out: bool = False) -> Holding:
    """Start the driver with `args` (ending with --hold or --read); return once it holds.
    With `out`, its stdout is a pipe (what --read read)."""
    proc = subprocess.Popen(
        [str(build.sanitized), "--timeout", "5.0", "--socket", socket_path, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE if out else subprocess.DEVNULL,
        stderr=subprocess.PIPE, env={**os.environ, **SANITIZER_ENV})
    assert proc.stderr is not None
    lines: list[dict[str, Any]] = []
    text = b""
    deadline = time.monotonic() + 30
    while not any(x.get("holding") for x in lines):
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"the driver never held: {text!r}"
        if select.select([proc.stderr], [], [], left)[0]:
            chunk = os.read(proc.stderr.fileno(), 65536)
            assert chunk, f"the driver ended: {text!r}"
            text += chunk
            *whole, _partial = text.decode().split("\n")  # (a line cut by the read waits)
            lines = [json.loads(x) for x in whole if x.startswith("{")]
    return Holding(proc, lines)


@pytest.fixture
def holders_kept() -> Iterator[list[Holding]]:
    kept: list[Holding] = []
    yield kept
    for h in kept:
        if h.proc.poll() is None:
            h.proc.kill()
            h.proc.wait()
        for stream in (h.proc.stdin, h.proc.stdout, h.proc.stderr):
            if stream is not None:
                stream.close()


# --- into custody, against a real holder ---------------------------------------------------------


def test_reclaim_into_custody_takes_every_session_and_holds_them(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    holders_kept: list[Holding],
) -> None:
    client = holder.client()
    kids = [pty_children(SLEEPER) for _ in range(3)]
    for n, kid in enumerate(kids):
        client.hand_off(f"tab-{n}", kid.master, child_pid=kid.pid)
    wait_for(lambda: {s.state for s in states(holder).values()} == {"draining"},
             what="three draining")
    held = hold_c(build, holder.socket, "reclaim", "--keep", "--hold")
    holders_kept.append(held)
    report = held.report()
    assert report["failed"] == {}
    assert sorted(r["id"] for r in report["retrieved"]) == ["tab-0", "tab-1", "tab-2"]
    assert all(r["confirmed"] and r["tty"] for r in report["retrieved"])
    assert {r["id"]: r["child_pid"] for r in report["retrieved"]} == {
        f"tab-{n}": kid.pid for n, kid in enumerate(kids)}
    now = states(holder)
    assert {sid: (s.state, s.custodian_pid) for sid, s in now.items()} == {
        f"tab-{n}": ("held", held.proc.pid) for n in range(3)}
    status, _ = held.end()
    assert status == 0
    wait_for(lambda: {s.state for s in states(holder).values()} == {"draining"},
             what="custody ended: draining again")


def test_a_crash_right_after_the_reclaim_loses_nothing(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    holders_kept: list[Holding],
) -> None:
    """The driver reclaims into custody and is SIGKILLed at once: the holder drains the
    session again, and a Python retrieve's replay follows the driver's, every line once."""
    kid = pty_children(["sh", "-c", COUNTER])
    holder.client().hand_off("tab", kid.master, child_pid=kid.pid)
    wait_for(lambda: states(holder)["tab"].buffered_bytes > 40, what="some lines drained")
    held = hold_c(build, holder.socket, "reclaim", "--keep", "--hold")
    holders_kept.append(held)
    (got,) = held.report()["retrieved"]
    first = bytes.fromhex(got["replay"]["bin"])
    held.proc.send_signal(signal.SIGKILL)
    held.proc.wait(30)
    wait_for(lambda: states(holder)["tab"].state == "draining", what="draining again")
    again = holder.client().retrieve("tab")
    try:
        data = read_more_lines(again.fd, first + bytes(again.replay), 5)
    finally:
        os.close(again.fd)
    assert_gap_free_from_1(data)


def _lines_from(stream: Any, more: int) -> bytes:
    """Read `stream` (a pipe) until it has `more` newlines; every byte read."""
    data = b""
    deadline = time.monotonic() + 10
    while data.count(b"\n") < more:
        left = deadline - time.monotonic()
        assert left > 0, f"no {more} lines: {data!r}"
        if select.select([stream], [], [], left)[0]:
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, f"the driver's output ended: {data!r}"
            data += chunk
    return data


def test_what_the_app_reads_after_a_reclaim_with_a_journal_survives_its_sigkill(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    holders_kept: list[Holding],
) -> None:
    """The driver reclaims into custody with a journal, reads on (escrow_custody_read
    records what it reads), and is SIGKILLed. The next retrieve's replay is the first
    replay, then what the driver read, then what the holder drained after: every line
    once, in order."""
    kid = pty_children(["sh", "-c", COUNTER])
    holder.client().hand_off("tab", kid.master, child_pid=kid.pid)
    wait_for(lambda: states(holder)["tab"].buffered_bytes > 40, what="some lines drained")
    held = hold_c(build, holder.socket, "reclaim", "--keep", "--journal", "--read", out=True)
    holders_kept.append(held)
    (got,) = held.report()["retrieved"]
    assert (got["confirmed"], got["journal"]) == (True, True)
    first = bytes.fromhex(got["replay"]["bin"])
    assert held.proc.stdout is not None
    read_by_app = _lines_from(held.proc.stdout, 5)
    held.proc.send_signal(signal.SIGKILL)
    held.proc.wait(30)
    read_by_app += held.proc.stdout.read()  # what it wrote before the kill, if more
    wait_for(lambda: states(holder)["tab"].state == "draining", what="draining again")
    again = holder.client().retrieve("tab")
    try:
        replay = bytes(again.replay)
        assert replay.startswith(first + read_by_app), "the replay, then what the app read"
        assert again.replay_journaled >= len(read_by_app)
        assert_gap_free_from_1(read_more_lines(again.fd, replay, 5))
    finally:
        os.close(again.fd)


def test_custody_held_is_retried_while_the_old_app_exits(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
) -> None:
    kids = [pty_children(SLEEPER) for _ in range(2)]
    client = holder.client()
    client.hand_off("free", kids[0].master, child_pid=kids[0].pid)
    custody = client.custody()
    custody.deposit("held", kids[1].master, child_pid=kids[1].pid)
    wait_for(lambda: {sid: s.state for sid, s in states(holder).items()} == {
        "free": "draining", "held": "held"}, what="one draining, one held")

    def let_go_when_refused() -> None:  # the old instance exits once the reclaim has begun
        wait_for(lambda: " state=handing_off " in holder.logs(), what="the first handoff")
        custody.close()

    releaser = threading.Thread(target=let_go_when_refused)
    releaser.start()
    run = run_c(build, holder.socket, "reclaim")
    releaser.join()
    assert run.status == 0, run.err
    report = report_of(run.err)
    assert report["failed"] == {}
    assert sorted(r["id"] for r in report["retrieved"]) == ["free", "held"]
    assert states(holder) == {}, "both handed off"


def test_custody_held_by_a_live_process_is_reported_at_once(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
) -> None:
    kids = [pty_children(SLEEPER) for _ in range(2)]
    client = holder.client()
    client.hand_off("free", kids[0].master, child_pid=kids[0].pid)
    with client.custody() as other_instance:  # this process: alive throughout
        other_instance.deposit("held", kids[1].master, child_pid=kids[1].pid)
        run = run_c(build, holder.socket, "reclaim")
        assert run.status == 0, run.err
        report = report_of(run.err)
        assert [r["id"] for r in report["retrieved"]] == ["free"]
        assert report["failed"]["held"]["code"] == "custody_held"
        info = states(holder)["held"]
        assert (info.state, info.custodian_pid) == ("held", os.getpid())


def test_the_report_tells_a_lost_escrow_from_an_empty_one(
    build: Build, make_holder: Callable[..., HolderProcess],
) -> None:
    holder = make_holder(keeper=True)
    status = holder.client().status()
    first = run_c(build, holder.socket, "reclaim")
    assert first.status == 0, first.err
    report = report_of(first.err)
    assert (report["retrieved"], report["failed"]) == ([], {})
    assert (report["holder_instance"], report["adopted"]) == (status.instance, 0)
    assert (report["restarts"], report["unclean_restarts"]) == (0, 0)
    kill_serving_holder(holder)
    after = run_c(build, holder.socket, "reclaim", "--keep")
    assert after.status == 0, after.err
    report = report_of(after.err)
    assert report["holder_instance"] not in ("", status.instance)
    assert (report["restarts"], report["unclean_restarts"]) == (1, 1)


def test_a_hundred_sessions_come_back_over_one_connection(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild],
) -> None:
    kids = [pty_children(["sh", "-c", f"echo s{n}; sleep 60"]) for n in range(100)]
    client = holder.client()
    for n, kid in enumerate(kids):
        client.hand_off(f"s{n}", kid.master, child_pid=kid.pid)
    before = client.status().counters["connections"]
    run = run_c(build, holder.socket, "reclaim", timeout=10.0)
    after = client.status().counters["connections"]
    assert run.status == 0, run.err
    report = report_of(run.err)
    assert report["failed"] == {}
    assert sorted(r["id"] for r in report["retrieved"]) == sorted(f"s{n}" for n in range(100))
    assert after - before == 2, "the driver's one connection, and this status call's"


# --- repaint -------------------------------------------------------------------------------------

SIZE_ON_WINCH = [sys.executable, "-c", """if True:
    import signal, termios
    def winch(*_):
        print("winch %d %d" % termios.tcgetwinsize(0), flush=True)
    signal.signal(signal.SIGWINCH, winch)
    print("ready", flush=True)
    while True:
        signal.pause()
"""]


def _set_size(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _size(fd: int) -> tuple[int, int]:
    import fcntl
    import struct
    import termios
    rows, cols, _, _ = struct.unpack(
        "HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(8)))
    return rows, cols


@pytest.mark.parametrize(("rows", "changed"), [(24, 23), (1, 2), (0, 1)])
def test_repaint_signals_at_the_changed_size_then_at_its_own(
    build: Build, pty_children: Callable[..., PtyChild], rows: int, changed: int,
) -> None:
    kid = pty_children(SIZE_ON_WINCH)
    _set_size(kid.master, rows, 80)
    assert b"ready" in kid.read_available(until=b"ready")
    run = run_c(build, None, "repaint", str(kid.master), pass_fds=(kid.master,))
    assert run.status == 0, run.err
    seen = kid.read_available(until=f"winch {rows} 80".encode())
    assert f"winch {changed} 80".encode() in seen
    assert seen.index(f"winch {changed} 80".encode()) < seen.index(f"winch {rows} 80".encode())
    assert _size(kid.master) == (rows, 80)


def test_repaint_makes_less_draw_its_screen_again(
    build: Build, pty_children: Callable[..., PtyChild], tmp_path: Path,
) -> None:
    if subprocess.run(["sh", "-c", "command -v less"], capture_output=True).returncode:
        pytest.fail("less is not installed: scripts/system-deps installs it")
    text = tmp_path / "page.txt"
    text.write_text("".join(f"page line {n}\n" for n in range(1, 200)))
    kid = pty_children(["less", str(text)])
    _set_size(kid.master, 20, 80)
    os.kill(kid.pid, signal.SIGWINCH)
    kid.read_available(until=b"page line 19")
    kid.read_available(timeout=0.3)  # whatever it drew for the first size
    run = run_c(build, None, "repaint", str(kid.master), pass_fds=(kid.master,))
    assert run.status == 0, run.err
    again = kid.read_available(until=b"page line 19")
    assert b"page line 1" in again and b"page line 19" in again, again
    assert _size(kid.master) == (20, 80)


# --- what a real holder will not do on cue: a scripted fake ------------------------------------


def _handoff(sid: str, handoff_id: str = "h-1") -> protocol.Handoff:
    info = protocol.SessionInfo(owner=OWNER, id=sid, state="draining", deposited_at=1.5,
                                handoff_id=handoff_id, child_pid=4242)
    return protocol.Handoff(handoff_id=handoff_id, session=info, replay=b"R\r\n")


def _keep_welcome(conn: socket.socket) -> int:
    """Greet as a holder with keep and retrieve_many; the client's pid from its hello."""
    hello = read(conn)
    assert isinstance(hello, protocol.Hello)
    send(conn, protocol.Welcome(
        version=1, holder_version="fake", pid=1, drain_stop_budget=0.1, send_deadline=0.1,
        ack_deadline=1.0, features=["keep", "retrieve_many", "journal"]))
    return int(hello.client.split("pid=")[1])


def test_a_non_terminal_in_custody_is_not_acked_and_the_exchange_ends_with_status(
    build: Build, fake: Callable[..., FakeHolder],
) -> None:
    def pipe_instead(conn: socket.socket) -> None:
        _keep_welcome(conn)
        assert read(conn) == protocol.Retrieve(id="s", keep=True)
        r, w = os.pipe()
        try:
            send(conn, _handoff("s"), fd=r)
        finally:
            os.close(r)
            os.close(w)
        assert isinstance(read(conn), protocol.Status), "no ack: a status ends the wait"
        send(conn, protocol.Error(code="bad_request", message="not an ack", id="s"))
        conn.settimeout(10)
        assert conn.recv(1) == b"", "then custody ends"

    holder = fake([pipe_instead])
    run = run_c(build, holder.path, "custody-retrieve", "s")
    assert run.error()["code"] == "protocol"
    assert run.out == b""


def test_of_two_handoffs_the_terminal_is_acked_and_the_pipe_is_not(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],
) -> None:
    kid = pty_children(SLEEPER)

    def one_of_each(conn: socket.socket) -> None:
        _keep_welcome(conn)
        assert isinstance(read(conn), protocol.Status)
        send(conn, protocol.HolderStatus(pid=1, version="fake", started_at=1.0, socket="x",
                                         instance="i-1", restarts=None))
        assert isinstance(read(conn), protocol.List)
        infos = [_handoff(sid).session for sid in ("tty", "pipe")]
        send(conn, protocol.Sessions(sessions=infos))
        assert read(conn) == protocol.RetrieveMany(ids=["tty", "pipe"])
        r, w = os.pipe()
        try:
            send(conn, _handoff("pipe", "h-2"), fd=r)
            send(conn, _handoff("tty"), fd=kid.master)
        finally:
            os.close(r)
            os.close(w)
        assert read(conn) == protocol.Ack(id="tty", handoff_id="h-1")
        assert isinstance(read(conn), protocol.Status)
        send(conn, protocol.Done(id="tty"))
        send(conn, protocol.Error(code="bad_request", message="not an ack", id="pipe"))

    holder = fake([one_of_each])
    run = run_c(build, holder.path, "reclaim")
    assert run.status == 0, run.err
    report = report_of(run.err)
    assert [(r["id"], r["confirmed"]) for r in report["retrieved"]] == [("tty", True)]
    assert report["failed"]["pipe"]["code"] == "protocol"
    assert report["restarts"] is None, "nil: unknown, never read as no restart"


def _state_of(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def test_a_zombie_custodian_counts_as_dead_and_is_retried_past_the_grace(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],
) -> None:
    """The old app exited and its parent has not reaped it (a zombie: kill(pid, 0) still
    succeeds), and the holder has not yet seen the hang-up: custody_held. Past the 1 s
    grace the reclaim retries it all the same, the custodian being positively dead, and
    takes the session once the holder hands it off."""
    kid = pty_children(SLEEPER)
    zombie = subprocess.Popen(["true"])  # never waited for until the end: a zombie
    try:
        wait_for(lambda: _state_of(zombie.pid) == "Z", what="a zombie")
        grace = 1.0  # escrow_reclaim.c's CUSTODY_GRACE

        def held_by_a_zombie(conn: socket.socket) -> None:
            _keep_welcome(conn)
            assert isinstance(read(conn), protocol.Status)
            send(conn, protocol.HolderStatus(pid=1, version="fake", started_at=1.0,
                                             socket="x", instance="i-1"))
            assert isinstance(read(conn), protocol.List)
            send(conn, protocol.Sessions(sessions=[protocol.SessionInfo(
                owner=OWNER, id="s", state="held", deposited_at=1.5,
                custodian_pid=zombie.pid)]))
            first: float | None = None
            answered = 0.0
            while True:
                assert read(conn) == protocol.Retrieve(id="s")
                first = time.monotonic() if first is None else first
                # The grace began before the first retrieve: a retry asked for after an
                # answer sent past first + grace was asked past the grace.
                if answered > first + grace:
                    break
                answered = time.monotonic()
                send(conn, protocol.Error(code="custody_held", message="held", id="s"))
            send(conn, _handoff("s"), fd=kid.master)
            assert read(conn) == protocol.Ack(id="s", handoff_id="h-1")
            send(conn, protocol.Done(id="s"))

        holder = fake([held_by_a_zombie])
        run = run_c(build, holder.path, "reclaim")
        assert run.status == 0, run.err
        report = report_of(run.err)
        assert report["failed"] == {}
        assert [(r["id"], r["confirmed"]) for r in report["retrieved"]] == [("s", True)]
    finally:
        zombie.wait()


@pytest.mark.parametrize(("listed", "code"), [
    ("held_by_us", None),  # the holder took the ack: ours, escrowed
    ("draining", "unresponsive"),  # the holder kept it: our copy closed
    ("handed_off", "unresponsive"),  # anything else: closed too
])
def test_a_missing_done_in_custody_is_asked_about_on_a_fresh_connection(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],
    listed: str, code: str | None,
) -> None:
    kid = pty_children(SLEEPER)
    pid: list[int] = []

    def no_done(conn: socket.socket) -> None:
        pid.append(_keep_welcome(conn))
        assert read(conn) == protocol.Retrieve(id="s", keep=True)
        send(conn, _handoff("s"), fd=kid.master)
        assert read(conn) == protocol.Ack(id="s", handoff_id="h-1", keep=True)
        # and no done: the custody's connection ends

    def list_says(conn: socket.socket) -> None:
        greet(conn)
        assert read(conn) == protocol.List(all_owners=False)
        info = _handoff("s").session
        state = "held" if listed == "held_by_us" else listed
        send(conn, protocol.Sessions(sessions=[protocol.SessionInfo(
            owner=OWNER, id="s", state=state, deposited_at=1.5,  # type: ignore[arg-type]
            custodian_pid=pid[0] if listed == "held_by_us" else None,
            handoff_id=info.handoff_id)]))

    holder = fake([no_done, list_says])
    run = run_c(build, holder.path, "custody-retrieve", "s")
    if code is None:
        assert run.status == 0, run.err
        assert run.lines()[0]["retrieved"]["confirmed"] is True
        assert run.out == b"R\r\n"
    else:
        assert run.error()["code"] == code
        assert run.out == b""


def test_ack_late_in_custody_gives_the_copy_back(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],
) -> None:
    kid = pty_children(SLEEPER)

    def late(conn: socket.socket) -> None:
        _keep_welcome(conn)
        read(conn)
        send(conn, _handoff("s"), fd=kid.master)
        assert isinstance(read(conn), protocol.Ack)
        send(conn, protocol.Error(code="ack_late", message="too late", id="s"))
        conn.settimeout(10)
        assert conn.recv(1) == b"", "custody ends"

    holder = fake([late])
    run = run_c(build, holder.path, "custody-retrieve", "s")
    assert run.error()["code"] == "ack_late"
    assert run.out == b""
