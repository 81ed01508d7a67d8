"""A minimal terminal app for tests on a real screen: it shows one session in the terminal it
runs in (a tmux pane), as a terminal app shows a session in a window.

    screenapp.py new SOCKET ID READY -- CMD...     start CMD in a new PTY and deposit it
    screenapp.py relaunch SOCKET ID READY [--no-repaint]    take the session back

`new` starts CMD as the session leader of a new PTY the size of this terminal, deposits its
master under custody, then relays. `relaunch` takes the session back, resets this terminal,
writes the replay, repaints (unless --no-repaint) and relays. Relaying copies the PTY's
output to stdout and stdin (in raw mode) to the PTY, until either ends.

Once set up, each mode writes READY (atomically) for the test to poll: a JSON object with
its own pid, and in `new` the child's.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import subprocess
import sys
import termios
import tty

from escrow_client import Custody, EscrowClient, Retrieved, after_replay, repaint, safe_replay

OWNER = "com.example.term"


def write_ready(path: str, **info: int) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"app": os.getpid(), **info}, f)
    os.rename(path + ".tmp", path)


def start(argv: list[str]) -> tuple[int, int]:
    """CMD on a new PTY the size of this terminal, with the PTY as its controlling
    terminal: the master and the child's pid."""
    master, slave = os.openpty()
    termios.tcsetwinsize(slave, termios.tcgetwinsize(sys.stdout.fileno()))
    child = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    return master, child.pid


def take_back(custody: Custody, session_id: str) -> Retrieved:
    """The session, taken back into this app's custody (it stays escrowed)."""
    report = custody.reclaim_all()
    if session_id not in report.retrieved:
        raise SystemExit(f"screenapp: {session_id} not taken back: {report.failed}")
    return report.retrieved[session_id]


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def relay(master: int) -> None:
    """Copy the PTY's output to stdout and stdin to the PTY until either ends."""
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    saved = termios.tcgetattr(stdin)
    tty.setraw(stdin)
    try:
        while True:
            ready, _, _ = select.select([master, stdin], [], [])
            if master in ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the session's last process closed its terminal
                    return
                if not data:
                    return
                write_all(stdout, data)
            if stdin in ready:
                data = os.read(stdin, 65536)
                if not data:
                    return
                write_all(master, data)
    finally:
        termios.tcsetattr(stdin, termios.TCSAFLUSH, saved)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["new", "relaunch"])
    parser.add_argument("socket")
    parser.add_argument("id")
    parser.add_argument("ready")
    parser.add_argument("--no-repaint", action="store_true")
    parser.add_argument("command", nargs="*")
    args = parser.parse_args()
    client = EscrowClient(OWNER, socket_path=args.socket)
    stdout = sys.stdout.fileno()
    if args.mode == "new":
        master, child_pid = start(args.command)
        rows, cols = termios.tcgetwinsize(stdout)
        custody = client.custody()
        custody.deposit(args.id, master, child_pid=child_pid, cols=cols, rows=rows)
        write_ready(args.ready, child=child_pid)
    else:
        custody = client.custody()
        retrieved = take_back(custody, args.id)
        master = retrieved.fd
        # This window's size, as a terminal app gives it to a session it shows. Here it is
        # the size the session already has, which changes nothing and signals nobody.
        termios.tcsetwinsize(master, termios.tcgetwinsize(stdout))
        replay = retrieved.replay
        write_all(stdout, b"\x1bc" + safe_replay(replay) + after_replay(replay))
        if not args.no_repaint:
            repaint(master)
        write_ready(args.ready)
    relay(master)


if __name__ == "__main__":
    main()
