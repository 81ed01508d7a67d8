"""The command-line conventions every verb of `escrowctl`, and `escrowd`, keep: a bad option
is the verb's usage error, and `--version` is answered after the verb too.

(tests/test_cli_imports.py holds `--version` to the same words wherever it is, and what it
imports.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import escrow_client
import escrowd
from escrow_client import cli
from escrow_client.commands.arguments import positive
from escrow_client.parser import VERBS, build_parser, every_verb
from escrowd.__main__ import _parser as escrowd_parser
from escrowd.config import MiB


@pytest.mark.parametrize("verb", [name for name, _, _ in VERBS])
def test_a_verbs_bad_option_shows_the_verbs_usage(verb: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`escrowctl list --bogus` was the top parser's error, with the top usage: the usage
    said nothing of what `list` takes."""
    with pytest.raises(SystemExit) as stopped:
        cli.main([verb, "--bogus"])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"usage: escrowctl {verb} "), err
    # (A verb whose session is missing says so first; `run` takes what follows as its
    # command, and refuses it as an option before it.)
    assert f"\nescrowctl {verb}: error: " in err, err


@pytest.mark.parametrize("argv", [["list", "--bogus"], ["status", "--json", "--bogus", "x"],
                                  ["release", "a/b", "--bogus"]])
def test_unrecognized_arguments_are_the_verbs_error(argv: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    rest = " ".join(argv[argv.index("--bogus"):])
    assert err.startswith(f"usage: escrowctl {argv[0]} "), err
    assert err.endswith(f"escrowctl {argv[0]}: error: unrecognized arguments: {rest}\n"), err


def test_top_level_errors_keep_the_top_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--bogus", "list"], ["nosuch"]):
        with pytest.raises(SystemExit) as stopped:
            cli.main(argv)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: escrowctl [-h]") and "escrowctl: error:" in err, err


@pytest.mark.parametrize("verb", [name for name, _, _ in VERBS])
def test_every_verb_answers_version(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main([verb, "--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr() == (f"escrowctl {escrow_client.__version__}\n", "")


def test_escrowd_answers_version() -> None:
    result = subprocess.run([sys.executable, "-m", "escrowd", "--version"], capture_output=True,
                            text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stdout, result.stderr) == (
        0, f"escrowd {escrowd.__version__}\n", "")


def every_parser() -> dict[str, argparse.ArgumentParser]:
    """`escrowctl`'s parser, each verb's (every verb's arguments added), and `escrowd`'s."""
    top = build_parser()
    return {"escrowctl": top, **{f"escrowctl {name}": verb
                                 for name, verb in every_verb(top).items()},
            "escrowd": escrowd_parser()}


@pytest.mark.parametrize("program", list(every_parser()))
def test_every_option_has_help_that_gives_its_default(program: str) -> None:
    """Each option's help says what it is and what it is when not given. Exempt, because
    they have no default to give: a flag (off unless given, as every flag is), and an
    argument that must be given. A number of seconds or bytes given as the default is the
    parser's default."""
    wanting = []
    for action in every_parser()[program]._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            wanting.append(f"{name}: no help")
            continue
        if action.nargs == 0 or (not action.option_strings and action.required):
            continue
        if "default" not in action.help:
            wanting.append(f"{name}: its help does not give its default: {action.help!r}")
        default = action.default
        if action.type in (int, float, positive) and isinstance(default, int | float):
            said = {f"{default:g}", f"{default // MiB:g} MiB"}
            if not any(f"default {s}" in action.help or f"default: {s}" in action.help
                       for s in said):
                wanting.append(f"{name}: its help does not say its default {default:g}: "
                               f"{action.help!r}")
    assert not wanting, f"{program}:\n" + "\n".join(wanting)


@pytest.mark.parametrize(("argv", "dest", "value"), [
    (["run", "vim", "--version"], "command", ["vim", "--version"]),
    (["run", "--", "vim", "--version"], "command", ["--", "vim", "--version"]),
    (["install-service", "--", "--version"], "escrowd_args", ["--", "--version"]),
])
def test_a_version_after_the_verbs_command_is_the_commands(argv: list[str], dest: str,
                                                           value: list[str]) -> None:
    """`--version` once a verb's command has begun belongs to that command."""
    assert getattr(build_parser().parse_args(argv), dest) == value
