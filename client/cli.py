"""`escrowctl`: look at the holder, its sessions, and take a relaunch for a test drive;
attach a terminal to a session, or run a command in a new one.

Each verb is a module of `escrow_client.commands`, a thin layer over the library
(`EscrowClient`, `liveness.holder_verdict`, `control`, `service_files`, `demo`); nothing
here speaks the protocol itself. This module assembles the command line from the verbs'
own arguments and holds the exit-status policy. It imports only the verb the command line
names, when argparse reaches it: people type `escrowctl status` and scripts call it in
loops, and every module imported is time before the answer (`--version` and `--help`
import no verb at all; bench/cli_calls.py measures it, tests/test_cli_imports.py pins it).

Exit status:

- 0 on success; 2 for bad arguments (argparse, before anything is sent);
- 1 for an `EscrowError`, printed as `escrowctl: <message> (<code>)`;
- a verb's own refusal (`commands.Failed`): `escrowctl: <message>`, and the status it names.
  `status` and `stop` have codes of their own (`STATUS_EXIT_CODES`, `STOP_*`), listed in
  their `--help`; `run` exits with its program's status;
- 0 when stdout's reader has gone (`escrowctl status | head -1`), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__, errors, paths
from .commands import Failed
from .deadlines import DEFAULT_TIMEOUT, STATUS_TIMEOUT

TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from collections.abc import Sequence

    from .commands.status import STATUS_EXIT_CODES
    from .commands.stop import (
        STOP_CANNOT_TELL,
        STOP_NOT_PERMITTED,
        STOP_NOT_RUNNING,
        STOP_REFUSED,
        STOP_STILL_RUNNING,
        STOP_STOPPED,
    )
    from .liveness import Verdict, holder_verdict

__all__ = [
    "STATUS_EXIT_CODES",
    "STOP_CANNOT_TELL",
    "STOP_NOT_PERMITTED",
    "STOP_NOT_RUNNING",
    "STOP_REFUSED",
    "STOP_STILL_RUNNING",
    "STOP_STOPPED",
    "VERBS",
    "Verdict",
    "build_parser",
    "holder_verdict",
    "main",
]

# Each verb: its name, its module in `commands`, and its line in `escrowctl --help`, in the
# order that lists them. Only the verb named is imported (`_Verbs`).
VERBS: tuple[tuple[str, str, str], ...] = (
    ("status", "status", "is a holder running?"),
    ("stop", "stop", "stop the holder (refuses while it holds sessions)"),
    ("upgrade", "upgrade", "replace the holder with the installed code, keeping every session"),
    ("list", "list", "list escrowed sessions (every owner's by default)"),
    ("release", "release", "make the holder drop its copy of a session"),
    ("attach", "attach", "attach this terminal to an escrowed session"),
    ("run", "run", "run a command in a new escrowed session, attached to this terminal"),
    ("install-service", "install_service",
     "write the systemd units or the LaunchAgent for this escrowd"),
    ("demo", "demo", "watch a shell survive its app's restart"),
)
_MODULES = {name: module for name, module, _ in VERBS}

# The names this module gave before it imported its verbs lazily, from where they live.
_MOVED = {
    "STATUS_EXIT_CODES": "commands.status", "STOP_CANNOT_TELL": "commands.stop",
    "STOP_NOT_PERMITTED": "commands.stop", "STOP_NOT_RUNNING": "commands.stop",
    "STOP_REFUSED": "commands.stop", "STOP_STILL_RUNNING": "commands.stop",
    "STOP_STOPPED": "commands.stop", "Verdict": "liveness", "holder_verdict": "liveness",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        return getattr(importlib.import_module(f"{__package__}.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Verbs(argparse._SubParsersAction):  # type: ignore[type-arg]
    """The subcommands, each parser left bare (a name and a line of help) until the
    command line names it: then its module is imported and adds its arguments, just
    before argparse parses the rest of the line with it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None,
                 option_string: str | None = None) -> None:
        assert isinstance(values, list) and values
        name = values[0]
        verb = self._name_parser_map.get(name)
        if verb is not None and not verb.get_default("func"):
            module = importlib.import_module(f"{__package__}.commands.{_MODULES[name]}")
            module.add_arguments(verb)
        super().__call__(parser, namespace, values, option_string)


class _Version(argparse.Action):
    """`--version`, printed as it is: argparse's own formats it as help text, which imports
    `shutil` and `textwrap` (and `shutil` the compression modules) to wrap one line."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None,
                 option_string: str | None = None) -> None:
        print(f"escrowctl {__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="escrowctl",
        description="Look at escrowd, the holder that keeps terminal sessions alive while "
        "their app restarts, and at the sessions it holds.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show program's version number and exit")
    parser.add_argument(
        "--socket", metavar="PATH",
        help=f"the holder's socket (default: ${paths.SOCKET_ENV}, else "
        "$XDG_RUNTIME_DIR/escrowd/escrowd.sock, else /tmp/escrowd-<uid>/escrowd.sock; "
        f"here and now: {paths.default_socket_path()})",
    )
    parser.add_argument(
        "--timeout", type=_positive, default=None, metavar="SECONDS",
        help=f"deadline for each call to the holder (default {DEFAULT_TIMEOUT:g}; for "
        f"`status` and `stop`, {STATUS_TIMEOUT:g})",
    )
    parser.add_argument("--json", dest="top_json", action="store_true",
                        help="JSON output, for the commands that have it (status, list); "
                        "the same as --json after the command")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       action=_Verbs)
    for name, _, line in VERBS:
        subparsers.add_parser(name, help=line)
    return parser


def _positive(text: str) -> float:
    from .commands.arguments import positive  # a bad --timeout is rare: import it then

    return positive(text)


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
