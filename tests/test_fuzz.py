"""Fuzzing the protocol (issue 4, item 2) with hypothesis.

(a) The frame decoder, in process: `FrameAssembler` fed arbitrary bytes in arbitrary pieces
    (with and without MSG_CTRUNC), and `decode_request`/`decode_response` fed arbitrary bytes
    and structured-but-wrong messages (valid MessagePack maps with random keys and values,
    real message types with fields of the wrong type, random `type` strings, deep nesting).
    Nothing may escape but the protocol's own errors (ProtocolError, and EOFError for a clean
    end of stream); whatever does decode is a real message that encodes back to itself.

(b) A live holder fed streams of mutated frames: valid encoded requests with bytes flipped,
    inserted, deleted or overwritten (with the length header left stale or fixed up), some
    carrying fds (a pty master, a pipe, several), over several connections per example. After
    every example the holder answers `status`; a bystander session drains throughout and is
    whole at the end; the holder's fd count returns to its baseline.

Each test prints how many examples it ran.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hostile import Bystander, holder_status, mp, send_with_fds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawclient import RawClient

from conftest import HolderProcess
from escrow_client import fdpass, protocol

P = protocol
FUZZ_OWNER = "fuzz.owner"
HID = "0123456789abcdef0123456789abcdef"

REQUEST_TYPES: dict[str, type[msgspec.Struct]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (P.Hello, P.Deposit, P.Release, P.Retrieve, P.Ack, P.List, P.Status)
}
RESPONSE_TYPES: dict[str, type[msgspec.Struct]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (P.Welcome, P.Deposited, P.Released, P.Handoff, P.Done, P.Sessions,
                P.HolderStatus, P.Error)
}
ALL_TAGS = sorted(REQUEST_TYPES) + sorted(RESPONSE_TYPES)


def report(capsys: pytest.CaptureFixture[str], what: str, count: int) -> None:
    with capsys.disabled():
        print(f"\n[fuzz] {what}: {count} examples run")


# --- (a) the decoder, in process ----------------------------------------------------------------


def _check_decoded(message: Any, decode: Callable[[bytes], Any]) -> None:
    """Whatever decodes is a real message, and survives a round trip unchanged."""
    assert isinstance(message, P.Message)
    assert decode(P.encode(message)[4:]) == message


def _decode_body(body: bytes, fds: int = 0) -> None:
    for decode in (P.decode_request, P.decode_response):
        try:
            message = decode(body)
        except P.ProtocolError:
            continue
        _check_decoded(message, decode)
        try:
            P.check_fds(message, fds)
        except P.ProtocolError:
            pass


msgpack_scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=10) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def wrong_messages(draw: st.DrawFn) -> bytes:
    """A valid MessagePack body that is (mostly) not a valid message."""
    kind = draw(st.sampled_from(["random-map", "real-type-wrong-fields", "random-type",
                                 "real-type-random-extras", "not-a-map", "deep"]))
    if kind == "random-map":
        obj: Any = draw(st.dictionaries(st.text(max_size=10), msgpack_values, max_size=6))
    elif kind == "real-type-wrong-fields":
        tag = draw(st.sampled_from(ALL_TAGS))
        cls = REQUEST_TYPES.get(tag) or RESPONSE_TYPES[tag]
        names = list(cls.__struct_fields__)
        fields = draw(st.dictionaries(st.sampled_from(names), msgpack_values)) if names else {}
        obj = {"type": tag, **fields}
    elif kind == "random-type":
        obj = {"type": draw(st.text(max_size=30) | msgpack_scalars),
               **draw(st.dictionaries(st.text(max_size=10), msgpack_values, max_size=3))}
    elif kind == "real-type-random-extras":
        tag = draw(st.sampled_from(ALL_TAGS))
        obj = {"type": tag, **draw(st.dictionaries(st.text(max_size=10), msgpack_values))}
    elif kind == "not-a-map":
        obj = draw(msgpack_values)
    else:  # valid, deep nesting in a field the decoder skips
        depth = draw(st.integers(1, 3000))
        tag = draw(st.sampled_from(ALL_TAGS))
        return b"\x82" + mp("type") + mp(tag) + mp("x") + b"\x91" * depth + b"\xc0"
    return mp(obj)


def test_decoder_on_arbitrary_and_structured_but_wrong_input(
    capsys: pytest.CaptureFixture[str],
) -> None:
    count = 0

    @settings(max_examples=1500, deadline=None)
    @given(body=st.binary(max_size=300) | wrong_messages(), fds=st.integers(0, 3))
    def run(body: bytes, fds: int) -> None:
        nonlocal count
        count += 1
        _decode_body(body, fds)

    run()
    report(capsys, "decoder (decode_request/decode_response)", count)


def test_frame_assembler_on_arbitrary_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    count = 0

    @settings(max_examples=1000, deadline=None)
    @given(
        data=st.binary(max_size=600)
        | st.lists(wrong_messages() | st.binary(max_size=40), max_size=4).map(
            lambda bodies: b"".join(P.HEADER.pack(len(b)) + b for b in bodies)),
        pieces=st.lists(st.integers(1, 64), max_size=30),
        ctrunc_at=st.none() | st.integers(0, 30),
        max_body=st.integers(1, 2000),
    )
    def run(data: bytes, pieces: list[int], ctrunc_at: int | None, max_body: int) -> None:
        nonlocal count
        count += 1
        assembler = fdpass.FrameAssembler(max_body)
        view = memoryview(data)
        step = 0
        while True:
            want = assembler.wanted
            assert want > 0
            size = min(want, pieces[step % len(pieces)] if pieces else want)
            chunk = bytes(view[:size])
            view = view[size:]
            flags = socket.MSG_CTRUNC if step == ctrunc_at else 0
            step += 1
            try:
                got = assembler.feed(chunk, [], flags)
            except EOFError:
                assert not chunk
                return
            except P.ProtocolError:
                return  # the stream is out of step (or the frame was refused): stop
            if got is not None:
                body, fds = got
                assert fds == []
                assert 0 < len(body) <= max_body
                _decode_body(body)
            if not chunk and got is None:
                raise AssertionError("an empty read neither ended nor failed the stream")

    run()
    report(capsys, "FrameAssembler", count)


# --- (b) a live holder ----------------------------------------------------------------------


TEMPLATES: list[bytes] = [
    P.encode(m) for m in (
        P.Hello(version=1, owner=FUZZ_OWNER, client="fuzz", timeout=1.0),
        P.Status(),
        P.List(),
        P.List(all_owners=True),
        P.Retrieve(id="f1"),
        P.Retrieve(id="f2"),
        P.Release(id="f1"),
        P.Ack(id="f1", handoff_id=HID),
        P.Deposit(id="f1", label="fuzz", cols=80, rows=24, meta={"cwd": "/"}),
        P.Deposit(id="f2", child_pid=1),
    )
]

DEPOSITS = {t for t in TEMPLATES if P.decode_request(t[4:]).__class__ is P.Deposit}


@st.composite
def mutated_frames(draw: st.DrawFn) -> tuple[bytes, str | None]:
    template = draw(st.sampled_from(TEMPLATES))
    data = bytearray(template)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 4]))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "set"]))
        if op == "insert":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            at = draw(st.integers(0, len(data) - 1))
            if op == "flip":
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif op == "set":
                data[at] = draw(st.integers(0, 255))
            else:
                del data[at:at + draw(st.integers(1, 4))]
    if len(data) > 4 and draw(st.booleans()):
        data[:4] = P.HEADER.pack(len(data) - 4)  # keep the framing right: fuzz the body
    if template in DEPOSITS:  # mostly a pty master, so that some deposits go through
        fd = draw(st.sampled_from(["pty", "pty", "pty", None, "pipe", "three"]))
    else:
        fd = draw(st.sampled_from([None, None, None, "pty", "pipe", "three"]))
    return bytes(data), fd


connections = st.lists(
    st.tuples(st.booleans(), st.lists(mutated_frames(), min_size=1, max_size=6)),
    min_size=1, max_size=3,
)


def _fds_for(kind: str | None) -> list[int]:
    if kind is None:
        return []
    if kind == "pty":
        master, slave = os.openpty()
        os.close(slave)
        return [master]
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return [r]
    fds: list[int] = []
    for _ in range(3):
        r, w = os.pipe()
        os.close(w)
        fds.append(r)
    return fds


def _play(holder: HolderProcess, hello: bool, frames: list[tuple[bytes, str | None]]) -> None:
    """One connection: (a valid hello,) the frames, then half-close and read to the end."""
    with RawClient(holder.socket, timeout=10.0) as raw:
        try:
            if hello:
                raw.hello(owner=FUZZ_OWNER, timeout=1.0)
            for data, kind in frames:
                fds = _fds_for(kind)
                try:
                    send_with_fds(raw.sock, data, fds)
                finally:
                    fdpass.close_fds(fds)
            raw.sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the holder already ended it (a broken frame)
        # Read to the end; close whatever fd comes (a handoff of a fuzz session).
        while True:
            try:
                data, anc, flags, _ = raw.sock.recvmsg(1 << 16, fdpass.ANCILLARY_SPACE)
            except ConnectionResetError:
                break
            fdpass.close_fds(fdpass.fds_from_ancillary(anc, 0))
            if not data:
                break


def test_live_holder_survives_mutated_frames(
    make_holder: Callable[..., HolderProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    holder = make_holder()
    bystander = Bystander(holder)
    count = 0
    conns = 0
    start = time.monotonic()
    try:

        @settings(max_examples=300, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(plan=connections)
        def run(plan: list[tuple[bool, list[tuple[bytes, str | None]]]]) -> None:
            nonlocal count, conns
            count += 1
            for hello, frames in plan:
                conns += 1
                _play(holder, hello, frames)
            holder_status(holder)  # alive and serving after every example

        run()
        counters = holder_status(holder).counters
        assert holder.alive(), holder.logs()[-3000:]
        assert holder.log_lines("internal_error") == []
        bystander.assert_draining_and_growing()
        bystander.take_back_and_check()
        # Every fuzz session the mutations managed to deposit is released; then the holder
        # is back to its baseline fd count.
        holder.release_everything()
        holder.wait_fds_at_baseline()
    finally:
        bystander.stop()
    seen = ", ".join(f"{k}={counters[k]}" for k in ("bad_requests", "deposits", "releases",
                                                     "handoffs_failed"))
    report(capsys, f"live holder ({conns} connections, {time.monotonic() - start:.1f}s; "
           f"{seen})", count)
