"""The man pages of `escrowctl` and `escrowd`, written in roff from their parsers.

`render` turns a parser (and, for `escrowctl`, each verb's) into a page: the synopsis
argparse would print, the description, every option with its help, each verb with its
options and its epilog (the exit codes a verb's `--help` names), and the exit status the
top parser's epilog gives. The pages are files in the repository (share/man/man1), written
by `scripts/generate` (`python -m escrow_client.manpage DIR`) and installed with the
package; tests/test_manpage.py fails when they are not what the parsers say now.

A page is the same wherever it is written: the help that says what this machine's
default is (`--socket`'s path here and now, the escrowd `install-service` finds) says it
in general words here (`_LOCAL`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import __version__


def _roff(text: str) -> str:
    """Text as roff reads it literally: backslashes and hyphens escaped, and no line that
    starts with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line
                     for line in text.split("\n"))


def _prose(text: str) -> str:
    return _roff(" ".join(text.split()))


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=10_000)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups,
                        prefix="")
    return formatter.format_help().strip()


def _options(parser: argparse.ArgumentParser, local: Mapping[str, str]) -> list[str]:
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            value = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
            name = ", ".join(f"\\fB{_roff(o)}\\fR{_roff(value)}" for o in action.option_strings)
        else:
            name = f"\\fI{_roff(str(action.metavar or action.dest))}\\fR"
        text = action.help or ""
        for machine, general in local.items():
            text = text.replace(machine, general)
        lines += [".TP", name, _prose(text)]
    return lines


def _epilog(parser: argparse.ArgumentParser) -> list[str]:
    if not parser.epilog:
        return []
    if isinstance(parser.formatter_class, type) and issubclass(
            parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        return [".PP", ".nf", _roff(parser.epilog.rstrip("\n")), ".fi"]
    return [".PP", _prose(parser.epilog)]


def render(parser: argparse.ArgumentParser, summary: str,
           verbs: Mapping[str, argparse.ArgumentParser] | None = None,
           local: Mapping[str, str] | None = None) -> str:
    """The page of `parser`'s program: `summary` its line in NAME, `verbs` its subcommands'
    parsers, `local` what help says of this machine, and what the page says instead."""
    local = local or {}
    prog = parser.prog
    lines = [f'.TH {prog.upper()} 1 "" "fd-escrow {__version__}" "User Commands"',
             ".nh", ".ad l", ".SH NAME", f"{prog} \\- {_prose(summary)}",
             ".SH SYNOPSIS", f".B {_roff(_usage(parser))}",
             ".SH DESCRIPTION", _prose(parser.description or ""),
             ".SH OPTIONS", *_options(parser, local)]
    if verbs:
        lines.append(".SH COMMANDS")
        for name, verb in verbs.items():
            lines += [f".SS {_roff(name)}", f".B {_roff(_usage(verb))}", ".PP",
                      _prose(verb.description or ""), *_options(verb, local), *_epilog(verb)]
    if parser.epilog:
        lines += [".SH EXIT STATUS", _prose(parser.epilog)]
    return "\n".join(line for line in lines if line) + "\n"


def pages() -> dict[str, str]:
    """Each page's file name and text: `escrowctl.1` and `escrowd.1`."""
    from escrowd.__main__ import _parser as escrowd_parser

    from . import paths, service_files
    from .parser import build_parser, every_verb

    top = build_parser()
    local = {
        f"; here and now: {paths.default_socket_path()}": "; `escrowctl --help` shows the "
        "path it resolves to here and now",
        shlex.join(service_files.escrowd_command()): "the escrowd installed with this escrowctl",
    }
    escrowd = escrowd_parser()
    return {
        "escrowctl.1": render(top, "look at escrowd and its sessions, attach to them, run "
                              "commands in new ones", every_verb(top), local),
        "escrowd.1": render(escrowd, "the holder that keeps terminal sessions open while "
                            "their app restarts"),
    }


def main(argv: Sequence[str]) -> int:
    """`python -m escrow_client.manpage DIR`: write every page into DIR."""
    [directory] = argv
    for name, text in pages().items():
        (Path(directory) / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

