"""`escrowctl install-service`: write the systemd user units (Linux) or the LaunchAgent
(macOS) for this installation's escrowd, and say what to run next. Starts nothing itself.

Which files, with what text, and the steps after are `service_files.install_plan`'s; this
verb writes them (or prints them, with --print).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .. import errors, service_files
from . import Failed, describe


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Write the service files that start escrowd at login and restart it if "
        "it crashes: systemd user units (escrowd.socket, escrowd.service) in "
        "~/.config/systemd/user on Linux, or a LaunchAgent in ~/Library/LaunchAgents on "
        "macOS, naming the escrowd of this installation and the socket that apps use. "
        "Arguments after -- go to escrowd (e.g. -- --unclaimed-ttl 0).",
    )
    p.add_argument("--systemd", dest="kind", action="store_const", const="systemd",
                   help="systemd user units (the default on Linux)")
    p.add_argument("--launchd", dest="kind", action="store_const", const="launchd",
                   help="a LaunchAgent (the default on macOS)")
    p.add_argument("--escrowd", metavar="PATH", help="the escrowd to run (default: "
                   f"{shlex.join(service_files.escrowd_command())})")
    p.add_argument("--print", action="store_true", help="print the files instead of writing them")
    p.add_argument("escrowd_args", nargs=argparse.REMAINDER, metavar="-- ESCROWD_ARGS",
                   help="arguments for escrowd (default: none)")
    p.set_defaults(func=run, kind="launchd" if sys.platform == "darwin" else "systemd")


def run(args: argparse.Namespace) -> int:
    extra = args.escrowd_args[1:] if args.escrowd_args[:1] == ["--"] else args.escrowd_args
    if any(a == "--socket" or a.startswith("--socket=") for a in extra):
        raise errors.EscrowConfigError("give the socket as `escrowctl --socket PATH "
                                       "install-service`, not among escrowd's arguments")
    try:
        plan = service_files.install_plan(args.kind, args.escrowd, args.socket, extra)
    except service_files.ServiceFileError as exc:  # a path a unit file cannot carry
        raise Failed(str(exc)) from None
    for path, text in plan.files.items():
        if args.print:
            print(f"# {path}\n{text}")
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as exc:
            raise errors.EscrowConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
        print(f"wrote {path}")
    if not args.print:
        print(f"escrowd: {shlex.join(plan.command)}, serving {plan.socket_path}\nnext:")
        for step in plan.next_steps:
            print(f"  {step}")
    return 0
