"""The C client when an ack's answer goes wrong: a `done_many` no ack_many could have earned,
and a `done` that never came for a handoff the holder still waits on
(client/c/escrow_codec.c, client/c/escrow.c; PROTOCOL.md 12.3, 12.7 and 10.6).

A scripted fake holder (tests/fakeholder.py) plays the holder, so each answer is exact rather
than a race. The driver is test_c_client's build: the sanitized one (ASan, UBSan, and its own
check at exit that no fd was left open) for every behaviour, the plain one where its peak
memory is measured, which the sanitizer's shadow memory would blur.

- A `done_many` answers an `ack_many` of n sessions with n ids. One that claims millions
  (a frame of 1 MiB, every id one byte) is refused before the client allocates room for
  them (129 bytes an id): the reclaim treats it as the broken answer it is, asks `list` on a
  fresh connection, and the driver's peak memory stays near its frame's size.
- A holder that restarted while our handoff was under way adopts it `handing_off` with our
  handoff id and completes it only on an ack: the client, finding it so in `list`, acks again
  on a fresh connection and is confirmed by its `done`; told `busy` (the first connection is
  still winding it up) it asks again; told `ack_late` (the holder kept it) it gives its copy
  back, unread. A reclaim (escrow_reclaim_all) resolves its handoffs the same way, once its
  own connection is closed (until then the holder is still winding the handoff up: busy).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from fakeholder import OWNER, WELCOME, FakeHolder, Peer
from test_c_client import Build, expect_error, run_c
from test_c_client import build as build  # noqa: F401  (a fixture)

from escrow_client import fdpass, protocol

SID = "s"
HANDOFF_ID = "h-1"
DEPOSITED_AT = 1.5


@pytest.fixture
def masters() -> Iterator[list[int]]:
    """Two terminal masters to hand over (their terminals kept open, so they stay ttys)."""
    pairs = [os.openpty() for _ in range(2)]
    yield [master for master, _ in pairs]
    for pair in pairs:
        for fd in pair:
            os.close(fd)


def _info(sid: str, state: str, handoff_id: str | None = None) -> protocol.SessionInfo:
    return protocol.SessionInfo(owner=OWNER, id=sid, state=state,  # type: ignore[arg-type]
                                deposited_at=DEPOSITED_AT, handoff_id=handoff_id)


# --- a done_many no ack_many could have earned (12.7) ------------------------------------------

MANY_WELCOME = msgspec.structs.replace(WELCOME, features=["retrieve_many"])
# A million one-byte ids: a 1 MiB frame, which would be 129 MiB of ids once decoded.
HUGE = 1_000_000
# The driver's own peak is a few MiB, and the frame itself one: far under the ids it names.
PEAK_LIMIT_KIB = 48 * 1024


def _reclaim_answered_by_a_huge_done_many(masters: list[int]) -> list[Callable[[Peer], None]]:
    infos = [_info(f"t{i}", "draining") for i in range(len(masters))]

    def first(peer: Peer) -> None:
        peer.expect(protocol.Status)
        peer.send(protocol.HolderStatus(pid=1, version="fake", started_at=0.0, socket="x"))
        peer.expect(protocol.List)
        peer.send(protocol.Sessions(sessions=infos))
        request = peer.expect(protocol.RetrieveMany)
        assert sorted(request.ids) == [info.id for info in infos]
        for i, (info, master) in enumerate(zip(infos, masters, strict=True)):
            peer.send(protocol.Handoff(handoff_id=f"h{i}", session=info, replay=b""), fd=master)
        acks = peer.expect(protocol.AckMany)
        assert acks.acks == {info.id: f"h{i}" for i, info in enumerate(infos)}
        body = msgspec.msgpack.encode({"type": "done_many", "ids": [""] * HUGE})
        fdpass.send_frame(peer.sock, protocol.HEADER.pack(len(body)) + body)
        peer.until_eof()

    def asked(peer: Peer) -> None:
        # The question of 12.3, asked on a fresh connection: the holder did take our acks.
        peer.expect(protocol.List)
        peer.send(protocol.Sessions(sessions=[
            _info(info.id, "handed_off", f"h{i}") for i, info in enumerate(infos)]))

    return [first, asked]


# A process's peak RSS counts the memory it had before its exec (Linux keeps the larger),
# so the driver is not started from this test's large process but from a small one, which
# says how its child ended and the child's peak (KiB), as `wait4` tells them.
PEAK_OF_CHILD = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
peak = usage.ru_maxrss // 1024 if sys.platform == "darwin" else usage.ru_maxrss
print(os.waitstatus_to_exitcode(status), peak)
"""


def run_measured(argv: list[str]) -> tuple[int, int, str]:
    """Run `argv`: its exit status, its peak RSS in KiB, and its stderr."""
    result = subprocess.run([sys.executable, "-I", "-S", "-c", PEAK_OF_CHILD, *argv],
                            capture_output=True, text=True, timeout=60)
    status, peak = result.stdout.split()
    return int(status), int(peak), result.stderr


def test_a_done_many_naming_more_ids_than_acked_is_refused_unallocated(
    build: Build, socket_dir: Path, masters: list[int]
) -> None:
    """The first run (sanitized) shows the answer is a protocol error that the reclaim
    resolves by asking `list`, with no fd left open; the second (plain) that the driver's
    peak memory stayed far below the 129 MiB the ids would have taken."""
    with FakeHolder(socket_dir, _reclaim_answered_by_a_huge_done_many(masters),
                    welcome=MANY_WELCOME, concurrent=True, repeat_last=True) as holder:
        run = run_c(build, holder.socket_path, "reclaim")
    assert run.status == 0, run.err
    report = next(line["report"] for line in run.lines() if "report" in line)
    assert report["failed"] == {}
    assert sorted((r["id"], r["confirmed"]) for r in report["retrieved"]) == [
        ("t0", True), ("t1", True)], "confirmed by list, not by the done_many"
    (socket_dir / "fake.sock").unlink()

    with FakeHolder(socket_dir, _reclaim_answered_by_a_huge_done_many(masters),
                    welcome=MANY_WELCOME, concurrent=True, repeat_last=True) as holder:
        status, peak, err = run_measured(
            [str(build.plain), "--socket", holder.socket_path, "reclaim"])
    assert status == 0, err
    assert peak < PEAK_LIMIT_KIB, f"the driver peaked at {peak // 1024} MiB for a 1 MiB done_many"


# --- our handoff still under way after a holder restart (12.3, 10.6) ---------------------------


def _handed_over_then_gone(master: int) -> Callable[[Peer], None]:
    """A connection that hands `master` over, reads the ack, and dies without `done`."""

    def serve(peer: Peer) -> None:
        request = peer.expect(protocol.Retrieve)
        assert (request.id, request.keep) == (SID, False)
        peer.send(protocol.Handoff(handoff_id=HANDOFF_ID, session=_info(SID, "draining"),
                                   replay=b"R\r\n"), fd=master)
        assert peer.receive() == protocol.Ack(id=SID, handoff_id=HANDOFF_ID)

    return serve


def _still_handing_off(peer: Peer) -> None:
    """The restarted holder's list: the session adopted, our handoff waiting for its ack."""
    peer.expect(protocol.List)
    peer.send(protocol.Sessions(sessions=[_info(SID, "handing_off", HANDOFF_ID)]))


def _answer_the_ack(answer: protocol.Message) -> Callable[[Peer], None]:
    def serve(peer: Peer) -> None:
        assert peer.receive() == protocol.Ack(id=SID, handoff_id=HANDOFF_ID), (
            "the ack again, on a fresh connection")
        peer.send(answer)

    return serve


DONE = protocol.Done(id=SID)
BUSY = protocol.Error(code="busy", message="still under way on its own connection", id=SID)
LATE = protocol.Error(code="ack_late", message="the holder kept the session", id=SID)


@pytest.mark.parametrize(("answers", "code"), [
    ([DONE], None),  # the adopted handoff completes on our ack: ours, confirmed
    ([BUSY, DONE], None),  # the first connection still winding it up: asked again
    ([LATE], "ack_late"),  # the holder kept it and drains it: our copy given back
], ids=["done", "busy-then-done", "ack_late"])
def test_our_handoff_still_under_way_is_acked_again_on_a_fresh_connection(
    build: Build, socket_dir: Path, masters: list[int], answers: list[protocol.Message],
    code: str | None,
) -> None:
    script: list[Callable[[Peer], None]] = [_handed_over_then_gone(masters[0])]
    for answer in answers:
        script += [_still_handing_off, _answer_the_ack(answer)]
    with FakeHolder(socket_dir, script) as holder:
        run = run_c(build, holder.socket_path, "retrieve", SID)
    acks = [message for connection in holder.received for message in connection
            if isinstance(message, protocol.Ack)]
    assert len(acks) == 1 + len(answers), "acked on the first connection, then once a list"
    if code is not None:
        expect_error(run, code, SID)
        assert run.out == b"", "a copy given back was never read"
        return
    assert run.status == 0, run.err
    assert run.lines()[0]["confirmed"] is True
    assert run.out == b"R\r\n"


def test_a_reclaim_whose_done_never_came_acks_its_handoff_again(
    build: Build, socket_dir: Path, masters: list[int]
) -> None:
    """escrow_reclaim_all resolves as escrow_retrieve does: the holder died after our ack,
    its successor adopted the handoff and completes it on the ack sent again."""

    def first(peer: Peer) -> None:
        peer.expect(protocol.Status)
        peer.send(protocol.HolderStatus(pid=1, version="fake", started_at=0.0, socket="x"))
        peer.expect(protocol.List)
        peer.send(protocol.Sessions(sessions=[_info(SID, "draining")]))
        _handed_over_then_gone(masters[0])(peer)

    with FakeHolder(socket_dir, [first, _still_handing_off, _answer_the_ack(DONE)]) as holder:
        run = run_c(build, holder.socket_path, "reclaim")
    assert run.status == 0, run.err
    report = next(line["report"] for line in run.lines() if "report" in line)
    assert report["failed"] == {}
    assert [(r["id"], r["confirmed"]) for r in report["retrieved"]] == [(SID, True)]


def test_a_reclaim_closes_its_connection_before_it_acks_again(
    build: Build, socket_dir: Path, masters: list[int]
) -> None:
    """Found in review: a reclaim whose `done` never came asked about its handoff while its
    own connection was still open, so a holder still winding that handoff up (it does so
    when that connection goes) answered each ack sent again `busy`, until the timeout: the
    session kept unconfirmed. Now the connection is closed first, as client/retrieve.py
    closes it: the holder's `busy` ends with it, and the ack sent again is answered `done`.
    The fake holder says busy exactly while the reclaim's connection is open."""
    first_closed = threading.Event()
    answers: list[str] = []

    def first(peer: Peer) -> None:
        peer.expect(protocol.Status)
        peer.send(protocol.HolderStatus(pid=1, version="fake", started_at=0.0, socket="x"))
        peer.expect(protocol.List)
        peer.send(protocol.Sessions(sessions=[_info(SID, "draining")]))
        _handed_over_then_gone(masters[0])(peer)  # no `done`: the ack goes unanswered
        peer.until_eof()
        first_closed.set()

    def asking(peer: Peer) -> None:
        request = peer.receive()
        if isinstance(request, protocol.List):
            peer.send(protocol.Sessions(sessions=[_info(SID, "handing_off", HANDOFF_ID)]))
            return
        assert request == protocol.Ack(id=SID, handoff_id=HANDOFF_ID), request
        answers.append("done" if first_closed.is_set() else "busy")
        peer.send(DONE if first_closed.is_set() else BUSY)

    with FakeHolder(socket_dir, [first, asking], repeat_last=True, concurrent=True) as holder:
        run = run_c(build, holder.socket_path, "reclaim", timeout=2.0)
    assert run.status == 0, run.err
    report = next(line["report"] for line in run.lines() if "report" in line)
    assert [(r["id"], r["confirmed"]) for r in report["retrieved"]] == [(SID, True)]
    assert answers == ["done"], "acked again only once the reclaim's connection was closed"
