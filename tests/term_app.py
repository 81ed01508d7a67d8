"""The scenario app in Python, over escrow_client: the behaviour the C and Node apps match.

It keeps the contract tests/app_scenarios.py runs (client/c/examples/term-app.c is the C
one): reclaim into a custody with a journal, show each replay, repaint, read live; create
the sessions asked for that did not come back; say every lapse of protection and its end.
Its custody's watcher takes custody back by itself, where the C app's loop does.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import signal
import subprocess
import termios
from typing import Any

from escrow_client import EscrowClient

LOOP = "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--owner", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--new", action="append", default=[])
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args()
    events = os.open(os.path.join(args.out, "events"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def event(**fields: Any) -> None:
        os.write(events, (json.dumps(fields) + "\n").encode())  # one write: whole lines

    event(event="started", pid=os.getpid())
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(0)))
    screens: dict[str, int] = {}
    masters: dict[int, str] = {}

    def screen(sid: str) -> int:
        if sid not in screens:
            screens[sid] = os.open(os.path.join(args.out, f"{sid}.{os.getpid()}.out"),
                                   os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        return screens[sid]

    client = EscrowClient(args.owner, socket_path=args.socket, timeout=args.timeout)
    with client.custody() as custody:
        custody.on_change(lambda protected: event(event="protected" if protected else "lapsed"))
        report = custody.reclaim_all(deadline=8.0, journal=True)
        event(event="reclaimed", instance=report.holder_instance, adopted=report.adopted,
              restarts=report.restarts, unclean_restarts=report.unclean_restarts,
              retrieved=sorted(report.retrieved),
              failed={sid: e.code for sid, e in report.failed.items()})
        for sid, got in report.retrieved.items():
            os.write(screen(sid), got.replay)
            got.repaint()
            masters[got.fd] = sid
        for sid in args.new:
            if sid in report.retrieved:
                continue
            master, slave = os.openpty()
            termios.tcsetwinsize(master, (24, 80))
            attrs = termios.tcgetattr(slave)
            attrs[3] &= ~termios.ECHO
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            child = subprocess.Popen(
                ["sh", "-c", os.environ.get("TERM_APP_CMD", LOOP)], stdin=slave, stdout=slave,
                stderr=slave, start_new_session=True,
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
            os.close(slave)
            custody.deposit(sid, master, child_pid=child.pid, cols=80, rows=24, journal=True)
            masters[master] = sid
            event(event="created", id=sid, child_pid=child.pid,
                  journal=custody.journaled(sid))
        while True:
            readable, _, _ = select.select(list(masters), [], [])
            for fd in readable:
                sid = masters[fd]
                try:
                    data = custody.read(sid)
                except OSError:  # EIO: the terminal hung up
                    data = b""
                if not data:
                    event(event="ended", id=sid)
                    del masters[fd]
                    continue
                os.write(screen(sid), data)


if __name__ == "__main__":
    main()
