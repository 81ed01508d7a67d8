"""A process whose main thread has exited while another thread runs on is alive, though
/proc/<pid>/stat shows it `Z` (and psutil calls it a zombie): its leader waits there for
the rest of the thread group. An app may well do this (a runtime that ends its main
thread and serves from another), and a holder that took it for dead would start draining
a held session whose app is alive and reading it: two readers of one terminal.

The process is real: a small C program (compiled with the system's cc) whose main thread
calls pthread_exit while a second thread reads stdin until it is closed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from conftest import wait_for
from escrow_client import processes
from escrow_client.liveness import process_alive, process_start_time
from escrowd.pidwatch import wait_exit

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and pidfds: Linux")

_PROGRAM = r"""
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

static void *reader(void *arg) {
    char c;
    (void)arg;
    while (read(0, &c, 1) > 0) {
    }
    return NULL; /* the last thread: the process exits */
}

int main(void) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, reader, NULL) != 0)
        return 1;
    fputs("ready\n", stdout);
    fflush(stdout);
    pthread_exit(NULL);
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    where = tmp_path_factory.mktemp("leader")
    (where / "leader.c").write_text(_PROGRAM)
    subprocess.run([cc, "-O", "-pthread", "-o", str(where / "leader"), str(where / "leader.c")],
                   check=True)
    return where / "leader"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rfind(b")") + 2:].split()[0].decode()


@pytest.fixture
def leaderless(program: Path) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """The program, its main thread gone (`Z` in /proc/<pid>/stat), its reader running;
    and its start time, read while its main thread ran."""
    child = subprocess.Popen([str(program)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        started = process_start_time(child.pid)
        assert started is not None
        wait_for(lambda: _state(child.pid) == "Z", what="the main thread gone")
        yield child, started
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def test_a_process_whose_main_thread_exited_is_alive_until_its_last_thread_is(
    leaderless: tuple[subprocess.Popen[bytes], float],
) -> None:
    """`Z` with a thread still running: alive, not a zombie, the same start time. Once
    its last thread has exited (stdin closed) and before it is reaped: dead."""
    child, started = leaderless
    assert processes.process_state(child.pid) == (False, started)
    assert process_alive(child.pid, started) is True
    assert process_alive(child.pid, None) is None  # alive, and which process: not asked
    assert child.stdin is not None
    child.stdin.close()
    wait_for(lambda: _threads(child.pid) == 1, what="its last thread gone")
    assert _state(child.pid) == "Z"
    assert process_alive(child.pid, started) is False
    assert processes.process_state(child.pid)[0] is True
    child.wait()
    assert process_alive(child.pid, started) is False


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads: line")


def test_the_holder_waits_for_the_whole_process_to_exit(
    leaderless: tuple[subprocess.Popen[bytes], float],
) -> None:
    """escrowd.pidwatch.wait_exit (what a held session's custodian is watched with) does
    not return while the process runs without its main thread; it returns once the last
    thread has exited."""
    child, started = leaderless
    returned = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                await wait_exit(child.pid, started)
                returned.append(True)

            nursery.start_soon(watch)
            await trio.testing.wait_all_tasks_blocked()
            assert returned == [], "the holder took a live app for dead"
            assert child.stdin is not None
            child.stdin.close()
            with trio.fail_after(10):
                while not returned:
                    await trio.sleep(0.005)  # (polling its result, under a deadline)

    trio.run(main)
    assert returned == [True]
