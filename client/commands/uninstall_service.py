"""`escrowctl uninstall-service`: disable and remove the systemd user units (Linux) or the
LaunchAgent (macOS) that `install-service` wrote, only those it provably wrote
(`service_removal`), and say what still runs: removing the service stops no holder.
"""

from __future__ import annotations

import argparse
import sys

from .. import service_removal
from ..liveness import Verdict
from . import describe


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Disable and remove the service files `escrowctl install-service` "
        "wrote (systemd: `systemctl --user disable`, the units removed, daemon-reload; "
        "launchd: bootout, the plist removed). A file whose text is not what install-service "
        "writes (edited, or not its own) is left, and named. A running holder is not "
        "stopped: stopping it would hang up every terminal no app holds; it is named, with "
        "its sessions, and `escrowctl stop` stops it. Nothing is removed while the "
        "service's holder holds sessions, or while that cannot be told, unless --force: "
        "without the service a crash of the holder would lose them. Exit 1 if it refused, "
        "a file was left or a command failed.",
    )
    p.add_argument("--force", action="store_true",
                   help="remove the files even though the service's holder holds sessions "
                   "(or cannot be asked); the holder is still not stopped")
    p.add_argument("--systemd", dest="kind", action="store_const", const="systemd",
                   help="systemd user units (the default on Linux)")
    p.add_argument("--launchd", dest="kind", action="store_const", const="launchd",
                   help="a LaunchAgent (the default on macOS)")
    p.set_defaults(func=run, kind="launchd" if sys.platform == "darwin" else "systemd")


def run(args: argparse.Namespace) -> int:
    removal = service_removal.find(args.kind)
    socket = service_removal.socket_of(removal)
    verdict, held = service_removal.service_holder(args.kind, socket)
    if removal.ours and held != 0 and not args.force:
        _refuse(args.kind, socket or removal.socket_path, verdict, held)
        return 1
    service_removal.remove(removal, None if held is None else held > 0)
    for line in removal.done:
        print(f"ran {line}")
    for path in removal.ours:
        print(f"removed {path}")
    for path in removal.foreign:
        print(f"left {path}: not what install-service writes (edited, or not its own); "
              "remove it yourself if it should go")
    for line in removal.failed:
        print(f"failed: {line}", file=sys.stderr)
    if not removal.ours and not removal.foreign:
        print("nothing to remove: no service files of install-service's were found")
    if verdict is not None and verdict.state == "running":
        count = "?" if held is None else str(held)
        under_systemd = verdict.holder is not None and verdict.holder.fd_store == "systemd"
        how = ("`systemctl --user stop escrowd.socket escrowd.service` stops it, and hangs "
               "up every terminal no app holds" if under_systemd else
               "`escrowctl stop` stops it (it refuses while sessions are escrowed; `--force` "
               "then hangs up the terminals no app holds)")
        print(f"the holder (pid {verdict.pid}) on {socket} still runs, holding {count} "
              f"session(s): removing the service stopped nothing. {how}")
        if args.kind == "launchd" and held != 0:
            print("the LaunchAgent was not booted out, which would have stopped it")
    elif held is None and removal.socket_path is not None:
        print(f"cannot tell whether a holder runs on {socket or removal.socket_path}: "
              "`escrowctl --socket PATH status` says more")
    return 1 if removal.foreign or removal.failed else 0


def _refuse(kind: str, socket: str | None, verdict: Verdict | None, held: int | None) -> None:
    if held is None:
        why = (f"cannot tell whether the service's holder on {socket} holds sessions"
               + (f" ({verdict.state}: {verdict.reason})" if verdict is not None else ""))
    else:
        pid = f" (pid {verdict.pid})" if verdict is not None and verdict.pid else ""
        why = f"the service's holder{pid} on {socket} holds {held} session(s)"
    stop = ("`systemctl --user stop escrowd.socket escrowd.service`" if kind == "systemd"
            else f"`escrowctl --socket {socket} stop --force`")
    print(f"refused: {why}; without the service a crash of the holder would lose them. "
          "End them first (`escrowctl release`, `escrowctl kill`), or stop the holder "
          f"with {stop}, which hangs up every terminal no app holds; then run this again. "
          "`--force` removes the files anyway. Nothing was removed.", file=sys.stderr)
