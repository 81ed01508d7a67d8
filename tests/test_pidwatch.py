"""Waiting for a process to exit (escrowd.pidwatch), in-process under trio.

A held session an adopting holder took over waits for its custodian (the app that held
it) to die before it drains: draining while the app lives puts two readers on one terminal,
and the app loses what the holder reads. Waiting on for an app that is gone leaves the
session unread. So the wait ends on positive proof of death only, and on nothing less:

- with no pidfd to be had (the holder out of fds) it asks now and then; a look that cannot
  tell (out of fds, /proc cannot be read either) is not taken for death;
- a pid that another process has now (its start time is not the one recorded) is proof
  that the custodian is gone: the wait ends at once.

The clock is trio's autojump clock: the fallback's looks, seconds apart, come at once.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio
import trio.testing

from escrow_client.liveness import process_alive, process_start_time
from escrowd.pidwatch import wait_exit


@pytest.fixture
def custodian() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing for an app that holds custody."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@contextmanager
def fd_table_full() -> Iterator[None]:
    """Every fd this process may open is taken (a lowered soft RLIMIT_NOFILE, filled with
    copies of stdin); all closed and the limit restored on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        try:
            while True:
                taken.append(os.dup(0))
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_without_a_pidfd_a_custodian_whose_liveness_cannot_be_told_is_waited_for(
    autojump_clock: trio.testing.MockClock, custodian: subprocess.Popen[bytes],
) -> None:
    """Out of fds, the wait cannot open a pidfd, and every look at /proc fails the same
    way (liveness None): a minute of looks, and the wait goes on. Once fds are to be had
    again and the custodian dies, the next look sees it and the wait ends."""
    started = process_start_time(custodian.pid)
    assert started is not None
    ended = trio.Event()

    async def wait() -> None:
        await wait_exit(custodian.pid, started)
        ended.set()

    async with trio.open_nursery() as nursery:
        with fd_table_full():
            # What the wait meets, real: no pidfd, and a liveness that cannot be told.
            with pytest.raises(OSError) as no_pidfd:
                os.pidfd_open(custodian.pid)
            assert no_pidfd.value.errno == errno.EMFILE
            assert process_alive(custodian.pid, started) is None
            nursery.start_soon(wait)
            await trio.sleep(60.0)
            assert not ended.is_set(), (
                "the wait ended while the custodian's liveness could not be told")
        custodian.kill()
        custodian.wait()
        with trio.move_on_after(30.0):
            await ended.wait()
        assert ended.is_set(), "the wait went on after the custodian died"


async def test_a_pid_now_running_another_process_ends_the_wait(
    autojump_clock: trio.testing.MockClock, custodian: subprocess.Popen[bytes],
) -> None:
    """The process with the custodian's pid started at another time than the one recorded:
    it is not the custodian, whose pid was reused after it died. The wait ends at once
    (with the right start time, the same process is waited for)."""
    started = process_start_time(custodian.pid)
    assert started is not None
    with trio.move_on_after(10.0) as still_waiting:
        await wait_exit(custodian.pid, started)
    assert still_waiting.cancelled_caught, "the wait ended while the custodian lives"
    with trio.move_on_after(10.0) as still_waiting:
        await wait_exit(custodian.pid, started - 1.0)
    assert not still_waiting.cancelled_caught, (
        "the wait went on for a pid that another process has now")
