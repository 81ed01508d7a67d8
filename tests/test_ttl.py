"""`--unclaimed-ttl`: sessions nobody reclaimed are released after a while (docs/design.md §6), and
only those: a session its app still holds is never expired, and 0 turns expiry off."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import Expired

TTL = "0.5"
TICKS = ["sh", "-c", 'i=0; while :; do i=$((i+1)); echo "T$i"; sleep 0.05; done']


def _state(holder: HolderProcess, sid: str) -> str:
    states = {s.id: s.state for s in holder.client().list()}
    return states.get(sid, "unknown")


def _stays(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll `condition` for `seconds` and fail the moment it is false."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert condition(), f"{what} stopped holding"
        time.sleep(0.01)


def _state_lines(holder: HolderProcess, sid: str) -> list[str]:
    return [line for line in holder.log_lines("state") if f" session={OWNER}/{sid} " in line]


def test_unclaimed_draining_session_expires(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: sessions whose app never came back were kept (fd, ring and child)
    forever. With a short TTL a draining session becomes an `expired` tombstone, logged with
    its owner/id and the reason, its fd is closed, and a late retrieve answers Expired."""
    holder = make_holder("--unclaimed-ttl", TTL)
    kid = pty_children(TICKS)
    client = holder.client()
    client.hand_off("tab", kid.master, child_pid=kid.pid)
    wait_for(lambda: _state(holder, "tab") == "expired", what="the session to expire")
    expired = [line for line in _state_lines(holder, "tab") if " state=expired " in line]
    assert len(expired) == 1, holder.logs()
    assert "unclaimed for 0.5s" in expired[0]
    holder.wait_fds_at_baseline()  # the holder closed its copy of the master
    with pytest.raises(Expired) as exc:
        client.retrieve("tab")
    assert exc.value.code == "expired"
    assert exc.value.session_id == "tab"


def test_held_session_never_expires(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: the TTL must count from the end of custody, not from the deposit. A
    session whose app still holds it (custody open) stays `held` however long it waits;
    when custody ends it drains like any other (not expired on the spot)."""
    holder = make_holder("--unclaimed-ttl", TTL)
    kid = pty_children(TICKS)
    client = holder.client()
    custody = client.custody()
    try:
        custody.deposit("tab", kid.master, child_pid=kid.pid)
        _stays(lambda: _state(holder, "tab") == "held", 1.5, "held with custody open")
    finally:
        custody.close()
    assert _state(holder, "tab") == "draining"  # 3× the TTL after the deposit, yet not expired
    wait_for(lambda: _state(holder, "tab") == "expired", what="expiry once unclaimed")


def test_ttl_zero_disables_expiry(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: `--unclaimed-ttl 0` is documented as "never"; it must not mean
    "at once". A draining session stays draining."""
    holder = make_holder("--unclaimed-ttl", "0")
    kid = pty_children(TICKS)
    holder.client().hand_off("tab", kid.master, child_pid=kid.pid)
    _stays(lambda: _state(holder, "tab") == "draining", 1.5, "draining with the TTL off")
    assert not [line for line in _state_lines(holder, "tab") if " state=expired " in line]


def test_exited_session_expires_too(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: a session whose child had exited (terminal hung up, tail kept) was
    kept forever because the TTL only looked at `draining`. It goes exited, then expired,
    and the holder lets go of its fd."""
    holder = make_holder("--unclaimed-ttl", TTL)
    kid = pty_children(["sh", "-c", "echo bye"])
    kid.proc.wait()
    holder.client().hand_off("tab", kid.master, child_pid=kid.pid)
    wait_for(lambda: _state(holder, "tab") == "expired", what="the exited session to expire")
    states = [line.split(" state=")[1].split()[0] for line in _state_lines(holder, "tab")]
    assert states == ["held", "draining", "exited", "expired"], states
    holder.wait_fds_at_baseline()
