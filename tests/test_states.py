"""Session states as the holder reports them (docs/design.md §3, §4), and the timeout invariant.

A question about a session gets a true answer: `unknown` for what was never seen, the
tombstone's own state for what ended, never one dressed up as the other.
"""

from __future__ import annotations

import os

import pytest

import escrowd
from conftest import OWNER, HolderProcess, PtyChild
from escrow_client import (
    EscrowClient,
    EscrowConfigError,
    HandedOff,
    Released,
    SessionExists,
    SessionInfo,
    SessionUnknown,
    protocol,
)
from escrowd.registry import Registry
from escrowd.session import Session

MiB = 1 << 20


def entries(client: EscrowClient, sid: str) -> list[SessionInfo]:
    return [s for s in client.list() if s.id == sid]


def only(client: EscrowClient, sid: str) -> SessionInfo:
    (info,) = entries(client, sid)
    return info


def sleeper(pty_children) -> PtyChild:
    child: PtyChild = pty_children(["sh", "-c", "exec sleep 60"])
    return child


def escrow(client: EscrowClient, sid: str, child: PtyChild) -> None:
    """Hand `child` off as `sid` and drop the app's copy (it must not read it again)."""
    client.hand_off(sid, child.master, child_pid=child.pid)
    os.close(child.master)
    child.master = -1


def test_never_deposited_is_unknown(holder: HolderProcess) -> None:
    """Incident: a relaunched app asked about a session id the holder had never seen and was
    told it was handed off, so it assumed another instance owned the shell. A never-seen id
    answers `unknown`, for retrieve and release alike, and is not listed at all."""
    client = holder.client()
    with pytest.raises(SessionUnknown) as retrieved:
        client.retrieve("never-deposited")
    assert retrieved.value.code == "unknown"
    with pytest.raises(SessionUnknown) as released:
        client.release("never-deposited")
    assert released.value.code == "unknown"
    assert entries(client, "never-deposited") == []


def test_handed_off_tombstone(holder: HolderProcess, pty_children) -> None:
    """Incident: after a completed handoff, a second instance of the app retried the same
    id and got `unknown`, concluded the shell was gone, and showed the user a dead tab.
    After a handoff the id answers `handed_off` (retrieve and release) and `list()` shows
    the tombstone with the handoff_id that the retrieving app got."""
    client = holder.client()
    escrow(client, "tab-1", sleeper(pty_children))
    got = client.retrieve("tab-1")
    try:
        assert got.confirmed
        assert got.handoff_id
        for ask in (client.retrieve, client.release):
            with pytest.raises(HandedOff) as answer:
                ask("tab-1")
            assert answer.value.code == "handed_off"
        info = only(client, "tab-1")
        assert info.state == "handed_off"
        assert info.handoff_id == got.handoff_id
        assert info.buffered_bytes == 0
    finally:
        os.close(got.fd)


def test_released_tombstone(holder: HolderProcess, pty_children) -> None:
    """Incident: a session the user closed (released) was later reported as `unknown`
    (or handed off), so the app could not tell a closed tab from a lost one. A released
    session answers `released` for retrieve and release, and is listed as released."""
    client = holder.client()
    escrow(client, "tab-1", sleeper(pty_children))
    client.release("tab-1")
    for ask in (client.retrieve, client.release):
        with pytest.raises(Released) as answer:
            ask("tab-1")
        assert answer.value.code == "released"
    assert only(client, "tab-1").state == "released"


def test_deposit_of_a_live_id_is_refused(holder: HolderProcess, pty_children) -> None:
    """Incident: a second app instance deposited a session under an id still escrowed by
    the first, silently replacing it; the first shell's master leaked in the holder and its
    output was lost. A live id (held or draining) answers `exists` and the live session is
    left as it was."""
    client = holder.client()
    first, second, third = (sleeper(pty_children) for _ in range(3))
    with client.custody() as custody:
        custody.deposit("held-1", first.master, child_pid=first.pid)
        with pytest.raises(SessionExists) as refused:
            client.hand_off("held-1", second.master, child_pid=second.pid)
        assert refused.value.code == "exists"
        info = only(client, "held-1")
        assert info.state == "held" and info.child_pid == first.pid
    escrow(client, "draining-1", third)
    with pytest.raises(SessionExists):
        client.hand_off("draining-1", second.master, child_pid=second.pid)
    info = only(client, "draining-1")
    assert info.state == "draining" and info.child_pid == third.pid
    assert only(client, "held-1").state == "draining"


def test_deposit_may_reuse_a_tombstone_id(holder: HolderProcess, pty_children) -> None:
    """Incident: a relaunched app reuses its session ids (tab-1, tab-2, ...); the holder
    refused to escrow a new tab-1 because an old, handed-off tab-1 tombstone existed. A
    tombstone's id may be deposited again, and then the live session is the only entry."""
    client = holder.client()
    old, new = sleeper(pty_children), sleeper(pty_children)
    escrow(client, "tab-1", old)
    got = client.retrieve("tab-1")
    os.close(got.fd)
    assert only(client, "tab-1").state == "handed_off"
    escrow(client, "tab-1", new)
    info = only(client, "tab-1")
    assert info.state == "draining"
    assert info.child_pid == new.pid
    assert info.handoff_id is None
    again = client.retrieve("tab-1")
    try:
        assert again.session.child_pid == new.pid
        assert again.handoff_id != got.handoff_id
    finally:
        os.close(again.fd)


async def test_tombstones_are_evicted_oldest_first() -> None:
    """Incident pinned (issue 9, item 8): past the tombstone limit the holder forgot the
    session that had *just* ended, so an app asking about it a moment later was told
    `unknown` (never seen) instead of `released`, while tombstones of long ago stayed.
    Eviction goes oldest first: release a, b, c under a limit of two, and a is forgotten
    (`unknown`: no tombstone, not listed) while b and c still answer `released`.

    The holder has no flag for the limit, so the registry is driven in-process, with real
    sessions on real PTYs."""
    registry = Registry(max_sessions=8, ring_bytes=MiB, total_ring_bytes=8 * MiB,
                        max_tombstones=2)
    ptys = [os.openpty() for _ in range(3)]
    try:
        for sid, (master, _) in zip("abc", ptys, strict=True):
            session = Session(OWNER, protocol.Deposit(id=sid), os.dup(master),
                              registry.new_ring(), custodian=None, custodian_pid=None,
                              child_start_time=None)
            registry.add(session)
            registry.bury(session, "released", "release from the test")
        assert registry.tombstone(OWNER, "a") is None
        for sid in "bc":
            tomb = registry.tombstone(OWNER, sid)
            assert tomb is not None and tomb.state == "released", (sid, tomb)
        assert sorted((s.id, s.state) for s in registry.sessions(OWNER)) == [
            ("b", "released"), ("c", "released")]
    finally:
        for master, slave in ptys:
            os.close(master)
            os.close(slave)


def test_client_timeout_must_exceed_holder_budget(holder: HolderProcess, pty_children) -> None:
    """Incident: an app with a short retrieve timeout gave up while the holder was still
    legitimately stopping the drain and sending, then retried and raced its own first
    handoff. Against a default holder (drain_stop_budget 3 s + send_deadline 1 s), a client
    timeout of 3 s or exactly 4 s is a configuration error raised before any retrieve is
    sent: the session stays draining and the holder never starts a handoff."""
    client = holder.client()
    escrow(client, "tab-1", sleeper(pty_children))
    for timeout in (3.0, 4.0):
        short = holder.client(timeout=timeout)
        with pytest.raises(EscrowConfigError) as refused:
            short.retrieve("tab-1")
        assert refused.value.code == "config"
        assert "drain_stop_budget" in str(refused.value)
    assert only(client, "tab-1").state == "draining"
    assert "state=handing_off" not in holder.logs(), "a retrieve reached the holder"
    # The same request with the default timeout does reach it (so the check above can fail).
    got = client.retrieve("tab-1")
    os.close(got.fd)
    assert "state=handing_off" in holder.logs()
    assert only(client, "tab-1").state == "handed_off"


def test_small_holder_budget_allows_a_short_client_timeout(make_holder, pty_children) -> None:
    """Incident: the timeout check was hard-coded to the default budget, so a holder tuned
    for fast handoffs still refused short client timeouts. The check follows the holder's
    own `welcome`: drain_stop_budget 0.5 + send_deadline 0.2 accepts 1.0 and refuses 0.7."""
    holder: HolderProcess = make_holder("--drain-stop-budget", "0.5", "--send-deadline", "0.2")
    client = holder.client(timeout=1.0)
    escrow(client, "tab-1", sleeper(pty_children))
    with pytest.raises(EscrowConfigError):
        holder.client(timeout=0.7).retrieve("tab-1")
    assert only(client, "tab-1").state == "draining"
    got = client.retrieve("tab-1")
    try:
        assert got.confirmed
    finally:
        os.close(got.fd)


def test_welcome_states_budgets_and_limits(make_holder) -> None:
    """Incident: an app in another language computed its retrieve timeout from a stale
    guess of the holder's budget. `welcome` must state the holder's real version, pid,
    budgets, deadlines and limits, following its command line."""
    default: HolderProcess = make_holder()
    w = default.client().welcome()
    assert w.version == protocol.VERSION == 1
    assert w.holder_version == escrowd.__version__
    assert w.pid == default.pid
    assert (w.drain_stop_budget, w.send_deadline, w.ack_deadline) == (3.0, 1.0, 10.0)
    assert w.limits["ring_bytes"] == 1 * MiB
    assert w.limits["total_ring_bytes"] == 512 * MiB
    assert w.limits["max_sessions"] == 2048

    tuned: HolderProcess = make_holder(
        "--drain-stop-budget", "0.5", "--send-deadline", "0.2", "--ack-deadline", "7",
        "--ring-bytes", "65536", "--max-sessions", "3",
    )
    w = tuned.client().welcome()
    assert w.pid == tuned.pid
    assert (w.drain_stop_budget, w.send_deadline, w.ack_deadline) == (0.5, 0.2, 7.0)
    assert w.limits["ring_bytes"] == 65536
    assert w.limits["max_sessions"] == 3
