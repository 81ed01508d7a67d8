"""`Session.pull`, the drain's read loop, on real PTYs (no holder process).

What it must keep while being fast: each read is bounded by FIONREAD, so it returns even when
someone cleared O_NONBLOCK on the shared open file description; one call reads at most its
slice (plus one read), so a fast child cannot starve the event loop; and after a hangup every
byte written before it is in the ring first (drain, then mark).

The drain loop around it (`Session.start_drain`, under trio in this process) keeps two more:
`exited` is set only once the whole tail is in the ring, and a surprise from one read is
logged and retried, never the end of draining.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tty
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio

from escrow_client.protocol import Deposit
from escrowd.ring import Ring, RingBudget
from escrowd.session import Session

MAX_PTY_READ = 4096  # a Linux pty master never returns more than its line buffer


def session_on(master: int, limit: int = 1 << 20, ring: Ring | None = None,
               kind: type[Session] = Session) -> Session:
    ring = ring or Ring(limit, RingBudget(1 << 30))
    return kind("bench.pull", Deposit(id="s"), master, ring, custodian=None,
                custodian_pid=None, child_start_time=None)


@contextmanager
def raw_pty() -> Iterator[tuple[int, int]]:
    master, slave = os.openpty()
    tty.setraw(slave)
    try:
        yield master, slave
    finally:
        for fd in (master, slave):
            try:
                os.close(fd)
            except OSError:
                pass


@contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Fail instead of hanging if a read blocks."""
    def fire(*_: object) -> None:
        raise TimeoutError("a read blocked")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_one_pull_reads_at_most_its_slice_from_a_fast_child() -> None:
    total, slice_ = 2 << 20, 32 * 1024
    with raw_pty() as (master, slave):
        os.set_blocking(master, False)
        writer = subprocess.Popen(
            [sys.executable, "-c", f"import os; os.write(1, b'x' * {total})"], stdout=slave)
        os.close(slave)
        session = session_on(master)
        ring = session.ring
        got, pulls = 0, 0
        with alarm(30):
            while True:
                before = ring.size + ring.dropped
                hung_up = session.pull(overwrite=True, at_most=slice_)
                read = ring.size + ring.dropped - before
                assert read <= slice_ - 1 + MAX_PTY_READ, read
                got += read
                pulls += 1
                if hung_up:
                    break
        assert writer.wait() == 0
        assert got == total
        assert pulls >= total // (slice_ + MAX_PTY_READ)


def test_reads_stay_bounded_when_o_nonblock_was_cleared() -> None:
    with raw_pty() as (master, slave):
        fcntl.fcntl(master, fcntl.F_SETFL, fcntl.fcntl(master, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        session = session_on(master)
        with alarm(5):
            assert session.pull(overwrite=True) is False  # nothing there: returns at once
            os.write(slave, b"a" * 3000)
            assert session.pull(overwrite=True) is False
            assert session.pull(overwrite=False) is False
        assert session.ring.contents() == b"a" * 3000


def test_the_tail_is_in_the_ring_before_the_hangup_is_reported() -> None:
    with raw_pty() as (master, slave):
        os.set_blocking(master, False)
        tail = bytes(range(256)) * 40
        os.write(slave, tail)
        os.close(slave)
        session = session_on(master)
        with alarm(5):
            assert session.pull(overwrite=True) is True
        assert session.hung_up
        assert session.ring.contents() == tail


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_small_ring_keeps_order(overwrite: bool) -> None:
    """Overwrite keeps the newest bytes; the sweep fills free space and leaves the rest."""
    limit = 16 * 1024
    data = bytes(i % 251 for i in range(limit + 5000))
    with raw_pty() as (master, slave):
        os.set_blocking(master, False)
        os.set_blocking(slave, False)
        session = session_on(master, limit)
        written = 0
        with alarm(10):
            while written < len(data):
                try:
                    written += os.write(slave, data[written : written + 4096])
                except BlockingIOError:
                    pass
                session.pull(overwrite=overwrite)
                if not overwrite and session.ring.size == limit:
                    break
        ring = session.ring
        if overwrite:
            assert ring.contents() == data[-limit:]
            assert ring.dropped == len(data) - limit
        else:
            assert ring.contents() == data[:limit]
            assert ring.dropped == 0
            rest = b""
            with alarm(5):
                while True:
                    try:
                        rest += os.read(master, 65536)
                    except BlockingIOError:
                        break
            assert rest == data[limit:written]  # in order, none lost, none twice


def test_a_master_in_packet_mode_does_not_spin() -> None:
    """Incident: an app had put its master in packet mode (TIOCPKT). Every read returns a
    header byte FIONREAD does not count, so reading exactly FIONREAD left one byte behind
    and then returned only NUL headers, forever: the holder spun, and the ring filled with
    NULs that pushed the real output out. Reads ask for one more than FIONREAD."""
    tiocpkt = 0x5420
    with raw_pty() as (master, slave):
        fcntl.ioctl(master, tiocpkt, b"\1\0\0\0")
        os.set_blocking(master, False)
        session = session_on(master)
        os.write(slave, b"hello world\n")
        with alarm(5.0):
            for _ in range(20):  # twenty wake-ups' worth of pulls: nothing more to read
                session.pull(overwrite=True, at_most=256 * 1024)
        replay = session.ring.contents()
        assert replay.replace(b"\0", b"") == b"hello world\n"
        assert len(replay) <= len(b"hello world\n") + 4, replay  # a header per read, no more
        assert session.ring.dropped == 0


# --- the drain task ---------------------------------------------------------------------------


class WatchedSession(Session):
    """Notes, at every state change, how many bytes the ring had taken in by then."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.seen: list[tuple[str, int]] = []
        super().__init__(*args, **kwargs)

    def set_state(self, state: str, reason: str) -> None:
        self.seen.append((state, self.ring.size + self.ring.dropped))
        super().set_state(state, reason)


async def until(condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Poll `condition` under a deadline, letting the drain task run meanwhile."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.001)


TAIL = bytes(i % 251 for i in range(300_000))  # more than the tty buffers and a slice


@pytest.mark.parametrize("how", ["written_then_closed", "child_writing_then_exiting"])
async def test_exited_is_set_only_with_the_whole_tail_in_the_ring(how: str) -> None:
    """Incident pinned (issue 9, item 5): a build printed its last lines and exited while
    its app restarted; the session was marked `exited` when the hang-up was first seen, with
    the tail still in the kernel, and an app that took `exited` to mean "all output is in"
    showed it cut short. Sampling `list()` cannot see that order (the window is tiny), so
    it is asserted where it happens: at the moment the state becomes `exited`, the ring has
    taken in every byte the child wrote."""
    with raw_pty() as (master, slave):
        if how == "written_then_closed":
            tail = TAIL[:3000]  # fits the tty buffer: all of it waits for the drain
            os.write(slave, tail)
            writer = None
        else:
            tail = TAIL
            writer = subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.stdout.buffer.write("
                 "bytes(i % 251 for i in range(300_000)))"], stdout=slave)
        os.close(slave)
        session = session_on(os.dup(master), kind=WatchedSession)
        assert isinstance(session, WatchedSession)
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            await until(lambda: session.state == "exited", "exited")
            await session.stop_drain()
        if writer is not None:
            assert writer.wait(10) == 0
        assert session.seen[-1] == ("exited", len(tail))
        assert session.ring.contents() == tail
        session.close()


class FaultyOnce(Ring):
    """A ring whose first read raises, as an unforeseen error in the drain would."""

    faults = 0

    def read_from(self, fd: int, at_most: int, overwrite: bool) -> int:
        if not self.faults:
            self.faults += 1
            raise RuntimeError("injected fault")
        return super().read_from(fd, at_most, overwrite)


async def test_a_fault_in_the_drain_is_logged_and_draining_goes_on(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Incident pinned (issue 9, item 13): one terminal's unexpected error must neither take
    the holder down nor end that session's drain (its child would block on a full terminal
    once the kernel buffer filled). The drain logs `internal_error`, pauses, and reads on:
    every byte arrives, the fault counted once."""
    with raw_pty() as (master, slave):
        ring = FaultyOnce(1 << 20, RingBudget(1 << 30))
        session = session_on(os.dup(master), ring=ring)
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            os.write(slave, b"first\n")
            await until(lambda: ring.faults == 1, "the fault")
            os.write(slave, b"second\n")
            await until(lambda: ring.contents() == b"first\nsecond\n", "both lines drained")
            assert session.state == "draining"
            await session.stop_drain()
        session.close()
    logged = [line for line in capfd.readouterr().err.splitlines()
              if " event=internal_error " in line]
    assert len(logged) == 1 and "where=drain" in logged[0] and "injected fault" in logged[0]
