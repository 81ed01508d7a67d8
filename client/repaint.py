"""Repaint: make the full-screen program on a retrieved session draw its screen again
(docs/design.md §12).

A relaunched app has a blank screen (plus whatever replay the holder kept), while vim, less,
top or a shell prompt on the session drew their screen before the crash and will not draw it
again on their own. A resize is the request they all answer: they redraw on SIGWINCH. The
kernel sends SIGWINCH to the terminal's foreground process group only when TIOCSWINSZ
changes the size, so setting the same size again does nothing; changing it by one row and
back does.
"""

from __future__ import annotations

import fcntl
import struct
import termios
import time

_WINSIZE = struct.Struct("HHHH")  # struct winsize: rows, cols, x pixels, y pixels
_INT = struct.Struct("i")
DEFAULT_WAIT = 0.5  # vim, less, top and bash answered a resize within 10 ms (measured)


def repaint(fd: int, wait: float = DEFAULT_WAIT) -> None:
    """Make the program in the foreground of the terminal whose PTY master is `fd` redraw.

    The window is resized by one row, and back to its size once the program has answered
    (written something) or `wait` seconds have passed, so the foreground process group gets
    SIGWINCH twice even though the size does not change; the size it ends with is the size
    it had. Call it after writing the replay, and before reading `fd`, so that the program
    draws over the replay.

    Cost: a program that does not answer a resize (it ignores SIGWINCH, as a shell's
    foreground job may) costs the whole `wait`; one that answers costs what it takes to
    answer. Nothing is read from `fd`.

    Error handling: an `fd` that is not a terminal raises OSError (ENOTTY), as does any
    failing ioctl; if the first resize succeeded and the second failed, the window is left
    one row off. A terminal with no foreground process group (the program exited) is
    resized and signals nobody, which is not an error.
    """
    rows, cols, xpixel, ypixel = _WINSIZE.unpack(
        fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(_WINSIZE.size)))
    # Shrink rather than grow, so that nothing is drawn beyond the real screen meanwhile. An
    # unset size (0 rows) cannot shrink, and a program that draws while it is 0 rows may
    # take that for "unknown" and draw for 24: grow those instead.
    #
    # Why not killpg(os.tcgetpgrp(fd), SIGWINCH), as dtach's `-r winch` does: bash
    # (readline 8.2, measured) redraws its prompt and line only when the size it reads
    # differs from the one it knew, so a signal at an unchanged size leaves it blank. For
    # the same reason the program must see the changed size before it is restored: two
    # resizes in a row reach it as one signal (signals do not queue), at the old size. So
    # wait for its answer to the first. Resizing also signals whatever group is in the
    # foreground at that moment (no race with a shell starting a job), even one we may not
    # signal ourselves (su, sudo: EPERM).
    unread = _unread(fd)
    other = rows - 1 if rows > 1 else rows + 1
    fcntl.ioctl(fd, termios.TIOCSWINSZ, _WINSIZE.pack(other, cols, xpixel, ypixel))
    give_up = time.monotonic() + wait
    while _unread(fd) <= unread and time.monotonic() < give_up:
        time.sleep(0.002)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, _WINSIZE.pack(rows, cols, xpixel, ypixel))


def _unread(fd: int) -> int:
    """How many bytes the program wrote that nobody has read from `fd` yet. (Where FIONREAD
    on a master does not count them, this stays put and repaint waits the whole `wait`,
    which costs time but still lets the program see the change.)"""
    count: int = _INT.unpack(fcntl.ioctl(fd, termios.FIONREAD, bytes(_INT.size)))[0]
    return count
