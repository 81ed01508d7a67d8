"""`escrowctl`: look at the holder, its sessions, and take a relaunch for a test drive;
attach a terminal to a session, or run a command in a new one.

Each verb is a module of `escrow_client.commands`, a thin layer over the library
(`EscrowClient`, `liveness.holder_verdict`, `control`, `service_files`, `demo`); nothing
here speaks the protocol itself. The command line is `parser`'s, which imports only the
verb it names; this module holds the exit-status policy. People type `escrowctl status`
and scripts call it in loops, and every module imported is time before the answer: a
command line that starts with `--version` is answered before anything else, argparse
included, is imported (the parser answers it anywhere else on the line, in the same
words); bench/cli_calls.py measures it, tests/test_cli_imports.py pins it. So is
`_complete sessions`, the shells' question at each Tab (`completion`), which no `--help`
lists.

Exit status:

- 0 on success; 2 for bad arguments (argparse, before anything is sent);
- 1 for an `EscrowError`, printed as `escrowctl: <message> (<code>)`;
- a verb's own refusal (`commands.Failed`): `escrowctl: <message>`, and the status it names.
  `status` and `stop` have codes of their own (`STATUS_EXIT_CODES`, `STOP_*`), listed in
  their `--help`; `run` exits with its program's status;
- 0 when stdout's reader has gone (`escrowctl status | head -1`), 130 on Ctrl-C.
"""

from __future__ import annotations

import os
import sys

from . import __version__

TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    import argparse
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
    from .parser import VERBS, build_parser

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

# The names this module gave before the parser and the verbs were imported lazily, from
# where they live.
_MOVED = {
    "STATUS_EXIT_CODES": "commands.status", "STOP_CANNOT_TELL": "commands.stop",
    "STOP_NOT_PERMITTED": "commands.stop", "STOP_NOT_RUNNING": "commands.stop",
    "STOP_REFUSED": "commands.stop", "STOP_STILL_RUNNING": "commands.stop",
    "STOP_STOPPED": "commands.stop", "Verdict": "liveness", "holder_verdict": "liveness",
    "VERBS": "parser", "build_parser": "parser",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["--version"]:
        # What argparse would do with it, first on the line: print, exit 0, whatever
        # follows (its action runs before anything after it is looked at).
        print(f"escrowctl {__version__}")
        return 0
    if words[:2] == ["_complete", "sessions"]:  # a Tab's question: see `completion`
        from .completion import print_sessions

        return print_sessions(words[2:])
    from . import errors
    from .deadlines import DEFAULT_TIMEOUT
    from .parser import build_parser

    args = build_parser().parse_args(words)
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
    from . import waiting
    from .commands import Failed
    from .commands.waits import tell

    waiting.tell_with(tell)  # a person reads this: a long wait is said (waiting.py)
    try:
        result: int = args.func(args)
        return result
    except Failed as exc:
        print(f"escrowctl: {exc}", file=sys.stderr)
        return exc.status
    finally:
        waiting.tell_with(None)  # main called in process: its caller is told nothing after


if __name__ == "__main__":
    sys.exit(main())
