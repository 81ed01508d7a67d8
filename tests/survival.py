"""Three sessions that must outlive the holder (docs/design.md §11), whoever restarts it
(the keeper, systemd) and however it goes (SIGKILL, the watchdog, a restart):

- `draining`: a shell printing numbered lines (L1, L2, ...) every 20 ms, handed off;
- `exited`: a child that wrote a 200 KB tail of numbered records and exited;
- `held`: deposited under custody by a live app (a separate process) that reads it and
  appends what it reads to a file, so a test sees exactly what the app saw, even after the
  app's SIGKILL.

`start_three_sessions` sets them up; `assert_still_there` checks them after a restart
without touching them; `assert_all_survived` takes each back and checks every byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hostile import numbered_lines, read_more_lines

from conftest import PtyChild, wait_for
from escrow_client import EscrowClient

TICKER = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"]
TAIL_BYTES = 200_000
# Prints TAIL_BYTES of numbered 20-byte records, then exits: its whole tail must survive.
TAIL = ["python3", "-c",
        f"import sys; sys.stdout.write(''.join(f'T{{i:018d}}\\n' for i in "
        f"range({TAIL_BYTES} // 20)))"]
TAIL_EXPECTED = b"".join(f"T{i:018d}\r\n".encode() for i in range(TAIL_BYTES // 20))

# An app that deposits one session under custody and reads it for as long as it lives,
# appending what it reads to a file. It prints the child's pid once the deposit is
# confirmed. The child hangs up (and so goes away after a failed test) once nobody keeps
# its terminal's master.
APP = textwrap.dedent("""
    import fcntl, os, select, subprocess, sys, termios
    from escrow_client import EscrowClient
    socket_path, sid, out_path = sys.argv[1:4]
    master, slave = os.openpty()
    child = subprocess.Popen(  # its terminal's session leader: SIGHUP if it hangs up
        ["sh", "-c", "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    custody = EscrowClient("com.example.term", socket_path=socket_path).custody()
    custody.deposit(sid, master, child_pid=child.pid)
    print(child.pid, flush=True)
    out = open(out_path, "ab", buffering=0)
    while True:
        select.select([master], [], [])
        out.write(os.read(master, 65536))
""")

ALL_THERE = {"draining": "draining", "exited": "exited", "held": "held"}


def states(client: EscrowClient) -> dict[str, str]:
    return {s.id: s.state for s in client.list()}


@dataclass
class ThreeSessions:
    client: EscrowClient
    first: bytes  # what was read of `draining` before it was handed off
    app: subprocess.Popen[str]
    held_child: int  # the pid of the held session's shell
    read_by_app: Path

    def lines_read_by_app(self) -> int:
        if not self.read_by_app.exists():
            return 0  # the app has not opened it yet
        return len(numbered_lines(self.read_by_app.read_bytes()))


def start_three_sessions(
    client: EscrowClient, pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], directory: Path,
) -> ThreeSessions:
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

    read_by_app = directory / "app.out"
    assert client.socket_path is not None
    app = subprocess.Popen([sys.executable, "-c", APP, client.socket_path, "held",
                            str(read_by_app)], stdout=subprocess.PIPE, text=True)
    apps.append(app)
    assert app.stdout is not None
    held_child = int(app.stdout.readline())
    three = ThreeSessions(client, first, app, held_child, read_by_app)
    wait_for(lambda: states(client).get("held") == "held", 10.0, "the app's deposit")
    wait_for(lambda: three.lines_read_by_app() >= 5, 10.0, "the app reading its own session")
    return three


def assert_still_there(three: ThreeSessions) -> None:
    """After a restart: every session in its state, and the held one still the app's: the
    holder does not read it while the app lives."""
    client = three.client
    assert states(client) == ALL_THERE
    read_before = three.lines_read_by_app()
    wait_for(lambda: three.lines_read_by_app() >= read_before + 10, 10.0,
             "the app still reading after the holder's restart")
    info = next(s for s in client.list() if s.id == "held")
    assert info.state == "held" and info.buffered_bytes == 0, info
    assert info.custodian_pid == three.app.pid, info


def assert_all_survived(three: ThreeSessions, clean: bool) -> None:
    """Take every session back: the exited tail whole; the draining one's lines from the
    first the app read, with no gap but at most one at `replay_gap_at` (none if every
    restart was `clean`); then the app is SIGKILLed, its session drains at once and comes
    back with every line from the first the app read."""
    client = three.client
    got = client.retrieve("exited")
    try:
        assert got.replay == TAIL_EXPECTED, (len(got.replay), len(TAIL_EXPECTED))
        assert got.session.replay_gap_at is None
    finally:
        os.close(got.fd)

    got = client.retrieve("draining")
    try:
        assert got.confirmed
        if clean:
            assert got.session.replay_gap_at is None
        assert_one_stream(three.first, got.replay, read_more_lines(got.fd, b"", 5),
                          got.session.replay_gap_at)
        print(f"draining: {len(got.replay)} bytes of replay, replay_gap_at="
              f"{got.session.replay_gap_at}")
    finally:
        os.close(got.fd)

    three.app.kill()
    three.app.wait()
    wait_for(lambda: states(client).get("held") == "draining", 5.0,
             "the held session draining once its app is dead")
    got = client.retrieve("held")
    try:
        assert got.session.replay_gap_at is None  # this holder read it from the start
        assert_one_stream(three.read_by_app.read_bytes(), got.replay,
                          read_more_lines(got.fd, b"", 5), None)
    finally:
        os.close(got.fd)
        os.kill(three.held_child, signal.SIGKILL)


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
