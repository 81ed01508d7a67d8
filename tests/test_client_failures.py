"""The client's side of a handoff when the holder misbehaves (docs/design.md §4 step 8).

`EscrowClient.retrieve` must ack only once it holds the fd and has checked it is a terminal,
never read the fd before `done`, and when `done` does not come, ask on a fresh connection who
owns the fd instead of guessing: keep it if it is ours (or cannot be told), close it if the
holder kept the session or gave it to someone else. These are the paths on which a session is
lost or read twice, and a real holder does not take them on demand; a fake holder
(tests/fakeholder.py, a real Unix socket server speaking the real protocol) does.

Every fd is a real one (a PTY from os.openpty, a pipe); whether the client closed or kept its
copy is read from /proc/self/fd.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import tty
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import msgspec
import pytest
from fakeholder import SID, WELCOME, FakeHolder, Peer, Script, fds_open_on

from escrow_client import (
    AckLate,
    BadRequest,
    Busy,
    EscrowError,
    HandedOff,
    HolderUnresponsive,
    ProtocolViolation,
    breaker,
    protocol,
)
from escrow_client.channel import Channel
from escrow_client.platform import pty_number

HANDOFF_ID = "a" * 32
OTHER_ID = "b" * 32
DEPOSITED_AT = 1767225600.25


@pytest.fixture(autouse=True)
def fresh_breaker() -> Iterator[None]:
    breaker.reset()
    yield
    breaker.reset()


@pytest.fixture
def terminal() -> Iterator[tuple[int, int]]:
    """A real PTY (master, slave), raw, so bytes pass unchanged; the test's own copies."""
    master, slave = os.openpty()
    tty.setraw(slave)
    yield master, slave
    os.close(master)
    os.close(slave)


def info(state: str = "draining", handoff_id: str | None = None,
         deposited_at: float = DEPOSITED_AT) -> protocol.SessionInfo:
    return protocol.SessionInfo(owner="com.example.term", id=SID, state=state,  # type: ignore[arg-type]
                                handoff_id=handoff_id, deposited_at=deposited_at)


def hand_over(fd: int, then: Script | None = None) -> Script:
    """A script: answer `retrieve` with a `handoff` carrying `fd`, take the `ack`, then do
    `then` (by default: hang up without `done`)."""
    def script(peer: Peer) -> None:
        peer.expect(protocol.Retrieve)
        peer.send(protocol.Handoff(handoff_id=HANDOFF_ID, session=info(), replay=b"R"), fd=fd)
        ack = peer.expect(protocol.Ack)
        assert (ack.id, ack.handoff_id) == (SID, HANDOFF_ID)
        if then is not None:
            then(peer)
    return script


def answer_list(*sessions: protocol.SessionInfo) -> Script:
    def script(peer: Peer) -> None:
        peer.expect(protocol.List)
        peer.send(protocol.Sessions(sessions=list(sessions)))
    return script


def answer(message: protocol.Message) -> Script:
    def script(peer: Peer) -> None:
        peer.receive()
        peer.send(message)
    return script


def answer_ack(reply: protocol.Message) -> Script:
    """The client acks its handoff again on this connection (a holder that restarted may
    complete it): answer `reply`."""
    def script(peer: Peer) -> None:
        ack = peer.expect(protocol.Ack)
        assert ack.handoff_id == HANDOFF_ID
        peer.send(reply)
    script.acks = True  # type: ignore[attr-defined]
    return script


STILL_UNDER_WAY = protocol.Error(code="busy", message="still under way", id=SID)


def acks(fake: FakeHolder) -> list[protocol.Request]:
    return [m for conn in fake.received for m in conn if isinstance(m, protocol.Ack)]


def wait_readable(fd: int, timeout: float = 5.0) -> None:
    assert select.select([fd], [], [], timeout)[0], "nothing became readable"


# --- before the ack -------------------------------------------------------------------------


def test_a_handoff_of_a_non_terminal_is_never_acked(socket_dir: Path) -> None:
    """Incident pinned (issue 9, item 1a): a client that acked before checking what it was
    handed would tell a confused holder to close its copy of the terminal in exchange for a
    pipe: the session gone for good. A non-terminal is a ProtocolViolation, no `ack` leaves
    the client, and its copy of the pipe is closed. (The `status` that follows ends the
    holder's wait for an ack, as a wrong frame: PROTOCOL.md 12.7.)"""
    r, w = os.pipe()
    try:
        def script(peer: Peer) -> None:
            peer.expect(protocol.Retrieve)
            peer.send(protocol.Handoff(handoff_id=HANDOFF_ID, session=info(), replay=b""), fd=r)
            peer.expect(protocol.Status)
            peer.send(protocol.Error(code="bad_request", message="expected ack", id=SID))
            peer.until_eof()

        with FakeHolder(socket_dir, [script]) as fake:
            with pytest.raises(ProtocolViolation, match="non-terminal"):
                fake.client().retrieve(SID)
        assert [type(m) for m in fake.received[0]] == [protocol.Retrieve, protocol.Status]
        assert fds_open_on(r) == {r}
    finally:
        os.close(r)
        os.close(w)


def test_a_reply_that_is_not_a_handoff_is_a_protocol_violation(socket_dir: Path) -> None:
    """A holder that answers `retrieve` with something else has not handed anything over:
    ProtocolViolation, and no `ack`."""
    def script(peer: Peer) -> None:
        peer.expect(protocol.Retrieve)
        peer.send(protocol.Sessions(sessions=[]))
        peer.until_eof()

    with FakeHolder(socket_dir, [script]) as fake:
        with pytest.raises(ProtocolViolation, match="expected handoff, got Sessions"):
            fake.client().retrieve(SID)
    assert acks(fake) == []


def test_not_enough_time_left_after_a_slow_welcome(socket_dir: Path) -> None:
    """Incident pinned: a holder slow to greet left the client too little of its deadline
    for the holder's drain-stop budget and send deadline; starting the retrieve anyway would
    give up while the holder is still legitimately working (docs/design.md §4 step 2). The client
    does not send `retrieve` at all, says why, and pays no timeout (the breaker stays shut)."""
    welcome = msgspec.structs.replace(WELCOME, drain_stop_budget=0.4)
    with FakeHolder(socket_dir, [Peer.until_eof], welcome=welcome, welcome_delay=0.5) as fake:
        client = fake.client(timeout=1.0)
        with pytest.raises(HolderUnresponsive, match="not enough time left") as caught:
            client.retrieve(SID)
    assert not caught.value.timed_out
    assert fake.received == [[]]
    assert breaker.open_for(fake.socket_path) is None


# --- the ack is answered, but not with `done` ---------------------------------------------


def test_ack_late_closes_the_copy_unread(socket_dir: Path, terminal: tuple[int, int]) -> None:
    """Incident pinned (issue 9, item 1b): on `ack_late` the holder is draining the session
    again; a client that had read the fd (or kept it) would be a second reader splitting the
    stream. AckLate is raised, the client's copy is closed, and what the child wrote is
    still unread: the holder, the next reader, gets it."""
    master, slave = terminal
    os.write(slave, b"X")
    wait_readable(master)
    late = protocol.Error(code="ack_late", message="too late", id=SID)
    with FakeHolder(socket_dir, [hand_over(master, lambda peer: peer.send(late))]) as fake:
        with pytest.raises(AckLate):
            fake.client().retrieve(SID)
    assert fds_open_on(master) == {master}
    assert select.select([master], [], [], 0)[0], "the client read what the child wrote"
    assert os.read(master, 100) == b"X"


def test_an_ack_refused_closes_the_copy(socket_dir: Path, terminal: tuple[int, int]) -> None:
    """An `error` answer to the ack (here `bad_request`) means the holder kept the session
    and drains it again: the client raises it and closes its copy."""
    master, _ = terminal
    refused = protocol.Error(code="bad_request", message="expected ack", id=SID)
    with FakeHolder(socket_dir, [hand_over(master, lambda peer: peer.send(refused))]) as fake:
        with pytest.raises(BadRequest):
            fake.client().retrieve(SID)
    assert fds_open_on(master) == {master}


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt or SystemExit, without pytest taking it as one."""


def test_an_interrupt_after_the_ack_keeps_the_fd(socket_dir: Path,
                                                 terminal: tuple[int, int]) -> None:
    """Incident pinned: an app interrupted (Ctrl-C) while it waited for `done` closed the fd
    it had just acked; the holder, which had the ack, closed its copy too, and the terminal
    hung up for good. After the ack the fd is kept open and unread, and rides on the
    exception as `retrieved` for whoever catches it."""
    master, _ = terminal
    main = threading.main_thread().ident
    assert main is not None
    delivered = threading.Event()

    def waiting_for_done(frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code is Channel.receive.__code__:
                return True
            frame = frame.f_back
        return False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        # Only while the client waits for `done`: the interrupt under test comes after the
        # ack. Anywhere else (still finishing the send) the signal is ignored and sent again.
        if waiting_for_done(frame):
            delivered.set()
            raise Interrupted

    def after_ack(peer: Peer) -> None:
        deadline = time.monotonic() + 5.0
        while not delivered.is_set():
            assert time.monotonic() < deadline, "the client never waited for done"
            signal.pthread_kill(main, signal.SIGUSR1)
            delivered.wait(0.01)
        peer.until_eof()

    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with FakeHolder(socket_dir, [hand_over(master, after_ack)]) as fake:
            with pytest.raises(Interrupted) as caught:
                fake.client().retrieve(SID)
    finally:
        signal.signal(signal.SIGUSR1, old)
    got = caught.value.retrieved  # type: ignore[attr-defined]
    try:
        assert not got.confirmed
        assert got.handoff_id == HANDOFF_ID
        assert fds_open_on(master) == {master, got.fd}
        assert pty_number(got.fd) == pty_number(master)
    finally:
        os.close(got.fd)


# --- no `done`: asking again on a fresh connection ------------------------------------------

KEPT, CONFIRMED = "kept unconfirmed", "confirmed"

RESOLVE_CASES: dict[str, tuple[list[Script], type[EscrowError] | str]] = {
    # name: (scripts for the connections after the handoff's, what the client must conclude)
    "handed_off_to_another_client": (
        [answer_list(info("handed_off", OTHER_ID))], HandedOff),
    "handed_off_to_us": ([answer_list(info("handed_off", HANDOFF_ID))], CONFIRMED),
    "still_draining": ([answer_list(info("draining"))], HolderUnresponsive),
    "still_exited": ([answer_list(info("exited"))], HolderUnresponsive),
    "draining_under_a_new_deposit": (
        [answer_list(info("draining", deposited_at=DEPOSITED_AT + 1))], KEPT),
    "handing_off_to_another_client": ([answer_list(info("handing_off", OTHER_ID))], Busy),
    "handing_off_to_us_then_handed_off": (
        [answer_list(info("handing_off", HANDOFF_ID)), answer_ack(STILL_UNDER_WAY),
         answer_list(info("handed_off", HANDOFF_ID))], CONFIRMED),
    # A holder that restarted mid-handoff adopted it: the ack sent again completes it.
    "handing_off_to_us_adopted_by_a_new_holder": (
        [answer_list(info("handing_off", HANDOFF_ID)), answer_ack(protocol.Done(id=SID))],
        CONFIRMED),
    "handing_off_to_us_then_put_back": (
        [answer_list(info("handing_off", HANDOFF_ID)),
         answer_ack(protocol.Error(code="ack_late", message="kept", id=SID))], AckLate),
    "released": ([answer_list(info("released"))], KEPT),
    "unknown": ([answer_list()], KEPT),
    "holder_gone": ([], KEPT),
    "list_refused": ([answer(protocol.Error(code="limit", message="out of fds"))], KEPT),
    "list_answered_with_something_else": (
        [answer(protocol.HolderStatus(pid=1, version="fake", started_at=0.0, socket="s"))],
        KEPT),
}


@pytest.mark.parametrize("case", list(RESOLVE_CASES))
def test_no_done_asks_who_owns_the_fd(socket_dir: Path, terminal: tuple[int, int],
                                      case: str) -> None:
    """Incident pinned (issue 9, item 2): the holder took the ack and hung up before `done`.
    The client must ask on a fresh connection, and believe only what proves ownership:
    `handed_off` with *our* handoff_id confirms; `handed_off` or `handing_off` under
    another handoff_id is someone else's (close ours, or two apps read one terminal);
    `draining`/`exited` of the same deposit means the holder kept it (close ours, say so);
    anything that cannot be told (no holder, no answer, a new deposit, released, unknown)
    keeps the fd, unconfirmed, because closing it could hang up the terminal for good."""
    master, _ = terminal
    later, outcome = RESOLVE_CASES[case]
    with FakeHolder(socket_dir, [hand_over(master), *later]) as fake:
        client = fake.client()
        if isinstance(outcome, type):
            with pytest.raises(outcome) as caught:
                client.retrieve(SID)
            assert caught.value.session_id == SID
            if outcome is HolderUnresponsive:
                assert "still escrowed" in str(caught.value)
                assert "retrieve it again" in str(caught.value)
            got = None
        else:
            got = client.retrieve(SID)
    try:
        # One ack on the handoff's own connection; later ones only to a holder that says
        # the handoff is ours and still under way (it may have restarted and adopted it).
        acked_again = sum(1 for script in later if getattr(script, "acks", False))
        assert len(acks(fake)) == 1 + acked_again
        assert all(isinstance(m, protocol.List | protocol.Ack)
                   for conn in fake.received[1:] for m in conn)
        if got is None:
            assert fds_open_on(master) == {master}, "the client kept a copy it must close"
        else:
            assert got.confirmed is (outcome == CONFIRMED)
            assert got.handoff_id == HANDOFF_ID and got.replay == b"R"
            assert fds_open_on(master) == {master, got.fd}
    finally:
        if got is not None:
            os.close(got.fd)


def test_a_handoff_still_under_way_at_the_deadline_keeps_the_fd(
    socket_dir: Path, terminal: tuple[int, int]
) -> None:
    """No `done`, and the holder keeps saying the session is `handing_off` under our
    handoff_id (still acting on our ack, or wedged) until the client's deadline: the client
    cannot tell whether the holder has closed its copy, so it keeps the fd, unconfirmed,
    rather than risk hanging up the terminal for good."""
    master, _ = terminal

    def still(peer: Peer) -> None:  # every further connection: a list, or the ack again
        message = peer.receive()
        peer.send(protocol.Sessions(sessions=[info("handing_off", HANDOFF_ID)])
                  if isinstance(message, protocol.List) else STILL_UNDER_WAY)
    # A short client timeout keeps the test short; small budgets keep it above them.
    welcome = msgspec.structs.replace(WELCOME, drain_stop_budget=0.05, send_deadline=0.05)
    with FakeHolder(socket_dir, [hand_over(master), still], welcome=welcome,
                    repeat_last=True) as fake:
        got = fake.client(timeout=0.6).retrieve(SID)
    try:
        assert not got.confirmed
        assert len(fake.received) > 2  # it asked again while time was left
        assert fds_open_on(master) == {master, got.fd}
    finally:
        os.close(got.fd)


def test_a_reply_other_than_done_asks_who_owns_the_fd(socket_dir: Path,
                                                      terminal: tuple[int, int]) -> None:
    """A holder that answers the ack with something other than `done` has not confirmed
    anything: the client asks again, as when no answer came at all."""
    master, _ = terminal
    not_done = hand_over(master, lambda peer: peer.send(protocol.Deposited(id=SID)))
    with FakeHolder(socket_dir, [not_done, answer_list(info("handed_off", HANDOFF_ID))]) as fake:
        got = fake.client().retrieve(SID)
    try:
        assert got.confirmed
        assert [type(m) for m in fake.received[1]] == [protocol.List]
    finally:
        os.close(got.fd)


def test_an_answer_that_trickles_in_times_out_on_the_deadline(socket_dir: Path) -> None:
    """A peer that sends its answer a byte at a time restarted a socket's timeout at every
    byte, so no deadline ever passed: the call now gives up when its deadline does."""
    frame = protocol.encode(protocol.Sessions(sessions=[]))

    def trickle(peer: Peer) -> None:
        peer.expect(protocol.List)
        for i in range(len(frame)):
            try:
                peer.sock.send(frame[i:i + 1])
            except OSError:
                return  # the client gave up and hung up
            time.sleep(0.3)  # the peer's pace, not a wait for anything

    with FakeHolder(socket_dir, [trickle]) as fake:
        started = time.monotonic()
        with pytest.raises(HolderUnresponsive, match="did not answer"):
            fake.client(timeout=1.0).list()
        assert time.monotonic() - started < 1.6
