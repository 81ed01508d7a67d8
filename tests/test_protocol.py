"""Framing, messages and fd passing (escrow_client.protocol and escrow_client.fdpass).

Everything runs on real AF_UNIX stream socketpairs with real fds (os.openpty, os.pipe): no
mocks of the kernel. Where a receive must fail after the kernel has already installed fds
in this process, `Recording` wraps the receiving socket and notes the fd numbers every
recvmsg returned, so the test can prove each one is closed again (os.fstat gives EBADF), and
the whole set of open fds (/proc/self/fd) is compared before and after as well.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from escrow_client import fdpass, protocol
from escrow_client.platform import RECV_FLAGS, SEND_FLAGS
from escrowd.connection import Connection

P = protocol
HANDOFF_ID = "5f0c6a1e9b2d4c7f8a3e6b1d0c9f2a74"
BIG = 256 << 20  # what a client accepts for a response (a handoff may be as big as the ring)


def _info(**overrides: Any) -> P.SessionInfo:
    fields: dict[str, Any] = dict(
        owner="com.example.term", id="tab-1", label="zsh", state="draining", child_pid=31337,
        child_alive=True, deposited_at=1767225600.25, state_since=1767225612.5,
        buffered_bytes=6, dropped_bytes=0, custodian_pid=None, handoff_id=HANDOFF_ID, cols=120,
        rows=40, meta={"cwd": "/home/ada"},
    )
    fields.update(overrides)
    return P.SessionInfo(**fields)


REQUESTS: list[P.Message] = [
    P.Hello(version=1, owner="com.example.term", client="exampleterm 2.4.1", timeout=5.0),
    P.Hello(version=1, owner="o"),
    P.Deposit(id="tab-1", label="zsh", child_pid=31337, cols=120, rows=40,
              meta={"cwd": "/home/ada", "title": "build ✓"}),
    P.Deposit(id="tab-2"),
    P.Release(id="tab-1"),
    P.Deposit(id="tab-3", journal=True),
    P.Retrieve(id="tab-1"),
    P.Retrieve(id="tab-1", keep=True, journal=True),
    P.RetrieveMany(ids=["tab-1", "tab-2"], keep=True),
    P.Update(id="tab-1", cols=100, rows=30),
    P.Update(id="tab-1", meta={"cwd": "/tmp"}),
    P.Ack(id="tab-1", handoff_id=HANDOFF_ID),
    P.Ack(id="tab-1", handoff_id=HANDOFF_ID, keep=True),
    P.AckMany(acks={"tab-1": HANDOFF_ID, "tab-2": HANDOFF_ID}, keep=True),
    P.List(),
    P.List(all_owners=True),
    P.Status(),
    P.Start(id="run-1", argv=["sh", "-c", "exit 3"], cwd="/home/ann", env={"TERM": "xterm"},
            cols=80, rows=24),
    P.Wait(id="run-1"),
]

RESPONSES: list[P.Message] = [
    P.Welcome(version=1, holder_version="0.1.0", pid=4242, drain_stop_budget=3.0,
              send_deadline=1.0, ack_deadline=10.0, limits={"max_sessions": 2048}),
    P.Deposited(id="tab-1"),
    P.Deposited(id="tab-3", journal=P.Journal(capacity=1 << 20, total=0, position=0)),
    P.Updated(id="tab-1"),
    P.Waited(id="run-1", exit_status=P.ExitStatus(code=3)),
    P.Waited(id="run-2", exit_status=P.ExitStatus(signal=9)),
    P.Waited(id="run-3", exit_status="unknown"),
    P.Released(id="tab-1"),
    P.Handoff(handoff_id=HANDOFF_ID, session=_info(), replay=b"$ ls\r\n", dropped_bytes=0),
    P.Handoff(handoff_id=HANDOFF_ID, session=_info(state="exited", child_alive=None,
                                                   child_pid=None),
              replay=bytes(range(256)) * 300, dropped_bytes=123456),
    P.Handoff(handoff_id=HANDOFF_ID, session=_info(), replay=b"line\r\n", dropped_bytes=9000,
              replay_trimmed=17, replay_journaled=6,
              journal=P.Journal(capacity=1 << 20, total=1 << 21, position=4096)),
    P.Done(id="tab-1"),
    P.DoneMany(ids=["tab-1", "tab-2"]),
    P.Sessions(sessions=[]),
    P.Sessions(sessions=[_info(), _info(id="tab-2", state="handed_off", child_alive=False)]),
    P.HolderStatus(pid=4242, version="0.1.0", started_at=1767225000.0,
                   socket="/run/user/1000/escrowd/escrowd.sock",
                   sessions_by_state={"draining": 2}, counters={"deposits": 3},
                   limits={"ring_bytes": 1 << 20}, open_fds=12, rss_bytes=30 << 20),
    P.HolderStatus(pid=1, version="0.1.0", started_at=0.0, socket="/s"),
    P.Error(code="custody_held", message="session com.example.term/tab-1 is still held",
            id="tab-1"),
    P.Error(code="bad_request", message="empty frame"),
    P.Error(code="unsupported_version", message="this holder speaks 1", versions=[1]),
]

EVERY_TYPE = {type(m) for m in REQUESTS + RESPONSES}


def _tag(message: P.Message) -> str:
    return str(type(message).__struct_config__.tag)


def _ids(messages: list[P.Message]) -> list[str]:
    return [f"{i}-{_tag(m)}" for i, m in enumerate(messages)]


# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(sender, receiver): a connected AF_UNIX stream pair; the receiver times out at 5 s so
    a framing bug fails the test instead of hanging it."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


@contextmanager
def pty() -> Iterator[tuple[int, int]]:
    master, slave = os.openpty()
    try:
        yield master, slave
    finally:
        os.close(master)
        os.close(slave)


def send_raw(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    """One sendmsg of `data` with any number of fds on it (send_frame only ever sends one)."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    assert sock.sendmsg([data], anc, SEND_FLAGS) == len(data)


class Recording:
    """A receiving socket that remembers every fd the kernel installed through it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fds: list[int] = []

    def recvmsg(self, *args: int) -> tuple[bytes, list[tuple[int, int, bytes]], int, Any]:
        data, ancdata, flags, address = self.sock.recvmsg(*args)
        self.fds.extend(_fds_in(ancdata))
        return data, ancdata, flags, address


class AsyncRecording:
    """The same for a trio socket (the holder's Connection)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.fds: list[int] = []

    async def recvmsg(self, *args: int) -> tuple[bytes, list[tuple[int, int, bytes]], int, Any]:
        data, ancdata, flags, address = await self.sock.recvmsg(*args)
        self.fds.extend(_fds_in(ancdata))
        return data, ancdata, flags, address


def _fds_in(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, blob in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints = array.array("i")
            ints.frombytes(blob[: len(blob) - len(blob) % ints.itemsize])
            fds.extend(ints)
    return fds


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def assert_closed(fds: list[int]) -> None:
    assert fds, "the test meant to receive fds but none arrived"
    for fd in fds:
        with pytest.raises(OSError) as excinfo:
            os.fstat(fd)
        assert excinfo.value.errno == errno.EBADF, f"fd {fd} is still open"


def is_cloexec(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)


def pty_number(fd: int) -> int:
    return int(struct.unpack("I", fcntl.ioctl(fd, 0x80045430, b"\0" * 4))[0])  # TIOCGPTN


def decode(message_type: type[P.Message], body: bytes) -> P.Message:
    if message_type in P.Request.__args__:  # type: ignore[attr-defined]
        return P.decode_request(body)
    return P.decode_response(body)


def packb(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


# --- round trips --------------------------------------------------------------------------------


def test_the_samples_cover_every_message_type() -> None:
    request_types = set(P.Request.__args__)  # type: ignore[attr-defined]
    response_types = set(P.Response.__args__)  # type: ignore[attr-defined]
    assert request_types | response_types == EVERY_TYPE
    assert set(P.FD_CARRIERS) == {P.Deposit, P.Handoff}


@pytest.mark.parametrize("message", REQUESTS + RESPONSES, ids=_ids(REQUESTS + RESPONSES))
def test_round_trip_through_a_socket(pair: tuple[socket.socket, socket.socket],
                                     message: P.Message) -> None:
    a, b = pair
    carrier = isinstance(message, P.FD_CARRIERS)
    count = P.fds_carried(message)
    with pty() as (master, slave):
        fdpass.send_frame(a, P.encode(message), [master] * count)
        body, fds = fdpass.recv_frame(b, BIG)
        try:
            got = decode(type(message), body)
            assert got == message
            assert type(got) is type(message)
            P.check_fds(got, len(fds))
            assert len(fds) == count
            if carrier:
                fd = fds[0]
                assert fd != master
                assert is_cloexec(fd)
                assert pty_number(fd) == pty_number(master)
                # The very same terminal: what the slave writes, the received master reads.
                os.write(slave, b"ping\n")
                assert b"ping" in os.read(fd, 100)
        finally:
            fdpass.close_fds(fds)


def test_a_received_fd_is_exactly_the_one_sent(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        os.set_inheritable(r, True)  # the sender's flag must not matter: FD_CLOEXEC is per fd
        fdpass.send_frame(a, P.encode(P.Deposit(id="tab-1")), r)
        body, fds = fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)
        try:
            assert len(fds) == 1
            sent, got = os.fstat(r), os.fstat(fds[0])
            assert (got.st_dev, got.st_ino, got.st_rdev) == (sent.st_dev, sent.st_ino, sent.st_rdev)
            assert is_cloexec(fds[0])
            os.write(w, b"through the pipe")
            assert os.read(fds[0], 100) == b"through the pipe"
        finally:
            fdpass.close_fds(fds)
    finally:
        os.close(r)
        os.close(w)


def test_frame_layout() -> None:
    """4-byte big-endian length, then a MessagePack map whose first key is `type`."""
    frame = P.encode(P.Status())
    assert frame == b"\x00\x00\x00\x0d" + b"\x81\xa4type\xa6status"
    big = P.encode(P.Handoff(handoff_id="h", session=_info(), replay=b"x" * 70000))
    assert struct.unpack(">I", big[:4])[0] == len(big) - 4
    assert b"\xc6\x00\x01\x11\x70" + b"x" * 70000 in big  # bin32: raw bytes, not a string


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 600), min_size=1, max_size=30))
def test_frames_split_anywhere_arrive_whole(cuts: list[int]) -> None:
    """However the stream is cut into pieces, each frame arrives whole and in order. (The
    pieces are sent from a thread while the receiver reads: many tiny sends would fill the
    socket's send buffer, which is charged per packet, not per byte.)"""
    messages = [P.Status(), P.Retrieve(id="tab-1"), RESPONSES[3], P.Done(id="tab-1")]
    data = b"".join(P.encode(m) for m in messages)
    pieces: list[bytes] = []
    at, i = 0, 0
    while at < len(data):
        pieces.append(data[at : at + cuts[i % len(cuts)]])
        at += cuts[i % len(cuts)]
        i += 1
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5.0)
    b.settimeout(5.0)
    sender = threading.Thread(target=lambda: [a.sendall(piece) for piece in pieces])
    sender.start()
    try:
        for message in messages:
            body, fds = fdpass.recv_frame(b, BIG)
            assert fds == []
            assert decode(type(message), body) == message
    finally:
        sender.join(5.0)
        a.close()
        b.close()


# --- no over-read -------------------------------------------------------------------------------


def test_no_over_read_keeps_each_fd_on_its_own_frame(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Frame A (no fd) and frame B (with an fd) are both queued before the receiver reads
    anything. Reading exactly header then body, A comes with no fd and B with exactly one."""
    a, b = pair
    with pty() as (master, _):
        frame_a, frame_b = P.encode(P.Status()), P.encode(P.Deposit(id="tab-1"))
        fdpass.send_frame(a, frame_a)
        fdpass.send_frame(a, frame_b, master)
        body_a, fds_a = fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)
        body_b, fds_b = fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)
        try:
            assert P.decode_request(body_a) == P.Status()
            assert fds_a == []
            assert P.decode_request(body_b) == P.Deposit(id="tab-1")
            assert len(fds_b) == 1
            assert pty_number(fds_b[0]) == pty_number(master)
        finally:
            fdpass.close_fds(fds_a + fds_b)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux kernel behaviour")
def test_why_over_reading_is_wrong(pair: tuple[socket.socket, socket.socket]) -> None:
    """The trap the rule above avoids: one big recvmsg returns the fd-less bytes of frame A
    together with frame B and B's fd, so a reader that over-reads sees A's bytes arrive with
    an fd attached."""
    a, b = pair
    with pty() as (master, _):
        frame_a, frame_b = P.encode(P.Status()), P.encode(P.Deposit(id="tab-1"))
        fdpass.send_frame(a, frame_a)
        fdpass.send_frame(a, frame_b, master)
        data, ancdata, _, _ = b.recvmsg(4096, fdpass.ANCILLARY_SPACE)
        fds = _fds_in(ancdata)
        fdpass.close_fds(fds)
        assert data == frame_a + frame_b
        assert len(fds) == 1


# --- wrong fd counts ----------------------------------------------------------------------------

WRONG_COUNTS = [
    (P.Deposit(id="tab-1"), 0),
    (P.Deposit(id="tab-1"), 2),
    (P.Status(), 1),
    (P.Retrieve(id="tab-1"), 1),
    (P.Ack(id="tab-1", handoff_id=HANDOFF_ID), 3),
]


@pytest.mark.parametrize("message, count", WRONG_COUNTS,
                         ids=[f"{_tag(m)}-{n}fds" for m, n in WRONG_COUNTS])
def test_check_fds_refuses_a_wrong_count(pair: tuple[socket.socket, socket.socket],
                                         message: P.Message, count: int) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        send_raw(a, P.encode(message), [r] * count)
        body, fds = fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)
        assert len(fds) == count
        decoded = P.decode_request(body)
        wanted = P.fds_carried(decoded)
        with pytest.raises(P.ProtocolError, match=f"must carry {wanted} fd"):
            try:
                P.check_fds(decoded, len(fds))
            except P.ProtocolError:
                fdpass.close_fds(fds)  # what every receiver does with a bad request's fds
                raise
        if fds:
            assert_closed(fds)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("message, count", WRONG_COUNTS,
                         ids=[f"{_tag(m)}-{n}fds" for m, n in WRONG_COUNTS])
async def test_holder_connection_closes_every_fd_of_a_bad_request(
    message: P.Message, count: int
) -> None:
    """The holder's own receive path (escrowd.connection.Connection.receive): a request with
    the wrong number of fds is a ProtocolError, and every fd that came with it is closed."""
    a, b = trio.socket.socketpair()
    conn = Connection(b, 1)
    recording = AsyncRecording(b)
    conn.sock = recording
    r, w = os.pipe()
    try:
        before = open_fds()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r] * count).tobytes())]
        await a.sendmsg([P.encode(message)], anc if count else [], SEND_FLAGS)
        with trio.fail_after(5), pytest.raises(P.ProtocolError):
            await conn.receive(P.MAX_REQUEST_BYTES)
        assert len(recording.fds) == count
        if count:
            assert_closed(recording.fds)
        assert open_fds() == before
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()


async def test_holder_connection_accepts_the_right_count() -> None:
    a, b = trio.socket.socketpair()
    conn = Connection(b, 1)
    try:
        with pty() as (master, _):
            await a.sendmsg([P.encode(P.Deposit(id="tab-1"))],
                            fdpass.rights(master), SEND_FLAGS)
            with trio.fail_after(5):
                message, fd = await conn.receive(P.MAX_REQUEST_BYTES)
            assert message == P.Deposit(id="tab-1")
            assert fd is not None
            assert is_cloexec(fd)
            assert pty_number(fd) == pty_number(master)
            os.close(fd)
    finally:
        a.close()
        b.close()


# --- frames that fail after fds arrived ----------------------------------------------------------


def test_ctrunc_closes_every_received_fd(pair: tuple[socket.socket, socket.socket]) -> None:
    """More fds than the receiver makes room for (MAX_FDS_SEEN) truncate the control data
    (MSG_CTRUNC): TruncatedFds once the frame is read, and no fd the kernel did install
    stays open."""
    a, b = pair
    count = fdpass.MAX_FDS_SEEN + 1
    r, w = os.pipe()
    try:
        before = open_fds()
        send_raw(a, P.encode(P.Deposit(id="tab-1")), [r] * count)
        recording = Recording(b)
        with pytest.raises(fdpass.TruncatedFds, match="MSG_CTRUNC"):
            fdpass.recv_frame(recording, P.MAX_REQUEST_BYTES)  # type: ignore[arg-type]
        assert 1 <= len(recording.fds) <= fdpass.MAX_FDS_SEEN
        assert_closed(recording.fds)
        assert open_fds() == before
    finally:
        os.close(r)
        os.close(w)


async def test_ctrunc_on_the_holder_connection_closes_every_fd() -> None:
    a, b = trio.socket.socketpair()
    conn = Connection(b, 1)
    recording = AsyncRecording(b)
    conn.sock = recording
    r, w = os.pipe()
    try:
        before = open_fds()
        count = fdpass.MAX_FDS_SEEN + 4
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r] * count).tobytes())]
        await a.sendmsg([P.encode(P.Deposit(id="tab-1"))], anc, SEND_FLAGS)
        with trio.fail_after(5), pytest.raises(fdpass.TruncatedFds, match="MSG_CTRUNC"):
            await conn.receive(P.MAX_REQUEST_BYTES)
        assert_closed(recording.fds)
        assert open_fds() == before
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()


BROKEN_WITH_FDS = {
    # name: (bytes sent with the fds, then the sender shuts down)
    "eof_in_header": b"\x00\x00",
    "eof_in_body": P.encode(P.Deposit(id="tab-1"))[:-3],
    "over_the_limit": P.HEADER.pack(P.MAX_REQUEST_BYTES + 1) + b"\x81",
    "zero_length": P.HEADER.pack(0),
}


@pytest.mark.parametrize("name", list(BROKEN_WITH_FDS))
def test_a_broken_frame_closes_its_fds(pair: tuple[socket.socket, socket.socket],
                                       name: str) -> None:
    a, b = pair
    with pty() as (master, _):
        before = open_fds()
        send_raw(a, BROKEN_WITH_FDS[name], [master, master])
        a.shutdown(socket.SHUT_WR)
        recording = Recording(b)
        with pytest.raises(P.FrameError):
            fdpass.recv_frame(recording, P.MAX_REQUEST_BYTES)  # type: ignore[arg-type]
        assert len(recording.fds) == 2
        assert_closed(recording.fds)
        assert open_fds() == before


@pytest.mark.parametrize("cut", ["after_the_header", "in_the_body"])
def test_the_assembler_closes_the_fds_of_a_frame_cut_by_end_of_stream(
    pair: tuple[socket.socket, socket.socket], cut: str
) -> None:
    """Incident pinned (issue 9, item 10): FrameAssembler promises to close the fds of a
    frame it will not deliver, but both loops that drive it also close what it holds on any
    exception, which hid an assembler that did not; a driver that trusts the promise (an
    event loop of its own, a port to another language) leaked them. Fed directly: a header
    that carries a real fd, then end of stream, is a FrameError and the fd is closed."""
    a, b = pair
    frame = P.encode(P.Deposit(id="tab-1"))
    with pty() as (master, _):
        before = open_fds()
        send_raw(a, frame[: P.HEADER.size], [master])
        if cut == "in_the_body":
            send_raw(a, frame[P.HEADER.size : -2])
        a.shutdown(socket.SHUT_WR)
        assembler = fdpass.FrameAssembler(P.MAX_REQUEST_BYTES)
        received: list[int] = []
        with pytest.raises(P.FrameError, match="middle of a frame"):
            while True:
                data, ancdata, flags, _ = b.recvmsg(assembler.wanted, fdpass.ANCILLARY_SPACE,
                                                    RECV_FLAGS)
                received += _fds_in(ancdata)
                assert assembler.feed(data, ancdata, flags) is None
        assert len(received) == 1
        assert_closed(received)
        assert assembler.fds == []
        assert open_fds() == before


# --- framing errors ----------------------------------------------------------------------------


def test_a_frame_over_the_max_body_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frame = P.encode(P.Hello(version=1, owner="o", client="x" * 200))
    a.sendall(frame)
    with pytest.raises(P.FrameError, match="over the limit"):
        fdpass.recv_frame(b, len(frame) - 5)


def test_the_request_limit_is_1_mib() -> None:
    assert P.MAX_REQUEST_BYTES == 1 << 20
    assert P.parse_header(P.HEADER.pack(1 << 20), P.MAX_REQUEST_BYTES) == 1 << 20
    with pytest.raises(P.FrameError):
        P.parse_header(P.HEADER.pack((1 << 20) + 1), P.MAX_REQUEST_BYTES)
    with pytest.raises(P.FrameError):
        P.parse_header(b"\xff\xff\xff\xff", P.MAX_REQUEST_BYTES)


def test_a_zero_length_frame_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"\x00\x00\x00\x00")
    with pytest.raises(P.FrameError, match="empty frame"):
        fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 12], ids=lambda n: f"after_{n}_bytes")
def test_eof_mid_frame_is_a_frame_error(pair: tuple[socket.socket, socket.socket],
                                        cut: int) -> None:
    a, b = pair
    frame = P.encode(P.Retrieve(id="tab-1"))
    assert cut < len(frame)
    a.sendall(frame[:cut])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(P.FrameError, match="middle of a frame"):
        fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)


def test_eof_between_frames_is_eof(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(P.encode(P.Status()))
    a.shutdown(socket.SHUT_WR)
    body, fds = fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)
    assert (P.decode_request(body), fds) == (P.Status(), [])
    with pytest.raises(EOFError):
        fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)


def test_eof_before_any_frame_is_eof(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError):
        fdpass.recv_frame(b, P.MAX_REQUEST_BYTES)


def test_a_frame_error_is_a_protocol_error_with_code_bad_request() -> None:
    assert issubclass(P.FrameError, P.ProtocolError)
    assert P.ProtocolError.code == "bad_request"


# --- decoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    packb({"type": "gimme", "id": "tab-1"}),
    packb({"type": "welcome", "version": 1, "holder_version": "0.1.0", "pid": 1,
           "drain_stop_budget": 3.0, "send_deadline": 1.0, "ack_deadline": 10.0}),
    packb({"type": "HELLO", "version": 1, "owner": "o"}),
], ids=["unknown", "a_response_as_a_request", "wrong_case"])
def test_an_unknown_request_type_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_request(body)


def test_an_unknown_response_type_is_a_protocol_error() -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_response(packb({"type": "retrieve", "id": "tab-1"}))
    with pytest.raises(P.ProtocolError):
        P.decode_response(packb({"type": "surprise"}))


@pytest.mark.parametrize("body", [
    packb({"version": 1, "owner": "o"}),  # no type
    packb({"type": "hello", "owner": "o"}),  # no version
    packb({"type": "hello", "version": "1", "owner": "o"}),  # str for int
    packb({"type": "hello", "version": 1.0, "owner": "o"}),  # float for int
    packb({"type": "hello", "version": True, "owner": "o"}),  # bool for int
    packb({"type": "list", "all_owners": 1}),  # int for bool
    packb({"type": "deposit", "id": "t", "child_pid": 0}),  # pid below 1
    packb({"type": "deposit", "id": "t", "child_pid": 2**31}),  # pid above 2**31 - 1
    packb({"type": "deposit", "id": "t", "cols": 65536}),
    packb({"type": "deposit", "id": "t", "rows": -1}),
    packb({"type": "deposit", "id": "t", "label": "x" * 257}),
    packb({"type": "deposit", "id": "t", "meta": {"k": 1}}),
    packb({"type": "ack", "id": "t"}),  # no handoff_id
    packb({"type": "ack", "id": "t", "handoff_id": b"bytes"}),  # bin for str
    packb(["hello", 1, "o"]),  # an array, not a map
    packb("hello"),
    packb({"type": "status"}) + b"\x00",  # trailing bytes
    b"\xc1",  # never valid MessagePack
    b"\x85\xa4type",  # cut short
], ids=lambda b: repr(b[:24]))
def test_a_wrong_shaped_request_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_request(body)


def test_a_replay_must_be_bin_not_str() -> None:
    body = packb({"type": "handoff", "handoff_id": "h", "replay": "$ ls",
                  "session": {"owner": "o", "id": "i", "state": "draining"}})
    with pytest.raises(P.ProtocolError):
        P.decode_response(body)


def test_an_int_is_accepted_for_a_float_field() -> None:
    hello = P.decode_request(packb({"type": "hello", "version": 1, "owner": "o", "timeout": 5}))
    assert isinstance(hello, P.Hello)
    assert hello.timeout == 5.0


def test_unknown_fields_are_ignored() -> None:
    body = packb({"type": "deposit", "id": "tab-1", "colour": "green", "future": [1, {"x": 2}],
                  "cols": 80})
    assert P.decode_request(body) == P.Deposit(id="tab-1", cols=80)

    session = {"owner": "o", "id": "i", "state": "draining", "new_field": 3.5}
    body = packb({"type": "sessions", "sessions": [session], "page": 1})
    assert P.decode_response(body) == P.Sessions(
        sessions=[P.SessionInfo(owner="o", id="i", state="draining")]
    )


def test_absent_fields_take_their_defaults() -> None:
    assert P.decode_request(packb({"type": "deposit", "id": "t"})) == P.Deposit(
        id="t", label="", child_pid=None, cols=0, rows=0, meta={}
    )
    assert P.decode_request(packb({"type": "list"})) == P.List(all_owners=False)
    assert P.decode_response(packb({"type": "error", "code": "busy", "message": "m"})) == (
        P.Error(code="busy", message="m", id=None, versions=None)
    )


def test_the_versions_of_an_unsupported_version_error_are_optional() -> None:
    """`versions` came after version 1's first draft: an error without it still decodes, and
    a decoder that predates it skips it (unknown fields are ignored)."""
    error = P.Error(code="unsupported_version", message="speaks 1", versions=[1])
    body = P.encode(error)[4:]
    assert P.decode_response(body) == error

    class OldError(msgspec.Struct, tag_field="type", tag="error", kw_only=True):
        code: str
        message: str
        id: str | None = None

    old = msgspec.msgpack.decode(body, type=OldError)
    assert (old.code, old.message, old.id) == ("unsupported_version", "speaks 1", None)


def test_an_unknown_error_code_still_decodes() -> None:
    """`code` is an open set for a client: a newer holder may send codes it does not know."""
    error = P.decode_response(packb({"type": "error", "code": "brand_new", "message": "m"}))
    assert isinstance(error, P.Error)
    assert error.code == "brand_new"


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200))
def test_any_bytes_decode_or_raise_protocol_error(body: bytes) -> None:
    for decoder in (P.decode_request, P.decode_response):
        try:
            decoder(body)
        except P.ProtocolError:
            pass


# --- names: owner and id ------------------------------------------------------------------------

GOOD_NAMES = ["a", "tab-1", "com.example.term", "A.b_c:d@e-f", "0", "x" * 128]
BAD_NAMES = ["", "x" * 129, "a/b", "a b", "tab\t1", "café", "a\0b", "\ntab", "tab-1\n",
             "x" * 128 + "\n"]


def _name_carriers(name: str) -> list[dict[str, Any]]:
    return [
        {"type": "hello", "version": 1, "owner": name},
        {"type": "deposit", "id": name},
        {"type": "release", "id": name},
        {"type": "retrieve", "id": name},
        {"type": "ack", "id": name, "handoff_id": HANDOFF_ID},
    ]


def _name_id(name: str) -> str:
    if len(name) <= 16:
        return repr(name)
    return f"{len(name.rstrip())}_chars" + ("_then_newline" if name.endswith("\n") else "")


@pytest.mark.parametrize("name", GOOD_NAMES, ids=_name_id)
def test_good_names_are_accepted(name: str) -> None:
    for fields in _name_carriers(name):
        P.decode_request(packb(fields))


@pytest.mark.parametrize("name", BAD_NAMES, ids=_name_id)
def test_bad_names_are_refused(name: str) -> None:
    """Owner and id match [A-Za-z0-9._:@-]{1,128} exactly (docs/design.md §3). A trailing newline
    is not part of that set either."""
    for fields in _name_carriers(name):
        with pytest.raises(P.ProtocolError):
            P.decode_request(packb(fields))
