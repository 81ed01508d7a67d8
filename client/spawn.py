"""Starting the program of `escrowctl run`: a new PTY, the program its session leader.

The program gets a PTY of its own, the size of the local terminal and with its modes (its
erase character, iutf8...), as a terminal app gives a new tab the user's; the PTY is its
controlling terminal, and it holds no other fd of escrowctl's. A program that cannot be
started is `CannotRun`, with the status a shell would exit with. Its ending is reported as
a shell reports it (`exit_status`).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import termios
from collections.abc import Sequence


class CannotRun(Exception):
    """The command could not be started; `status` is what a shell would exit with (127
    not found, 126 found but not executable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def spawn(argv: Sequence[str], rows: int, cols: int,
          like: int | None = None) -> tuple[int, subprocess.Popen[bytes]]:
    """`argv` as the session leader of a new PTY of that size, which is its controlling
    terminal: the master and the process. The PTY's modes are those of terminal `like`
    (its erase character, iutf8...), as a terminal app gives a new tab the user's."""
    master, slave = os.openpty()
    try:
        if like is not None:
            try:
                termios.tcsetattr(slave, termios.TCSANOW, termios.tcgetattr(like))
            except termios.error:
                pass  # the PTY's own defaults, then
        termios.tcsetwinsize(slave, (rows, cols))
        child = subprocess.Popen(
            list(argv), stdin=slave, stdout=slave, stderr=slave, close_fds=True,
            start_new_session=True, preexec_fn=_take_controlling_terminal)
    except OSError as exc:
        os.close(master)
        status = 127 if isinstance(exc, FileNotFoundError) else 126
        raise CannotRun(f"cannot run {argv[0]}: {exc.strerror or exc}", status) from None
    finally:
        os.close(slave)
    return master, child


def _take_controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def end(child: subprocess.Popen[bytes]) -> None:
    """End a program whose terminal was just closed: the hang-up ends most (SIGHUP)."""
    try:
        child.wait(2.0)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def exit_status(returncode: int) -> int:
    """A program's ending as a shell reports it: its exit code, or 128+N for signal N
    (`subprocess` gives -N)."""
    return returncode if returncode >= 0 else 128 - returncode
