"""Slow and greedy peers (issue 4, item 3), against a real holder process.

- A connection that stalls (half a frame, or nothing at all) is closed after --idle-timeout,
  and the holder logs `conn_idle`; a custodian connection never is.
- A flood of connections beyond --max-connections is refused at once (`error{limit}`, then
  closed) while existing custodians and a handoff carry on.
- Out of file descriptors (a holder started under RLIMIT_NOFILE=64): the accept loop
  survives EMFILE, deposits beyond what fits get `limit`, new connections are refused
  promptly rather than left hanging, nothing crashes, and once sessions are released
  everything works again.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile import (
    SESSION_FDS,
    Bystander,
    assert_gap_free_from_1,
    assert_idle,
    check_unharmed,
    expect_error,
    expect_still_serving,
    holder_status,
    log_fields,
    read_more_lines,
    wait_fds,
)
from rawclient import RawClient

from conftest import OWNER, HolderProcess, wait_for
from escrow_client import fdpass, protocol

P = protocol
IDLE = 0.5


def wait_eof(raw: RawClient, timeout: float) -> float:
    """Block until the holder closes the connection; return how long it took."""
    start = time.monotonic()
    raw.sock.settimeout(timeout)
    try:
        while raw.sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def idle_lines(holder: HolderProcess) -> list[dict[str, str]]:
    return [log_fields(line) for line in holder.log_lines("conn_idle")]


# --- idle connections -------------------------------------------------------------------------


STALLS: dict[str, tuple[bool, bytes]] = {
    # name: (hello first, then these bytes, then silence)
    "nothing-after-connect": (False, b""),
    "half-a-header-before-hello": (False, b"\x00\x00"),
    "half-a-hello": (False, P.encode(P.Hello(version=1, owner=OWNER))[:10]),
    "nothing-after-hello": (True, b""),
    "half-a-frame-after-hello": (True, P.encode(P.List(all_owners=True))[:7]),
    "header-only-after-hello": (True, P.HEADER.pack(1000)),
}


@pytest.mark.parametrize("name", list(STALLS))
def test_a_stalled_connection_is_closed_after_the_idle_limit(
    make_holder: Callable[..., HolderProcess], name: str
) -> None:
    holder = make_holder("--idle-timeout", str(IDLE))
    with_hello, data = STALLS[name]
    with RawClient(holder.socket) as raw:
        start = time.monotonic()
        if with_hello:
            raw.hello()
        if data:
            raw.send_bytes(data)
        took = wait_eof(raw, timeout=10.0)
        elapsed = time.monotonic() - start
    assert IDLE * 0.9 <= elapsed < IDLE + 2.0, elapsed
    assert took > 0
    wait_for(lambda: idle_lines(holder), 5.0, "a conn_idle log line")
    (line,) = idle_lines(holder)
    assert line["reason"] == "idle timeout"
    if with_hello:
        assert line["owner"] == OWNER
    holder_status(holder)
    wait_fds(holder, 0)


def test_a_trickle_of_bytes_does_not_keep_a_connection_open(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """Slowloris: one byte every 0.1 s never completes a request; the idle limit bounds the
    whole request, not the gap between bytes."""
    holder = make_holder("--idle-timeout", str(IDLE))
    frame = P.encode(P.Hello(version=1, owner=OWNER, client="x" * 200))
    with RawClient(holder.socket) as raw:
        start = time.monotonic()
        closed_at = None
        for byte in frame:
            try:
                raw.send_bytes(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - start
                break
            readable, _, _ = select.select([raw.sock], [], [], 0.1)
            if readable:
                try:
                    assert raw.sock.recv(65536) == b"", "no answer to an incomplete hello"
                except ConnectionResetError:
                    pass  # closed with our last bytes unread: a reset, not an answer
                closed_at = time.monotonic() - start
                break
        assert closed_at is not None, "the holder waited for the whole trickle"
        assert closed_at < IDLE + 1.5, closed_at
    wait_for(lambda: idle_lines(holder), 5.0, "a conn_idle log line")


def test_a_custodian_connection_is_never_idle_timed_out(
    make_holder: Callable[..., HolderProcess], pty_children
) -> None:
    holder = make_holder("--idle-timeout", str(IDLE))
    child = pty_children(["sh", "-c", "while :; do sleep 1; done"])
    with RawClient(holder.socket) as raw:
        raw.hello()
        raw.send(P.Deposit(id="kept", child_pid=child.pid), fd=child.master)
        assert raw.receive()[0] == P.Deposited(id="kept")
        admin = holder.client()
        until = time.monotonic() + 3 * IDLE
        while time.monotonic() < until:  # polled: held all along, connection open
            (info,) = [s for s in admin.list() if s.id == "kept"]
            assert info.state == "held", info
            readable, _, _ = select.select([raw.sock], [], [], 0.05)
            assert not readable, "the holder closed (or wrote to) a custodian connection"
        expect_still_serving(raw)  # and it still answers on it
        assert idle_lines(holder) == []
        raw.send(P.Release(id="kept"))
        assert raw.receive()[0] == P.Released(id="kept")


def test_idle_timeout_closes_idle_connections_but_not_their_neighbours(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """Three idle connections and one that keeps asking: only the idle ones are closed."""
    holder = make_holder("--idle-timeout", str(IDLE))
    idle = [RawClient(holder.socket) for _ in range(3)]
    try:
        with RawClient(holder.socket) as busy:
            busy.hello()
            until = time.monotonic() + 3 * IDLE
            while time.monotonic() < until:
                expect_still_serving(busy)
                time.sleep(0.1)
            for raw in idle:
                assert wait_eof(raw, 2.0) < 2.0
        wait_for(lambda: len(idle_lines(holder)) == 3, 5.0, "three conn_idle lines")
    finally:
        for raw in idle:
            raw.close()


# --- a flood of connections -------------------------------------------------------------------


def test_a_connection_flood_is_refused_while_custodians_and_a_handoff_carry_on(
    make_holder: Callable[..., HolderProcess], pty_children
) -> None:
    max_conns = 8
    holder = make_holder("--max-connections", str(max_conns))
    bystander = Bystander(holder)
    flood: list[socket.socket] = []
    try:
        # Before the flood: a custodian holding a session, and an app connected to retrieve.
        held_child = pty_children(["sh", "-c", "while :; do sleep 1; done"])
        custodian = RawClient(holder.socket)
        custodian.hello()
        custodian.send(P.Deposit(id="held", child_pid=held_child.pid), fd=held_child.master)
        assert custodian.receive()[0] == P.Deposited(id="held")
        retriever = RawClient(holder.socket)
        retriever.hello()

        # The flood: 60 connections that never speak. 6 fit; 54 are refused at once.
        start = time.monotonic()
        for _ in range(60):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(holder.socket)
            flood.append(s)
        refused: dict[socket.socket, bytes] = {}
        deadline = time.monotonic() + 5.0
        while len(refused) < 60 - (max_conns - 2) and time.monotonic() < deadline:
            pending = [s for s in flood if s not in refused]
            readable, _, _ = select.select(pending, [], [], 0.1)
            for s in readable:
                refused[s] = _read_to_eof(s)
        took = time.monotonic() - start
        assert len(refused) == 60 - (max_conns - 2), len(refused)
        assert took < 3.0, f"refusing the flood took {took:.2f}s"
        for data in refused.values():
            (length,) = P.HEADER.unpack(data[:4])
            assert len(data) == 4 + length
            error = P.decode_response(data[4:])
            assert isinstance(error, P.Error) and error.code == "limit", error
        assert len(holder.log_lines("conn_refused")) == len(refused)
        # The connections that fit are still open (and silent).
        still_open = [s for s in flood if s not in refused]
        assert not select.select(still_open, [], [], 0)[0]

        # While the flood is held open: the custodian carries on...
        extra = os.openpty()
        try:
            custodian.send(P.Deposit(id="during-flood"), fd=extra[0])
            assert custodian.receive()[0] == P.Deposited(id="during-flood")
            custodian.send(P.Release(id="during-flood"))
            assert custodian.receive()[0] == P.Released(id="during-flood")
        finally:
            os.close(extra[0])
            os.close(extra[1])
        expect_still_serving(custodian)
        # ...and a full handoff of the bystander works, replay gap-free.
        handoff, fd = retriever.retrieve_handoff(bystander.sid)
        assert handoff.dropped_bytes == 0
        retriever.send(P.Ack(id=bystander.sid, handoff_id=handoff.handoff_id))
        assert retriever.receive()[0] == P.Done(id=bystander.sid)
        assert_gap_free_from_1(read_more_lines(fd, handoff.replay, 3))
        retriever.close()

        # After the flood: new connections are served again.
        for s in flood:
            s.close()
        flood.clear()
        wait_for(lambda: _status_ok(holder), 5.0, "a fresh connection to be served")
        custodian.send(P.Release(id="held"))
        assert custodian.receive()[0] == P.Released(id="held")
        custodian.close()
        assert holder.alive()
        wait_fds(holder, 0)
    finally:
        for s in flood:
            s.close()
        bystander.stop()


def _read_to_eof(s: socket.socket) -> bytes:
    s.settimeout(2.0)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _status_ok(holder: HolderProcess) -> bool:
    try:
        holder_status(holder)
        return True
    except (AssertionError, OSError, EOFError, P.ProtocolError):
        return False


# --- out of file descriptors (EMFILE) ---------------------------------------------------------


NOFILE = 64


def _start_limited(directory: Path, nofile: int) -> HolderProcess:
    """Like conftest.start_holder, but the holder runs under RLIMIT_NOFILE=`nofile`."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = str(directory / "escrowd.sock")
    log_path = directory / "escrowd.log"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "escrowd", "--bare", "--socket", sock],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=limit,
        )
    holder = HolderProcess(sock, proc, log_path)

    def ready() -> bool:
        assert proc.poll() is None, holder.logs()
        return " event=ready " in holder.logs()

    wait_for(ready, 15.0, "escrowd to be ready")
    holder.baseline_fds = holder.fd_count()
    return holder


@pytest.fixture
def limited_holder() -> Iterator[HolderProcess]:
    directory = Path(tempfile.mkdtemp(prefix="esc-nofile-"))
    os.chmod(directory, 0o700)
    holder = _start_limited(directory / "h", NOFILE)
    try:
        yield holder
    finally:
        holder.stop()
        print(holder.logs()[-6000:])  # shown when the test fails
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def _connect_outcome(holder: HolderProcess, timeout: float = 3.0) -> str:
    """What a new connection gets while the holder is out of fds: 'refused' (connect fails),
    'limit' (an error{limit} then the end), 'closed' (the end), or 'served' (hello works).
    A connection left hanging past `timeout` fails the test."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        try:
            s.connect(holder.socket)
        except OSError:
            return "refused"
        try:
            fdpass.send_frame(s, P.encode(P.Hello(version=1, owner=OWNER)))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before our hello got there: its answer may still be waiting
        start = time.monotonic()
        try:
            body, fds = fdpass.recv_frame(s, 1 << 20)
        except (EOFError, ConnectionResetError, P.ProtocolError):
            return "closed"
        except TimeoutError:
            raise AssertionError(
                f"a new connection got no answer within {timeout}s while the holder is out of "
                "fds: a client would time out and think the holder wedged"
            ) from None
        fdpass.close_fds(fds)
        reply = P.decode_response(body)
        if isinstance(reply, P.Welcome):
            return "served"
        assert isinstance(reply, P.Error) and reply.code == "limit", reply
        assert time.monotonic() - start < timeout
        return "limit"
    finally:
        s.close()


def test_out_of_file_descriptors(limited_holder: HolderProcess) -> None:
    holder = limited_holder
    bystander = Bystander(holder)
    ptys: list[tuple[int, int]] = []
    deposited: list[str] = []
    custodian = RawClient(holder.socket)
    try:
        custodian.hello()
        # Deposit real PTY masters (naming a live child pid, so the holder looks the process
        # up at deposit) until the holder says `limit`.
        answers: list[P.Response] = []
        for i in range(NOFILE + 10):
            pair = os.openpty()
            ptys.append(pair)
            sid = f"s{i}"
            custodian.send(P.Deposit(id=sid, child_pid=bystander.child.pid), fd=pair[0])
            reply, _ = custodian.receive()
            answers.append(reply)
            if isinstance(reply, P.Deposited):
                deposited.append(sid)
            else:
                break
        assert isinstance(answers[-1], P.Error) and answers[-1].code == "limit", answers[-1]
        assert "file descriptors" in answers[-1].message
        assert len(deposited) >= (NOFILE - holder.baseline_fds - 8) // SESSION_FDS, len(deposited)
        # More deposits keep getting `limit` on the same connection, which stays usable.
        for i in range(3):
            pair = os.openpty()
            ptys.append(pair)
            custodian.send(P.Deposit(id=f"over{i}", child_pid=bystander.child.pid), fd=pair[0])
            expect_error(custodian, "limit")
        expect_still_serving(custodian)
        custodian.send(P.List())
        reply, _ = custodian.receive()
        assert isinstance(reply, (P.Sessions, P.Error)), reply
        if isinstance(reply, P.Error):
            assert reply.code == "limit", reply
        # The deposit that got `limit` was closed again, so one fd may be free: open
        # connections (and keep them) until the holder turns one away. It is then at its
        # limit to the last fd.
        fillers: list[RawClient] = []
        try:
            for _ in range(5):
                filler = RawClient(holder.socket)
                fillers.append(filler)
                try:
                    filler.send(P.Hello(version=1, owner=OWNER))
                except BrokenPipeError:
                    pass  # turned away before our hello got there: its answer is waiting
                reply, _ = filler.receive()
                if isinstance(reply, P.Error):
                    assert reply.code == "limit" and "file descriptors" in reply.message
                    break
                assert isinstance(reply, P.Welcome), reply
            else:
                raise AssertionError("five more connections were served at the fd limit")
            assert len(fillers) <= 3, "more than a couple of fds were free at the limit"
            # At the limit to the last fd: a deposit cannot even be received (MSG_CTRUNC),
            # and still gets `limit`; new connections are turned away promptly, never left
            # hanging in the backlog.
            pair = os.openpty()
            ptys.append(pair)
            custodian.send(P.Deposit(id="at-limit", child_pid=bystander.child.pid), fd=pair[0])
            expect_error(custodian, "limit")
            wait_for(lambda: any("a received fd was dropped" in line
                                 for line in holder.log_lines("limit")),
                     5.0, "the MSG_CTRUNC of a holder out of fds logged as limit")
            outcomes = [_connect_outcome(holder) for _ in range(5)]
            assert set(outcomes) <= {"refused", "limit", "closed"}, outcomes
            expect_still_serving(custodian)
            # At the limit with nobody connecting, the accept loop waits quietly (Linux
            # fails accept() with EMFILE even when no connection is queued: no spinning).
            # The bystander still drains, so its wake-ups are not counted; a spin would
            # take most of a core.
            assert_idle(holder, seconds=1.0, max_cpu=0.25, max_wakeups=None)
        finally:
            for filler in fillers:
                filler.close()
        assert holder.alive()
        accept_errors = [log_fields(line) for line in holder.log_lines("accept_error")]
        assert accept_errors and all(f["errno"] == "EMFILE" for f in accept_errors)
        # Nothing was lost meanwhile: every session is still held by the custodian.
        assert " event=internal_error " not in holder.logs(), holder.log_lines("internal_error")

        # Release a few: new connections and deposits work again.
        for sid in deposited[:5]:
            custodian.send(P.Release(id=sid))
            assert custodian.receive()[0] == P.Released(id=sid)
        deposited = deposited[5:]

        assert _connect_outcome(holder) == "served"
        states = {s.id: s.state for s in holder.client().list()}
        assert all(states[sid] == "held" for sid in deposited), states
        assert states[bystander.sid] == "draining"
        with RawClient(holder.socket) as fresh:
            fresh.hello()
            pair = os.openpty()
            ptys.append(pair)
            fresh.send(P.Deposit(id="after", child_pid=bystander.child.pid), fd=pair[0])
            assert fresh.receive()[0] == P.Deposited(id="after")
            fresh.send(P.Release(id="after"))
            assert fresh.receive()[0] == P.Released(id="after")
        bystander.assert_draining_and_growing()

        for sid in deposited:
            custodian.send(P.Release(id=sid))
            assert custodian.receive()[0] == P.Released(id=sid)
        custodian.close()
        check_unharmed(holder, bystander, sessions=1)
        bystander.take_back_and_check()
        wait_fds(holder, 0)
        assert holder.alive()
    finally:
        custodian.close()
        bystander.stop()
        for a, b in ptys:
            os.close(a)
            os.close(b)


def test_an_idle_holder_is_quiet(make_holder: Callable[..., HolderProcess]) -> None:
    """Incident pinned: "idle means idle" (docs/design.md §6). A holder that polled (an accept loop
    retrying, a timer for idle exit) kept a laptop's CPU from sleeping all day. With nothing
    held and nothing asked, it uses no CPU and does not wake up."""
    holder = make_holder("--idle-timeout", str(IDLE))
    holder_status(holder)
    assert_idle(holder, seconds=1.0)
    check_unharmed(holder, None, sessions=0)
