"""`escrowctl kill OWNER/ID`: end a session's program and release the session
(`escrow_client.kill` does it, signalling only what the kernel names as its terminal's)."""

from __future__ import annotations

import argparse

from . import Failed, describe
from .arguments import add_session_ref, client, positive

KILL_NO_SUCH_SESSION = 3
KILL_REFUSED = 4
KILL_NOT_ENDED = 5
_GRACE = 3.0  # escrow_client.kill.DEFAULT_GRACE, without importing it for --help


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="End a session's program and release the session. The session is taken "
        "into custody (as attach does); the kernel names the processes whose terminal it is "
        "(its session leader and its foreground process group); those get SIGHUP, as on a "
        "hangup, and SIGKILL if they have not ended after the grace. No other process is "
        "signalled: not even the pid the app gave, if the kernel does not name it. A "
        "session whose program has already ended is only released.",
        epilog=f"exit status: 0 ended and released; {KILL_NO_SUCH_SESSION} no such session "
        f"(unknown, or already ended and gone: released, handed off, expired); "
        f"{KILL_REFUSED} refused, nothing signalled (an app or another attach holds the "
        f"session, or the kernel cannot say whose its terminal is); {KILL_NOT_ENDED} the "
        "program could not be ended (still running after SIGKILL, or another user's): the "
        "session stays escrowed; 1 any other error.",
    )
    add_session_ref(p)
    p.add_argument("--grace", type=positive, default=_GRACE, metavar="SECONDS",
                   help=f"how long the program has after SIGHUP before SIGKILL (default "
                   f"{_GRACE:g})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import errors, kill

    owner, sid = args.session
    try:
        killed = kill.kill(client(args, owner), sid, args.grace)
    except (errors.SessionUnknown, errors.Released, errors.HandedOff, errors.Expired) as exc:
        what = "is unknown to the holder" if exc.code == "unknown" else f"is {exc.code}"
        raise Failed(f"{owner}/{sid} {what}: there is nothing to kill",
                     KILL_NO_SUCH_SESSION) from None
    except kill.Refused as exc:
        raise Failed(f"{owner}/{sid}: not killed: {exc} ({exc.code})", KILL_REFUSED) from None
    except kill.NotEnded as exc:
        raise Failed(f"{owner}/{sid}: could not end it: {exc}", KILL_NOT_ENDED) from None
    print(f"killed {owner}/{sid}: {kill.describe(killed)}")
    return 0
