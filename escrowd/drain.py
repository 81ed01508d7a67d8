"""Draining: the holder as the reader of a terminal whose app has let go of it.

A session's `Reader` does everything the holder does to its PTY master while it reads it:
it saves the file status flags the app had and sets O_NONBLOCK (the app shares the open
file description, and gets its flags back before the fd goes to it again), runs one task
that reads into the session's replay ring until the terminal hangs up, and stops that task
only by waiting until it has really finished (a cancelled `wait_readable` can still return
normally once). The session starts the task and changes its state (escrowd.session); the
reading itself is here.

A read never blocks, even if another process clears O_NONBLOCK on the shared open file
description: each is bounded by FIONREAD, and by poll where FIONREAD cannot see (see
`Reader.pull`). One fast child cannot keep the event loop from every other session either:
a drain reads a slice at a time, then lets the other tasks run. And a surprise from one
terminal never stops its drain (a child must not block on a full terminal): it is logged,
and the drain retries.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import select
from termios import FIONREAD
from typing import Protocol

import trio

from .ring import Ring

# A read of fewer bytes counts as this many against a slice, so a slice is also bounded in
# reads (64 of them), not only in bytes.
_READ_COST = 4096
# What one drain wake-up reads at most before it lets other tasks run.
_DRAIN_SLICE = 256 * 1024
# Upper bound for one read when FIONREAD says 0 but poll says readable (a hangup, or bytes
# not yet pushed to the line discipline): such a read returns at once.
_HANGUP_READ = 64 * 1024
# FIONREAD's answer lands here: the event loop is one thread, and this saves an allocation
# and an unpack on every read of a fast child.
_READABLE = array.array("i", [0])


class Drained(Protocol):
    """What the reader reads and tells of a session (escrowd.session.Session)."""

    fd: int
    ring: Ring
    hung_up: bool

    def log(self, event: str, **fields: object) -> None: ...
    def persist(self, clean: bool = False) -> None: ...


class Reader:
    """One session's reading side. Owns no fd: the master is the session's (`session.fd`,
    -1 once closed). `saved_flags` is the app's file status flags while the holder has
    set O_NONBLOCK (the session records them: a holder that adopts it restores them)."""

    def __init__(self, session: Drained, saved_flags: int | None = None) -> None:
        self._session = session
        self.saved_flags = saved_flags
        self._scope: trio.CancelScope | None = None
        self._done: trio.Event | None = None
        self._poller: select.poll | None = None  # POLLIN on fd, made once per fd
        self._slice_used_up = False  # the last pull() stopped at `at_most`, not at empty

    @property
    def running(self) -> bool:
        """True from `begin` until a `stop` has completed."""
        return self._done is not None

    def begin(self) -> tuple[trio.CancelScope, trio.Event]:
        """Become the reader: save the fd's flags and make it non-blocking. Returns the
        scope the drain task runs in and the event it sets when it has finished."""
        fd = self._session.fd
        if self.saved_flags is None:  # else a drain restarted before the flags were restored
            self.saved_flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, self.saved_flags | os.O_NONBLOCK)
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        return self._scope, self._done

    async def read_until_hangup(self) -> None:
        """The drain task's loop: read each slice as it comes, until the terminal hangs
        up (then every byte written before the hangup is in the ring)."""
        session = self._session
        pause = 0.1
        while True:
            if self._slice_used_up:
                # More is waiting: let every other task have its turn, then go on without
                # a round trip through epoll.
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.wait_readable(session.fd)
            try:
                hung_up = self.pull(overwrite=True, at_most=_DRAIN_SLICE)
                if session.ring.modes.dirty:
                    # The modes at the replay's start changed (bytes that set them left the
                    # ring): recorded once a slice, for a holder that adopts this session.
                    session.persist()
            except Exception as exc:
                # Never let one terminal's surprise take the holder (and every session)
                # down, nor stop draining it: a child must not block. Log and retry.
                self._slice_used_up = False
                session.log("internal_error", where="drain", error=repr(exc))
                await trio.sleep(pause)
                pause = min(pause * 2, 5.0)
                continue
            if hung_up:
                return

    def cancel(self) -> None:
        """Ask the drain task to stop; `stop` waits for it."""
        if self._scope is not None and not self._scope.cancel_called:
            self._scope.cancel()

    async def stop(self) -> None:
        """Stop the drain task and wait until it has really finished (idempotent). No
        checkpoint if it has finished already: a handoff of many sessions cancels them all
        first, and they all finish in the one scheduling round the first wait gives."""
        self.cancel()
        done = self._done
        if done is not None and not done.is_set():
            await done.wait()
        if self._done is done:
            # (Else another waiter woke first and has started a new drain: not ours to
            # forget. The caller checks `running`.)
            self._scope = self._done = None

    def forget(self) -> None:
        """The nursery the drain ran in has exited (the holder is stopping): the task is
        over whatever it was doing."""
        assert self._done is None or self._done.is_set()
        self._scope = self._done = None

    def pull(self, overwrite: bool, at_most: int | None = None) -> bool:
        """Read what is readable now into the ring; True once the terminal has hung up.

        With `overwrite`, the ring drops its oldest bytes to keep the newest. Without it (the
        sweep), it stops when the ring has no free space: what is left stays in the kernel
        for the next reader. Each read is bounded by FIONREAD, so it never blocks even if
        another process clears O_NONBLOCK on the shared open file description. With
        `at_most`, it returns after about that many bytes even if more keep coming, so one
        fast child cannot keep the event loop from every other session.
        """
        session = self._session
        fd, ring = session.fd, session.ring
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(fd, select.POLLIN)
        poll, ioctl, read_from, readable_now = poller.poll, fcntl.ioctl, ring.read_from, _READABLE
        budget = at_most
        self._slice_used_up = False
        # Right after a read, FIONREAD is usually 0 because the tty has not yet pushed its
        # next bytes to the reader's side; poll waits for that push. Once seen, ask poll
        # first after each read, which saves a system call per read for the rest of this call.
        poll_first = after_read = False
        while True:
            try:
                if poll_first and after_read:
                    if not poll(0):
                        return False
                    ioctl(fd, FIONREAD, readable_now, True)
                    readable = readable_now[0] or _HANGUP_READ
                else:
                    ioctl(fd, FIONREAD, readable_now, True)
                    readable = readable_now[0]
                    if readable == 0:
                        # FIONREAD misses bytes still in the tty's flip buffer, and a hangup;
                        # poll (which first waits for the flip buffer to be pushed) sees both,
                        # and a read after a poll event cannot block.
                        if not poll(0):
                            return False
                        poll_first = after_read
                        ioctl(fd, FIONREAD, readable_now, True)
                        readable = readable_now[0] or _HANGUP_READ
                # One more than FIONREAD: a master in packet mode (TIOCPKT) returns a header
                # byte that FIONREAD does not count, and reading exactly FIONREAD would
                # leave one byte behind forever, returning only headers. A read returns as
                # soon as anything is copied, so asking for one more never blocks.
                count = read_from(fd, readable + 1, overwrite)
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno != errno.EIO:
                    session.log("read_error",
                                errno=errno.errorcode.get(exc.errno or 0, exc.errno))
                session.hung_up = True
                return True
            if count == 0:
                # End of file, unless a sweep found no room and so did not read at all.
                if overwrite or ring.size < ring.capacity:
                    session.hung_up = True
                    return True
                return False
            after_read = True
            if budget is not None:
                budget -= max(count, _READ_COST)  # tiny reads still use up the slice
                if budget <= 0:
                    self._slice_used_up = True
                    return False

    def leave_event_loop(self) -> None:
        """Before the fd goes to another process: restore the app's flags and tell trio to
        forget it (a cancelled wait stays registered in epoll until notify_closing)."""
        fd = self._session.fd
        trio.lowlevel.notify_closing(fd)
        self._poller = None
        if self.saved_flags is not None:
            fcntl.fcntl(fd, fcntl.F_SETFL, self.saved_flags)
            self.saved_flags = None

    def close(self) -> None:
        """The master is about to be closed: nothing is read from it again. The drain
        must be stopped first."""
        assert self._done is None, "stop the drain before closing"
        self._poller = None
