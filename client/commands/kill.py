"""`escrowctl kill OWNER/ID`: end a session's program and release the session
(`escrow_client.kill` does it, signalling only what the kernel names as its terminal's)."""

from __future__ import annotations

import argparse

from . import Failed, describe
from .arguments import add_session_ref, client, positive

KILL_NO_SUCH_SESSION = 3
KILL_REFUSED = 4
KILL_NOT_ENDED = 5
KILL_HELD_OPEN = 6
_GRACE = 3.0  # escrow_client.kill.DEFAULT_GRACE, without importing it for --help


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="End a session's program and release the session. The session is taken "
        "into custody (as attach does); the kernel names the processes whose terminal it is "
        "(its session leader and its foreground process group); those get SIGHUP, as on a "
        "hangup; if the terminal has not hung up after the grace, every process of its "
        "session gets SIGKILL. No other process is signalled: not even the pid the app "
        "gave, if it is not in the terminal's session. A session whose program has already "
        "ended is only released.",
        epilog=f"exit status: 0 ended (its terminal hung up) and released; "
        f"{KILL_NO_SUCH_SESSION} no such session here (unknown; released or expired; or "
        f"handed off to an app, which holds it now); "
        f"{KILL_REFUSED} refused, nothing signalled (an app or another attach holds the "
        f"session, or the kernel cannot say whose its terminal is); {KILL_NOT_ENDED} a "
        "process of its session still runs (after SIGKILL, or another user's): the session "
        f"stays escrowed; {KILL_HELD_OPEN} its session's processes have ended but something "
        "else holds its terminal open: the session stays escrowed; 1 any other error.",
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
    except errors.HandedOff:
        raise Failed(f"{owner}/{sid} was handed off to an app, which holds it now: close it "
                     "there", KILL_NO_SUCH_SESSION) from None
    except (errors.SessionUnknown, errors.Released, errors.Expired) as exc:
        what = "is unknown to the holder" if exc.code == "unknown" else f"is {exc.code}"
        raise Failed(f"{owner}/{sid} {what}: there is nothing to kill",
                     KILL_NO_SUCH_SESSION) from None
    except kill.Refused as exc:
        raise Failed(f"{owner}/{sid}: not killed: {exc} ({exc.code})", KILL_REFUSED) from None
    except kill.NotEnded as exc:
        code = KILL_HELD_OPEN if exc.code == "held_open" else KILL_NOT_ENDED
        raise Failed(f"{owner}/{sid}: not ended: {exc} ({exc.code})", code) from None
    print(f"killed {owner}/{sid}: {kill.describe(killed)}")
    return 0
