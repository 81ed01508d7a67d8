"""Repaint: make the full-screen program on a retrieved session draw its screen again
(docs/design.md §12).

A relaunched app has a blank screen (plus whatever replay the holder kept), while vim, less,
top or a shell prompt on the session drew their screen before the crash and will not draw it
again on their own. A resize is the request they all answer: they redraw on SIGWINCH. The
kernel sends SIGWINCH to the terminal's foreground process group only when TIOCSWINSZ
changes the size, so setting the same size again does nothing; changing it by one row and
back does.

When the size goes back matters. A program answers the shrink with a redraw that it writes
just before it waits for input again: less flushes its output, then reads; vim checks for a
pending resize, then flushes and selects. A SIGWINCH that lands in between is noted and not
acted on until the next key, and the program stays drawn one row short. So the size goes
back only once the program's output has stopped for `quiet` (50 ms): by then it is waiting,
and the second signal wakes it. On two cores kept busy by three other processes, restoring
the size at the program's first output left less a row short in 15 and 26 of 200 repaints
(two runs) and vim in 7 and 12; waiting for quiet, neither in 400
(tests/test_repaint_rounds.py, with ESCROW_REPAINT_ROUNDS=400).

The output is watched, never read: the caller reads it afterwards, so nothing is lost. It is
counted with FIONREAD on the master, and a terminal holds only so much that nobody reads:
Linux counts 4 KiB at most (more output than that cannot be seen), and a program writing a
redraw of more than about 8 to 20 KiB (by how it writes it) blocks until the caller reads.
The size then goes back while the program is still writing, and the race above is back:
vim drawing a 200x50 window of 180-character lines (9 KiB a redraw) was left a row short in
10 of 100 repaints."""

from __future__ import annotations

import fcntl
import struct
import termios
import time

_WINSIZE = struct.Struct("HHHH")  # struct winsize: rows, cols, x pixels, y pixels
_INT = struct.Struct("i")
DEFAULT_WAIT = 0.5  # vim, less, top and bash answered a resize within 10 ms (measured)
DEFAULT_QUIET = 0.05
DEFAULT_LIMIT = 1.0
_POLL = 0.002


def repaint(fd: int, wait: float = DEFAULT_WAIT, quiet: float = DEFAULT_QUIET,
            limit: float = DEFAULT_LIMIT) -> None:
    """Make the program in the foreground of the terminal whose PTY master is `fd` redraw.

    The window is resized by one row, and back to its size once the program has answered
    that: its output came and then stayed quiet for `quiet` seconds, or none came within
    `wait`, or `limit` seconds passed in all. So the foreground process group gets SIGWINCH
    twice, the second time once it is waiting for input again, even though the size does
    not change; the size it ends with is the size it had. Call it after writing the replay,
    and before reading `fd`, so that the program draws over the replay.

    Cost: for a program that answers, its answer time and `quiet` (53 ms for vim and less,
    the median of 400 each); for one that does not answer a resize (it ignores SIGWINCH,
    as a shell's foreground job may), the whole `wait` (0.5 s); for one that keeps writing
    a little more often than every `quiet`, `limit` (1 s) at most. Nothing is read from
    `fd`.

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
    # resizes in a row reach it as one signal (signals do not queue), at the old size.
    # Resizing also signals whatever group is in the foreground at that moment (no race
    # with a shell starting a job), even one we may not signal ourselves (su, sudo: EPERM).
    unread = _unread(fd)
    other = rows - 1 if rows > 1 else rows + 1
    try:  # the shrink inside: an interruption right after it restores the size too
        fcntl.ioctl(fd, termios.TIOCSWINSZ, _WINSIZE.pack(other, cols, xpixel, ypixel))
        _wait_for_answer(fd, unread, wait, quiet, limit)
    finally:  # interrupted (KeyboardInterrupt) too: never leave the window a row off
        fcntl.ioctl(fd, termios.TIOCSWINSZ, _WINSIZE.pack(rows, cols, xpixel, ypixel))


def _wait_for_answer(fd: int, unread: int, wait: float, quiet: float, limit: float) -> None:
    """Return once the program has answered and gone quiet, or the bounds say stop."""
    started = time.monotonic()
    changed_at: float | None = None  # when the count last moved: None, no answer yet
    while True:
        now = time.monotonic()
        count = _unread(fd)
        if count != unread:
            unread, changed_at = count, now
        if now - started >= limit:
            return
        if changed_at is None:
            if now - started >= wait:
                return
        elif now - changed_at >= quiet:
            return
        time.sleep(_POLL)


def _unread(fd: int) -> int:
    """How many bytes the program wrote that nobody has read from `fd` yet. (Where FIONREAD
    on a master does not count them, this stays put and repaint waits the whole `wait`,
    which costs time but still lets the program see the change.)"""
    count: int = _INT.unpack(fcntl.ioctl(fd, termios.FIONREAD, bytes(_INT.size)))[0]
    return count
