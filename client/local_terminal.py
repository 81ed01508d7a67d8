"""The local terminal: the one escrowctl runs in, on which an attached session is shown.

Keys come from its input and the program's output goes to its output; while attached, it
is in raw mode. It has to be escrowctl's foreground terminal: in the background, the first
change of its modes would stop escrowctl (SIGTTOU) while it holds the session. A retrieved
session is shown on a screen reset first (`RESET`); the terminal is given back with its
termios as they were, what was typed and not read discarded, and the modes a program may
have switched on switched off again (`leaving`). A terminal that goes away (EOF or EIO on
it) is `TerminalGone`: the attachment detaches.
"""

from __future__ import annotations

import os
import select
import termios
import tty
from collections.abc import Iterator
from contextlib import contextmanager

from . import errors
from .leaving import AlternateScreen

READ_SIZE = 65536

# Written to the local terminal before the replay: RIS, a full reset (a fresh screen,
# default modes), since the replay begins somewhere in the middle of the session's life.
RESET = b"\x1bc"


class TerminalGone(Exception):
    """The local terminal went away (EOF or EIO on it): the attachment detaches."""


class LocalTerminal:
    """The terminal escrowctl runs in: keys come from `in_fd`, output goes to `out_fd`.

    Resource handling: `raw()` puts it in raw mode and gives it back on leaving, with the
    termios it had and the modes a program may have set through escape sequences
    (`leaving`), and what was typed and not read discarded; a terminal that has gone away
    is not an error there. Nothing here changes the file status flags of either fd: the
    shell that started escrowctl shares them."""

    def __init__(self, in_fd: int = 0, out_fd: int = 1) -> None:
        for fd, what in ((in_fd, "input"), (out_fd, "output")):
            if not os.isatty(fd):
                raise errors.NotATerminal(f"escrowctl needs a terminal to attach to: its "
                                          f"{what} (fd {fd}) is not one")
        if os.tcgetpgrp(in_fd) != os.getpgrp():
            # In the background the first change of its modes would stop this process
            # (SIGTTOU) while it holds the session: nobody would read it.
            raise errors.EscrowConfigError("escrowctl needs to run in the foreground of its "
                                           "terminal to attach (not with &)")
        self.in_fd, self.out_fd = in_fd, out_fd
        self.stalled = False  # it stopped taking output: nothing more is written to it
        self.screen = AlternateScreen()  # how the program is on the alternate screen

    def size(self) -> tuple[int, int]:
        """(rows, cols)."""
        rows, cols = termios.tcgetwinsize(self.in_fd)
        return rows, cols

    @contextmanager
    def raw(self) -> Iterator[None]:
        saved = termios.tcgetattr(self.in_fd)
        tty.setraw(self.in_fd, termios.TCSADRAIN)
        try:
            yield
        finally:
            # A terminal that is gone has nothing left to give back; one that stopped
            # taking output would block us for ever (TCSANOW: what was written already
            # went through output processing as it was written).
            try:
                if not self.stalled:
                    self.write(self.screen.leave())
            except TerminalGone:
                pass
            try:
                termios.tcsetattr(self.in_fd, termios.TCSANOW, saved)
                # Typed and not read: keys for the session (the detach key pressed again,
                # or held down; in the program's keyboard protocol), not for the shell the
                # terminal goes back to. What is typed from now on is the shell's.
                termios.tcflush(self.in_fd, termios.TCIFLUSH)
            except (OSError, termios.error):
                pass

    def read(self) -> bytes:
        """What the user typed (b"" if nothing was there after all)."""
        try:
            data = os.read(self.in_fd, READ_SIZE)
        except BlockingIOError:
            return b""  # O_NONBLOCK, set by someone sharing the terminal
        except OSError as exc:
            raise TerminalGone(str(exc)) from None
        if not data:
            raise TerminalGone("end of input")
        return data

    def write(self, data: bytes) -> None:
        self.screen.seen(data)
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view) :]
            except BlockingIOError:
                select.select([], [self.out_fd], [])
            except OSError as exc:
                raise TerminalGone(str(exc)) from None
