"""Repaint, round after round: the program it wakes ends up drawn at the terminal's own size
every time, never one row short (docs/design.md §12).

less and vim each run on a bare PTY whose master the test holds and reads: no holder, no
app, so that nothing but the program and the two resizes takes part. Each says in its own
redraw the size it believes: less's prompt is the number of the bottom line it shows (the
file from its first line, so 29 at 30 rows: the prompt is on the last row), vim's status
line its `&lines`. A round waits until the program is idle, waiting for input as it would
be on a session an app takes back; calls `repaint`; and then reads until the program's last
redraw is at the real size. A program that got the second SIGWINCH on its way back to
waiting for input stays drawn one row short until a key comes, and the round fails.

The suite runs ROUNDS (40) of each; `ESCROW_REPAINT_ROUNDS=400` runs the long one (about
30 s each).
"""

from __future__ import annotations

import os
import re
import select
import termios
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil
import pytest

from conftest import PtyChild, require_program, wait_for
from escrow_client import repaint

ROUNDS = int(os.environ.get("ESCROW_REPAINT_ROUNDS", "40"))
COLS, ROWS = 100, 30
SETTLE = 10.0  # generous: the machine is shared, and a round that fails costs it once


def less(text: Path) -> tuple[list[str], bytes, int]:
    """less's argv, what its prompt says, and what it says at the real size."""
    return ["less", "-Pbottom%lb", str(text)], rb"bottom(\d+)\D", ROWS - 1


def vim(text: Path) -> tuple[list[str], bytes, int]:
    """vim's argv (no vimrc, viminfo or swap file), what its status line says, and what it
    says at the real size."""
    return (["vim", "-N", "-u", "NONE", "-i", "NONE", "-n",
             "--cmd", "set laststatus=2 statusline=rows%{&lines}", str(text)],
            rb"rows(\d+)\D", ROWS)


class Drawn:
    """What the program drew: read from the master as it comes, and the size it said last."""

    def __init__(self, child: PtyChild, says: bytes) -> None:
        self.child = child
        self.says = re.compile(says)
        self.seen = bytearray()

    def read_more(self, wait: float = 0.02) -> bool:
        """Read what is there, waiting up to `wait` for it: whether anything came."""
        if not select.select([self.child.master], [], [], wait)[0]:
            return False
        self.seen += os.read(self.child.master, 65536)
        return True

    def sizes(self, since: int = 0) -> list[int]:
        """Every size it said in what it drew from byte `since` on."""
        return [int(size) for size in self.says.findall(self.seen, since)]

    def drew_last(self, size: int, since: int) -> bool:
        """Whether the last size it said, from byte `since` on, is `size`."""
        return self.sizes(since)[-1:] == [size]

    def until(self, check: Callable[[], bool], what: str) -> None:
        def read_and_check() -> bool:
            self.read_more()
            return check()

        try:
            wait_for(read_and_check, SETTLE, what)
        except AssertionError as exc:
            said = self.sizes()
            raise AssertionError(f"{exc}; the last size it said: {said[-1:]}; the end of "
                                 f"what it drew: {bytes(self.seen[-300:])!r}") from None

    def idle(self) -> bool:
        """Everything it drew is read and it sleeps: it waits for input. (A program blocked
        on a full terminal sleeps too, but then there is something to read.)"""
        return not self.read_more(0) and psutil.Process(self.child.pid).status() == "sleeping"


@pytest.mark.parametrize("program", [less, vim], ids=["less", "vim"])
def test_repaint_leaves_the_program_drawn_at_its_size_every_time(
    pty_children: Callable[..., PtyChild], tmp_path: Path,
    program: Callable[[Path], tuple[list[str], bytes, int]],
) -> None:
    argv, says, full = program(tmp_path / "numbered.txt")
    require_program(argv[0])
    (tmp_path / "numbered.txt").write_text(
        "".join(f"numbered line {i:04d}\n" for i in range(1, 501)))
    # A clean environment: no user's options, history or input preprocessor.
    env = ["env", "-i", f"PATH={os.environ['PATH']}", "TERM=xterm", f"HOME={tmp_path}",
           "LESSHISTFILE=-"]
    child = pty_children([*env, *argv], rows=ROWS, cols=COLS)
    drawn = Drawn(child, says)
    drawn.until(partial(drawn.drew_last, full, since=0), f"{argv[0]} to draw its first screen")

    answered = 0  # rounds in which it drew itself at the shrunk size first
    took: list[float] = []
    for round_ in range(1, ROUNDS + 1):
        drawn.until(drawn.idle, f"round {round_}: {argv[0]} to wait for input")
        start = len(drawn.seen)
        started = time.monotonic()
        repaint(child.master)
        took.append(time.monotonic() - started)
        assert termios.tcgetwinsize(child.master) == (ROWS, COLS)
        drawn.until(partial(drawn.drew_last, full, since=start),
                    f"round {round_}: {argv[0]} to draw itself at {ROWS} rows again")
        answered += full - 1 in drawn.sizes(start)
    took.sort()
    print(f"\n  {argv[0]}: {ROUNDS} repaints, each left at {ROWS} rows; {answered} drawn at "
          f"{ROWS - 1} rows first; repaint took {took[len(took) // 2] * 1000:.0f} ms "
          f"(median), {took[-1] * 1000:.0f} ms at most")
