"""`escrowctl upgrade`: replace the running holder with the installed code, every session
intact (DESIGN §11).

SIGHUP to its keeper, or a restart of its systemd unit, once `escrow_client.control` has
proven which process that is; then wait for the new holder. A holder with no fd store is not
touched: replacing it would drop its sessions.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time

from .. import control, errors, paths
from ..liveness import STATUS_TIMEOUT, holder_verdict
from . import Failed
from .arguments import add_sub_timeout, admin, positive

DEFAULT_UPGRADE_WAIT = 30.0  # the new code is tried, the old holder winds up, the new adopts
UPGRADE_NO_NEW_HOLDER = 5  # asked for, but no new holder answered within --wait seconds


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "upgrade", help="replace the holder with the installed code, keeping every session",
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
    if before.fd_store == "keeper":
        os.kill(who.pid, signal.SIGHUP)
    elif before.fd_store == "systemd":
        done = subprocess.run(["systemctl", "--user", "restart", "escrowd.service"],
                              capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise Failed(f"systemctl --user restart escrowd.service failed: "
                         f"{done.stderr.strip()}")
    else:
        raise Failed(f"escrowd (pid {who.pid}) keeps no fd store: replacing it would drop "
                     "every session it holds. Run escrowd with its keeper (plain `escrowd`) "
                     "or under systemd to upgrade in place.")
    client = admin(args)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            after = client.status()
            if after.instance != before.instance:
                break
        except errors.EscrowError:
            pass
        if time.monotonic() >= deadline:
            raise Failed(f"no new holder answered within {args.wait:g}s (the sessions stay "
                         "with the keeper or systemd, and it keeps trying)",
                         UPGRADE_NO_NEW_HOLDER)
        time.sleep(0.05)
    print(f"upgraded escrowd {before.version} (pid {before.pid}) -> {after.version} "
          f"(pid {after.pid}) on {socket_path}: {after.adopted} session(s) adopted")
    return 0
