"""`Session.pull`, the drain's read loop, on real PTYs (no holder process).

What it must keep while being fast: each read is bounded by FIONREAD, so it returns even when
someone cleared O_NONBLOCK on the shared open file description; one call reads at most its
slice (plus one read), so a fast child cannot starve the event loop; and after a hangup every
byte written before it is in the ring first (drain, then mark).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tty
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from escrow_client.protocol import Deposit
from escrowd.ring import Ring, RingBudget
from escrowd.session import Session

MAX_PTY_READ = 4096  # a Linux pty master never returns more than its line buffer


def session_on(master: int, limit: int = 1 << 20) -> Session:
    return Session("bench.pull", Deposit(id="s"), master, Ring(limit, RingBudget(1 << 30)),
                   custodian=None, custodian_pid=None, child_start_time=None)


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
