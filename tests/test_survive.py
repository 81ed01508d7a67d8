"""The escrow outlives the holder (DESIGN §11): its serving process SIGKILLed under the
keeper, every session comes back as it was.

Incident pinned: SIGKILL of the holder hung up every draining shell (exit 129), threw away
an exited session's replay, and the holder started again listed nothing; a session an app
still held lost its protection without anyone being told.

Here `escrowd` runs as users run it: the keeper and its holder, a real process tree. Three
sessions live through the holder's SIGKILL: one draining (a shell printing numbered lines
every 20 ms), one exited with a 200 KB tail, and one held by a live app that reads it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile import numbered_lines, read_more_lines

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import EscrowClient, EscrowError, paths, protocol
from escrow_client.liveness import process_alive, read_lock

TICKER = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"]
TAIL_BYTES = 200_000
# Prints TAIL_BYTES of numbered 20-byte records, then exits: its whole tail must survive.
TAIL = ["python3", "-c",
        f"import sys; sys.stdout.write(''.join(f'T{{i:018d}}\\n' for i in "
        f"range({TAIL_BYTES} // 20)))"]

# An app that deposits one session under custody and reads it for as long as it lives,
# appending what it reads to a file (so a test sees exactly what the app saw, even after
# SIGKILL). It prints the child's pid, then `ready` once the deposit is confirmed.
APP = textwrap.dedent("""
    import os, select, subprocess, sys
    from escrow_client import EscrowClient
    socket_path, sid, out_path = sys.argv[1:4]
    master, slave = os.openpty()
    child = subprocess.Popen(
        ["sh", "-c", "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    custody = EscrowClient("com.example.term", socket_path=socket_path).custody()
    custody.deposit(sid, master, child_pid=child.pid)
    print(child.pid, flush=True)
    out = open(out_path, "ab", buffering=0)
    while True:
        select.select([master], [], [])
        out.write(os.read(master, 65536))
""")


def serving_pid(holder: HolderProcess) -> int:
    record = paths.read_pidfile(holder.socket)
    assert record is not None
    return record.pid


def kill_serving_holder(holder: HolderProcess) -> protocol.HolderStatus:
    """SIGKILL the process that answers, and wait for the keeper's next one to answer with
    what it adopted."""
    before = holder.client("escrowctl").status()
    os.kill(before.pid, signal.SIGKILL)

    def restarted() -> protocol.HolderStatus | None:
        try:
            status = holder.client("escrowctl", timeout=1.0).status()
        except Exception:
            return None
        return status if status.instance != before.instance else None

    after = wait_for(restarted, 15.0, "the keeper's next holder to answer")
    assert after.keeper_pid == before.keeper_pid == holder.pid
    assert after.unclean_restarts == before.unclean_restarts + 1
    return after


def states(client: EscrowClient) -> dict[str, str]:
    return {s.id: s.state for s in client.list()}


@pytest.fixture
def apps() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for app in started:
        if app.poll() is None:
            app.kill()
        app.communicate()


def test_every_kind_of_session_survives_the_holders_sigkill(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    holder = make_holder(keeper=True)
    client = holder.client()

    ticker = pty_children(TICKER)
    first = read_more_lines(ticker.master, b"", 3)  # what the app read before handing off
    client.hand_off("draining", ticker.master, child_pid=ticker.pid)
    os.close(ticker.master)
    ticker.master = -1

    tail = pty_children(TAIL)
    client.hand_off("exited", tail.master, child_pid=tail.pid)
    os.close(tail.master)
    tail.master = -1
    wait_for(lambda: states(client).get("exited") == "exited", 15.0, "the tail session exited")

    read_by_app = tmp_path / "app.out"
    app = subprocess.Popen([sys.executable, "-c", APP, holder.socket, "held", str(read_by_app)],
                           stdout=subprocess.PIPE, text=True)
    apps.append(app)
    assert app.stdout is not None
    held_child = int(app.stdout.readline())
    wait_for(lambda: states(client).get("held") == "held", 10.0, "the app's deposit")
    wait_for(lambda: len(numbered_lines(read_by_app.read_bytes())) >= 5, 10.0,
             "the app reading its own session")

    after = kill_serving_holder(holder)
    assert after.adopted == 3, after
    assert states(client) == {"draining": "draining", "exited": "exited", "held": "held"}

    # The held session: still the app's. The holder does not read it while the app lives.
    read_before = len(numbered_lines(read_by_app.read_bytes()))
    wait_for(lambda: len(numbered_lines(read_by_app.read_bytes())) >= read_before + 10, 10.0,
             "the app still reading after the holder's death")
    info = next(s for s in client.list() if s.id == "held")
    assert info.state == "held" and info.buffered_bytes == 0 and info.custodian_pid == app.pid

    # The exited session: its whole tail.
    got = client.retrieve("exited")
    try:
        expected = b"".join(f"T{i:018d}\r\n".encode() for i in range(TAIL_BYTES // 20))
        assert got.replay == expected, (len(got.replay), len(expected))
        assert got.session.replay_gap_at is None
    finally:
        os.close(got.fd)

    # The draining session: every line from the first the app saw, with at most one gap
    # (the one read in flight when the holder died), exactly where replay_gap_at says.
    got = client.retrieve("draining")
    try:
        assert got.confirmed
        assert_one_stream(first, got.replay, read_more_lines(got.fd, b"", 5),
                          got.session.replay_gap_at)
    finally:
        os.close(got.fd)

    # The app dies: now, and not before, the holder drains its session; a new app takes
    # it back with every line from the first the dead app read.
    app.kill()
    app.wait()
    wait_for(lambda: states(client).get("held") == "draining", 5.0,
             "the held session draining once its app is dead")
    got = client.retrieve("held")
    try:
        assert got.session.replay_gap_at is None  # this holder read it from the start
        assert_one_stream(read_by_app.read_bytes(), got.replay,
                          read_more_lines(got.fd, b"", 5), None)
    finally:
        os.close(got.fd)
        os.kill(held_child, signal.SIGKILL)


def assert_one_stream(seen: bytes, replay: bytes, live: bytes, gap_at: int | None) -> None:
    """What the old app read, the replay and what is read live are one stream of lines
    L1, L2, ...: no repeat, and no gap but at most one, where `gap_at` says the bytes of one
    read may be missing (after an unclean stop of the holder)."""
    if gap_at is None:
        numbers = _lines(seen + replay + live)
        assert numbers == list(range(1, len(numbers) + 1)), f"a gap or a repeat: {numbers}"
        return
    before = _lines(seen + replay[:gap_at])
    after = _lines(replay[gap_at:] + live, partial_start=True)
    assert before == list(range(1, len(before) + 1)), before
    assert after == list(range(after[0], after[0] + len(after))), after
    assert after[0] > before[-1], (before[-3:], after[:3])
    missing = after[0] - before[-1] - 1
    assert missing * len(b"L99\r\n") <= 8 * 1024, f"{missing} lines missing: more than a read"


def _lines(data: bytes, partial_start: bool = False) -> list[int]:
    chunks = data.split(b"\r\n")
    if partial_start:
        chunks = chunks[1:]  # the rest of a line whose start went with the gap
    chunks = chunks[:-1]  # after the last CR LF: a line still being written (or cut)
    numbers = []
    for line in chunks:
        assert line[:1] == b"L" and line[1:].isdigit(), f"not a numbered line: {line!r}"
        numbers.append(int(line[1:]))
    return numbers


def test_status_shows_the_pair(make_holder: Callable[..., HolderProcess]) -> None:
    """escrowctl status --json names both processes: the holder that answers and its
    keeper, which holds the lock."""
    holder = make_holder(keeper=True)
    result = subprocess.run([str(Path(sys.executable).parent / "escrowctl"), "--socket",
                             holder.socket, "status", "--json"], capture_output=True,
                            text=True, timeout=30)
    shown = json.loads(result.stdout)
    assert result.returncode == 0 and shown["state"] == "running"
    assert shown["pid"] == serving_pid(holder)
    assert shown["holder"]["keeper_pid"] == holder.pid == shown["keeper"]["pid"]
    assert shown["evidence"]["lock_holder_pid"] == holder.pid
    assert shown["holder"]["fd_store"] == "keeper"


def test_upgrade_under_load_loses_nothing_and_hands_nothing_off_twice(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """`escrowctl upgrade`, twice, while 20 sessions drain and a client retrieves and hands
    back one session after another in a loop: every retrieve completes or fails with a
    clean error (its session still retrievable), each session's output runs 1, 2, 3, ...
    across every retrieve with no gap and no repeat (a clean restart marks no gap), and no
    handoff is confirmed twice."""
    holder = make_holder(keeper=True)
    client = holder.client(timeout=5.0)
    sessions = [f"tab-{n}" for n in range(20)]
    streams: dict[str, bytearray] = {}
    for sid in sessions:
        kid = pty_children(TICKER)
        streams[sid] = bytearray(read_more_lines(kid.master, b"", 1))
        client.hand_off(sid, kid.master, child_pid=kid.pid)
        os.close(kid.master)
        kid.master = -1

    stop = threading.Event()
    outcomes: dict[str, int] = {}
    handoff_ids: list[str] = []

    def cycle() -> None:
        n = 0
        while not stop.is_set():
            sid = sessions[n % len(sessions)]
            n += 1
            try:
                got = client.retrieve(sid)
            except EscrowError as exc:
                outcomes[exc.code] = outcomes.get(exc.code, 0) + 1
                continue
            try:
                assert got.confirmed, sid
                handoff_ids.append(got.handoff_id)
                assert got.session.replay_gap_at is None, (sid, got.session)
                streams[sid] += got.replay
                streams[sid][:] = read_more_lines(got.fd, bytes(streams[sid]), 1)
                client.hand_off(sid, got.fd, child_pid=got.session.child_pid)
                outcomes["ok"] = outcomes.get("ok", 0) + 1
            finally:
                os.close(got.fd)

    worker = threading.Thread(target=cycle)
    worker.start()
    try:
        escrowctl = str(Path(sys.executable).parent / "escrowctl")
        for _ in range(2):
            wait_for(lambda: outcomes.get("ok", 0) >= 10, 30.0, "retrieves under way")
            outcomes["ok"] = 0
            upgraded = subprocess.run([escrowctl, "--socket", holder.socket, "upgrade",
                                       "--wait", "60"], capture_output=True, text=True,
                                      timeout=90)
            assert upgraded.returncode == 0, upgraded.stderr
            assert "session(s) adopted" in upgraded.stdout
        wait_for(lambda: outcomes.get("ok", 0) >= 10, 30.0, "retrieves after the upgrades")
    finally:
        stop.set()
        worker.join(30)
    status = client.status()
    assert status.restarts == 2 and status.unclean_restarts == 0, status
    assert len(handoff_ids) == len(set(handoff_ids)), "a handoff confirmed twice"
    assert set(outcomes) <= {"ok", "busy", "unavailable", "unresponsive"}, outcomes
    report = client.reclaim_all()
    try:
        assert report.failed == {} and sorted(report.retrieved) == sorted(sessions)
        for sid, got in report.retrieved.items():
            stream = bytes(streams[sid]) + got.replay
            stream = read_more_lines(got.fd, stream, 1)
            numbers = numbered_lines(stream)
            assert numbers == list(range(1, len(numbers) + 1)), (sid, numbers)
    finally:
        for got in report.retrieved.values():
            os.close(got.fd)


def test_the_holder_outlives_its_keeper(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """The keeper SIGKILLed: its stored fds go with it, but the holder has its own copies.
    It serves on alone, takes the lock (so no second escrowd starts on the path), says
    `fd_store: none`, and still takes deposits and hands sessions back."""
    holder = make_holder(keeper=True)
    client = holder.client()
    kid = pty_children(TICKER)
    first = read_more_lines(kid.master, b"", 2)
    client.hand_off("tab", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    serving = serving_pid(holder)
    os.kill(holder.pid, signal.SIGKILL)
    holder.proc.wait()
    wait_for(lambda: client.status().fd_store == "none", 10.0, "the holder alone")
    status = client.status()
    assert status.pid == serving and status.keeper_pid is None
    assert read_lock(holder.socket).pid == serving
    got = client.retrieve("tab")
    try:
        assert_one_stream(first, got.replay, read_more_lines(got.fd, b"", 3), None)
        client.hand_off("tab", got.fd, child_pid=kid.pid)  # deposits work without a store
    finally:
        os.close(got.fd)
    client.release("tab")
    os.kill(serving, signal.SIGTERM)
    wait_for(lambda: process_alive(serving, None) is False, 15.0, "the holder to stop")
