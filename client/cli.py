"""`escrowctl`: look at the holder, its sessions, and take a relaunch for a test drive;
attach a terminal to a session, or run a command in a new one.

Each verb is a module of `escrow_client.commands`, a thin layer over the library
(`EscrowClient`, `liveness.holder_verdict`, `control`, `service_files`, `demo`); nothing
here speaks the protocol itself. This module assembles the command line from the verbs'
own parsers and holds the exit-status policy:

- 0 on success; 2 for bad arguments (argparse, before anything is sent);
- 1 for an `EscrowError`, printed as `escrowctl: <message> (<code>)`, or for a service file
  that cannot carry a path (`ServiceFileError`);
- a verb's own refusal (`commands.Failed`): `escrowctl: <message>`, and the status it names.
  `status` and `stop` have codes of their own (`STATUS_EXIT_CODES`, `STOP_*`), listed in
  their `--help`; `run` exits with its program's status;
- 0 when stdout's reader has gone (`escrowctl status | head -1`), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import __version__, errors, paths, service_files
from .client import DEFAULT_TIMEOUT
from .commands import (
    Failed,
    Verb,
    attach,
    demo,
    install_service,
    release,
    run,
    status,
    stop,
    upgrade,
)
from .commands import list as list_
from .commands.arguments import positive
from .commands.status import STATUS_EXIT_CODES
from .commands.stop import (
    STOP_CANNOT_TELL,
    STOP_NOT_PERMITTED,
    STOP_NOT_RUNNING,
    STOP_REFUSED,
    STOP_STILL_RUNNING,
    STOP_STOPPED,
)
from .liveness import STATUS_TIMEOUT, Verdict, holder_verdict

__all__ = [
    "STATUS_EXIT_CODES",
    "STOP_CANNOT_TELL",
    "STOP_NOT_PERMITTED",
    "STOP_NOT_RUNNING",
    "STOP_REFUSED",
    "STOP_STILL_RUNNING",
    "STOP_STOPPED",
    "Verdict",
    "build_parser",
    "holder_verdict",
    "main",
]

# In the order `escrowctl --help` lists them.
VERBS: tuple[Verb, ...] = (status, stop, upgrade, list_, release, attach, run,
                           install_service, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="escrowctl",
        description="Look at escrowd, the holder that keeps terminal sessions alive while "
        "their app restarts, and at the sessions it holds.",
    )
    parser.add_argument("--version", action="version", version=f"escrowctl {__version__}")
    parser.add_argument(
        "--socket", metavar="PATH",
        help=f"the holder's socket (default: ${paths.SOCKET_ENV}, else "
        "$XDG_RUNTIME_DIR/escrowd/escrowd.sock, else /tmp/escrowd-<uid>/escrowd.sock; "
        f"here and now: {paths.default_socket_path()})",
    )
    parser.add_argument(
        "--timeout", type=positive, default=None, metavar="SECONDS",
        help=f"deadline for each call to the holder (default {DEFAULT_TIMEOUT:g}; for "
        f"`status` and `stop`, {STATUS_TIMEOUT:g})",
    )
    parser.add_argument("--json", dest="top_json", action="store_true",
                        help="JSON output, for the commands that have it (status, list); "
                        "the same as --json after the command")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for verb in VERBS:
        verb.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # One deadline per call: `--timeout` after the subcommand, else before it, else the
    # subcommand's own default (short for status and stop, which only look or signal).
    args.timeout = (getattr(args, "sub_timeout", None) or args.timeout
                    or getattr(args, "default_timeout", DEFAULT_TIMEOUT))
    args.json = getattr(args, "json", False) or args.top_json
    try:
        return _run(args)
    except errors.EscrowError as exc:
        print(f"escrowctl: {exc} ({exc.code})", file=sys.stderr)
        return 1
    except service_files.ServiceFileError as exc:
        print(f"escrowctl: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `escrowctl status | head -1`: the reader has what it wanted.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    """The verb's exit status, its refusal said on stderr (inside main's handlers, so that
    a reader gone or a Ctrl-C while it is said count as they do anywhere else)."""
    try:
        result: int = args.func(args)
        return result
    except Failed as exc:
        print(f"escrowctl: {exc}", file=sys.stderr)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
