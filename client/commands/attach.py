"""`escrowctl attach OWNER/ID`: attach this terminal to an escrowed session
(`escrow_client.attach` does it), and say how the attachment ended.

`ended` is shared with `escrowctl run`, which ends the same way.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .. import attach, takeover
from . import describe
from .arguments import add_detach_key, add_session_ref, client


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Take a session into custody and attach this terminal to it: the "
        "screen is reset, the session's replay written and its program made to redraw; "
        "then what you type goes to the program and what it prints comes here, without "
        "passing through the holder. The detach key, or losing this terminal, ends "
        "custody: the holder drains the session again, and it can be attached again. A "
        "session an app holds is left alone: the answer names the pid that holds it. If "
        "the program ends while attached, the session is released.",
    )
    add_session_ref(p)
    p.add_argument("-d", "--steal", action="store_true",
                   help="if another escrowctl attach (or run) has the session, make it "
                   "detach and attach here; an app's is still left alone")
    add_detach_key(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    owner, sid = args.session
    takeover.catch_stray()
    ending = attach.attach(client(args, owner), sid, args.detach_key, exiting=True,
                           steal=args.steal, takeover=True, on_wait=_tell)
    return ended(args, owner, sid, ending)


def ended(args: argparse.Namespace, owner: str, sid: str, ending: attach.Ending) -> int:
    """Say how the attachment ended; the exit status. A detach is 0; the program's end is
    its status for `run` (125 if nobody can know it, 1 if it could not be asked, as for
    `escrowctl wait`), 0 for `attach` (which cannot know it)."""
    if ending.detached and ending.stalled:
        return 0  # a terminal that takes no output would block any word to it
    if ending.detached:
        again = shlex.join(["escrowctl", *(["--socket", args.socket] if args.socket else []),
                            "attach", f"{owner}/{sid}"])
        _tell(f"\nescrowctl: detached from {owner}/{sid} ({ending.why}); attach again with: "
              f"{again}")
        return 0
    if ending.unknown:
        from .wait import UNKNOWN_STATUS

        _tell(f"escrowctl: {owner}/{sid} has ended ({ending.why}), but how is unknown: it "
              "was orphaned where no keeper could keep its status")
        return UNKNOWN_STATUS
    if ending.wait_failed is not None:
        _tell(f"escrowctl: {owner}/{sid} has ended ({ending.why}), but its status could not "
              f"be asked: {ending.wait_failed}")
        return 1
    if ending.status is None:
        _tell(f"escrowctl: {owner}/{sid} has ended ({ending.why}); the holder released it")
        return 0
    return ending.status


def _tell(text: str) -> None:
    """A line on stderr, unless the terminal is gone."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass
