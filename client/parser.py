"""`escrowctl`'s command line: every verb named, with its line of help, and a verb's module
imported only when argparse reaches it.

People type `escrowctl status` and scripts call it in loops, and every module imported is
time before the answer: `--help` imports no verb at all, and a verb's `--help` or its run
imports that verb alone (bench/cli_calls.py measures it, tests/test_cli_imports.py pins
it). This module is itself imported only past `escrowctl --version`, which `cli.main`
answers before argparse is loaded; the `--version` here answers it anywhere else on the
line (`escrowctl --socket PATH --version`, `escrowctl list --version`), in the same words.
"""

from __future__ import annotations

import argparse
import importlib

from . import __version__, paths
from .deadlines import DEFAULT_TIMEOUT, STATUS_TIMEOUT

TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from collections.abc import Sequence

# Each verb: its name, its module in `commands`, and its line in `escrowctl --help`, in the
# order that lists them. Only the verb named is imported (`_Verbs`).
VERBS: tuple[tuple[str, str, str], ...] = (
    ("status", "status", "is a holder running?"),
    ("stop", "stop", "stop the holder (refuses while it holds sessions)"),
    ("upgrade", "upgrade", "replace the holder with the installed code, keeping every session"),
    ("list", "list", "list escrowed sessions (every owner's by default)"),
    ("release", "release", "make the holder drop its copy of a session"),
    ("kill", "kill", "end a session's program (SIGHUP, then SIGKILL) and release it"),
    ("attach", "attach", "attach this terminal to an escrowed session"),
    ("run", "run", "run a command in a new escrowed session, attached to this terminal"),
    ("wait", "wait", "wait for the program of a session `run` started to end"),
    ("install-service", "install_service",
     "write the systemd units or the LaunchAgent for this escrowd"),
    ("uninstall-service", "uninstall_service",
     "disable and remove the service files install-service wrote"),
    ("demo", "demo", "watch a shell survive its app's restart"),
    ("completion", "completion", "print a completion script for bash, zsh or fish"),
)
_MODULES = {name: module for name, module, _ in VERBS}


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
        # argparse leaves what the verb did not know to the top parser, whose error would
        # show the top usage: the verb's own usage says what it takes.
        unknown = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if verb is not None and unknown:
            verb.error(f"unrecognized arguments: {' '.join(unknown)}")


class _Version(argparse.Action):
    """`--version`, printed as it is: argparse's own formats it as help text, which imports
    `shutil` and `textwrap` (and `shutil` the compression modules) to wrap one line."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None,
                 option_string: str | None = None) -> None:
        print(f"escrowctl {__version__}")  # cli.main's own answer, in the same words
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="escrowctl",
        description="Look at escrowd, the holder that keeps terminal sessions alive while "
        "their app restarts, and at the sessions it holds.",
        epilog="Exit status: 0 on success; 2 for bad arguments (nothing is sent); 1 for an "
        "error, said on stderr; status and stop have codes of their own, which their --help "
        "lists; run exits with its program's status; 130 on Ctrl-C.",
    )
    add_version(parser)
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
        verb = subparsers.add_parser(name, help=line)
        add_version(verb)
    return parser


def every_verb(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each verb's parser, by name, with its arguments (every verb's module imported): for
    what describes the whole command line (completion, the man page), never for a call."""
    verbs = next(a for a in parser._actions if isinstance(a, _Verbs))
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, module, _ in VERBS:
        verb = verbs._name_parser_map[name]
        if not verb.get_default("func"):
            importlib.import_module(f"{__package__}.commands.{module}").add_arguments(verb)
        parsers[name] = verb
    return parsers


def add_version(parser: argparse.ArgumentParser) -> None:
    """`--version`, on the top parser and on each verb's (`escrowctl list --version`)."""
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show program's version number and exit")


def _positive(text: str) -> float:
    from .commands.arguments import positive  # a bad --timeout is rare: import it then

    return positive(text)
