"""Hostile and broken input against a real holder process (issue 4, item 1).

For every bad input the test checks four things:

1. the answer: a clear `error` with the right code (or a clean disconnect where no answer is
   possible, or where the stream is out of step after a `bad_request`);
2. the holder keeps serving: a `status` on a fresh connection works, and where the protocol
   says the connection goes on, a `status` on the same connection works too;
3. every other session is untouched: a *bystander* (a real PTY child printing L1, L2, ...
   every 10 ms) drains in the background through the whole module; after each input it is
   still draining with a growing buffer, and at the end of the module its replay plus live
   output is L1, L2, ... with no gap and no repeat;
4. the holder's open fd count returns to its baseline plus the sessions it holds, so no fd
   that arrived with a bad frame (or was refused) stays open in the holder.

Most cases share one holder (module scope) so that the bystander sees every one of them;
cases that need a differently configured holder (a session limit, a bad socket directory)
start their own.
"""

from __future__ import annotations

import os
import random
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile import (
    BYSTANDER,
    NOBODY,
    Bystander,
    answers_until_eof,
    check_unharmed,
    connect_as,
    expect_closed,
    expect_error,
    expect_still_serving,
    frame,
    holder_status,
    mp,
    send_with_fds,
    wait_fds,
)
from rawclient import RawClient

from conftest import OWNER, HolderProcess, require_real, start_holder, wait_for
from escrow_client import protocol

P = protocol
MAX = P.MAX_REQUEST_BYTES
HELLO = P.Hello(version=1, owner=OWNER, client="bad-input")
HID = "0123456789abcdef0123456789abcdef"


# --- the shared holder and its bystander ------------------------------------------------------


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[HolderProcess, Bystander]]:
    directory = Path(tempfile.mkdtemp(prefix="esc-bad-"))
    os.chmod(directory, 0o700)
    holder = start_holder(directory / "h")
    bystander: Bystander | None = None
    try:
        bystander = Bystander(holder)
        yield holder, bystander
        # The whole module's abuse left the bystander's stream whole.
        bystander.take_back_and_check()
        assert holder.alive(), holder.logs()[-3000:]
        assert " event=internal_error " not in holder.logs(), holder.log_lines("internal_error")
        holder.release_everything()
        holder.wait_fds_at_baseline()
    finally:
        if bystander is not None:
            bystander.stop()
        holder.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def h(shared: tuple[HolderProcess, Bystander]) -> Iterator[HolderProcess]:
    """The shared holder; after the test it must be unharmed with only the bystander held."""
    holder, bystander = shared
    yield holder
    check_unharmed(holder, bystander, sessions=1)


def bad_requests(holder: HolderProcess) -> int:
    return holder_status(holder).counters["bad_requests"]


# --- fds of every kind ------------------------------------------------------------------------


class Fds:
    """Open fds for a test; all closed at the end (the test's copies, not the holder's)."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.sockets: list[socket.socket] = []

    def keep(self, *fds: int) -> int:
        self.opened.extend(fds)
        return fds[0]

    def pty_master(self) -> int:
        master, slave = os.openpty()
        self.keep(slave)
        return self.keep(master)

    def pty_slave(self) -> int:
        master, slave = os.openpty()
        self.keep(master)
        return self.keep(slave)

    def pipe_read(self) -> int:
        r, w = os.pipe()
        return self.keep(r, w)

    def pipe_write(self) -> int:
        r, w = os.pipe()
        return self.keep(w, r)

    def regular_file(self) -> int:
        fd, path = tempfile.mkstemp()
        os.unlink(path)
        return self.keep(fd)

    def unix_socket(self) -> int:
        a, b = socket.socketpair()
        self.sockets += [a, b]
        return a.fileno()

    def inet_socket(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sockets.append(s)
        return s.fileno()

    def dev_null(self) -> int:
        return self.keep(os.open(os.devnull, os.O_RDWR))

    def directory(self) -> int:
        return self.keep(os.open(tempfile.gettempdir(), os.O_RDONLY | os.O_DIRECTORY))

    def eventfd(self) -> int:
        return self.keep(os.eventfd(0))

    def memfd(self) -> int:
        return self.keep(os.memfd_create("escrow-test"))

    def epoll(self) -> int:
        ep = select.epoll()
        return self.keep(os.dup(ep.fileno()))

    def close(self) -> None:
        for fd in self.opened:
            try:
                os.close(fd)
            except OSError:
                pass
        for s in self.sockets:
            s.close()


@pytest.fixture
def fds() -> Iterator[Fds]:
    f = Fds()
    yield f
    f.close()


# --- 1. broken framing: bad_request where it can still send, then the connection ends ---------


def _random(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


BROKEN_STREAMS: dict[str, tuple[bool, bytes]] = {
    # name: (send a valid hello first, the bytes; then the client half-closes)
    **{f"random-bytes-before-hello-{seed}": (False, _random(seed, 64)) for seed in range(4)},
    **{f"random-bytes-after-hello-{seed}": (True, _random(100 + seed, 300)) for seed in range(4)},
    "random-bytes-short-frame-first": (True, b"\x00\x00\x00\x05" + _random(7, 40)),
    "half-a-header": (True, b"\x00\x00"),
    "header-only": (True, P.HEADER.pack(20)),
    "truncated-hello": (False, P.encode(HELLO)[:9]),
    "truncated-status": (True, P.encode(P.Status())[:-1]),
    "truncated-retrieve": (True, P.encode(P.Retrieve(id=BYSTANDER))[:-4]),
    "length-over-limit": (True, P.HEADER.pack(MAX + 1) + b"\x80" * 16),
    "length-over-limit-before-hello": (False, P.HEADER.pack(MAX + 1) + b"\x80"),
    "length-2^31": (True, P.HEADER.pack(2**31) + b"\x80"),
    "length-2^31-before-hello": (False, P.HEADER.pack(2**31)),
    "length-2^32-1": (True, P.HEADER.pack(2**32 - 1) + b"\x80" * 100),
    "length-zero": (True, P.HEADER.pack(0)),
    "length-zero-before-hello": (False, P.HEADER.pack(0)),
}


@pytest.mark.parametrize("name", list(BROKEN_STREAMS))
def test_broken_stream(h: HolderProcess, name: str) -> None:
    with_hello, data = BROKEN_STREAMS[name]
    before = bad_requests(h)
    with RawClient(h.socket) as raw:
        if with_hello:
            raw.hello()
        raw.send_bytes(data)
        raw.sock.shutdown(socket.SHUT_WR)
        answers = answers_until_eof(raw)
    assert answers, "a broken frame gets an answer where the holder can still send one"
    for answer in answers:
        assert isinstance(answer, P.Error) and answer.code == "bad_request", answer
    if "length" in name:
        assert len(answers) == 1
        assert ("over the limit" in answers[0].message or "empty frame" in answers[0].message)
    if "truncated" in name or "header" in name:
        assert answers == [P.Error(code="bad_request",
                                   message="connection closed in the middle of a frame")]
    assert bad_requests(h) == before + len(answers)


@pytest.mark.parametrize("length", [MAX + 1, 2**31, 2**32 - 1])
def test_over_limit_is_refused_without_waiting_for_the_body(h: HolderProcess, length: int) -> None:
    """A header announcing a huge body is refused at once (the holder neither waits for nor
    allocates the body) and names the limit; the connection ends."""
    with RawClient(h.socket, timeout=5.0) as raw:
        raw.hello()
        raw.send_bytes(P.HEADER.pack(length))
        error = expect_error(raw, "bad_request")
        assert f"frame of {length} bytes is over the limit of {MAX}" in error.message
        expect_closed(raw)


def test_truncated_deposit_with_its_fd(h: HolderProcess, fds: Fds) -> None:
    """Half a deposit frame, its fd on the first byte, then the peer half-closes: the holder
    answers bad_request and closes the fd it got (checked by the fd count at teardown)."""
    with RawClient(h.socket) as raw:
        raw.hello()
        send_with_fds(raw.sock, P.encode(P.Deposit(id="half"))[:6], [fds.pty_master()])
        raw.sock.shutdown(socket.SHUT_WR)
        assert answers_until_eof(raw) == [
            P.Error(code="bad_request", message="connection closed in the middle of a frame")
        ]


def test_half_a_frame_then_hang_up_with_no_answer_possible(h: HolderProcess, fds: Fds) -> None:
    """The peer vanishes mid-frame (no one to answer): a clean disconnect, fd closed."""
    with RawClient(h.socket) as raw:
        raw.hello()
        send_with_fds(raw.sock, P.encode(P.Deposit(id="gone"))[:5], [fds.pty_master()])
    # teardown: fds back to baseline + the bystander, holder serving


# --- 2. a whole frame with a bad message: bad_request, and the connection goes on -------------


BAD_MESSAGES: dict[str, bytes] = {
    # does not decode as MessagePack
    "msgpack-reserved-byte": b"\xc1",
    "msgpack-truncated-map": b"\x82\xa4type",
    "msgpack-truncated-str": b"\x81\xa4type\xa6stat",
    "msgpack-trailing-bytes": mp({"type": "status"}) + b"\x00\x00",
    "msgpack-huge-array-header": b"\xdd\xff\xff\xff\xff",
    "msgpack-huge-map-header": b"\xdf\xff\xff\xff\xff",
    "msgpack-huge-bin-header": b"\xc6\xff\xff\xff\xff",
    "msgpack-0xff-run": b"\xff" * 64,
    "msgpack-nested-too-deep": b"\x91" * 100_000 + b"\xc0",
    "msgpack-nested-too-deep-in-ignored-field": b"\x82" + mp("type") + mp("status") + mp("x")
    + b"\x91" * 100_000 + b"\xc0",
    # decodes, but is not a message
    "shape-array": mp([1, 2, 3]),
    "shape-int": mp(5),
    "shape-str": mp("status"),
    "shape-nil": mp(None),
    "shape-bin": mp(b"status"),
    "shape-empty-map": mp({}),
    "shape-map-without-type": mp({"id": "tab-1"}),
    "shape-type-is-int": mp({"type": 1}),
    "shape-type-is-nil": mp({"type": None}),
    "shape-type-is-bin": mp({"type": b"status"}),
    "shape-non-str-key": b"\x81\x01\x02",
    "shape-duplicate-type-keys": b"\x82" + mp("type") + mp("status") + mp("type") + mp("list"),
    # a real message type with fields of the wrong type or out of range
    "field-retrieve-without-id": mp({"type": "retrieve"}),
    "field-retrieve-id-int": mp({"type": "retrieve", "id": 5}),
    "field-release-id-nil": mp({"type": "release", "id": None}),
    "field-ack-without-handoff-id": mp({"type": "ack", "id": "tab-1"}),
    "field-ack-handoff-id-int": mp({"type": "ack", "id": "tab-1", "handoff_id": 7}),
    "field-list-all-owners-str": mp({"type": "list", "all_owners": "yes"}),
    "field-list-all-owners-int": mp({"type": "list", "all_owners": 1}),
    "field-hello-version-str": mp({"type": "hello", "version": "1", "owner": OWNER}),
    "field-hello-timeout-str": mp({"type": "hello", "version": 1, "owner": OWNER,
                                   "timeout": "5"}),
    "field-status-is-a-list": mp(["status"]),
    # an unknown type, or a holder-to-client type sent to the holder
    "type-unknown": mp({"type": "frobnicate"}),
    "type-empty": mp({"type": ""}),
    "type-uppercase": mp({"type": "STATUS"}),
    "type-with-nul": mp({"type": "status\x00"}),
    "type-welcome": P.encode(P.Welcome(version=1, holder_version="x", pid=1,
                                       drain_stop_budget=1.0, send_deadline=1.0,
                                       ack_deadline=1.0))[4:],
    "type-error": P.encode(P.Error(code="bad_request", message="x"))[4:],
    "type-done": mp({"type": "done", "id": "tab-1"}),
    "type-sessions": mp({"type": "sessions", "sessions": []}),
    # a second hello
    "second-hello": P.encode(HELLO)[4:],
}


@pytest.mark.parametrize("name", list(BAD_MESSAGES))
def test_bad_message_then_the_connection_goes_on(h: HolderProcess, name: str) -> None:
    before = bad_requests(h)
    with RawClient(h.socket) as raw:
        raw.hello()
        raw.send_bytes(frame(BAD_MESSAGES[name]))
        expect_error(raw, "bad_request")
        expect_still_serving(raw)
    assert bad_requests(h) == before + 1


def test_the_nested_too_deep_bodies_really_nest() -> None:
    """(The two deep bodies above are what their names say: valid MessagePack, 100,000
    levels deep, the second inside a field the decoder would skip.)"""
    deep = BAD_MESSAGES["msgpack-nested-too-deep-in-ignored-field"]
    assert deep.startswith(b"\x82\xa4type\xa6status\xa1x\x91\x91")


FIELD_LIMITS: dict[str, dict[str, object]] = {
    # deposits whose fields are out of range: refused before the fd is looked at
    "label-too-long": {"label": "x" * 257},
    "child-pid-zero": {"child_pid": 0},
    "child-pid-negative": {"child_pid": -5},
    "child-pid-2^31": {"child_pid": 2**31},
    "child-pid-str": {"child_pid": "123"},
    "cols-65536": {"cols": 65536},
    "rows-negative": {"rows": -1},
    "cols-float": {"cols": 80.0},
    "meta-not-a-map": {"meta": ["cwd"]},
    "meta-value-int": {"meta": {"cwd": 1}},
    "meta-33-keys": {"meta": {f"k{i}": "v" for i in range(33)}},
    "meta-value-too-long": {"meta": {"cwd": "x" * 1025}},
    "meta-key-too-long": {"meta": {"k" * 65: "v"}},
}


@pytest.mark.parametrize("name", list(FIELD_LIMITS))
def test_deposit_with_a_bad_field_closes_its_fd(h: HolderProcess, fds: Fds, name: str) -> None:
    with RawClient(h.socket) as raw:
        raw.hello()
        body = mp({"type": "deposit", "id": "bad-field", **FIELD_LIMITS[name]})
        send_with_fds(raw.sock, frame(body), [fds.pty_master()])
        expect_error(raw, "bad_request")
        expect_still_serving(raw)
        wait_fds(h, 1, connections=1)  # the bystander and this connection: the master was closed
    assert "bad-field" not in {s.id for s in h.client().list()}


# --- 3. anything before hello -----------------------------------------------------------------


BEFORE_HELLO: dict[str, P.Message] = {
    "status": P.Status(),
    "list": P.List(all_owners=True),
    "retrieve": P.Retrieve(id=BYSTANDER),
    "release": P.Release(id=BYSTANDER),
    "ack": P.Ack(id=BYSTANDER, handoff_id=HID),
    "deposit-with-fd": P.Deposit(id="early"),
}


@pytest.mark.parametrize("name", list(BEFORE_HELLO))
def test_a_request_before_hello_is_refused_and_the_connection_ends(
    h: HolderProcess, fds: Fds, name: str
) -> None:
    message = BEFORE_HELLO[name]
    with RawClient(h.socket) as raw:
        fd = fds.pty_master() if isinstance(message, P.Deposit) else None
        raw.send(message, fd=fd)
        error = expect_error(raw, "bad_request")
        assert "expected hello first" in error.message
        expect_closed(raw)
    # The bystander was neither retrieved nor released (checked at teardown), and the fd of
    # the early deposit was closed (the fd count).
    assert "early" not in {s.id for s in h.client().list()}


BAD_HELLOS: dict[str, bytes] = {
    "hello-without-owner": mp({"type": "hello", "version": 1}),
    "hello-without-version": mp({"type": "hello", "owner": OWNER}),
    "hello-owner-int": mp({"type": "hello", "version": 1, "owner": 7}),
    "hello-version-float": mp({"type": "hello", "version": 1.0, "owner": OWNER}),
    "hello-client-too-long": mp({"type": "hello", "version": 1, "owner": OWNER,
                                 "client": "c" * 257}),
    "deposit-without-fd-first": P.encode(P.Deposit(id="early"))[4:],
}


@pytest.mark.parametrize("name", list(BAD_HELLOS))
def test_a_malformed_first_frame_gets_bad_request_and_hello_is_still_awaited(
    h: HolderProcess, name: str
) -> None:
    with RawClient(h.socket) as raw:
        raw.send_bytes(frame(BAD_HELLOS[name]))
        expect_error(raw, "bad_request")
        raw.hello()  # a valid hello is still taken
        expect_still_serving(raw)


def test_hello_with_an_fd_is_refused_and_the_fd_closed(h: HolderProcess, fds: Fds) -> None:
    with RawClient(h.socket) as raw:
        raw.send(HELLO, fd=fds.pty_master())
        expect_error(raw, "bad_request")
        wait_fds(h, 1, connections=1)
        raw.hello()
        expect_still_serving(raw)


# --- 4. an unsupported version ----------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, 3, 999, -1, 2**31, 2**63 - 1, 2**64 - 1, -(2**63)])
def test_an_unsupported_version_names_the_supported_ones(h: HolderProcess, version: int) -> None:
    with RawClient(h.socket) as raw:
        raw.send(P.Hello(version=version, owner=OWNER))
        error = expect_error(raw, "unsupported_version")
        assert f"protocol version {version} is not supported" in error.message
        assert "speaks 1" in error.message
        assert error.versions == [1], "the supported versions, machine-readable"
        assert error.id is None
        expect_closed(raw)


# --- 5. the wrong number of fds ---------------------------------------------------------------


def _kinds(fds: Fds, count: int) -> list[int]:
    makers: list[Callable[[], int]] = [fds.pty_master, fds.pipe_read, fds.regular_file]
    return [makers[i % len(makers)]() for i in range(count)]


FD_COUNTS: dict[str, tuple[P.Message, int]] = {
    "deposit-0-fds": (P.Deposit(id="fdcount"), 0),
    "deposit-2-fds": (P.Deposit(id="fdcount"), 2),
    "deposit-3-fds": (P.Deposit(id="fdcount"), 3),
    "deposit-8-fds": (P.Deposit(id="fdcount"), 8),
    "status-1-fd": (P.Status(), 1),
    "list-1-fd": (P.List(), 1),
    "retrieve-1-fd": (P.Retrieve(id=BYSTANDER), 1),
    "release-1-fd": (P.Release(id=BYSTANDER), 1),
    "ack-1-fd": (P.Ack(id=BYSTANDER, handoff_id=HID), 1),
    "second-hello-1-fd": (HELLO, 1),
    "status-2-fds": (P.Status(), 2),
}


@pytest.mark.parametrize("name", list(FD_COUNTS))
def test_the_wrong_number_of_fds_is_a_bad_request(h: HolderProcess, fds: Fds, name: str) -> None:
    message, count = FD_COUNTS[name]
    with RawClient(h.socket) as raw:
        raw.hello()
        send_with_fds(raw.sock, P.encode(message), _kinds(fds, count))
        error = expect_error(raw, "bad_request")
        assert f"must carry {1 if isinstance(message, P.Deposit) else 0} fd(s), not {count}" in (
            error.message)
        wait_fds(h, 1, connections=1)  # every fd that came with it is closed
        expect_still_serving(raw)
    # No retrieve or release of the bystander happened (checked at teardown).
    assert "fdcount" not in {s.id for s in h.client().list()}


@pytest.mark.parametrize("message", [P.Deposit(id="ctrunc"), P.Status(), HELLO],
                         ids=["deposit", "status", "second-hello"])
@pytest.mark.parametrize("count", [9, 12, 64])
def test_msg_ctrunc_is_a_bad_request_and_the_connection_goes_on(
    h: HolderProcess, fds: Fds, message: P.Message, count: int
) -> None:
    """More fds than the holder's ancillary buffer holds (8): the kernel installs what fits
    and sets MSG_CTRUNC. The holder closes all of them, reads the rest of the frame, answers
    bad_request, and the same connection goes on (the stream is still in step)."""
    master = fds.pty_master()
    with RawClient(h.socket) as raw:
        raw.hello()
        send_with_fds(raw.sock, P.encode(message), [master] * count)
        error = expect_error(raw, "bad_request")
        assert "MSG_CTRUNC" in error.message
        wait_fds(h, 1, connections=1)
        expect_still_serving(raw)
        expect_still_serving(raw)
    assert "ctrunc" not in {s.id for s in h.client().list()}


def test_ctrunc_in_the_body_also_closes_the_fd_that_came_with_the_header(
    h: HolderProcess, fds: Fds
) -> None:
    """Incident pinned (issue 9, item 10): a frame whose fds came in two chunks (one with
    its header, nine with its body, so the body's ancillary data was truncated) was refused
    with only the body's fds closed: the header's fd stayed open in the holder, one more
    with every such frame until it ran out. Every fd of a refused frame is closed, whichever
    chunk brought it."""
    body = P.encode(P.Deposit(id="ctrunc"))[P.HEADER.size:]
    with RawClient(h.socket) as raw:
        raw.hello()
        send_with_fds(raw.sock, P.HEADER.pack(len(body)), [fds.pty_master()])
        send_with_fds(raw.sock, body, [fds.pipe_read()] * 9)
        error = expect_error(raw, "bad_request")
        assert "MSG_CTRUNC" in error.message
        wait_fds(h, 1, connections=1)  # the bystander's master and this connection: nothing else
        expect_still_serving(raw)
    assert "ctrunc" not in {s.id for s in h.client().list()}


def test_ctrunc_before_hello_then_hello(h: HolderProcess, fds: Fds) -> None:
    with RawClient(h.socket) as raw:
        send_with_fds(raw.sock, P.encode(HELLO), [fds.pipe_read()] * 12)
        expect_error(raw, "bad_request")
        raw.hello()
        expect_still_serving(raw)


# --- 6. a deposited fd that is not a pty master -----------------------------------------------


NOT_A_MASTER = ["pipe_read", "pipe_write", "regular_file", "unix_socket", "inet_socket",
                "pty_slave", "dev_null", "directory", "eventfd", "memfd", "epoll"]


@pytest.mark.parametrize("kind", NOT_A_MASTER)
def test_a_deposit_that_is_not_a_pty_master(h: HolderProcess, fds: Fds, kind: str) -> None:
    fd = getattr(fds, kind)()
    with RawClient(h.socket) as raw:
        raw.hello()
        raw.send(P.Deposit(id="not-a-master"), fd=fd)
        error = expect_error(raw, "not_a_terminal")
        assert error.id == "not-a-master"
        wait_fds(h, 1, connections=1)
        expect_still_serving(raw)
    assert "not-a-master" not in {s.id for s in h.client().list()}
    line = h.log_lines("deposit_refused")[-1]
    assert f"session={OWNER}/not-a-master" in line and "code=not_a_terminal" in line


def test_the_socket_the_client_sends_on_is_not_a_terminal(h: HolderProcess) -> None:
    """The sender's own end of the connection, passed over itself."""
    with RawClient(h.socket) as raw:
        raw.hello()
        raw.send(P.Deposit(id="itself"), fd=raw.sock.fileno())
        expect_error(raw, "not_a_terminal")
        wait_fds(h, 1, connections=1)
        expect_still_serving(raw)


# --- 7. one terminal, one session -------------------------------------------------------------


@pytest.mark.parametrize("how", ["same-fd", "dup", "second-connection"])
def test_the_same_pty_master_under_a_second_id_is_exists(
    h: HolderProcess, fds: Fds, how: str
) -> None:
    master = fds.pty_master()
    with RawClient(h.socket) as raw:
        raw.hello()
        raw.send(P.Deposit(id="one-pty-a"), fd=master)
        reply, _ = raw.receive()
        assert reply == P.Deposited(id="one-pty-a")
        if how == "second-connection":
            other = RawClient(h.socket)
            other.hello(owner="com.other.app")
        else:
            other = raw
        second = fds.keep(os.dup(master)) if how == "dup" else master
        other.send(P.Deposit(id="one-pty-b"), fd=second)
        error = expect_error(other, "exists")
        assert "already escrowed as com.example.term/one-pty-a" in error.message
        if other is not raw:
            other.close()
        wait_fds(h, 2, connections=1)  # the bystander, one-pty-a and this connection
        raw.send(P.Release(id="one-pty-a"))
        assert raw.receive()[0] == P.Released(id="one-pty-a")
    ids = {s.id: s.state for s in h.client().list()}
    assert ids.get("one-pty-a") == "released" and "one-pty-b" not in ids


@pytest.mark.parametrize("where", ["same-connection", "other-connection"])
def test_a_duplicate_id_is_exists(h: HolderProcess, fds: Fds, where: str) -> None:
    with RawClient(h.socket) as raw:
        raw.hello()
        if where == "same-connection":
            raw.send(P.Deposit(id="dup-id"), fd=fds.pty_master())
            assert raw.receive()[0] == P.Deposited(id="dup-id")
            sid = "dup-id"
        else:
            sid = BYSTANDER  # the live bystander, deposited by another connection
        raw.send(P.Deposit(id=sid), fd=fds.pty_master())
        error = expect_error(raw, "exists")
        assert error.id == sid
        if where == "same-connection":
            raw.send(P.Release(id="dup-id"))
            assert raw.receive()[0] == P.Released(id="dup-id")
        wait_fds(h, 1, connections=1)


# --- 8. names: owner and id -------------------------------------------------------------------


BAD_NAMES = {
    "empty": "",
    "space": "a b",
    "slash": "com.example/term",
    "too-long-129": "x" * 129,
    "way-too-long": "x" * 5000,
    "trailing-newline": "tab-1\n",
    "leading-newline": "\ntab-1",
    "nul": "tab\x001",
    "non-ascii": "tàb",
    "star": "tab*",
    "tab-char": "tab\t1",
}


@pytest.mark.parametrize("name", list(BAD_NAMES))
def test_bad_owner_and_id_are_bad_requests(h: HolderProcess, fds: Fds, name: str) -> None:
    bad = BAD_NAMES[name]
    before = bad_requests(h)
    with RawClient(h.socket) as raw:
        raw.send_bytes(frame(mp({"type": "hello", "version": 1, "owner": bad})))
        expect_error(raw, "bad_request")
        raw.hello()
        raw.send_bytes(frame(mp({"type": "retrieve", "id": bad})))
        expect_error(raw, "bad_request")
        raw.send_bytes(frame(mp({"type": "release", "id": bad})))
        expect_error(raw, "bad_request")
        raw.send_bytes(frame(mp({"type": "ack", "id": bad, "handoff_id": HID})))
        expect_error(raw, "bad_request")
        send_with_fds(raw.sock, frame(mp({"type": "deposit", "id": bad})), [fds.pty_master()])
        expect_error(raw, "bad_request")
        wait_fds(h, 1, connections=1)
        expect_still_serving(raw)
    assert bad_requests(h) == before + 5
    assert bad not in {s.id for s in h.client().list(all_owners=True)}


def test_the_longest_name_is_still_accepted(h: HolderProcess, fds: Fds) -> None:
    """(The boundary: 128 characters of the allowed set is a valid id.)"""
    sid = "a.b_c:d@e-" * 12 + "12345678"
    assert len(sid) == 128
    with RawClient(h.socket) as raw:
        raw.hello(owner="O" * 128)
        raw.send(P.Deposit(id=sid), fd=fds.pty_master())
        assert raw.receive()[0] == P.Deposited(id=sid)
        raw.send(P.Release(id=sid))
        assert raw.receive()[0] == P.Released(id=sid)


# --- 9. over the session limit ----------------------------------------------------------------


def test_over_the_session_limit_is_limit(make_holder: Callable[..., HolderProcess],
                                         fds: Fds) -> None:
    holder = make_holder("--max-sessions", "2")
    bystander = Bystander(holder)
    try:
        with RawClient(holder.socket) as raw:
            raw.hello()
            raw.send(P.Deposit(id="second"), fd=fds.pty_master())
            assert raw.receive()[0] == P.Deposited(id="second")
            raw.send(P.Deposit(id="third"), fd=fds.pty_master())
            error = expect_error(raw, "limit")
            assert error.id == "third" and "limit of 2 session(s)" in error.message
            wait_fds(holder, 2, connections=1)  # bystander, second; "third" was closed
            # Room again after a release.
            raw.send(P.Release(id="second"))
            assert raw.receive()[0] == P.Released(id="second")
            raw.send(P.Deposit(id="third"), fd=fds.pty_master())
            assert raw.receive()[0] == P.Deposited(id="third")
            raw.send(P.Release(id="third"))
            assert raw.receive()[0] == P.Released(id="third")
        check_unharmed(holder, bystander, sessions=1)
        bystander.take_back_and_check()
    finally:
        bystander.stop()


# --- 10. a peer of another uid ----------------------------------------------------------------


def test_a_peer_of_another_uid_is_forbidden(holder: HolderProcess) -> None:
    require_real("root", os.geteuid() == 0,
                 "needs root: the test forks a client that drops to uid 65534 (CI runs as root)")
    bystander = Bystander(holder)
    try:
        data, closed = connect_as(NOBODY, holder)
        assert closed, "the holder must disconnect a forbidden peer"
        (length,) = P.HEADER.unpack(data[:4])
        assert len(data) == 4 + length, "exactly one frame, then the end"
        error = P.decode_response(data[4:])
        assert isinstance(error, P.Error) and error.code == "forbidden", error
        assert "uid" in error.message
        lines = holder.log_lines("peer_refused")
        assert len(lines) == 1 and f"peer_uid={NOBODY}" in lines[0] and "reason=" in lines[0]
        assert holder_status(holder).counters["refused_peers"] == 1
        check_unharmed(holder, bystander, sessions=1)
        bystander.take_back_and_check()
    finally:
        bystander.stop()


# --- 11. an unsafe socket directory -----------------------------------------------------------


def _start_in(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "escrowd", "--socket", str(directory / "escrowd.sock")],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=15,
    )


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o705, 0o777, 0o710])
def test_a_socket_directory_open_to_others_is_refused(socket_dir: Path, mode: int) -> None:
    directory = socket_dir / "open"
    directory.mkdir()
    os.chmod(directory, mode)
    result = _start_in(directory)
    assert result.returncode == 1, result
    assert f"has mode {mode:04o}, open to group or others: refusing to use it" in result.stderr
    assert os.listdir(directory) == [], "no socket, lock or pidfile was created"
    assert stat.S_IMODE(os.stat(directory).st_mode) == mode, "and the mode was not changed"


def test_a_socket_directory_owned_by_someone_else_is_refused(socket_dir: Path) -> None:
    require_real("root", os.geteuid() == 0,
                 "needs root to chown a directory to another uid (CI runs as root)")
    directory = socket_dir / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOBODY)
    result = _start_in(directory)
    assert result.returncode == 1, result
    assert f"is owned by uid {NOBODY}, not by you" in result.stderr
    assert "refusing to use it" in result.stderr
    assert os.listdir(directory) == []


def test_a_socket_directory_that_is_a_symlink_is_refused(socket_dir: Path) -> None:
    real = socket_dir / "real"
    real.mkdir(mode=0o700)
    link = socket_dir / "link"
    link.symlink_to(real)
    result = _start_in(link)
    assert result.returncode == 1, result
    assert "is not a directory (a symlink?)" in result.stderr
    assert os.listdir(real) == []


def test_the_holder_serves_after_every_refusal_above(h: HolderProcess) -> None:
    """(A last look at the shared holder: still the same process, answering.)"""
    status = holder_status(h)
    assert status.counters["bad_requests"] > 0
    wait_for(lambda: h.alive(), 1.0)
