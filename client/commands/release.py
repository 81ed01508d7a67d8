"""`escrowctl release OWNER/ID`: make the holder close its copy of a session's terminal.

A session that has already ended (a tombstone: released, handed off, expired) has no copy
left to close: that is said, and is no failure, so that releasing twice is harmless."""

from __future__ import annotations

import argparse

from . import describe
from .arguments import add_session_ref, client

TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from ..client import EscrowClient

# How each tombstone is said: what became of the session.
_ENDED = {
    "released": "was already released",
    "handed_off": "was already handed off to an app",
    "expired": "had already expired unclaimed",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Make the holder close its copy of a session's terminal (as when the user "
        "closes the tab). If no app holds the terminal either, its programs get SIGHUP. A "
        "session that had ended already (exited and released, handed off, expired) is said "
        "to be so, exit 0: the holder holds no copy of it.",
        epilog="exit status: 0 released, or no copy of it was left to release; 1 an unknown "
        "session (`unknown`: never deposited, or ended too long ago to remember), or any "
        "other error.",
    )
    add_session_ref(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import errors

    owner, sid = args.session
    holder = client(args, owner)
    try:
        holder.release(sid)
    except (errors.Released, errors.HandedOff, errors.Expired) as exc:
        print(f"{owner}/{sid} {_ENDED[exc.code]}{_ago(holder, sid)}: escrowd holds no copy "
              "of it")
        return 0
    print(f"released {owner}/{sid}: escrowd closed its copy of the terminal")
    return 0


def _ago(holder: EscrowClient, sid: str) -> str:
    """` 3m20s ago`, from the session's tombstone; nothing if it cannot be had."""
    import time

    from .. import errors
    from .text import duration

    try:
        info = next((s for s in holder.list() if s.id == sid), None)
    except errors.EscrowError:
        return ""
    return "" if info is None else f" {duration(time.time() - info.state_since)} ago"
