"""The escrow outlives the holder (docs/design.md §11): its serving process SIGKILLed under the
keeper, every session comes back as it was.

Incident pinned: SIGKILL of the holder hung up every draining shell (exit 129), threw away
an exited session's replay, and the holder started again listed nothing; a session an app
still held lost its protection without anyone being told.

Here `escrowd` runs as users run it: the keeper and its holder, a real process tree. Three
sessions live through the holder's SIGKILL (tests/survival.py): one draining (a shell
printing numbered lines every 20 ms), one exited with a 200 KB tail, and one held by a live
app that reads it. tests/test_systemd_escrow.py does the same under a real systemd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hostile import numbered_lines, read_more_lines
from rawclient import RawClient
from survival import (
    TICKER,
    assert_all_survived,
    assert_one_stream,
    assert_still_there,
    start_three_sessions,
)

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import EscrowError, paths, protocol
from escrow_client.liveness import process_alive, read_lock


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


def test_every_kind_of_session_survives_the_holders_sigkill(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    holder = make_holder(keeper=True)
    three = start_three_sessions(holder.client(), pty_children, apps, tmp_path)

    after = kill_serving_holder(holder)
    assert after.adopted == 3, after
    assert_still_there(three)
    assert_all_survived(three, clean=False)


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


def test_a_handoff_caught_by_the_holders_death_waits_for_its_client(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Found in review: a holder killed after sending a handoff, before the ack. The client
    has the fd; the next holder adopted the session `handing_off` and drained it again after
    the ack deadline, while the client, alive, could be reading it: two readers. Now the
    session is left alone while the client's process lives (well past the ack deadline),
    and the client's ack on a new connection completes the handoff."""
    holder = make_holder("--ack-deadline", "0.5", keeper=True)
    kid = pty_children(TICKER)
    holder.client().hand_off("tab", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    with RawClient(holder.socket) as raw:
        raw.hello()
        handoff, fd = raw.retrieve_handoff("tab")
        kill_serving_holder(holder)
        info = {s.id: s for s in holder.client().list()}["tab"]
        assert info.state == "handing_off" and info.handoff_id == handoff.handoff_id
        deadline_passed = time.monotonic() + 2.0  # four ack deadlines
        while time.monotonic() < deadline_passed:
            state = {s.id: s.state for s in holder.client().list()}["tab"]
            assert state == "handing_off", "drained while its client may be reading it"
            time.sleep(0.1)  # the behaviour under test: nothing happens while we wait
        with RawClient(holder.socket) as again:
            again.hello()
            again.send(protocol.Ack(id="tab", handoff_id=handoff.handoff_id))
            assert again.receive()[0] == protocol.Done(id="tab")
        assert {s.id: s.state for s in holder.client().list()}["tab"] == "handed_off"
        assert os.isatty(fd)


# A client of a handoff, as its own process: it retrieves the session, prints the handoff's
# id once it has the fd, and holds the fd without ever acking it until it is killed.
HANDOFF_CLIENT = textwrap.dedent("""
    import signal, sys
    sys.path.insert(0, sys.argv[1])
    from rawclient import RawClient
    raw = RawClient(sys.argv[2])
    raw.hello()
    handoff, fd = raw.retrieve_handoff(sys.argv[3])
    print(handoff.handoff_id, flush=True)
    signal.pause()
""")


def test_a_handoff_caught_by_the_holders_death_drains_again_once_its_client_is_dead(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]],
) -> None:
    """A holder killed between sending a handoff and its ack, and then the client that got
    the fd killed too, before it acked: the next holder, which waited for that client, drains
    the session again as soon as the client is proven dead (long before any ack deadline),
    instead of leaving it `handing_off` with nobody reading it (its child blocked on a full
    terminal, its output lost to the user). Nothing read is lost: the replay runs from the
    first line."""
    holder = make_holder("--ack-deadline", "30", keeper=True)
    kid = pty_children(TICKER)
    holder.client().hand_off("tab", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    client = subprocess.Popen(
        [sys.executable, "-c", HANDOFF_CLIENT, str(Path(__file__).parent), holder.socket,
         "tab"], stdout=subprocess.PIPE, text=True)
    apps.append(client)
    assert client.stdout is not None
    handoff_id = client.stdout.readline().strip()
    assert handoff_id, "the client got no handoff"
    kill_serving_holder(holder)
    info = {s.id: s for s in holder.client().list()}["tab"]
    assert info.state == "handing_off" and info.handoff_id == handoff_id, info

    client.kill()
    client.wait()
    wait_for(lambda: {s.id: s.state for s in holder.client().list()}["tab"] == "draining",
             10.0, "the session draining again once the client of its handoff was dead")
    got = holder.client().retrieve("tab")
    try:
        assert_one_stream(b"", got.replay, read_more_lines(got.fd, b"", 3),
                          got.session.replay_gap_at)
    finally:
        os.close(got.fd)


def test_a_second_sigterm_does_not_cut_an_orderly_stop_short(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Found in review: SIGTERM twice (an upgrade asked twice) killed the holder in the
    middle of its orderly stop, with a handoff waiting for its ack. The second is ignored:
    the handoff completes, the holder exits 0 and the next start is clean."""
    holder = make_holder()
    kid = pty_children(TICKER)
    holder.client().hand_off("tab", kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    with RawClient(holder.socket) as raw:
        raw.hello(timeout=10.0)
        handoff, fd = raw.retrieve_handoff("tab")
        holder.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: holder.log_lines("stopping"), 10.0, "the orderly stop")
        holder.proc.send_signal(signal.SIGTERM)
        raw.send(protocol.Ack(id="tab", handoff_id=handoff.handoff_id))
        assert raw.receive()[0] == protocol.Done(id="tab")
        assert holder.proc.wait(15) == 0
        assert os.isatty(fd)
