"""A process by its pid, read from /proc (client/platform.py), against psutil, side by side.

`escrowctl status` tells whether the pidfile's process is alive, and the holder whether a
session's program is, from /proc/<pid>/stat read the way psutil reads it. False is proof of
death, so every answer must be the one psutil gave (`psutil_answers` is liveness as it was,
over psutil), start times to the bit (pidfiles written by one are read with the other):
a live process, a zombie, a reaped pid, pid 1, another user's process, a pid that started
at another time (a reused pid), one whose name the kernel cuts. Each is asked by a checker
of its own, as root and as another uid, and in a mount namespace whose /proc refuses or
hides what it is asked about: there the answer is "cannot tell", never "dead". (psutil says
"no such process" for a /proc that hides a process or is not mounted at all; the /proc
reader asks the kernel, kill(pid, 0), before it says so.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import require_program, require_real, wait_for

NOBODY = 65534

# The checker: for each (pid, start time as root saw it), the answers of both, as JSON.
_CHECK = """
import json, os, sys
import psutil
from escrow_client import liveness, platform, processes

asked, uid = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if uid is not None:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)

def psutil_alive(pid, start_time):
    if pid is None or not 0 < pid < 1 << 31:
        return None
    try:
        proc = psutil.Process(pid)
        status = proc.status()
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError, ValueError, OverflowError):
        return None
    if status == psutil.STATUS_ZOMBIE:
        return False
    if start_time is None:
        return None
    return bool(abs(created - start_time) < 1e-3)

def psutil_call(pid, what):
    try:
        return what(psutil.Process(pid))
    except (psutil.Error, OSError, ValueError, OverflowError):
        return None

def ours_parent(pid):
    try:
        return processes.process_parent(pid)
    except (processes.NoSuchProcess, OSError, ValueError):
        return None

out = {}
for pid, start in asked:
    starts = (None, start, start + 0.01, start - 1.0)  # the last two: a pid reused
    out[pid] = {
        "ours": [[liveness.process_alive(pid, s) for s in starts],
                 liveness.process_start_time(pid), liveness.process_name(pid),
                 ours_parent(pid)],
        "psutil": [[psutil_alive(pid, s) for s in starts],
                   psutil_call(pid, lambda p: float(p.create_time())),
                   psutil_call(pid, lambda p: str(p.name()) or None),
                   psutil_call(pid, lambda p: p.ppid())],
        "kill": None,
    }
    try:
        os.kill(pid, 0)
        out[pid]["kill"] = "exists"
    except ProcessLookupError:
        out[pid]["kill"] = "no such process"
    except PermissionError:
        out[pid]["kill"] = "exists"
print(json.dumps(out))
"""


def check(asked: dict[int, float], uid: int | None = None,
          mount: str | None = None) -> dict[int, dict[str, Any]]:
    """Both answers for each pid of `asked` (its start time as this process saw it), from a
    checker of `uid`, in a mount namespace with `mount` (a shell command) done first."""
    argv = [sys.executable, "-c", _CHECK, json.dumps(list(asked.items())), json.dumps(uid)]
    if mount is not None:
        argv = [require_program("unshare"), "--mount", "--propagation", "private", "--",
                "sh", "-c", f'{mount} && exec "$@"', "sh", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/",
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return {int(pid): answers for pid, answers in json.loads(done.stdout).items()}


def start_of(pid: int) -> float:
    return float(psutil.Process(pid).create_time())


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[dict[str, int]]:
    """A live child, a zombie, a reaped pid, pid 1, this process, another user's process (as
    root), and one whose name is longer than the kernel keeps."""
    long_name = tmp_path / "sleep-with-a-name-longer-than-fifteen"
    long_name.symlink_to(shutil.which("sleep") or "/bin/sleep")
    live = subprocess.Popen(["sleep", "60"])
    named = subprocess.Popen([str(long_name), "60"])
    zombie = subprocess.Popen(["true"])
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    children = [live, named, zombie]
    pids = {"live": live.pid, "long name": named.pid, "zombie": zombie.pid,
            "reaped": reaped.pid, "pid 1": 1, "this process": os.getpid()}
    if os.geteuid() == 0:
        other = subprocess.Popen(["sleep", "60"], user=NOBODY, group=NOBODY, extra_groups=[])
        children.append(other)
        pids["another uid"] = other.pid
    try:
        wait_for(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, 10.0,
                 "the child to become a zombie")
        wait_for(lambda: psutil.Process(named.pid).name() == long_name.name, 10.0,
                 "the long-named child to exec")
        yield pids
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()


def starts(pids: dict[str, int]) -> dict[int, float]:
    """Each pid's start time as psutil, here, says it (the reaped pid's: any)."""
    return {pid: start_of(pid) if name != "reaped" else 1.0 for name, pid in pids.items()}


def assert_same(pids: dict[str, int], answers: dict[int, dict[str, Any]]) -> None:
    for name, pid in pids.items():
        assert answers[pid]["ours"] == answers[pid]["psutil"], name


def test_the_same_answers_as_psutil(processes: dict[str, int]) -> None:
    answers = check(starts(processes))
    assert_same(processes, answers)
    # What they agree on, said once: alive with its own start time, dead once reaped or a
    # zombie, a different start a different process.
    assert answers[processes["live"]]["ours"][0] == [None, True, False, False]
    assert answers[processes["zombie"]]["ours"][0] == [False] * 4
    assert answers[processes["reaped"]]["ours"][:2] == [[False] * 4, None]
    assert answers[processes["long name"]]["ours"][2] == "sleep-with-a-name-longer-than-fifteen"
    assert answers[processes["live"]]["ours"][3] == os.getpid()


def test_the_same_answers_as_psutil_for_another_uid(processes: dict[str, int]) -> None:
    """Asked by a process of another uid: root's processes, and its own (its /proc entries
    are as readable, hidepid aside)."""
    require_real("root", os.geteuid() == 0,
                 "needs root: the checker drops to uid 65534 (CI runs as root)")
    answers = check(starts(processes), uid=NOBODY)
    assert_same(processes, answers)
    assert answers[processes["live"]]["ours"][0] == [None, True, False, False]
    assert answers[1]["ours"][0] == [None, True, False, False]


def _can_mount() -> bool:
    unshare = shutil.which("unshare")
    return unshare is not None and os.geteuid() == 0 and subprocess.run(
        [unshare, "--mount", "--", "sh", "-c", "mount -t tmpfs none /mnt"],
        capture_output=True, timeout=30).returncode == 0


def test_a_proc_that_refuses_gives_cannot_tell(processes: dict[str, int]) -> None:
    """/proc mounted hidepid=1: another user's /proc/<pid>/stat is EACCES. Both say they
    cannot tell; the reaped pid is still gone."""
    require_real("mount namespaces", _can_mount(),
                 "needs root and unshare(CLONE_NEWNS): CI runs as root in a VM")
    answers = check(starts(processes), uid=NOBODY,
                    mount="mount -t proc -o hidepid=1 proc /proc")
    assert_same(processes, answers)
    for name in ("live", "pid 1", "this process"):
        assert answers[processes[name]]["ours"] == [[None] * 4, None, None, None], name
    assert answers[processes["reaped"]]["ours"][0] == [False] * 4


@pytest.mark.parametrize("mount", ["mount -t proc -o hidepid=2 proc /proc",
                                   "mount -t tmpfs none /proc"])
def test_a_proc_that_hides_or_is_absent_gives_cannot_tell(processes: dict[str, int],
                                                          mount: str) -> None:
    """/proc mounted hidepid=2 (another user's processes have no entry), or not mounted at
    all: a live process is "cannot tell", where psutil said "no such process"; a pid the
    kernel does not have is still proven gone."""
    require_real("mount namespaces", _can_mount(),
                 "needs root and unshare(CLONE_NEWNS): CI runs as root in a VM")
    answers = check(starts(processes), uid=NOBODY, mount=mount)
    hidden = ["live", "pid 1", "this process"]  # root's: the checker's own uid it sees...
    if "tmpfs" in mount:
        hidden.append("another uid")  # ...but no /proc at all shows it nothing
    for name in hidden:
        got = answers[processes[name]]
        assert got["kill"] == "exists", name
        assert got["ours"][0] == [None] * 4, (name, got)
    # A zombie has a pid: only its /proc entry would tell it is one.
    assert answers[processes["zombie"]]["ours"][0] == [None] * 4
    assert answers[processes["reaped"]]["kill"] == "no such process"
    assert answers[processes["reaped"]]["ours"][0] == [False] * 4


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("/proc is Linux's")
