"""Draining (docs/design.md §3): the exit tail, and bounded replay rings that never block a child.

Children here run on a raw slave (no output processing), so the bytes read from the master
are exactly the bytes the child wrote. Each child waits for one byte of input before it
writes, so it can be handed off first: all of its output goes to the holder.
"""

from __future__ import annotations

import os
import subprocess
import time
import tty
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import (
    HolderProcess,
    PtyChild,
    _make_controlling_tty,
    wait_for,
)
from escrow_client import EscrowClient, SessionInfo


@pytest.fixture
def raw_children(tmp_path: Path) -> Iterator[Callable[[bytes], PtyChild]]:
    """spawn(data): a child on a raw PTY that, after one byte of input, writes `data` and
    exits. Every child is killed and its master closed at teardown."""
    children: list[PtyChild] = []

    def spawn(data: bytes) -> PtyChild:
        path = tmp_path / f"data{len(children)}"
        path.write_bytes(data)
        master, slave = os.openpty()
        tty.setraw(slave)
        proc = subprocess.Popen(
            ["sh", "-c", 'head -c 1 >/dev/null && exec cat "$0"', str(path)],
            stdin=slave, stdout=slave, stderr=slave, preexec_fn=_make_controlling_tty,
            close_fds=True,
        )
        os.close(slave)
        child = PtyChild(master, proc)
        children.append(child)
        return child

    yield spawn
    for child in children:
        child.kill()
        if child.master >= 0:
            os.close(child.master)


def counting(size: int, tag: bytes = b"") -> bytes:
    """`size` bytes of numbered records, so any slice of it says where it came from."""
    records = (b"%s%08d\n" % (tag, i) for i in range(size // (len(tag) + 9) + 1))
    return b"".join(records)[:size]


def hand_off_and_go(client: EscrowClient, sid: str, child: PtyChild) -> None:
    """Escrow the child's master, let the child start writing, and drop the app's copy."""
    client.hand_off(sid, child.master, child_pid=child.pid)
    os.write(child.master, b"g")  # writing is not reading: the holder stays the only reader
    os.close(child.master)
    child.master = -1


def info_of(client: EscrowClient, sid: str) -> SessionInfo:
    (info,) = [s for s in client.list() if s.id == sid]
    return info


def test_exit_tail_is_drained_before_exited(holder: HolderProcess, raw_children) -> None:
    """Incident: a build printed its last 200 KB and exited while the app was restarting;
    the session was marked `exited` on the hangup before the tail was read, and the
    relaunched app showed the output cut short. Every byte written before the exit must be
    in the replay, and `exited` must never be reported before it is all in."""
    data = os.urandom(200_000)
    child = raw_children(data)
    client = holder.client()
    hand_off_and_go(client, "build", child)

    samples = mid_drain = 0
    deadline = time.monotonic() + 10.0
    while True:
        info = info_of(client, "build")
        samples += 1
        if info.state == "exited":
            # Drain first, then mark: by the time it says exited, every byte is in.
            assert info.buffered_bytes + info.dropped_bytes == len(data), (
                f"exited reported with {info.buffered_bytes + info.dropped_bytes} of "
                f"{len(data)} bytes drained")
            # ... and kept: 200 KB is far below the 1 MiB ring, so nothing may be dropped.
            assert info.dropped_bytes == 0, (
                f"the ring dropped {info.dropped_bytes} B while under its limit")
            assert info.buffered_bytes == len(data)
            break
        assert info.state == "draining"
        mid_drain += info.buffered_bytes + info.dropped_bytes < len(data)
        assert time.monotonic() < deadline, "the session never became exited"
    print(f"\n  list() samples while draining: {samples} ({mid_drain} with the tail "
          f"still coming)")
    wait_for(lambda: child.proc.poll() is not None, 5.0, "the child to exit")

    got = client.retrieve("build")
    try:
        assert got.confirmed
        assert got.session.state == "exited"
        assert got.dropped_bytes == 0
        assert len(got.replay) == len(data)
        assert got.replay == data
    finally:
        os.close(got.fd)


def test_ring_overflow_keeps_the_newest_bytes(make_holder, raw_children) -> None:
    """Incident: a child flooded its terminal while escrowed; the ring filled up and the
    holder stopped reading, so the child blocked on write forever (and the user got a hung
    shell back). A full ring must drop its oldest bytes, count them exactly, keep exactly
    the newest, and the child must run to its end."""
    ring = 65536
    holder: HolderProcess = make_holder("--ring-bytes", str(ring))
    data = counting(1 << 20)
    child = raw_children(data)
    client = holder.client()
    hand_off_and_go(client, "flood", child)

    # Nobody but the holder reads; the child can only finish if the holder keeps draining.
    wait_for(lambda: child.proc.poll() is not None, 10.0, "the flooding child to exit")
    assert child.proc.returncode == 0
    wait_for(lambda: info_of(client, "flood").state == "exited", 5.0, "state exited")
    info = info_of(client, "flood")
    assert info.buffered_bytes == ring
    assert info.dropped_bytes == len(data) - ring

    got = client.retrieve("flood")
    try:
        assert got.session.state == "exited"
        assert got.dropped_bytes == len(data) - ring
        # The ring wrapped: the replay starts at the first whole line (docs/design.md §12).
        assert len(got.replay) + got.replay_trimmed == ring
        assert got.replay == data[-ring:][got.replay_trimmed:]
        assert got.replay_trimmed <= 9 and got.replay.split(b"\n")[0].isdigit()
    finally:
        os.close(got.fd)
    print(f"\n  wrote {len(data)} B, replayed {len(got.replay)} B, dropped {got.dropped_bytes} B")


def test_total_ring_cap_is_shared(make_holder, raw_children) -> None:
    """Incident: many flooding sessions each got a full per-session ring and the holder's
    memory grew with the number of sessions. The holder-wide cap must bound the sum of all
    rings, while every child still runs to its end and every byte is either kept or counted
    as dropped."""
    cap = 65536
    holder: HolderProcess = make_holder("--ring-bytes", str(cap), "--total-ring-bytes", str(cap))
    written = {sid: counting(256 * 1024, tag=sid.encode()) for sid in ("a", "b")}
    children = {sid: raw_children(data) for sid, data in written.items()}
    client = holder.client()
    for sid, child in children.items():
        hand_off_and_go(client, sid, child)

    for sid, child in children.items():
        wait_for(lambda c=child: c.proc.poll() is not None, 10.0, f"child {sid} to exit")
        assert child.proc.returncode == 0
    for sid in written:
        wait_for(lambda s=sid: info_of(client, s).state == "exited", 5.0, f"{sid} exited")

    infos = {s.id: s for s in client.list()}
    total = sum(infos[sid].buffered_bytes for sid in written)
    print(f"\n  buffered: { {sid: infos[sid].buffered_bytes for sid in written} } "
          f"(sum {total}, cap {cap})")
    assert total <= cap
    assert holder.client("escrowctl").status().counters["ring_bytes_used"] <= cap
    for sid, data in written.items():
        assert infos[sid].buffered_bytes + infos[sid].dropped_bytes == len(data), sid

    for sid, data in written.items():
        got = client.retrieve(sid)
        try:
            assert got.session.state == "exited"
            assert len(got.replay) + got.replay_trimmed == infos[sid].buffered_bytes
            assert got.dropped_bytes == infos[sid].dropped_bytes
            assert data.endswith(got.replay), f"{sid}: the replay is not the newest bytes"
        finally:
            os.close(got.fd)

