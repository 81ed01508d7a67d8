"""`escrowctl run -- COMMAND`: start a command in a new escrowed session and attach this
terminal to it (`escrow_client.attach.run` does it); the exit status is the program's when
it ends while attached."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import uuid

from .. import attach, takeover
from ..protocol import HolderStatus
from . import Failed, describe
from .arguments import ADMIN_OWNER, add_detach_key, client, name
from .attach import ended


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Start COMMAND (default: $SHELL) in a new terminal the size of this one, "
        "escrow it, and attach this terminal to it (see `escrowctl attach`). Detach with "
        "the detach key: the program runs on, the holder drains its output, and `escrowctl "
        "attach OWNER/ID` picks it up from any terminal. When the program ends while "
        "attached, escrowctl exits with its status (128+N for signal N).",
        epilog="exit status: the program's when it ends while attached (128+N for signal "
        "N); 0 on a detach; 125 if the program ended but nobody can know how (it was "
        "orphaned where no keeper could keep its status); 1 if its status could not be "
        "asked of the holder; 126 or 127 as a shell says it if the command cannot run.",
    )
    p.add_argument("--owner", type=name, default=ADMIN_OWNER,
                   help=f"the session's owner (default {ADMIN_OWNER})")
    p.add_argument("--id", type=name, help="the session's id (default: the program's name "
                   "and a random suffix, e.g. bash-3f9a1c)")
    p.add_argument("--label", help="the label `escrowctl list` shows (default: the command)")
    add_detach_key(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command and its arguments (default: $SHELL, else /bin/sh)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        command = [os.environ.get("SHELL") or "/bin/sh"]
    sid = args.id or _run_id(command[0])
    label = args.label if args.label is not None else shlex.join(command)[:256]
    attach.LocalTerminal()  # no terminal to attach: said before a holder is started for it
    # A holder is started for the session's start only: one that dies while attached is
    # not replaced behind the user's back (the attachment says it is gone).
    _announce(args, client(args, args.owner, autostart=True).status(), sid)
    takeover.catch_stray()
    try:
        ending = attach.run(client(args, args.owner), command, sid, label, args.detach_key,
                            exiting=True, takeover=True)
    except attach.CannotRun as exc:
        raise Failed(str(exc), exc.status) from None
    return ended(args, args.owner, sid, ending)


def _announce(args: argparse.Namespace, status: HolderStatus, sid: str) -> None:
    """Say, before attaching, whether this call started the holder, and how to come back."""
    from ..autostart import started_here

    socket = ["--socket", args.socket] if args.socket else []
    pid = started_here(status)
    if pid is not None:
        stop = shlex.join(["escrowctl", *socket, "stop"])
        print(f"escrowctl: started a holder (pid {pid}) on {status.socket}; it keeps running "
              f"after this session ends; `{stop}` stops it", file=sys.stderr)
    name = attach.key_name(args.detach_key)
    key = ("no detach key" if args.detach_key is None
           else "detach with " + (f"Ctrl-{name[1:]}" if name != "^?" else name))
    back = shlex.join(["escrowctl", *socket, "attach", f"{args.owner}/{sid}"])
    print(f"escrowctl: session {args.owner}/{sid}; {key}, back with {back}", file=sys.stderr,
          flush=True)


def _run_id(program: str) -> str:
    """A new session id for `run`, named for the program: `bash-3f9a1c`."""
    stem = re.sub(r"[^A-Za-z0-9._:@-]", "_", os.path.basename(program))[:64] or "run"
    return f"{stem}-{uuid.uuid4().hex[:6]}"
