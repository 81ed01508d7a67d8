"""What `escrowctl attach` shows, and what it keeps from the program (docs/design.md §12,
"A replay on a real terminal"; §13).

On a real screen, as in test_attach.py: each session is started with `escrowctl run` in a
tmux pane of 90x25, detached, and attached from panes of 80x24, 120x40 and 60x20 in turn.
At each size the pane must show the program whole (vim and less exactly as a fresh run of
them at that size does; top and htop with their header on the first row and every row
drawn; a shell its half-typed line), tmux's scroll region must be the whole pane, and the
program must be given nothing but the keys the test types: the program runs under
tests/inputlog.py, which writes down every byte it is given.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from test_attach import (
    ESCROWCTL,
    INNER,
    INNER_BASH,
    OUTER,
    RUN_OWNER,
    TIMEOUT,
    Pane,
    Screens,
    detach,
    session,
)

from conftest import OWNER, HolderProcess, PtyChild, require_program, wait_for
from escrow_client.replies import ASK
from escrow_client.safe_replay import ST, safe_replay

INPUTLOG = str(Path(__file__).with_name("inputlog.py"))
SIZES = [(80, 24), (120, 40), (60, 20)]  # attached at each in turn, after a run at 90x25
FIRST = (90, 25)
LINES = "".join(f"line {n}: {'abcdefghij' * (n % 7)}\n" for n in range(1, 201))


@pytest.fixture
def tmux(holder: HolderProcess) -> Iterator[Screens]:
    for program in ("tmux", "bash", "vim", "less", "top", "htop"):
        require_program(program)
    s = Screens(holder)
    try:
        yield s
    finally:
        s.close()


def scroll_region(pane: Pane) -> tuple[int, int]:
    upper, lower = pane.value("#{scroll_region_upper} #{scroll_region_lower}").split()
    return int(upper), int(lower)


def rows(screen: str, count: int) -> list[str]:
    """The pane's `count` rows (capture-pane drops the blank ones at the end)."""
    lines = screen.split("\n")[:count]
    return lines + [""] * (count - len(lines))


@dataclass
class Program:
    """A program to show in a session: how to start it (in a shell command line), and when
    a pane of a size shows it drawn whole."""

    command: str
    up: str  # shown once it has started
    drawn: Callable[[Screens, int, int], Callable[[str], bool]]
    keys: tuple[str, ...] = ("C-l",)  # typed after each attach: a redraw, nothing more
    typed: bytes = b"\x0c"  # what those keys are


def as_fresh(command: str, prompt: str | None = None
             ) -> Callable[[Screens, int, int], Callable[[str], bool]]:
    """Drawn as `command`, started afresh in a pane of that size, draws itself; with
    `prompt`, as it draws itself again when asked to (Ctrl-L) and shows that prompt on its
    last row (less shows the file's name there at first, and its prompt from then on)."""
    def drawn(screens: Screens, cols: int, rows_: int) -> Callable[[str], bool]:
        server = screens.servers[0]
        name = f"fresh{cols}x{rows_}"
        server.tmux("new-session", "-d", "-s", name, "-x", str(cols), "-y", str(rows_),
                    f"cd {shlex.quote(str(screens.dir))} && {command}")
        pane = Pane(server, name)
        fresh = pane.wait_screen(lambda s: "line 1:" in s and s.count("\n") >= rows_ - 1,
                                 f"{command} drawn afresh at {cols}x{rows_}", join=False)
        if prompt is not None:
            pane.keys("C-l")
            fresh = pane.wait_screen(lambda s: rows(s, rows_)[-1] == prompt,
                                     f"{command} drawn again at {cols}x{rows_}", join=False)
        return lambda s: s == fresh
    return drawn


def with_header(header: str, footer: str) -> Callable[[Screens, int, int],
                                                     Callable[[str], bool]]:
    """Drawn at that height: `header` on one of the first two rows (htop leaves the first
    blank), `footer` on the last (top's last process; there are processes enough)."""
    def drawn(screens: Screens, cols: int, rows_: int) -> Callable[[str], bool]:
        def check(screen: str) -> bool:
            lines = rows(screen, rows_)
            return (any(re.match(header, line) for line in lines[:2])
                    and re.search(footer, lines[-1]) is not None)
        return check
    return drawn


# No message on vim's last row: it is gone after a redraw.
VIM = "vim -N -u NONE -i NONE -n --cmd 'set ttimeout ttimeoutlen=10 shortmess+=F' lines.txt"
LESS = "env LESS= LESSHISTFILE=- less lines.txt"
PROGRAMS = {
    "vim": Program(VIM, "line 1:", as_fresh(VIM)),
    "less": Program(LESS, "line 1:", as_fresh(LESS, prompt=":")),
    "top": Program("top -d 1", "top - ", with_header(r"top - ", r"\S")),
    "htop": Program("htop -d 10", "F1", with_header(r"\s*\d+\[|\s*CPU", r"F1\s*Help")),
}


def given_at_least(log: Path, count: int, last: bytes) -> bool:
    given = log.read_bytes()
    return len(given) >= count and given.endswith(last)


def attach_at(tmux: Screens, sid: str, cols: int, rows_: int) -> Pane:
    pane = tmux.pane(f"at{cols}x{rows_}", cols, rows_)
    pane.line(f"escrowctl attach {RUN_OWNER}/{sid}")
    return pane


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_program_is_shown_whole_and_given_nothing_at_every_size(
    tmux: Screens, holder: HolderProcess, name: str
) -> None:
    program = PROGRAMS[name]
    (tmux.dir / "lines.txt").write_text(LINES)
    log = tmux.dir / "typed"
    pane = tmux.pane("run", *FIRST)
    pane.line(f"cd {shlex.quote(str(tmux.dir))} && escrowctl run --id {name} -- "
              f"{shlex.quote(sys.executable)} {INPUTLOG} {log} -- {program.command}")
    pane.wait_text(program.up)
    # The keys once, live: what the terminal answered the program as it started (vim asks
    # where the cursor is) comes before them.
    pane.keys(*program.keys)
    wait_for(lambda: log.exists() and log.read_bytes().endswith(program.typed), TIMEOUT,
             f"{name} to be given the keys typed")
    given = log.read_bytes()
    for cols, rows_ in SIZES:
        detach(pane, name, holder)
        pane = attach_at(tmux, name, cols, rows_)
        pane.wait_screen(program.drawn(tmux, cols, rows_), f"{name} drawn at {cols}x{rows_}",
                         join=False)
        assert scroll_region(pane) == (0, rows_ - 1), pane.capture()
        pane.keys(*program.keys)
        given += program.typed
        wait_for(partial(given_at_least, log, len(given), program.typed), TIMEOUT,
                 f"{name} to be given the keys typed at {cols}x{rows_}")
        assert log.read_bytes() == given, f"{name} was given more than the keys typed"


def shown(screen: str) -> list[str]:
    """The rows that show something, without trailing blanks."""
    return [line.rstrip() for line in screen.split("\n") if line.strip()]


def test_a_half_typed_line_at_a_shell_prompt_comes_back_as_typed(
    tmux: Screens, holder: HolderProcess
) -> None:
    """The shell asked the terminal where its cursor was (and read the answer itself, live),
    then a line was half typed. On each attach the screen comes back as it was, the prompt
    with the half line alone on the row after the last output (no answer to the replayed
    question typed into it, and the shell's redraw where the cursor was left), and the
    shell is given nothing but the keys typed."""
    log = tmux.dir / "typed"
    pane = tmux.pane("run", *FIRST)
    pane.line(f"escrowctl run --id sh -- {shlex.quote(sys.executable)} {INPUTLOG} {log} -- "
              f"{INNER_BASH}")
    pane.wait_prompt(INNER)
    asked = "printf '\\e[6n'; read -rsdR; echo asked"
    pane.line(asked)
    pane.wait_line(r"^asked$")
    pane.wait_prompt(INNER)
    pane.keys("-l", "echo hal")
    transcript = [f"{INNER}{asked}", "asked", f"{INNER}echo hal"]
    pane.wait_screen(lambda s: shown(s)[-3:] == transcript, "the half-typed line")
    given = log.read_bytes()  # what the run gave, the live answer among it
    assert given.endswith(b"echo hal")
    for n, (cols, rows_) in enumerate(SIZES):
        detach(pane, "sh", holder)
        pane = attach_at(tmux, "sh", cols, rows_)
        pane.wait_screen(lambda s: shown(s) == transcript, f"the screen at {cols}x{rows_}")
        assert scroll_region(pane) == (0, rows_ - 1), pane.capture()
        pane.line(f"f{n}")
        transcript[-1:] = [f"{INNER}echo half{n}", f"half{n}", INNER.rstrip()]
        pane.wait_screen(lambda s: shown(s) == transcript, f"half{n} echoed")
        given += f"f{n}\r".encode()
        assert log.read_bytes() == given, "the shell was given more than the keys typed"
        pane.keys("-l", "echo hal")
        given += b"echo hal"
        transcript[-1] = f"{INNER}echo hal"


# Questions a program asks the terminal on purpose: where the cursor is, what the terminal
# is (primary and secondary), the background colour.
QUESTIONS = r"printf '\033[6n\033[c\033[>c\033]11;?\007'"


def test_questions_a_program_asked_are_answered_on_no_later_attach(
    tmux: Screens, holder: HolderProcess
) -> None:
    """`cat -v` shows every byte it is given: the answers to the questions asked when it
    started (live, at `escrowctl run`), then, on each attach, nothing but the line typed."""
    pane = tmux.pane("run", *FIRST)
    pane.line(f"escrowctl run --id q -- sh -c {shlex.quote(QUESTIONS + '; exec cat -v')}")
    pane.wait_text("^[[>")  # the terminal's answers, live, echoed as they are typed
    pane.line("start")
    pane.wait_line(r"^\^\[\[.*start$")  # and given to cat, with the line typed after them
    for n, (cols, rows_) in enumerate(SIZES):
        detach(pane, "q", holder)
        pane = attach_at(tmux, "q", cols, rows_)
        pane.line(f"mark{n}")
        line = pane.wait_line(rf"^.*mark{n}$")[0]  # the echo, then what cat prints
        screen = pane.wait_screen(partial(printed_twice, line), f"cat -v to print {line}")
        assert line == f"mark{n}", screen
        assert scroll_region(pane) == (0, rows_ - 1)


def printed_twice(line: str, screen: str) -> bool:
    return screen.rstrip().endswith(f"{line}\n{line}")


def test_attach_writes_no_question_to_the_terminal_but_its_own(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """What escrowctl writes to a terminal it attaches to (here a bare PTY the test reads):
    the replay without the program's questions, then the one question escrowctl asks
    itself (`ASK`), whose answer it keeps from the program."""
    program = pty_children(["sh", "-c", QUESTIONS + "; echo asked; exec sleep 60"])
    holder.client().hand_off("q", program.master, child_pid=program.pid)
    wait_for(lambda: (s := session(holder, "q", OWNER)) is not None
             and s.buffered_bytes >= len(b"\x1b[6n\x1b[c\x1b[>c\x1b]11;?\x07asked\r\n"), TIMEOUT,
             "the questions and `asked` in the replay")
    local = pty_children([ESCROWCTL, "--socket", holder.socket, "attach", f"{OWNER}/q"])
    shown = local.read_available(timeout=TIMEOUT, until=ASK)  # the last thing written
    assert b"asked" in shown and shown.endswith(ASK), shown
    assert safe_replay(shown) == shown.replace(ASK, ST), shown  # no other question in it
    info = session(holder, "q", OWNER)
    assert info is not None and info.custodian_pid is not None
    os.kill(info.custodian_pid, signal.SIGTERM)
    assert local.proc.wait(TIMEOUT) == 0


def test_an_attach_that_ends_at_once_leaves_no_answer_to_the_shell(
    tmux: Screens, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """A session whose program has exited: the attach shows its last words and ends at
    once, before the terminal can have answered escrowctl's question; that answer must not
    be left to the shell escrowctl returns to, typed at its prompt."""
    program = pty_children(["sh", "-c", "echo last words"])
    holder.client().hand_off("x", program.master, child_pid=program.pid)
    wait_for(lambda: (s := session(holder, "x", OWNER)) is not None and s.state == "exited",
             TIMEOUT, "the session to exit")
    pane = tmux.pane("a")
    pane.line(f"escrowctl attach {OWNER}/x")
    pane.wait_text(f"{OWNER}/x has ended")
    pane.wait_prompt(OUTER)
    pane.line("echo typed")
    pane.wait_line(r"^typed$")
    assert f"{OUTER}echo typed" in shown(pane.capture()), pane.capture()
