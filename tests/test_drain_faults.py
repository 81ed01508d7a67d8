"""The drain loop (escrowd.drain) under faults that are not the terminal's: no fd left for
its readiness set, an fd closed while in the set (and its number reused), a terminal that
rests while others keep the loop busy, a sweep's read that fails with no hangup.

Real PTYs and, where it matters, a real holder at its fd limit. Counts, never times: a
stale entry in the set is a spin, seen as the number of times the loop asks the set in an
idle second (millions against a handful).
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import subprocess
import sys
from collections.abc import Callable

import pytest
import trio
from test_drain_loop import many_ptys
from test_pull import session_on, until

from conftest import OWNER, HolderProcess, fd_count, wait_for
from escrow_client import protocol
from escrowd import readiness
from escrowd.ring import Ring, RingBudget


@pytest.fixture
def asks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[n]: how many times the loop has asked its readiness set for ready fds."""
    count = [0]
    ready = readiness.Readiness.ready

    def counted(self: readiness.Readiness, at_most: int) -> list[int]:
        count[0] += 1
        return ready(self, at_most)

    monkeypatch.setattr(readiness.Readiness, "ready", counted)
    return count


async def asks_in_an_idle_second(asks: list[int]) -> int:
    before = asks[0]
    await trio.sleep(1.0)  # a second of nothing happening is what is measured
    return asks[0] - before


@pytest.mark.parametrize("reused_by", ["nothing", "a socket", "another session"])
async def test_an_fd_closed_in_the_set_is_no_spin_and_no_other_file_is_read(
    reused_by: str, asks: list[int], logged: Callable[[str], bool]
) -> None:
    """A session's fd is closed under the loop (a bug elsewhere in the holder), its open
    file kept alive by a dup (the app's, the keeper's): epoll keeps the entry, which no
    number can name again, ready for as long as the terminal has bytes. It was a spin (2.5
    million asks in 2 s); a socket that got the number had its requests read into the
    session's ring. Now the set is rebuilt at the first surprise, without that entry: the
    loop is idle again, the socket's later bytes stay on it, another session that got the
    number drains its own terminal, and the first stays draining (nothing proves its
    terminal hung up), logged as lost."""
    with many_ptys(3) as ptys:
        lost = session_on(os.dup(ptys[0][0]))
        other = session_on(os.dup(ptys[1][0]))
        async with trio.open_nursery() as nursery:
            for session in (lost, other):
                session.start_drain(nursery, "custodian gone")
            number = lost.fd
            os.close(lost.fd)  # under the loop's feet
            sockets = reused = None
            if reused_by == "a socket":
                sockets = socket.socketpair()
                assert sockets[0].fileno() == number
                sockets[0].setblocking(False)  # as trio's are
            elif reused_by == "another session":
                reused = session_on(os.dup(ptys[2][0]))
                assert reused.fd == number
                reused.start_drain(nursery, "custodian gone")
            os.write(ptys[0][1], b"into a closed fd\n")
            await until(lambda: logged("event=drain_lost"), "the loop to see it")
            if sockets is not None:
                sockets[1].send(b"a request")
            if reused is not None:
                os.write(ptys[2][1], b"its own line\n")
                await until(lambda: reused.ring.contents() == b"its own line\n", "its line")
            os.write(ptys[1][1], b"still draining\n")
            await until(lambda: other.ring.contents() == b"still draining\n", "the other")
            assert await asks_in_an_idle_second(asks) <= 10
            if sockets is not None:
                assert sockets[0].recv(100) == b"a request"
                for each in sockets:
                    each.close()
            assert b"request" not in lost.ring.contents()
            assert lost.state == "draining"
            for session in (lost, other, reused):
                if session is not None:
                    await session.stop_drain()
        lost.fd = -1  # (closed above)
        for session in (lost, other, reused):
            if session is not None:
                session.close()


@pytest.fixture
def logged(capfd: pytest.CaptureFixture[str]) -> Callable[[str], bool]:
    """logged(text): whether the log (stderr) has said `text` in this test."""
    seen: list[str] = []

    def said(text: str) -> bool:
        seen.append(capfd.readouterr().err)
        sys.stderr.write(seen[-1])  # (kept for the report)
        return text in "".join(seen)

    return said


# --- no fd left for the readiness set -------------------------------------------------------

APP = """
import os, subprocess, sys, time, tty
from escrow_client import EscrowClient
master, slave = os.openpty()
tty.setraw(slave)
child = subprocess.Popen(["sh", "-c", "head -c 1 >/dev/null; exec yes"], stdin=slave,
                         stdout=slave, stderr=slave, start_new_session=True)
os.close(slave)
custody = EscrowClient(sys.argv[2], socket_path=sys.argv[1]).custody()
custody.deposit("tab", master, child_pid=child.pid)
os.write(master, b"g")
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_custody_that_ends_at_the_fd_limit_drains(holder: HolderProcess) -> None:
    """Incident pinned: with no session draining there was no readiness set, so the next
    drain made one, and at the holder's fd limit that failed after O_NONBLOCK was set and
    before the state changed: an app that crashed then left its session `held` with no
    custodian and no reader, its child blocked for good (`retrieve` answered custody_held).
    The set is made as the holder starts and kept: a drain needs no fd."""
    app = subprocess.Popen([sys.executable, "-c", APP, holder.socket, OWNER],
                           stdout=subprocess.PIPE)
    child_pid = 0
    try:
        assert app.stdout is not None
        child_pid = int(app.stdout.readline())
        client = holder.client()
        wait_for(lambda: [s.state for s in client.list()] == ["held"], 10.0, "the deposit")
        limits = resource.prlimit(holder.pid, resource.RLIMIT_NOFILE)
        # One under what it holds: the app's connection, closed as the custody ends, frees
        # no room either.
        resource.prlimit(holder.pid, resource.RLIMIT_NOFILE,
                         (fd_count(holder.pid) - 1, limits[1]))
        try:
            app.kill()  # the app crashes: its custody ends, at the limit
            app.wait()
            wait_for(lambda: "state=draining" in holder.logs(), 10.0, "the drain")
        finally:
            resource.prlimit(holder.pid, resource.RLIMIT_NOFILE, limits)

        (info,) = client.list()
        assert info.state == "draining"
        drained = info.buffered_bytes + info.dropped_bytes
        wait_for(lambda: sum(s.buffered_bytes + s.dropped_bytes for s in client.list())
                 > drained, 10.0, "the child's output to go on coming")
    finally:
        app.kill()
        app.wait()
        if app.stdout is not None:
            app.stdout.close()
        if child_pid:
            os.kill(child_pid, 9)


async def test_a_drain_that_cannot_have_its_set_rests_and_comes_back() -> None:
    """With no set made yet (a trio run that has not prepared one) and no fd to make it,
    `start_drain` does not raise: the session is draining, its reader rests, and once an
    fd is to be had it is read."""
    with many_ptys(1) as ptys:
        session = session_on(os.dup(ptys[0][0]))
        os.write(ptys[0][1], b"written before\n")
        limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        async with trio.open_nursery() as nursery:
            lowest_free = os.dup(0)
            os.close(lowest_free)
            # (a limit is on fd numbers: none at or over it can be made)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, limits[1]))
            try:
                session.start_drain(nursery, "custodian gone")
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            assert session.state == "draining" and session.has_drain()
            await until(lambda: session.ring.contents() == b"written before\n", "the bytes")
            await session.stop_drain()
        session.close()


# --- the sweep before a handoff -------------------------------------------------------------


def test_a_sweep_read_that_fails_otherwise_is_no_hangup(logged: Callable[[str], bool]) -> None:
    """The sweep before a handoff took any failed read for a hangup: a session whose fd
    failed EBADF went back `exited`, with no drain. Only EIO is a hangup now; anything
    else is logged, and the session is as it was."""
    with many_ptys(1) as ptys:
        session = session_on(os.dup(ptys[0][0]))
        os.write(ptys[0][1], b"still to come\n")
        number = session.fd
        os.close(number)  # under the sweep's feet
        assert session.pull(False) is False
        assert not session.hung_up
        assert logged("errno=EBADF")
        session.fd = -1
        session.close()


# --- a deposit that resumes custody, its answer lost ----------------------------------------


def test_a_resumed_custody_whose_answer_cannot_be_sent_closes_its_fd_once(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """A deposit that takes back custody of a session the restarted holder adopted closes
    the deposited fd (the holder has the terminal already), and then, when its answer could
    not be sent (the app gone at once), closed the same number again: by then it may be a
    journal's fd or a draining master (the connection ended on EBADF where nothing else
    had the number). It is closed once."""
    from rawclient import RawClient
    from test_survive import kill_serving_holder

    holder = make_holder(keeper=True)
    master, slave = os.openpty()
    kid = subprocess.Popen(["sleep", "600"], stdin=slave, stdout=slave, stderr=slave,
                           start_new_session=True)
    try:
        first = RawClient(holder.socket)
        first.hello()
        first.send(protocol.Deposit(id="tab", child_pid=kid.pid), fd=master)
        assert isinstance(first.receive()[0], protocol.Deposited)
        kill_serving_holder(holder)
        client = holder.client()
        wait_for(lambda: [s.state for s in client.list()] == ["held"], 10.0, "adopted, held")
        again = RawClient(holder.socket)
        again.hello()
        # Gone at once, with a reset: the answer to the deposit cannot be sent.
        again.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        again.send(protocol.Deposit(id="tab", child_pid=kid.pid), fd=master)
        again.sock.close()
        wait_for(lambda: holder.log_lines("custody"), 10.0, "the custody resumed")
        wait_for(lambda: [s.state for s in client.list()] == ["draining"], 10.0,
                 "the custody's end with its connection, and the drain")
        assert not [line for line in holder.log_lines("conn_error") if "EBADF" in line], \
            holder.logs()
        first.sock.close()
    finally:
        kid.kill()
        kid.wait()
        os.close(master)
        os.close(slave)


# --- a resting terminal while the loop is busy ----------------------------------------------


class Endless(Ring):
    """A ring whose read takes nothing out of the terminal: its pending bytes stay, and it
    is ready at every ask, as a terminal with endless output is."""

    __slots__ = ()

    def read_from(self, fd: int, at_most: int, overwrite: bool) -> int:
        return 1


class FaultsOnce(Ring):
    """A ring whose first read raises: the terminal rests, and then is read as any other."""

    __slots__ = ("faulted",)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.faulted = False

    def read_from(self, fd: int, at_most: int, overwrite: bool) -> int:
        if not self.faulted:
            self.faulted = True
            raise RuntimeError("one surprise")
        return super().read_from(fd, at_most, overwrite)


async def test_a_resting_terminal_comes_back_while_the_loop_stays_busy() -> None:
    """A terminal that rests after a surprise was woken only when the loop waited, and a
    loop with 64 terminals ready at every ask never waits (each turn of 64 reads ends in a
    checkpoint): it rested for as long as they had output. It is read again once due."""
    with many_ptys(65) as ptys:
        quiet = session_on(os.dup(ptys[0][0]), ring=FaultsOnce(1 << 20, RingBudget(1 << 30)))
        busy = [session_on(os.dup(master), ring=Endless(1 << 16, RingBudget(1 << 30)))
                for master, _ in ptys[1:]]
        async with trio.open_nursery() as nursery:
            quiet.start_drain(nursery, "custodian gone")
            os.write(ptys[0][1], b"first\n")
            assert isinstance(quiet.ring, FaultsOnce)
            ring = quiet.ring
            await until(lambda: ring.faulted, "the surprise")
            for session, (_, slave) in zip(busy, ptys[1:], strict=True):
                os.write(slave, b"pending")
                session.start_drain(nursery, "custodian gone")
            await until(lambda: quiet.ring.contents() == b"first\n",
                        "the resting terminal read again, the others busy all along")
            for session in (quiet, *busy):
                await session.stop_drain()
        for session in (quiet, *busy):
            session.close()
