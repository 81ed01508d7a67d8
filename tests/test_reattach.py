"""Reattach, right by default (docs/design.md §12): retrieve into custody survives a second crash,
the journal brings back what was printed before a crash, a wrapped replay starts clean,
size and meta stay current, and one connection reclaims many sessions.

Real things throughout: a real escrowd, apps that are real processes (tests/reattach_app.py)
killed with SIGKILL, children printing numbered lines into real PTYs.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import tty
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile import numbered_lines, read_more_lines

from conftest import HolderProcess, wait_for
from escrow_client import CustodyHeld, EscrowClient

APP = str(Path(__file__).with_name("reattach_app.py"))


class App:
    """One run of reattach_app.py; what it read is in `out`, its replay in `out.replay`."""

    def __init__(self, holder: HolderProcess, sid: str, out: Path, mode: str,
                 *flags: str) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, APP, holder.socket, sid, str(out), mode, *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 15)
        line = self.proc.stdout.readline().split() if ready else []
        if not line or line[0] != b"ready":
            self.proc.kill()
            raise AssertionError(f"the app did not start: {self.proc.stderr.read()!r}")  # type: ignore[union-attr]
        self.child_pid, self.journaled = int(line[1]), int(line[2])

    def read(self) -> bytes:
        return self.out.read_bytes() if self.out.exists() else b""

    def replay(self) -> bytes:
        return Path(f"{self.out}.replay").read_bytes()

    def wait_lines(self, count: int) -> None:
        wait_for(lambda: len(numbered_lines(self.read())) >= count, 15,
                 f"{count} lines read by the app")

    def kill(self, where_it_is: bool = False) -> None:
        """SIGKILL, once the app has written out everything it read (it stops reading on
        SIGUSR1), so that what it read is exactly what `read()` gives; with `where_it_is`,
        at once."""
        if not where_it_is:
            self.proc.send_signal(signal.SIGUSR1)
            wait_for(lambda: Path(f"{self.out}.paused").exists(), 10, "the app to pause")
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def apps(holder: HolderProcess, tmp_path: Path) -> Iterator[Callable[..., App]]:
    """Start an app on session "tab": `apps(name, mode, *flags)`; each is killed, with its
    child, at the end."""
    started: list[App] = []

    def start(name: str, mode: str, *flags: str) -> App:
        app = App(holder, "tab", tmp_path / name, mode, *flags)
        started.append(app)
        return app

    yield start
    for app in started:
        if app.proc.poll() is None:
            app.kill()
        try:
            os.kill(app.child_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def state_of(client: EscrowClient, sid: str) -> str:
    return next((s.state for s in client.list() if s.id == sid), "unknown")


def crash(app: App, client: EscrowClient, lines: int = 20) -> None:
    """Let `app` read `lines` lines, SIGKILL it, and wait until the holder drains again."""
    app.wait_lines(lines)
    app.kill()
    wait_draining_with_output(client, "tab")


def wait_draining_with_output(client: EscrowClient, sid: str) -> None:
    """Custody ended (the app died) and the holder has drained some of what came since."""
    wait_for(lambda: any(s.id == sid and s.state == "draining" and s.buffered_bytes > 200
                         for s in client.list()), 15, f"{sid} draining with output")


def test_a_second_crash_loses_and_repeats_nothing(holder: HolderProcess, apps: Callable[..., App],
                                                   tmp_path: Path) -> None:
    """Incident pinned (issue 12): after `reclaim_all()` a session was `handed_off` and a
    second crash of the app lost it. Retrieved into custody it stays escrowed: app 1 dies,
    app 2 reclaims it into custody and dies too, app 3 reclaims it; what app 1 read, replay
    1, what app 2 read, replay 2 and the live output run on from L1, no line missing or
    repeated."""
    client = holder.client()
    app1 = apps("app1", "new")
    crash(app1, client)

    app2 = apps("app2", "reclaim")
    assert state_of(client, "tab") == "held"  # escrowed while the app reads it
    crash(app2, client)

    with client.custody() as custody:
        report = custody.reclaim_all()
        third = report.retrieved["tab"]
        assert state_of(client, "tab") == "held"
        live = read_more_lines(third.fd, b"", 10)
        seen = app1.read() + app2.replay() + app2.read() + third.replay + live
        numbers = numbered_lines(seen)
        assert numbers[:1] == [1]
        assert numbers == list(range(1, len(numbers) + 1)), "a line missing or repeated"
        assert third.replay_journaled == 0
        custody.release("tab")
    os.close(third.fd)


def test_the_journal_brings_back_what_was_printed_before_the_crash(
    holder: HolderProcess, apps: Callable[..., App], tmp_path: Path
) -> None:
    """With the journal on, the replay after a crash starts with the first line the app
    ever read, and `replay_journaled` counts what the app recorded; then live output
    follows it without a gap or a repeat. The app that reclaims journals on, so a second
    crash brings back both."""
    client = holder.client()
    app1 = apps("app1", "new", "--journal")
    crash(app1, client, 30)
    read_by_app1 = app1.read()

    app2 = apps("app2", "reclaim", "--journal")
    replay1 = app2.replay()
    assert replay1.startswith(b"L1\r\n")
    assert replay1.startswith(read_by_app1)  # what app 1 read, then what the holder drained
    assert app2.journaled == len(read_by_app1)
    assert numbered_lines(replay1) == list(range(1, len(numbered_lines(replay1)) + 1))
    crash(app2, client)

    with client.custody() as custody:
        third = custody.retrieve("tab")
        # Everything: app 1's reads, the first drain, app 2's reads, the second drain.
        assert third.replay.startswith(replay1 + app2.read())
        assert third.replay_journaled == len(read_by_app1) + len(app2.read())
        live = read_more_lines(third.fd, third.replay, 10)
        numbers = numbered_lines(live)
        assert numbers == list(range(1, len(numbers) + 1))
        custody.release("tab")
    os.close(third.fd)


def test_an_app_killed_waiting_in_a_journaled_read_leaves_a_gap_and_drops_nothing(
    holder: HolderProcess, apps: Callable[..., App]
) -> None:
    """An app that waits for output inside `Custody.read` (journal on) is SIGKILLed there.
    The holder cannot know whether that read had taken bytes off the terminal, so the spot
    is marked as a gap; nothing the app recorded is dropped: the replay is every line from
    L1, and the gap is at its end, where the app's reads stopped."""
    client = holder.client()
    app = apps("app", "new", "--journal", "--idle", "--blocking")
    app.wait_lines(20)
    wait_for(lambda: app.read().endswith(b"L20\r\n"), 15, "the app to read all 20 lines")
    app.kill(where_it_is=True)  # in its read, waiting for more
    wait_for(lambda: state_of(client, "tab") == "draining", 15, "custody to end")
    with client.custody() as custody:
        retrieved = custody.retrieve("tab")
        expected = b"".join(f"L{i}\r\n".encode() for i in range(1, 21))
        assert retrieved.replay == expected == app.read()
        assert retrieved.replay_journaled == len(expected)
        assert retrieved.session.replay_gaps == [len(expected)]
        custody.release("tab")
    os.close(retrieved.fd)


def test_without_the_journal_the_replay_is_what_the_holder_drained(
    holder: HolderProcess, apps: Callable[..., App], tmp_path: Path
) -> None:
    client = holder.client()
    app1 = apps("app1", "new")
    crash(app1, client)
    retrieved = client.retrieve("tab")
    try:
        assert retrieved.replay_journaled == 0
        assert not retrieved.replay.startswith(b"L1\r\n")
        numbers = numbered_lines(app1.read() + retrieved.replay)
        assert numbers == list(range(1, len(numbers) + 1))
    finally:
        os.close(retrieved.fd)


def test_a_wrapped_replay_starts_after_a_torn_escape_sequence(make_holder: object) -> None:
    """A ring that lost its oldest bytes mid-way through `ESC [ 1 ; 3 1 m` (or a UTF-8
    character) would replay the tail of it as text: the replay starts at the next line,
    and `replay_trimmed` counts what was cut."""
    holder: HolderProcess = make_holder("--ring-bytes", "16384")  # type: ignore[operator]
    line = "\x1b[1;31mé€ red ✓\x1b[0m plain text\r\n".encode()
    cap = 16384
    count = cap // len(line) + 50
    extra = (count * len(line) - cap) % len(line)
    # Shift the cut 3 bytes into a line: inside the escape sequence.
    prefix = b"x" * ((3 - extra) % len(line))
    data = prefix + line * count
    master, slave = os.openpty()
    tty.setraw(slave)
    client = holder.client()
    try:
        client.hand_off("wrapped", master)
        os.write(slave, data)
        wait_for(lambda: any(s.id == "wrapped" and s.buffered_bytes + s.dropped_bytes
                             == len(data) for s in client.list()), 10, "everything drained")
        retrieved = client.retrieve("wrapped")
        try:
            assert retrieved.replay_trimmed > 0
            assert retrieved.replay.startswith(line)
            assert retrieved.dropped_bytes + retrieved.replay_trimmed + len(retrieved.replay) \
                == len(data)
            assert retrieved.replay == data[len(data) - len(retrieved.replay):]
        finally:
            os.close(retrieved.fd)
    finally:
        os.close(master)
        os.close(slave)


def test_drops_delivered_into_custody_are_not_counted_again(make_holder: object) -> None:
    """A session whose ring overflowed is retrieved into custody without a journal: that
    replay is the app's, drops and all. Custody ends and the program prints a little more.
    The next replay is that, whole: nothing dropped (`dropped_bytes` 0), nothing cut from
    its head (`replay_trimmed` 0). Counted again, the old drops made the next app cut the
    first line off a replay that had lost nothing, and say output was lost."""
    holder: HolderProcess = make_holder("--ring-bytes", "16384")  # type: ignore[operator]
    flood = b"".join(f"flood line {i:05d}\r\n".encode() for i in range(2000))  # 36 KB
    after = b"printed after custody\r\n"
    master, slave = os.openpty()
    tty.setraw(slave)
    client = holder.client()
    try:
        client.hand_off("tab", master)
        os.write(slave, flood)
        wait_for(lambda: any(s.id == "tab" and s.buffered_bytes + s.dropped_bytes
                             == len(flood) for s in client.list()), 10, "the flood drained")
        with client.custody() as custody:
            first = custody.retrieve("tab")
            os.close(first.fd)
            assert first.dropped_bytes > 0 and first.replay_trimmed > 0  # it overflowed
        os.write(slave, after)
        wait_for(lambda: any(s.id == "tab" and s.state == "draining"
                             and s.buffered_bytes == len(after) for s in client.list()),
                 10, "the line printed after custody drained")
        second = client.retrieve("tab")
        os.close(second.fd)
        assert (second.dropped_bytes, second.replay_trimmed) == (0, 0), \
            "drops delivered into custody were counted again"
        assert second.replay == after
    finally:
        os.close(master)
        os.close(slave)


def test_update_keeps_size_and_meta_current(holder: HolderProcess) -> None:
    master, slave = os.openpty()
    client = holder.client()
    try:
        with client.custody() as custody:
            custody.deposit("tab", master, cols=80, rows=24, meta={"cwd": "/"})
            custody.update("tab", cols=132, rows=50)
            (info,) = client.list()
            assert (info.cols, info.rows, info.meta) == (132, 50, {"cwd": "/"})
            custody.update("tab", meta={"cwd": "/tmp", "title": "vim"})
            (info,) = client.list()
            assert (info.cols, info.rows, info.meta) == (132, 50, {"cwd": "/tmp",
                                                                   "title": "vim"})
        retrieved = client.retrieve("tab")
        assert (retrieved.session.cols, retrieved.session.rows) == (132, 50)
        os.close(retrieved.fd)
    finally:
        os.close(master)
        os.close(slave)


def test_reclaim_into_custody_with_a_live_other_instance_reports_custody_held(
    holder: HolderProcess, apps: Callable[..., App], tmp_path: Path
) -> None:
    """Launch race: another instance of the app is alive and holds the session. Its
    reclaim reports CustodyHeld within 2 s, not after the whole deadline, and not as a
    holder that does not answer."""
    apps("other", "new")
    client = holder.client()
    with client.custody() as custody:
        started = time.monotonic()
        report = custody.reclaim_all(deadline=8.0)
        took = time.monotonic() - started
    assert isinstance(report.failed["tab"], CustodyHeld)
    assert not report.retrieved
    assert took < 2.0, f"took {took:.2f}s"
    assert state_of(client, "tab") == "held"


def test_many_sessions_come_back_over_the_custody_connection(holder: HolderProcess) -> None:
    """One request reclaims them all: no connection per session."""
    client = holder.client()
    pairs = [os.openpty() for _ in range(40)]
    try:
        for i, (master, _) in enumerate(pairs):
            client.hand_off(f"s{i}", master)
        connections = client.status().counters["connections"]
        with client.custody() as custody:
            report = custody.reclaim_all()
            assert sorted(report.retrieved) == sorted(f"s{i}" for i in range(40))
            assert not report.failed
            assert {s.state for s in client.list()} == {"held"}
            # This custody, the list just now and this status: nothing per session.
            assert client.status().counters["connections"] - connections == 3
            for i in range(40):
                custody.release(f"s{i}")
        for retrieved in report.retrieved.values():
            os.close(retrieved.fd)
    finally:
        for master, slave in pairs:
            os.close(master)
            os.close(slave)
