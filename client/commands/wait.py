"""`escrowctl wait OWNER/ID`: block until the program of a session the holder started
has ended, and exit with its status as a shell would (`escrow_client.program_wait` does
the waiting); its own exit codes say why there is none."""

from __future__ import annotations

import argparse

from .. import errors
from . import Failed, describe
from .arguments import add_session_ref, client, positive

NO_SUCH_SESSION = 122
NOT_A_PROGRAM = 123
TIMED_OUT = 124
UNKNOWN_STATUS = 125


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Wait until the program of a session the holder started (`escrowctl "
        "run`) ends, attached or not, and exit with its status: its exit code, or 128+N "
        "if signal N killed it. The wait outlives a restart of the holder.",
        epilog=f"exit status: the program's; {NO_SUCH_SESSION} no such session (or it was "
        f"forgotten); {NOT_A_PROGRAM} the holder did not start its program (an app did: "
        f"only the app can know how it ended); {TIMED_OUT} --deadline passed first; "
        f"{UNKNOWN_STATUS} the program ended but nobody can know how (it was orphaned "
        "where no keeper could keep its status); 1 the holder could not be asked.",
    )
    add_session_ref(p)
    p.add_argument("--deadline", type=positive, metavar="SECONDS", default=None,
                   help="give up after this long (default: wait as long as it runs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..program_wait import WaitTimeout, wait

    owner, sid = args.session
    try:
        ending = wait(client(args, owner), sid, args.deadline)
    except errors.SessionUnknown as exc:
        raise Failed(str(exc), NO_SUCH_SESSION) from None
    except errors.NotAProgram as exc:
        raise Failed(str(exc), NOT_A_PROGRAM) from None
    except WaitTimeout as exc:
        raise Failed(str(exc), TIMED_OUT) from None
    if isinstance(ending, str):
        raise Failed(f"the program of {owner}/{sid} ended, but how is unknown: it was "
                     "orphaned where no keeper could keep its status", UNKNOWN_STATUS)
    return ending.shell_status()
