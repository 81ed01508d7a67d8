"""Fair shares (docs/design.md §6, limits): one app cannot take what the others need.

Incident pinned: one app could take every session slot, the whole ring budget (another
app's session then drained with 0 B of replay), or all 256 connections (custody
connections never time out). Each has a per-owner cap now (`--max-sessions-per-owner`,
`--owner-ring-bytes`, `--max-connections-per-owner`), answered with a clear `limit`, and
another owner is served all the same. Real holder, real PTYs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import EscrowError, LimitReached

GREEDY, OTHER = "com.example.greedy", "com.example.other"


def test_one_owner_cannot_take_every_session_slot(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    holder = make_holder("--max-sessions", "4", "--max-sessions-per-owner", "2")
    greedy = holder.client(GREEDY)
    for n in range(2):
        kid = pty_children(["sh", "-c", "exec sleep 600"])
        greedy.hand_off(f"s{n}", kid.master, child_pid=kid.pid)
    kid = pty_children(["sh", "-c", "exec sleep 600"])
    with pytest.raises(LimitReached, match="--max-sessions-per-owner"):
        greedy.hand_off("s2", kid.master, child_pid=kid.pid)
    other = pty_children(["sh", "-c", "exec sleep 600"])
    holder.client(OTHER).hand_off("mine", other.master, child_pid=other.pid)
    assert [s.id for s in holder.client(OTHER).list()] == ["mine"]


def test_one_owner_cannot_take_the_whole_ring_budget(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Two floods of one app fill its share; the other app's session still has its
    replay, every byte of it."""
    kib = 1024
    holder = make_holder("--ring-bytes", str(64 * kib), "--total-ring-bytes", str(96 * kib),
                         "--owner-ring-bytes", str(48 * kib))
    greedy = holder.client(GREEDY)
    for n in range(2):
        kid = pty_children(["sh", "-c", "yes greedy | head -c 400000; exec sleep 600"])
        greedy.hand_off(f"flood{n}", kid.master, child_pid=kid.pid)
        os.close(kid.master)
        kid.master = -1
    wait_for(lambda: sum(s.dropped_bytes for s in greedy.list()) > 0, 15.0,
             "the floods to fill their share")
    said = b"".join(f"line {i}\n".encode() for i in range(300))
    kid = pty_children(["sh", "-c", f"printf '{said.decode()}'; exec sleep 600"])
    other = holder.client(OTHER)
    other.hand_off("mine", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    expected = len(said.replace(b"\n", b"\r\n"))
    wait_for(lambda: other.list()[0].buffered_bytes == expected, 10.0,
             f"the other app's {expected} bytes of replay")
    assert sum(s.buffered_bytes for s in greedy.list()) <= 48 * kib
    got = other.retrieve("mine")
    try:
        assert got.replay == said.replace(b"\n", b"\r\n") and got.dropped_bytes == 0
    finally:
        os.close(got.fd)


def test_one_owner_cannot_take_every_connection(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Custody connections never time out: an app that opens too many is refused the next
    one, and another app still connects."""
    holder = make_holder("--max-connections", "8", "--max-connections-per-owner", "3")
    custodies = []
    try:
        for n in range(3):
            kid = pty_children(["sh", "-c", "exec sleep 600"])
            custody = holder.client(GREEDY).custody()
            custodies.append(custody)
            custody.deposit(f"s{n}", kid.master, child_pid=kid.pid)
        with pytest.raises(EscrowError, match="--max-connections-per-owner") as refused:
            holder.client(GREEDY).status()
        assert refused.value.code == "limit"
        assert holder.client(OTHER).list() == []
    finally:
        for custody in custodies:
            custody.close()
