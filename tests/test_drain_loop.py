"""The one drain loop (escrowd.drain, docs/design.md §6): what it costs, counted, and what it
keeps while it reads every draining terminal from one task.

Counts, never times: the fds a session holds in a real holder, the system calls a read costs
under a flood (strace on the holder), the tasks that drain. And the guarantees, on real
PTYs: a read never blocks though O_NONBLOCK was cleared on the shared description, a flood
starves no other session, and a terminal that fails, or whose fd is closed under the loop,
leaves every other one draining.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tty
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from test_drain import hand_off_and_go, info_of
from test_pull import alarm, raw_pty, session_on, until

from conftest import HolderProcess, PtyChild, fd_count, require_program, wait_for
from escrow_client import EscrowClient
from escrowd.drain import DrainLoop
from escrowd.ring import Ring, RingBudget

MiB = 1 << 20


@contextlib.contextmanager
def counting_calls(strace: str, pid: int, out: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`strace -c -f` on `pid` while the block runs, its counts in `out` after it."""
    tracer = subprocess.Popen([strace, "-c", "-f", "-o", str(out), "-p", str(pid)],
                              stderr=subprocess.PIPE)
    try:
        assert tracer.stderr is not None
        # strace says on stderr when it has attached (every thread of the holder).
        wait_for(lambda: b"attached" in tracer.stderr.read1(4096), 10.0, "strace to attach")
        yield tracer
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        if tracer.stderr is not None:
            tracer.stderr.close()


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[Callable[[bytes], PtyChild]]:
    """writers(data): a child on a raw PTY that, after one byte of input, writes `data`
    and waits to be killed (its terminal stays open: no hangup), killed at teardown."""
    children: list[PtyChild] = []

    def spawn(data: bytes) -> PtyChild:
        path = tmp_path / f"data{len(children)}"
        path.write_bytes(data)
        child = spawn_raw(["sh", "-c", 'head -c 1 >/dev/null && cat "$0" && exec sleep 600',
                           str(path)])
        children.append(child)
        return child

    yield spawn
    for child in children:
        child.kill()
        if child.master >= 0:
            os.close(child.master)


# --- counted in a real holder ---------------------------------------------------------------


def test_a_draining_session_holds_two_fds(holder: HolderProcess, writers) -> None:
    """A session costs the holder its PTY master and its state file, no more: Python's mmap
    kept a duplicate of the state file's fd for as long as it was mapped (three a session,
    3,000 fds for 1,000 sessions), and the state file is now mapped without one."""
    sessions = 20
    client = holder.client()
    # (Each call's connection closes after it: the base is the holder's own, the drain
    # loop's readiness set among them, made as it started.)
    holder.wait_fds_at_baseline()
    base = holder.baseline_fds
    for i in range(sessions):
        hand_off_and_go(client, f"s{i}", writers(b"x" * 100))
    wait_for(lambda: [s.buffered_bytes for s in client.list()] == [100] * sessions, 10.0,
             "every session drained")
    wait_for(lambda: fd_count(holder.pid) - base <= 2 * sessions, 10.0,
             f"the holder to hold 2 fds a session (it holds {fd_count(holder.pid) - base} "
             f"for {sessions})")
    assert fd_count(holder.pid) - base == 2 * sessions


def strace_counts(output: str) -> dict[str, int]:
    """{system call: calls} from the table `strace -c` writes."""
    counts = {}
    for line in output.splitlines():
        fields = line.split()
        if (len(fields) >= 5 and fields[-1].isidentifier() and fields[3].isdigit()
                and fields[-1] != "total"):
            counts[fields[-1]] = int(fields[3])
    return counts


def test_a_flood_costs_a_read_and_a_share_of_one_epoll_wait_a_read(
    make_holder: Callable[..., HolderProcess], writers, tmp_path
) -> None:
    """16 MiB flooded into one session, every system call of the holder counted (strace -c
    -f). A read was a FIONREAD, a readv and, mostly, a poll for the bytes still in the tty's
    flip buffer: 2.9 calls. Now the loop reads right after its epoll set says an fd is
    ready (the epoll wait is what pushes the flip buffer), so a read costs the readv and a
    share of one epoll wait: no FIONREAD, no poll. Reads are at most 4 KiB (what a Linux
    pty holds for its reader), so there are at least 16 MiB / 4 KiB of them."""
    strace = require_program("strace")
    total = 16 * MiB
    holder = make_holder("--ring-bytes", str(MiB))
    child = writers(b"y" * total)
    client = holder.client()
    out = tmp_path / "strace.txt"
    with counting_calls(strace, holder.pid, out):
        hand_off_and_go(client, "flood", child)
        wait_for(lambda: drained(client, "flood") == total, 120.0, "the flood drained")
    info = info_of(client, "flood")
    assert info.buffered_bytes + info.dropped_bytes == total
    calls = strace_counts(out.read_text())
    reads = calls.get("readv", 0)
    others = {name: calls.get(name, 0) for name in ("ioctl", "poll", "epoll_wait", "epoll_ctl",
                                                    "epoll_pwait")}
    print(f"\n  {reads} reads of {total} B: {others}")
    assert reads >= total // 4097
    assert calls.get("ioctl", 0) + calls.get("poll", 0) <= reads // 20
    # One epoll wait a read at most (the loop's, while one terminal alone is ready), and
    # trio's own at each turn: under 1.25 a read with everything around the drain.
    assert sum(others.values()) <= reads * 1.25, others


def test_an_idle_holder_with_draining_sessions_makes_no_system_call(
    holder: HolderProcess, writers, tmp_path
) -> None:
    """30 sessions draining, all quiet: the holder waits in one epoll wait, whatever the
    number of sessions. A second of strace on it, and one request after it, count the
    request's system calls and no read of a terminal, no wake-up of its own."""
    strace = require_program("strace")
    client = holder.client()
    for i in range(30):
        hand_off_and_go(client, f"s{i}", writers(b"printed once\n"))
    wait_for(lambda: [s.buffered_bytes for s in client.list()] == [13] * 30, 10.0,
             "every session drained")
    out = tmp_path / "strace.txt"
    with counting_calls(strace, holder.pid, out) as tracer:
        # What is measured is a second of nothing happening: no event can end it.
        with contextlib.suppress(subprocess.TimeoutExpired):
            tracer.wait(1.0)
        client.status()  # and then one request, which strace must see: it is tracing
    calls = strace_counts(out.read_text())
    print(f"\n  an idle second, then one request: {calls}")
    assert calls.get("sendmsg", 0) + calls.get("sendto", 0) >= 1, "strace saw nothing"
    assert calls.get("readv", 0) == 0  # no terminal read: none had anything
    assert calls.get("epoll_wait", 0) <= 10, calls  # the request's, no idle wake-up


def test_a_flood_in_one_session_starves_no_other(make_holder: Callable[..., HolderProcess],
                                                 tmp_path) -> None:
    """One child writes as fast as it can, for as long as the test lasts; another writes
    one line once the flood is well under way. That line reaches its ring while the flood
    goes on: each ready terminal gets one read a round."""
    holder = make_holder("--ring-bytes", str(MiB))
    client = holder.client()
    flood = spawn_raw([sys.executable, "-c", "import os\nb = b'z' * 65536\n"
                       "while True: os.write(1, b)"])
    quiet = spawn_raw(["sh", "-c", "head -c 1 >/dev/null && printf 'the quiet line\\n' "
                       "&& exec sleep 60"])
    try:
        client.hand_off("flood", flood.master, child_pid=flood.pid)
        os.close(flood.master)
        flood.master = -1
        talk = os.dup(quiet.master)  # to write to the quiet child later; never read
        client.hand_off("quiet", quiet.master, child_pid=quiet.pid)
        os.close(quiet.master)
        quiet.master = -1
        flooded = wait_for(lambda: drained(client, "flood") >= 8 * MiB and
                           drained(client, "flood"), 60.0, "the flood to be under way")
        os.write(talk, b"g")
        os.close(talk)
        wait_for(lambda: info_of(client, "quiet").buffered_bytes == len(b"the quiet line\n"),
                 10.0, "the quiet line, while the flood goes on")
        assert drained(client, "flood") > flooded
        assert info_of(client, "flood").state == "draining"
    finally:
        for child in (flood, quiet):
            child.kill()


def drained(client: EscrowClient, sid: str) -> int:
    info = info_of(client, sid)
    return info.buffered_bytes + info.dropped_bytes


def spawn_raw(argv: list[str]) -> PtyChild:
    from conftest import _make_controlling_tty

    master, slave = os.openpty()
    tty.setraw(slave)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=_make_controlling_tty, close_fds=True)
    os.close(slave)
    return PtyChild(master, proc)


# --- the loop, in this process --------------------------------------------------------------


async def test_every_draining_session_is_read_by_one_task() -> None:
    """No task a session (one was about 3.8 KB of a session's memory): 30 draining
    sessions are one task in the nursery, which ends once none drains."""
    with many_ptys(30) as ptys:
        sessions = [session_on(os.dup(master)) for master, _ in ptys]
        async with trio.open_nursery() as nursery:
            for session in sessions:
                session.start_drain(nursery, "custodian gone")
            for i, (_, slave) in enumerate(ptys):
                os.write(slave, b"line %d\n" % i)
            await until(lambda: all(s.ring.contents() == b"line %d\n" % i
                                    for i, s in enumerate(sessions)), "every line")
            assert len(nursery.child_tasks) == 1
            for session in sessions:
                await session.stop_drain()
        assert not nursery.child_tasks
        for session in sessions:
            session.close()


async def test_reads_never_block_with_o_nonblock_cleared() -> None:
    """Another process that shares the open file description clears O_NONBLOCK while the
    holder drains: the loop reads only what its epoll set said is there, so no read
    blocks (a blocked read would stop every session, and the holder), and every byte
    arrives, in bursts and in a flood from a child."""
    with raw_pty() as (master, slave):
        session = session_on(os.dup(master))
        with alarm(30):
            async with trio.open_nursery() as nursery:
                session.start_drain(nursery, "custodian gone")
                flags = fcntl.fcntl(master, fcntl.F_GETFL)
                fcntl.fcntl(master, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)  # shared: ours too
                expected = b""
                for burst in range(5):
                    data = bytes([65 + burst]) * (1000 + 700 * burst)
                    os.write(slave, data)
                    expected += data
                    await until(lambda want=expected: session.ring.contents() == want,
                                "the burst")
                writer = subprocess.Popen(
                    [sys.executable, "-c", "import os; os.write(1, b'w' * (2 << 20))"],
                    stdout=slave)
                await until(lambda: writer.poll() is not None
                            and session.ring.total == len(expected) + (2 << 20),
                            "the child's flood", timeout=30)
                assert fcntl.fcntl(master, fcntl.F_GETFL) & os.O_NONBLOCK == 0
                await session.stop_drain()
        session.close()


class AlwaysFaulty(Ring):
    """A ring whose every read raises, as a terminal that keeps surprising the drain."""

    __slots__ = ("faults",)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.faults = 0

    def read_from(self, fd: int, at_most: int, overwrite: bool) -> int:
        self.faults += 1
        raise RuntimeError("injected fault")


async def test_a_failing_terminal_and_one_closed_under_the_loop_leave_the_others_draining(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """One session's every read raises; another's fd is closed under the loop (a bug
    elsewhere in the holder, say); a third floods 1 MiB and then says one more line. The
    third gets every byte; the failing one is logged and tried again after a pause that
    doubles (not at every round: the loop does not spin on it), and so is the closed one
    (EBADF is no proof of a hangup: it stays draining); nothing stops the loop."""
    with many_ptys(3) as ptys:
        faulty = session_on(os.dup(ptys[0][0]), ring=AlwaysFaulty(1 << 20, RingBudget(1 << 30)))
        closed = session_on(os.dup(ptys[1][0]))
        good = session_on(os.dup(ptys[2][0]))
        async with trio.open_nursery() as nursery:
            for session in (faulty, closed, good):
                session.start_drain(nursery, "custodian gone")
            os.write(ptys[0][1], b"never read\n")
            assert isinstance(faulty.ring, AlwaysFaulty)
            ring = faulty.ring
            await until(lambda: ring.faults >= 1, "the first fault")
            os.close(closed.fd)  # under the loop's feet
            os.write(ptys[1][1], b"into a closed fd\n")
            writer = subprocess.Popen(
                [sys.executable, "-c", "import os; os.write(1, b'g' * (1 << 20))"],
                stdout=ptys[2][1])
            await until(lambda: writer.poll() is not None and good.ring.total == 1 << 20,
                        "the flood", timeout=30)
            os.write(ptys[2][1], b"and one more line\n")
            await until(lambda: good.ring.total == (1 << 20) + 18, "the last line")
            assert good.state == faulty.state == closed.state == "draining"
            assert ring.faults <= 5, "the failing terminal was retried without a pause"
            for session in (faulty, closed, good):
                await session.stop_drain()
        closed.fd = -1  # (closed above)
        for session in (faulty, closed, good):
            session.close()
    err = capfd.readouterr().err.splitlines()
    logged = [line for line in err if " event=internal_error " in line]
    assert logged and all("where=drain" in line and "injected fault" in line for line in logged)
    assert all(closed.name in line for line in err if " event=read_error " in line)
    assert any(" event=read_error " in line and "errno=EBADF" in line for line in err)


@contextmanager
def many_ptys(count: int) -> Iterator[list[tuple[int, int]]]:
    ptys = []
    try:
        for _ in range(count):
            master, slave = os.openpty()
            tty.setraw(slave)
            ptys.append((master, slave))
        yield ptys
    finally:
        for master, slave in ptys:
            os.close(master)
            os.close(slave)


def test_the_loop_is_one_per_trio_run() -> None:
    """Each trio run has its own loop (the holder has one run; tests have many)."""
    seen: list[DrainLoop] = []

    async def main() -> None:
        seen.append(DrainLoop.current())
        assert DrainLoop.current() is seen[-1]

    trio.run(main)
    trio.run(main)
    assert seen[0] is not seen[1]

