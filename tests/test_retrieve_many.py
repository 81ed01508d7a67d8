"""`retrieve_many` on the wire, and every way it can go wrong (docs/design.md §4, §12): a peer that
hangs up before its acks, acks that never come, a wrong ack, bad requests. Each time every
session not acked goes back to draining on the same fd with its replay intact, the holder
keeps serving, and no fd leaks (the `holder` fixture counts them at the end).
"""

from __future__ import annotations

import os
import tty
from collections.abc import Callable, Iterator

import pytest
from rawclient import RawClient

from conftest import HolderProcess, wait_for
from escrow_client import EscrowClient, protocol

IDS = [f"s{i}" for i in range(5)]


@pytest.fixture
def ptys() -> Iterator[dict[str, tuple[int, int]]]:
    pairs = {sid: os.openpty() for sid in IDS}
    yield pairs
    for master, slave in pairs.values():
        os.close(master)
        os.close(slave)


def escrow(holder: HolderProcess, ptys: dict[str, tuple[int, int]]) -> EscrowClient:
    """Every pty handed off, each with a line of replay."""
    client = holder.client()
    for sid, (master, slave) in ptys.items():
        client.hand_off(sid, master)
        os.write(slave, f"replay of {sid}\n".encode())
    wait_for(lambda: all(s.buffered_bytes > 0 for s in client.list()), 10, "the replays")
    return client


def states(client: EscrowClient) -> dict[str, str]:
    return {s.id: s.state for s in client.list()}


def retrieve_all(raw: RawClient, keep: bool = False) -> dict[str, protocol.Handoff]:
    """`retrieve_many` of every session, and the handoffs it answers (not acked)."""
    raw.send(protocol.RetrieveMany(ids=IDS, keep=keep))
    return handoffs(raw, len(IDS))


def handoffs(raw: RawClient, count: int) -> dict[str, protocol.Handoff]:
    got = {}
    for _ in range(count):
        reply, fd = raw.receive()
        assert isinstance(reply, protocol.Handoff), reply
        assert fd is not None and os.isatty(fd)
        got[reply.session.id] = reply
    return got


def test_every_session_comes_back_over_one_request(holder: HolderProcess,
                                                   ptys: dict[str, tuple[int, int]]) -> None:
    client = escrow(holder, ptys)
    with RawClient(holder.socket) as raw:
        raw.hello()
        got = retrieve_all(raw)
        assert {sid: h.replay for sid, h in got.items()} == {
            sid: f"replay of {sid}\r\n".encode() for sid in IDS}
        raw.send(protocol.AckMany(acks={sid: h.handoff_id for sid, h in got.items()}))
        assert raw.receive()[0] == protocol.DoneMany(ids=list(got))
    assert set(states(client).values()) == {"handed_off"}


def test_refusals_are_answered_per_session(holder: HolderProcess,
                                           ptys: dict[str, tuple[int, int]]) -> None:
    """An unknown id and a released one get their own errors; the others come back."""
    client = escrow(holder, ptys)
    client.release("s4")
    with RawClient(holder.socket) as raw:
        raw.hello()
        raw.send(protocol.RetrieveMany(ids=["s0", "nope", "s4", "s1"]))
        answers = [raw.receive()[0] for _ in range(4)]
        errors = {a.id: a.code for a in answers if isinstance(a, protocol.Error)}
        got = {a.session.id: a for a in answers if isinstance(a, protocol.Handoff)}
        assert errors == {"nope": "unknown", "s4": "released"}
        raw.send(protocol.AckMany(acks={sid: h.handoff_id for sid, h in got.items()}))
        assert isinstance(raw.receive()[0], protocol.DoneMany)
    assert states(client) == {"s0": "handed_off", "s1": "handed_off", "s2": "draining",
                              "s3": "draining", "s4": "released"}


def test_a_peer_that_hangs_up_before_its_acks_loses_nothing(
    holder: HolderProcess, ptys: dict[str, tuple[int, int]]
) -> None:
    client = escrow(holder, ptys)
    with RawClient(holder.socket) as raw:
        raw.hello()
        retrieve_all(raw, keep=True)
        assert set(states(client).values()) == {"handing_off"}
    wait_for(lambda: set(states(client).values()) == {"draining"}, 10, "all put back")
    # The same fds and replays: output written meanwhile follows the first lines.
    master, slave = ptys["s2"]
    os.write(slave, b"more\n")
    retrieved = client.retrieve("s2")
    assert retrieved.replay.startswith(b"replay of s2\r\n")
    os.close(retrieved.fd)


def test_acks_that_never_come_put_every_session_back(
    make_holder: Callable[..., HolderProcess], ptys: dict[str, tuple[int, int]]
) -> None:
    holder = make_holder("--ack-deadline", "0.5")
    client = escrow(holder, ptys)
    with RawClient(holder.socket) as raw:
        raw.hello(timeout=None)
        got = retrieve_all(raw)
        wait_for(lambda: set(states(client).values()) == {"draining"}, 10, "all put back")
        raw.send(protocol.AckMany(acks={sid: h.handoff_id for sid, h in got.items()}))
        late, _ = raw.receive()
        assert isinstance(late, protocol.Error) and late.code == "ack_late"
        raw.send(protocol.Status())  # still serving this connection
        assert isinstance(raw.receive()[0], protocol.HolderStatus)
    assert set(states(client).values()) == {"draining"}


def test_a_wrong_ack_puts_every_session_back(holder: HolderProcess,
                                            ptys: dict[str, tuple[int, int]]) -> None:
    client = escrow(holder, ptys)
    with RawClient(holder.socket) as raw:
        raw.hello()
        got = retrieve_all(raw)
        acks = {sid: h.handoff_id for sid, h in got.items()}
        acks["s3"] = "not-the-handoff-id"
        raw.send(protocol.AckMany(acks=acks))
        refused, _ = raw.receive()
        assert isinstance(refused, protocol.Error) and refused.code == "bad_request"
        assert set(states(client).values()) == {"draining"}
        raw.send(protocol.Status())
        assert isinstance(raw.receive()[0], protocol.HolderStatus)


@pytest.mark.parametrize("request_", [
    protocol.RetrieveMany(ids=["s0", "s1", "s0"]),
    protocol.RetrieveMany(ids=["s0"], journal=True),
    protocol.Retrieve(id="s0", journal=True),
], ids=["a-session-twice", "journal-without-keep", "single-journal-without-keep"])
def test_bad_retrieve_requests_change_nothing(holder: HolderProcess,
                                              ptys: dict[str, tuple[int, int]],
                                              request_: protocol.Message) -> None:
    client = escrow(holder, ptys)
    with RawClient(holder.socket) as raw:
        raw.hello()
        raw.send(request_)
        refused, _ = raw.receive()
        assert isinstance(refused, protocol.Error) and refused.code == "bad_request"
        raw.send(protocol.Status())
        assert isinstance(raw.receive()[0], protocol.HolderStatus)
    assert set(states(client).values()) == {"draining"}


def test_kept_sessions_are_held_by_the_connection_and_drain_when_it_ends(
    holder: HolderProcess, ptys: dict[str, tuple[int, int]]
) -> None:
    """Retrieve into custody: after the ack the holder keeps its copies and the sessions are
    held by this connection; when it ends (an app killed), they drain again, and the next
    replay starts where this app stopped reading."""
    client = escrow(holder, ptys)
    with RawClient(holder.socket) as raw:
        raw.hello()
        got = retrieve_all(raw, keep=True)
        raw.send(protocol.AckMany(acks={sid: h.handoff_id for sid, h in got.items()},
                                  keep=True))
        assert isinstance(raw.receive()[0], protocol.DoneMany)
        listed = {s.id: s for s in client.list()}
        assert {s.state for s in listed.values()} == {"held"}
        assert {s.custodian_pid for s in listed.values()} == {os.getpid()}
        assert {s.buffered_bytes for s in listed.values()} == {0}  # delivered
    wait_for(lambda: set(states(client).values()) == {"draining"}, 10, "custody ended")
    master, slave = ptys["s1"]
    os.write(slave, b"after\n")
    wait_for(lambda: any(s.id == "s1" and s.buffered_bytes for s in client.list()), 10,
             "the new output drained")
    retrieved = client.retrieve("s1")
    assert retrieved.replay == b"after\r\n"
    assert retrieved.dropped_bytes == 0  # delivered bytes are not counted as dropped
    os.close(retrieved.fd)


def test_a_custodian_the_holder_drops_keeps_its_sessions_held(
    make_holder: Callable[..., HolderProcess], ptys: dict[str, tuple[int, int]]
) -> None:
    """A custody connection that retrieves and does not take the handoff in time is
    dropped by the holder. The app is alive and still reads its other sessions: they stay
    held (by nobody connected, while its process lives), never drained behind its back, and
    its custody takes them back on a new connection; they drain once it hangs up."""
    holder = make_holder("--send-deadline", "0.3")
    client = holder.client()
    big_master, big_slave = ptys["s0"]
    tty.setraw(big_slave)
    client.hand_off("big", big_master)
    for _ in range(10):  # more than both socket buffers can take unread
        os.write(big_slave, b"x" * 60000)
    wait_for(lambda: any(s.id == "big" and s.buffered_bytes == 600000 for s in client.list()),
             10, "the big replay drained")
    mine, _ = ptys["s1"]
    with RawClient(holder.socket, rcvbuf=4096) as raw:
        raw.hello()
        raw.send(protocol.Deposit(id="mine"), fd=mine)
        assert raw.receive()[0] == protocol.Deposited(id="mine")
        raw.send(protocol.Retrieve(id="big"))  # and never read: the send times out
        wait_for(lambda: states(client).get("big") == "draining", 10, "the handoff put back")
        wait_for(lambda: "dropped by the holder" in holder.logs(), 10, "the drop logged")
        assert states(client)["mine"] == "held"
        (info,) = [s for s in client.list() if s.id == "mine"]
        assert info.custodian_pid == os.getpid()
        with RawClient(holder.socket) as again:  # the app's custody, reconnected
            again.hello()
            again.send(protocol.Deposit(id="mine"), fd=mine)
            assert again.receive()[0] == protocol.Deposited(id="mine")  # a resume
            assert states(client)["mine"] == "held"
    wait_for(lambda: states(client)["mine"] == "draining", 10, "custody ended by the app")


def test_more_sessions_than_go_out_at_a_time(holder: HolderProcess) -> None:
    """The holder claims, stops and sends a chunk of sessions at a time. A peer that takes
    the handoffs of the first chunks and hangs up leaves every session draining again (sent
    or not, claimed or not yet), each with its replay; a peer that takes them all gets them
    all, and a refusal in a later chunk is answered in its turn."""
    many = [f"m{i:03d}" for i in range(100)]
    pairs = {sid: os.openpty() for sid in many}
    try:
        client = escrow(holder, pairs)
        with RawClient(holder.socket) as raw:
            raw.hello()
            raw.send(protocol.RetrieveMany(ids=many))
            handoffs(raw, 40)  # past the first chunk, then gone
        wait_for(lambda: set(states(client).values()) == {"draining"}, 10, "all put back")
        with RawClient(holder.socket) as raw:
            raw.hello()
            asked = many[:70] + ["nope"] + many[70:]
            raw.send(protocol.RetrieveMany(ids=asked))
            answers = [raw.receive() for _ in asked]
            got = {a.session.id: (a, fd) for a, fd in answers
                   if isinstance(a, protocol.Handoff)}
            assert [a.id for a, _ in answers if isinstance(a, protocol.Error)] == ["nope"]
            assert {sid: a.replay for sid, (a, _) in got.items()} == {
                sid: f"replay of {sid}\r\n".encode() for sid in many}
            raw.send(protocol.AckMany(acks={sid: a.handoff_id for sid, (a, _) in got.items()}))
            assert raw.receive()[0] == protocol.DoneMany(ids=list(got))
            for _, fd in got.values():
                assert fd is not None
                os.close(fd)
        assert set(states(client).values()) == {"handed_off"}
    finally:
        for master, slave in pairs.values():
            os.close(master)
            os.close(slave)
