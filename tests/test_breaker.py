"""The circuit breaker (docs/design.md §4): a wedged holder costs an app
one timeout, not one per session, and nothing escrowed is lost.

A wedged holder is a real holder stopped with SIGSTOP: the kernel still accepts connections
into its listen backlog and queues requests, but nothing answers. Every test resumes it in a
`finally`. The number of timeouts paid is counted with `breaker.timeouts_paid` and with
`HolderUnresponsive.timed_out` (True only where a deadline really passed); wall time is only
printed.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import OWNER, HolderProcess, PtyChild, start_holder, wait_for
from escrow_client import (
    EscrowClient,
    EscrowError,
    HolderUnavailable,
    HolderUnresponsive,
    ReclaimReport,
    Retrieved,
    SessionUnknown,
    breaker,
    protocol,
)
from escrow_client.channel import Channel, Deadline

# Budgets small enough that a 1 s client timeout passes the timeout invariant
# (docs/design.md §4, step 2).
FAST_BUDGETS = ("--drain-stop-budget", "0.3", "--send-deadline", "0.3")
CLIENT_TIMEOUT = 1.0
SESSIONS = 5
TICKS = ["sh", "-c", 'i=0; while :; do i=$((i+1)); echo "T$i"; sleep 0.05; done']


@pytest.fixture(autouse=True)
def fresh_breaker() -> Iterator[None]:
    """The breaker is process-wide: every test starts and ends with it closed."""
    breaker.reset()
    yield
    breaker.reset()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _wedge(holder: HolderProcess) -> None:
    os.kill(holder.pid, signal.SIGSTOP)
    wait_for(lambda: _stopped(holder.pid), what="holder stopped")


def _resume(holder: HolderProcess) -> None:
    os.kill(holder.pid, signal.SIGCONT)


def _states(holder: HolderProcess) -> dict[str, str]:
    return {s.id: s.state for s in holder.client().list()}


def _hand_off_tickers(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> dict[str, PtyChild]:
    """SESSIONS draining sessions, each a shell printing T1, T2, ... every 50 ms."""
    client = holder.client()
    kids = {f"tab-{n}": pty_children(TICKS) for n in range(SESSIONS)}
    for sid, kid in kids.items():
        client.hand_off(sid, kid.master, child_pid=kid.pid)
    wait_for(lambda: _states(holder) == dict.fromkeys(kids, "draining"), what="all draining")
    return kids


def _read_until(fd: int, data: bytes, last: int, timeout: float = 10.0) -> bytes:
    """Append what `fd` gives to `data` until a complete line T<n> with n >= last is in it."""
    out = bytearray(data)
    deadline = time.monotonic() + timeout
    while not any(int(n) >= last for n in re.findall(rb"T(\d+)\r?\n", out)):
        left = deadline - time.monotonic()
        assert left > 0, f"no line T{last} within {timeout}s; got {bytes(out[-200:])!r}"
        ready, _, _ = select.select([fd], [], [], min(left, 0.2))
        if ready:
            out += os.read(fd, 65536)
    return bytes(out)


def _assert_all_reclaimed_contiguous(
    report: ReclaimReport, kids: dict[str, PtyChild]
) -> None:
    """Every session came back confirmed, same child, and replay + what the fd gives next is
    T1, T2, ... with no gap and no line twice: nothing was lost or duplicated by the wedge,
    the failed calls, or a handoff whose send failed while the holder was stopped."""
    assert report.failed == {}
    assert sorted(report.retrieved) == sorted(kids)
    for sid, got in report.retrieved.items():
        assert got.confirmed, sid
        assert got.session.child_pid == kids[sid].pid
        replayed = [int(n) for n in re.findall(rb"T(\d+)\r?\n", got.replay)]
        assert replayed, f"{sid}: empty replay"
        data = _read_until(got.fd, got.replay, replayed[-1] + 3)
        numbers = [int(n) for n in re.findall(rb"T(\d+)\r?\n", data)]
        assert numbers == list(range(1, len(numbers) + 1)), f"{sid}: {numbers}"


def _close_all(report: ReclaimReport | None) -> None:
    if report is not None:
        for got in report.retrieved.values():
            os.close(got.fd)


def test_launch_under_a_wedged_holder_pays_one_timeout(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: an app relaunching against a wedged holder (SIGSTOPped: it accepts
    but never answers) froze its launch for one timeout per call. reclaim_all pays exactly
    one timeout, every later call fails fast with HolderUnresponsive while the breaker is
    open, all five sessions stay escrowed, and once the holder is resumed and the breaker
    closed, reclaim_all takes back all five with contiguous output."""
    holder = make_holder(*FAST_BUDGETS)
    kids = _hand_off_tickers(holder, pty_children)
    client = holder.client(timeout=CLIENT_TIMEOUT)
    report: ReclaimReport | None = None
    _wedge(holder)
    try:
        started = time.monotonic()
        with pytest.raises(HolderUnresponsive) as wedged:
            client.reclaim_all(deadline=8.0)
        took = time.monotonic() - started
        print(f"reclaim_all against wedged holder took {took:.2f} s")
        assert wedged.value.timed_out, "the one timeout paid is a real timeout"
        assert breaker.timeouts_paid(holder.socket) == 1

        # The breaker is open: calls fail fast, without waiting for the holder.
        for call in (client.list, client.status, lambda: client.retrieve("tab-0"),
                     lambda: client.reclaim_all(deadline=8.0)):
            with pytest.raises(HolderUnresponsive) as fast:
                call()
            assert not fast.value.timed_out, f"{fast.value} paid a timeout"
            assert "circuit breaker" in str(fast.value)
        assert breaker.timeouts_paid(holder.socket) == 1
        assert breaker.open_for(holder.socket) is not None
    finally:
        _resume(holder)
    try:
        breaker.reset(holder.socket)
        # Nothing was taken: every session is still escrowed and draining.
        wait_for(lambda: _states(holder) == dict.fromkeys(kids, "draining"),
                 what="all five still draining after the wedge")
        report = client.reclaim_all(deadline=8.0)
        _assert_all_reclaimed_contiguous(report, kids)
        assert breaker.timeouts_paid(holder.socket) == 0
    finally:
        _close_all(report)


class _WedgesAtFirstRetrieve(EscrowClient):
    """An app whose holder wedges between reclaim_all's list and its first retrieve. The
    hook only decides *when* the real holder gets a real SIGSTOP; every call still goes to
    it over the real socket."""

    def __init__(self, holder: HolderProcess, timeout: float) -> None:
        super().__init__(OWNER, socket_path=holder.socket, timeout=timeout)
        self.holder = holder
        self.wedged = False

    def _retrieve_many_on(
        self, channel: Channel, ids: list[str], deadline: Deadline, keep: bool = False,
        journal: bool = False, replay_file: bool = False,
    ) -> tuple[dict[str, Retrieved], dict[str, EscrowError]]:
        if not self.wedged:
            self.wedged = True
            _wedge(self.holder)
        return super()._retrieve_many_on(channel, ids, deadline, keep, journal, replay_file)


def test_holder_wedging_mid_reclaim_costs_one_timeout_not_one_per_session(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: a holder that wedges during reclaim_all cost the launch one timeout
    per session (5 × the client timeout). The list answers, the one `retrieve_many` for all
    five times out (the only timeout paid), and all five are reported in `failed`; all five
    stay escrowed (the queued retrieve, answered to a client that had gone, fails its sends
    and they drain again) and are reclaimed in full, with contiguous output, once the
    holder is resumed."""
    holder = make_holder(*FAST_BUDGETS)
    kids = _hand_off_tickers(holder, pty_children)
    client = _WedgesAtFirstRetrieve(holder, timeout=CLIENT_TIMEOUT)
    final: ReclaimReport | None = None
    try:
        started = time.monotonic()
        report = client.reclaim_all(deadline=8.0)
        took = time.monotonic() - started
        print(f"reclaim_all against a holder wedged after its list took {took:.2f} s")
        assert client.wedged
        assert report.retrieved == {}
        assert sorted(report.failed) == sorted(kids)
        assert all(isinstance(e, HolderUnresponsive) for e in report.failed.values())
        assert all(e.timed_out for e in report.failed.values())  # type: ignore[attr-defined]
        assert took < 2 * CLIENT_TIMEOUT
        assert breaker.timeouts_paid(holder.socket) == 1
    finally:
        _resume(holder)
    try:
        breaker.reset(holder.socket)
        wait_for(lambda: _states(holder) == dict.fromkeys(kids, "draining"),
                 what="all five draining again after the wedge")
        # The retrieve was queued in the stopped holder: on resuming it hands off to a
        # client that has gone, the sends fail, and the sessions drain again
        # (docs/design.md §4, step 6).
        for sid in kids:
            states = [line.split(" state=")[1].split()[0] for line in holder.log_lines("state")
                      if f" session={OWNER}/{sid} " in line]
            assert states[-1] == "draining" and "handed_off" not in states, (sid, states)
        final = holder.client(timeout=CLIENT_TIMEOUT).reclaim_all(deadline=8.0)
        _assert_all_reclaimed_contiguous(final, kids)
    finally:
        _close_all(final)


def test_breaker_closes_after_its_cool_down(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """Incident pinned: a holder that recovered stayed unreachable because the breaker never
    closed. Within the cool-down calls fail fast (no second timeout); after it, the next call
    reaches the resumed holder."""
    holder = make_holder(*FAST_BUDGETS)
    client = holder.client(timeout=0.3, breaker_cooldown=1.5)
    _wedge(holder)
    try:
        with pytest.raises(HolderUnresponsive) as slow:
            client.status()
        assert slow.value.timed_out
    finally:
        _resume(holder)
    with pytest.raises(HolderUnresponsive) as fast:
        client.status()  # resumed, but still inside the cool-down
    assert not fast.value.timed_out

    def reachable() -> bool:
        try:
            return client.status().pid == holder.pid
        except HolderUnresponsive as exc:
            assert not exc.timed_out
            return False

    wait_for(reachable, timeout=5.0, what="the breaker to close after its cool-down")
    assert breaker.timeouts_paid(holder.socket) == 1


def test_refusals_and_error_answers_do_not_open_the_breaker(
    make_holder: Callable[..., HolderProcess], socket_dir: Path
) -> None:
    """Incident pinned: treating every failure as a wedge would lock an app out of a
    holder that had simply answered. Nothing listening (HolderUnavailable) and an error
    answer (SessionUnknown) leave the breaker closed: the next call is really made."""
    nothing = EscrowClient(OWNER, socket_path=str(socket_dir / "none.sock"), timeout=0.5)
    for _ in range(2):  # the second call tries to connect again: refused again, not fast-failed
        with pytest.raises(HolderUnavailable):
            nothing.status()
        assert breaker.open_for(nothing.socket_path) is None
    assert breaker.timeouts_paid(nothing.socket_path) == 0

    holder = make_holder(*FAST_BUDGETS)
    client = holder.client(timeout=CLIENT_TIMEOUT)
    with pytest.raises(SessionUnknown):
        client.retrieve("never-deposited")
    assert breaker.open_for(holder.socket) is None
    assert client.status().pid == holder.pid  # went through to the holder
    assert breaker.timeouts_paid(holder.socket) == 0


def test_a_refused_connection_does_not_open_the_breaker(socket_dir: Path) -> None:
    """Incident pinned (issue 9, item 9): a holder that died leaves its socket file behind,
    bound by nobody, so connecting is refused (ECONNREFUSED), not missing (ENOENT). That is
    an answer, not a wedge: every call is really made and gets HolderUnavailable, and the
    breaker stays shut, so the app can autostart a holder or retry at once."""
    path = str(socket_dir / "bound.sock")
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        bound.bind(path)  # the file exists and nothing listens on it
        client = EscrowClient(OWNER, socket_path=path, timeout=0.5)
        for _ in range(2):
            with pytest.raises(HolderUnavailable, match="Connection refused"):
                client.status()
            assert breaker.open_for(path) is None
        assert breaker.timeouts_paid(path) == 0
    finally:
        bound.close()


def test_a_spent_deadline_does_not_open_the_breaker(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """Incident pinned: a Channel created with no time left (e.g. autostart's wait for a
    holder ran out) opened the breaker for a minute although no call to the holder had
    been made, let alone timed out; the app could not even autostart again."""
    holder = make_holder()
    client = holder.client()
    hello = protocol.Hello(version=protocol.VERSION, owner=OWNER, client="test")
    Channel(holder.socket, hello, Deadline(1.0)).close()  # with time left, the path works
    with pytest.raises(HolderUnresponsive) as exc:
        Channel(holder.socket, hello, Deadline(0.0))
    assert not exc.value.timed_out
    assert breaker.open_for(holder.socket) is None
    assert breaker.timeouts_paid(holder.socket) == 0
    assert client.status().pid == holder.pid


def test_a_new_holder_on_the_path_closes_the_breaker_at_once(socket_dir: Path) -> None:
    """Incident pinned: after a wedged holder was killed and a new one started on the same
    path, the app kept failing fast for the rest of the cool-down. The new holder removes
    the leftover socket and binds a new one (on ext4, often with the *same* inode number),
    and the next call goes straight through."""
    directory = socket_dir / "replaced"
    old = start_holder(directory, *FAST_BUDGETS)
    new: HolderProcess | None = None
    client = old.client(timeout=0.5)  # the default 60 s cool-down
    try:
        _wedge(old)
        with pytest.raises(HolderUnresponsive) as slow:
            client.status()
        assert slow.value.timed_out
        with pytest.raises(HolderUnresponsive) as fast:
            client.status()
        assert not fast.value.timed_out
        old.proc.kill()
        old.proc.wait()
        new = start_holder(directory, *FAST_BUDGETS)
        assert new.socket == old.socket
        assert client.status().pid == new.pid  # no cool-down wait: straight through
        assert breaker.timeouts_paid(old.socket) == 1
    finally:
        try:
            if old.alive():
                _resume(old)
            old.stop()
        finally:
            if new is not None:
                new.stop()


def test_breaker_is_per_socket_path(make_holder: Callable[..., HolderProcess]) -> None:
    """Incident pinned: one wedged holder must not cut an app off from another holder on
    another path. A timeout on path A opens A's breaker only; B answers as before."""
    a = make_holder(*FAST_BUDGETS, name="a")
    b = make_holder(*FAST_BUDGETS, name="b")
    _wedge(a)
    try:
        with pytest.raises(HolderUnresponsive) as slow:
            a.client(timeout=0.3).status()
        assert slow.value.timed_out
        assert breaker.open_for(a.socket) is not None
        assert breaker.open_for(b.socket) is None
        assert b.client(timeout=0.3).status().pid == b.pid
        assert breaker.timeouts_paid(a.socket) == 1
        assert breaker.timeouts_paid(b.socket) == 0
    finally:
        _resume(a)
    breaker.reset(a.socket)  # so the fixture's teardown can release and check a's fds
