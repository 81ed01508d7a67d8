"""`escrowctl`, run as a real process against a real holder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import psutil

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import HolderStatus, SessionInfo
from escrow_client.liveness import process_alive
from escrow_client.protocol import LIVE_STATES

DEMO_OWNER = "com.example.escrowctl-demo"
OTHER_OWNER = "com.example.other"


def escrowctl(socket: str, *args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "escrow_client.cli", "--socket", socket, *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def assert_no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr


def deposit(holder: HolderProcess, pty_children: Callable[..., PtyChild], sid: str,
            owner: str = OWNER, label: str = "sh") -> PtyChild:
    """A child in a PTY, handed off to the holder (draining); the test's master is closed."""
    child = pty_children(["sh", "-c", f"echo hi-{sid}; exec sleep 60"])
    assert f"hi-{sid}".encode() in child.read_available(until=f"hi-{sid}".encode())
    holder.client(owner).hand_off(sid, child.master, child_pid=child.pid, label=label)
    os.close(child.master)
    child.master = -1
    return child


# --- status ---------------------------------------------------------------------------------


def test_status_running(holder: HolderProcess) -> None:
    result = escrowctl(holder.socket, "status")
    assert result.returncode == 0, result.stderr
    assert "running" in result.stdout
    assert f"pid {holder.pid}" in result.stdout
    assert holder.socket in result.stdout
    assert result.stderr == ""


def test_status_running_json(holder: HolderProcess) -> None:
    result = escrowctl(holder.socket, "status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["state"] == "running"
    assert report["pid"] == holder.pid
    assert report["socket"] == holder.socket
    assert set(report["holder"]) == set(HolderStatus.__struct_fields__)
    assert report["holder"]["pid"] == holder.pid
    assert report["holder"]["socket"] == holder.socket
    assert report["evidence"]["answered_status"] is True


def test_status_not_running(socket_dir: Path) -> None:
    nothing = str(socket_dir / "nobody-here.sock")
    result = escrowctl(nothing, "status")
    assert result.returncode == 3
    assert "not running" in result.stdout
    assert_no_traceback(result)

    result = escrowctl(nothing, "status", "--json")
    assert result.returncode == 3
    report = json.loads(result.stdout)
    assert report["state"] == "not_running"
    assert report["pid"] is None
    assert report["holder"] is None
    assert report["socket"] == nothing
    assert report["evidence"]["answered_status"] is False
    assert not os.path.exists(nothing)  # status is read-only: it created nothing


# --- list -----------------------------------------------------------------------------------


def test_list_empty(holder: HolderProcess) -> None:
    result = escrowctl(holder.socket, "list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no sessions"
    result = escrowctl(holder.socket, "list", "--json")
    assert json.loads(result.stdout) == []


def test_list_shows_deposited_sessions(holder: HolderProcess, pty_children) -> None:
    mine = deposit(holder, pty_children, "tab-1", label="zsh")
    theirs = deposit(holder, pty_children, "tab-9", owner=OTHER_OWNER, label="vim")

    result = escrowctl(holder.socket, "list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["SESSION", "STATE", "LABEL", "CHILD", "ALIVE", "EXIT",
                                "BUFFERED", "DROPPED", "AGE", "ATTACH"]
    row = next(line for line in lines if line.startswith(f"{OWNER}/tab-1 "))
    assert row.split()[:5] == [f"{OWNER}/tab-1", "draining", "zsh", str(mine.pid), "yes"]
    row = next(line for line in lines if line.startswith(f"{OTHER_OWNER}/tab-9 "))
    assert row.split()[:5] == [f"{OTHER_OWNER}/tab-9", "draining", "vim", str(theirs.pid), "yes"]

    result = escrowctl(holder.socket, "list", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    infos = {(s["owner"], s["id"]): msgspec.convert(s, SessionInfo) for s in listed}
    assert set(infos) == {(OWNER, "tab-1"), (OTHER_OWNER, "tab-9")}
    assert all(set(s) >= set(SessionInfo.__struct_fields__) for s in listed)
    info = infos[(OWNER, "tab-1")]
    assert (info.state, info.label, info.child_pid, info.child_alive) == (
        "draining", "zsh", mine.pid, True)

    result = escrowctl(holder.socket, "list", "--owner", OTHER_OWNER, "--json")
    assert [(s["owner"], s["id"]) for s in json.loads(result.stdout)] == [(OTHER_OWNER, "tab-9")]
    result = escrowctl(holder.socket, "list", "--owner", OWNER)
    assert f"{OWNER}/tab-1" in result.stdout
    assert OTHER_OWNER not in result.stdout


def test_list_says_what_can_be_attached(holder: HolderProcess, pty_children) -> None:
    """`escrowctl attach` takes a draining or exited session; a held one is named with the
    process that holds it. An exited session is live: listed without --all."""
    deposit(holder, pty_children, "t-draining")
    exited = pty_children(["sh", "-c", "echo bye"])
    exited.read_available(until=b"bye")
    holder.client().hand_off("t-exited", exited.master, child_pid=exited.pid)
    wait_for(lambda: [s.state for s in holder.client().list() if s.id == "t-exited"]
             == ["exited"], 10.0, "the session to be exited")
    held = pty_children(["sh", "-c", "exec sleep 60"])
    with holder.client().custody() as custody:
        custody.deposit("t-held", held.master, child_pid=held.pid)
        result = escrowctl(holder.socket, "list")
        custody.release("t-held")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    column = lines[0].index("ATTACH")
    attach = {line.split()[0]: line[column:] for line in lines[1:]}
    assert attach == {
        f"{OWNER}/t-draining": "yes",
        f"{OWNER}/t-exited": "yes (ended)",
        f"{OWNER}/t-held": f"no: held by pid {os.getpid()} ({psutil.Process().name()})",
    }


def test_list_without_a_holder_is_a_clean_error(socket_dir: Path) -> None:
    result = escrowctl(str(socket_dir / "nobody-here.sock"), "list")
    assert result.returncode == 1
    assert result.stdout == ""
    assert re.fullmatch(r"escrowctl: no holder is listening on .*\(unavailable\)\n",
                        result.stderr), result.stderr


# --- release --------------------------------------------------------------------------------


def test_release_then_list_shows_released(holder: HolderProcess, pty_children) -> None:
    deposit(holder, pty_children, "tab-1")
    result = escrowctl(holder.socket, "release", f"{OWNER}/tab-1")
    assert result.returncode == 0, result.stderr
    assert f"released {OWNER}/tab-1" in result.stdout

    result = escrowctl(holder.socket, "list", "--all", "--json")
    [info] = json.loads(result.stdout)
    assert (info["owner"], info["id"], info["state"]) == (OWNER, "tab-1", "released")
    result = escrowctl(holder.socket, "list", "--all")
    assert result.stdout.splitlines()[1].split()[:2] == [f"{OWNER}/tab-1", "released"]

    # Releasing it again says so, and is no failure: nothing is left to release.
    result = escrowctl(holder.socket, "release", f"{OWNER}/tab-1")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"{OWNER}/tab-1 was already released \d+s ago: escrowd holds no "
                        r"copy of it\n", result.stdout), result.stdout
    assert result.stderr == ""


def test_release_of_ended_sessions_says_what_became_of_them(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """An exited session is released (its tombstone says so); a handed-off one has no copy
    left to release, and saying so is no failure."""
    child = pty_children(["sh", "-c", "echo bye"])
    assert b"bye" in child.read_available(until=b"bye")
    holder.client().hand_off("ended", child.master, child_pid=child.pid)
    wait_for(lambda: any(s.id == "ended" and s.state == "exited"
                         for s in holder.client().list()), 5, "exited")
    result = escrowctl(holder.socket, "release", f"{OWNER}/ended")
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith(f"released {OWNER}/ended: ")
    assert [s.state for s in holder.client().list() if s.id == "ended"] == ["released"]

    deposit(holder, pty_children, "taken")
    got = holder.client().retrieve("taken")
    os.close(got.fd)
    result = escrowctl(holder.socket, "release", f"{OWNER}/taken")
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert re.fullmatch(rf"{OWNER}/taken was already handed off to an app \d+s ago: escrowd "
                        r"holds no copy of it\n", result.stdout), result.stdout


def test_release_unknown_session_fails_clearly(holder: HolderProcess) -> None:
    result = escrowctl(holder.socket, "release", f"{OWNER}/no-such-tab")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == f"escrowctl: session {OWNER}/no-such-tab is unknown (unknown)\n"


def test_release_needs_owner_slash_id(holder: HolderProcess) -> None:
    for bad in ("just-an-id", "/tab-1", f"{OWNER}/", f"{OWNER}/a b"):
        result = escrowctl(holder.socket, "release", bad)
        assert result.returncode == 2, bad
        assert "OWNER/ID" in result.stderr
        assert_no_traceback(result)


# --- demo -----------------------------------------------------------------------------------


def test_demo_runs_a_relaunch(holder: HolderProcess) -> None:
    result = escrowctl(holder.socket, "demo", timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert_no_traceback(result)
    for step in range(1, 6):
        assert re.search(rf"^{step}\. ", out, re.MULTILINE), f"step {step} missing:\n{out}"
    assert re.search(r"app exiting with pid \d+", out)
    replayed = re.findall(r"replay \| tick (\d+) from pid (\d+)", out)
    assert replayed, out
    live = re.findall(r"live +\| tick (\d+) from pid (\d+)", out)
    assert live, out
    same = re.search(r"shell pid before: (\d+), after: (\d+) \(same process\)", out)
    assert same and same[1] == same[2], out
    shell_pid = int(same[1])
    assert {int(pid) for _, pid in replayed + live} == {shell_pid}

    # Nothing is left behind: no live session of the demo owner, and the shell is gone.
    sessions = holder.client(DEMO_OWNER).list()
    # (Retrieved into custody, it stayed escrowed until the demo released it.)
    assert sessions, "the demo's session should be remembered as released"
    assert [s for s in sessions if s.state in LIVE_STATES] == []
    assert [s.state for s in sessions] == ["released"]
    wait_for(lambda: process_alive(shell_pid, None) is False, 5.0, "the demo shell to end")


def test_demo_without_a_holder_says_how_to_start_one(socket_dir: Path) -> None:
    result = escrowctl(str(socket_dir / "nobody-here.sock"), "demo")
    assert result.returncode == 1
    assert "scripts/holder" in result.stderr
    assert "escrowd" in result.stderr
    assert_no_traceback(result)
