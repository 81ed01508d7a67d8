"""The verbs of `escrowctl`, one module each: `status`, `stop`, `upgrade`, `list`, `release`,
`kill`, `attach`, `run`, `install_service`, `uninstall_service`, `demo`, `completion`, `wait`.

A subpackage rather than flat `cmd_*.py` modules beside the library: nine verbs and what they
share would more than double the files in `escrow_client`, and mix the command line (argument
types, tables, messages) into a directory whose every other module an app may import. Here
the library stays one listing, and the command line another.

Each verb module has the same two functions (`Verb`):

- `add_arguments(p)`: its options and its `--help` (`describe`), on the subcommand's
  parser, with `set_defaults(func=run)` (and `default_timeout=` for the verbs that only
  look or signal);
- `run(args) -> int`: the verb, a thin layer over the library, returning its exit status.

Its name and one line of help are `escrow_client.parser.VERBS`'s, so that `escrowctl --help`
lists every verb while importing none: a verb's module, and what it needs, is imported only
when that verb runs (or shows its own `--help`).

A verb that cannot do what it was asked raises `Failed`; a library error (`EscrowError`)
it lets through. `escrow_client.cli.main` turns either into a line on stderr and an exit
status: the policy lives there, once. (`demo` alone tells its own failures, as
`escrowctl demo: ...` lines among its narration.)

`arguments` holds the options more than one verb takes, `text` how figures are written.
"""

from __future__ import annotations

import argparse

# `typing` is not among what `escrowctl status` imports; mypy takes any TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    class Verb(Protocol):
        """What `escrow_client.cli` asks of a verb module."""

        def add_arguments(self, p: argparse.ArgumentParser) -> None: ...

        def run(self, args: argparse.Namespace) -> int: ...


def describe(p: argparse.ArgumentParser, description: str, epilog: str | None = None,
             formatter_class: type[argparse.HelpFormatter] | None = None) -> None:
    """A verb's `--help` text, on the parser `cli` made for it."""
    p.description = description
    p.epilog = epilog
    if formatter_class is not None:
        p.formatter_class = formatter_class


class Failed(Exception):
    """The verb could not do what it was asked: `escrowctl: <message>` on stderr, and exit
    status `status` (a verb's own codes are listed in its `--help`)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status
