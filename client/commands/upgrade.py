"""`escrowctl upgrade`: replace the running holder with the installed code, every session
intact (docs/design.md §11).

`escrow_client.control` proves which process to signal, asks for the replacement (SIGHUP to
the keeper, or a restart of the systemd unit) and waits for the new holder; a holder with
no fd store is not touched, since replacing it would drop its sessions.
"""

from __future__ import annotations

import argparse

from .. import control, paths
from ..liveness import STATUS_TIMEOUT, holder_verdict
from . import Failed, describe
from .arguments import add_sub_timeout, admin, positive

DEFAULT_UPGRADE_WAIT = 30.0  # the new code is tried, the old holder winds up, the new adopts
UPGRADE_NO_NEW_HOLDER = 5  # asked for, but no new holder answered within --wait seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Replace the running holder with the code installed now, every session "
        "intact: its keeper (or systemd) keeps their fds while the old holder finishes the "
        "handoffs under way and stops, and the new one adopts them. A holder run with "
        "--bare outside systemd keeps no fd store and is not touched.",
    )
    p.add_argument("--wait", type=positive, default=DEFAULT_UPGRADE_WAIT, metavar="SECONDS",
                   help="how long to wait for the new holder (default "
                   f"{DEFAULT_UPGRADE_WAIT:g})")
    add_sub_timeout(p, "how long the holder has to answer")
    p.set_defaults(func=run, default_timeout=STATUS_TIMEOUT)


def run(args: argparse.Namespace) -> int:
    socket_path = paths.resolve_socket_path(args.socket)
    verdict = holder_verdict(socket_path, args.timeout)
    try:
        who = control.target(verdict)
    except control.NotProven as exc:
        raise Failed(f"not upgrading the holder on {socket_path}: {exc}") from None
    before = verdict.holder
    assert before is not None  # control.target proves a `running` verdict, which has it
    try:
        control.replace(who, before)
    except control.CannotReplace as exc:
        raise Failed(str(exc)) from None
    after = control.new_holder(admin(args).status, before, args.wait)
    if after is None:
        raise Failed(f"no new holder answered within {args.wait:g}s (the sessions stay with "
                     "the keeper or systemd, and it keeps trying)", UPGRADE_NO_NEW_HOLDER)
    print(f"upgraded escrowd {before.version} (pid {before.pid}) -> {after.version} "
          f"(pid {after.pid}) on {socket_path}: {after.adopted} session(s) adopted")
    return 0
