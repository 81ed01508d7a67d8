"""`escrowctl list`: the escrowed sessions, every owner's (or one owner's), as a table or
as JSON; the live ones (exited ones too: their output is buffered, and they can be
attached), or with `--all` the tombstones too (released, handed_off, expired).
EXIT says how a program the holder started ended; the last column whether `escrowctl
attach` can take a session now, and if not, who has it."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import msgspec

from .. import liveness
from ..protocol import LIVE_STATES, SessionInfo
from .arguments import admin, client
from .text import ALIVE, duration, print_json, size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--owner", metavar="OWNER",
                   help="only this owner's sessions (default: every owner's)")
    p.add_argument("--json", action="store_true", help="print a JSON list of sessions")
    p.add_argument("--all", action="store_true", help="the tombstones too: sessions "
                   "released, handed_off or expired lately")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.owner is None:
        sessions = admin(args).list(all_owners=True)
    else:
        sessions = client(args, args.owner).list()
    if not args.all:
        sessions = [s for s in sessions if s.state in LIVE_STATES]
    if args.json:
        print_json([msgspec.to_builtins(s) for s in sessions])
    elif not sessions:
        where = f" of {args.owner}" if args.owner else ""
        print(f"no sessions{where}")
    else:
        print(_session_table(sessions, time.time()))
    return 0


def _session_table(sessions: Sequence[SessionInfo], now: float) -> str:
    header = ("SESSION", "STATE", "LABEL", "CHILD", "ALIVE", "EXIT", "BUFFERED", "DROPPED",
              "AGE", "ATTACH")
    rows = [header] + [
        (
            f"{s.owner}/{s.id}",
            s.state,
            s.label or "-",
            str(s.child_pid) if s.child_pid is not None else "-",
            ALIVE[s.child_alive],
            _exit(s),
            size(s.buffered_bytes),
            size(s.dropped_bytes),
            duration(now - s.state_since),
            _attachable(s),
        )
        for s in sessions
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {6, 7, 8}  # numbers line up on the right
    return "\n".join(
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
        for row in rows
    )


def _exit(s: SessionInfo) -> str:
    """How the program ended: its code, or the signal that killed it; `?` when nobody can
    know; `-` while it runs, or for a program the holder did not start."""
    ending = s.exit_status
    if ending is None:
        return "-"
    if isinstance(ending, str):
        return "?"
    if ending.code is not None:
        return str(ending.code)
    import signal

    try:
        return signal.Signals(ending.signal or 0).name
    except ValueError:
        return f"SIG{ending.signal}"


def _attachable(s: SessionInfo) -> str:
    """Whether `escrowctl attach` can pick the session up now, and if not, who has it."""
    if s.state == "draining":
        return "yes"
    if s.state == "exited":
        return "yes (ended)"
    if s.state == "held":
        if s.custodian_pid is None:
            return "no: held"
        name = liveness.process_name(s.custodian_pid)
        return f"no: held by pid {s.custodian_pid}" + (f" ({name})" if name else "")
    if s.state == "handing_off":
        return "no: being retrieved"
    return "-"
