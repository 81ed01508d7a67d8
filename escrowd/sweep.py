"""The sweep before a handoff: what a terminal has for its reader now, into its ring.

A handoff stops the drain (escrowd.drain), then sweeps each terminal (escrowd.handoff):
everything readable now goes into the ring's free space, and no further, so that nothing is
lost and nothing is delivered twice (what the sweep leaves stays in the kernel for the new
reader). A holder that stops sweeps the same way, overwriting, so that a holder adopting
the session has every byte.

Unlike the drain loop's single read after its readiness set spoke, the sweep must read
everything there is: it asks FIONREAD how much, and when that says 0, poll (which first
pushes the bytes a pty still holds in its flip buffer, and sees a hangup). Each read is
bounded by FIONREAD or follows a poll event, so, with the holder the terminal's only
reader, it cannot block even if the app cleared O_NONBLOCK on the shared description.

Only EIO is a hangup (a pty master returns it once nothing is left). Any other failure
(EBADF for an fd closed under us, say) is logged and proves nothing: the sweep stops there
and the session goes on as it was, never `exited` on a guess.
"""

from __future__ import annotations

import array
import errno
import fcntl
import select
from termios import FIONREAD
from typing import Protocol

from .ring import Ring

# A read of fewer bytes counts as this many against `at_most`.
_READ_COST = 4096
# Upper bound for one read when FIONREAD says 0 but poll says readable (a hangup, or bytes
# not yet pushed to the line discipline): such a read returns at once.
_HANGUP_READ = 64 * 1024
# FIONREAD's answer lands here, and the poll: the event loop is one thread.
_READABLE = array.array("i", [0])
_POLL = select.poll()


class Swept(Protocol):
    """What the sweep reads and tells of a session (escrowd.session.Session)."""

    fd: int
    ring: Ring
    hung_up: bool

    def log(self, event: str, **fields: object) -> None: ...


def sweep(session: Swept, overwrite: bool, at_most: int | None = None) -> bool:
    """Read what is readable now into the ring; True once the terminal has hung up.

    With `overwrite`, the ring drops its oldest bytes to keep the newest. Without it, it
    stops when the ring has no free space: what is left stays in the kernel for the next
    reader. With `at_most`, it returns after about that many bytes even if more keep
    coming.
    """
    fd = session.fd
    _POLL.register(fd, select.POLLIN)
    try:
        return _sweep(session, fd, session.ring, overwrite, at_most)
    finally:
        _POLL.unregister(fd)


def _sweep(session: Swept, fd: int, ring: Ring, overwrite: bool, at_most: int | None) -> bool:
    ioctl, poll, readable_now = fcntl.ioctl, _POLL.poll, _READABLE
    budget = at_most
    while True:
        try:
            ioctl(fd, FIONREAD, readable_now, True)
            readable = readable_now[0]
            if readable == 0:
                # FIONREAD misses bytes still in the tty's flip buffer, and a hangup; poll
                # (which first waits for the flip buffer to be pushed) sees both, and a
                # read after a poll event cannot block.
                if not poll(0):
                    return False
                ioctl(fd, FIONREAD, readable_now, True)
                readable = readable_now[0] or _HANGUP_READ
            # One more than FIONREAD: a master in packet mode (TIOCPKT) returns a header byte
            # that FIONREAD does not count, and reading exactly FIONREAD would leave one byte
            # behind forever, returning only headers. A read returns as soon as anything is
            # copied, so asking for one more never blocks.
            count = ring.read_from(fd, readable + 1, overwrite)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno == errno.EIO:  # a master's hangup, with nothing left to read
                session.hung_up = True
                return True
            session.log("read_error", errno=errno.errorcode.get(exc.errno or 0, exc.errno))
            return False  # no proof of a hangup
        if count == 0:
            # End of file, unless the sweep found no room and so did not read at all.
            if overwrite or ring.size < ring.capacity:
                session.hung_up = True
                return True
            return False
        if budget is not None:
            budget -= max(count, _READ_COST)  # tiny reads still use up the budget
            if budget <= 0:
                return False
