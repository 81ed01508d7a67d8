"""The man pages (escrow_client.manpage): what the parsers say now, and rendered by `man`
without a warning."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import require_program
from escrow_client import manpage
from escrow_client.commands.status import STATUS_EXIT_CODES
from escrow_client.parser import VERBS

PAGES = Path(__file__).resolve().parent.parent / "share" / "man" / "man1"


def test_the_committed_pages_are_what_the_parsers_say() -> None:
    for name, text in manpage.pages().items():
        committed = PAGES / name
        assert committed.exists() and committed.read_text() == text, (
            f"{committed} is out of date with the parsers (or missing): run scripts/generate "
            "and commit what it writes")


def test_escrowctl_page_has_every_verb_option_and_exit_code() -> None:
    page = manpage.pages()["escrowctl.1"]
    for name, _, _ in VERBS:
        assert f".SS {name.replace('-', chr(92) + '-')}\n" in page
    assert "\\fB\\-\\-detach\\-key\\fR KEY" in page  # attach's and run's
    assert "\\fB\\-\\-force\\fR" in page  # stop's
    for code in STATUS_EXIT_CODES.values():
        assert f" {code} " in page
    assert ".SH EXIT STATUS" in page


@pytest.mark.parametrize("name", ["escrowctl.1", "escrowd.1"])
def test_man_renders_each_page_without_warnings(name: str) -> None:
    require_program("man")
    require_program("groff")
    env = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "", "LC_ALL": "C.UTF-8"}
    result = subprocess.run(["man", "--warnings", "-l", str(PAGES / name)], capture_output=True,
                            text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    program = name.removesuffix(".1")
    assert result.stdout.startswith(f"{program.upper()}(1)")
    assert "SYNOPSIS" in result.stdout and "--version" in result.stdout
