"""Which of many fds are readable, asked of one fd the event loop can wait on.

The drain (escrowd.drain) reads every draining terminal from one task: it waits for this
set's own fd to be readable, then takes the ready fds from it without blocking. On Linux it
is an epoll set, level-triggered, so a terminal that still has bytes after its turn is
ready again at the next ask (and, put back at the end of epoll's ready list, comes after
the others: each gets its turn). Asking it polls each ready terminal, which is also what
pushes a pty's pending bytes through to its reader (see escrowd.drain). On macOS, which has
no epoll, it is a kqueue with a read filter per fd. Only the Linux side runs in the tests.
"""

from __future__ import annotations

import select
import sys


class Readiness:
    """A set of fds, and which of them are readable now. Resource handling: owns its own
    fd (`fileno`), closed by `close`; it owns none of the fds in the set."""

    __slots__ = ("_set",)

    if sys.platform == "linux":
        def __init__(self) -> None:
            self._set = select.epoll()

        def add(self, fd: int) -> None:
            self._set.register(fd, select.EPOLLIN)

        def discard(self, fd: int) -> None:
            self._set.unregister(fd)

        def ready(self, at_most: int) -> list[int]:
            """The fds readable now (or hung up, or in error), at most `at_most` of them;
            never blocks."""
            return [fd for fd, _ in self._set.poll(0, at_most)]
    else:
        def __init__(self) -> None:
            self._set = select.kqueue()

        def add(self, fd: int) -> None:
            self._set.control([select.kevent(fd, select.KQ_FILTER_READ, select.KQ_EV_ADD)], 0)

        def discard(self, fd: int) -> None:
            self._set.control([select.kevent(fd, select.KQ_FILTER_READ, select.KQ_EV_DELETE)],
                              0)

        def ready(self, at_most: int) -> list[int]:
            return [int(event.ident) for event in self._set.control(None, at_most, 0)]

    def fileno(self) -> int:
        return self._set.fileno()

    def close(self) -> None:
        self._set.close()
