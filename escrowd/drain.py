"""Draining: the holder as the reader of every terminal whose app has let go of it.

A session's `Reader` is what the holder does to its PTY master while it reads it: it saves
the file status flags the app had and sets O_NONBLOCK (the app shares the open file
description, and gets its flags back before the fd goes to it again), and puts the master
in the holder's one `DrainLoop`. The session changes its state (escrowd.session); the
reading itself is here.

One task reads every draining terminal. It waits for the readiness set of the loop
(escrowd.readiness: an epoll set, level-triggered) to be readable, takes the ready fds from
it without blocking, and reads each once, straight into its session's ring; then it asks
again, until nothing is ready or it has made `_TURN_READS` reads, and then it lets every
other task run (the wait, or a checkpoint). So a session gets one read a round, about 4 KiB
(a Linux pty never holds more for its reader), however fast its child writes: a flood in
one terminal cannot starve another, nor the holder's requests. An idle holder waits in one
epoll wait, whatever the number of sessions; with none draining, the task has ended.

A read never blocks, even if another process clears O_NONBLOCK on the shared description:
the loop reads an fd only right after the readiness set said it was readable (or hung up),
and the holder is its only reader, so the bytes are still there. A master's line discipline
returns whatever it holds at once (its termios is its own: a tcsetattr on the master sets
the slave's, so nobody can give it a VMIN to wait for), and a hung-up master returns EIO at
once. Asking the set costs one system call for all the ready fds, and it polls each, which
is what pushes the bytes a pty still holds in its flip buffer to the reader (FIONREAD does
not see those: right after a read it is mostly 0 while a fast child writes on). So the loop
makes one read, and a share of one epoll wait, per read: no FIONREAD, no poll. The sweep
before a handoff (`Reader.pull`), which must read everything there is and only into free
space, still asks FIONREAD and, when that says 0, poll for the flip buffer.

Starting a drain registers the master, and stopping it unregisters it, synchronously: no
task to cancel or wait for. No read can be in flight when a drain stops: the loop reads only
between two of its own checkpoints, and any other task (a handoff stopping the drain) runs
only while the loop waits at one; once unregistered, no later ready list names that fd, and
each fd of a list already taken is looked up again before it is read.

A hangup is drained to its last byte before it is told: a pty master returns EIO only once
it has nothing left to read, so every byte written before the hangup is in the ring when
the session hears of it (`Drained.drained_to_hangup`). A surprise from one terminal (a read
that fails otherwise, EBADF for an fd closed under us, or any exception from a read into its
ring) is logged, and that terminal rests out of the set for a pause (0.1 s, doubling up to
5 s) and is then read again, still draining: the loop and every other session go on.
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

from .readiness import Readiness
from .ring import Ring

# Reads one turn of the loop makes at most before it lets other tasks run.
_TURN_READS = 64
# Ready fds taken from the set at once: one round.
_ROUND = 64
# One read in the loop: a Linux pty holds at most 4 KiB for its reader (N_TTY_BUF_SIZE),
# plus the header byte a master in packet mode (TIOCPKT) returns that FIONREAD does not
# count. A read returns as soon as it has copied what is there.
_LOOP_READ = 4096 + 1
# A terminal whose read raised rests this long before it is read again (doubling).
_FIRST_PAUSE, _LONGEST_PAUSE = 0.1, 5.0
# The sweep (`Reader.pull`): a read of fewer bytes counts as this many against `at_most`.
_READ_COST = 4096
# Upper bound for one sweep read when FIONREAD says 0 but poll says readable (a hangup, or
# bytes not yet pushed to the line discipline): such a read returns at once.
_HANGUP_READ = 64 * 1024
# FIONREAD's answer lands here, and the sweep's poll: the event loop is one thread.
_READABLE = array.array("i", [0])
_POLL = select.poll()


class Drained(Protocol):
    """What the reader reads and tells of a session (escrowd.session.Session)."""

    fd: int
    ring: Ring
    hung_up: bool

    def log(self, event: str, **fields: object) -> None: ...
    def persist(self, clean: bool = False) -> None: ...
    def drained_to_hangup(self) -> None: ...


class Reader:
    """One session's reading side. Owns no fd: the master is the session's (`session.fd`,
    -1 once closed). `saved_flags` is the app's file status flags while the holder has
    set O_NONBLOCK (the session records them: a holder that adopts it restores them)."""

    __slots__ = ("_session", "saved_flags", "_loop", "_fd", "pause")

    def __init__(self, session: Drained, saved_flags: int | None = None) -> None:
        self._session = session
        self.saved_flags = saved_flags
        self._loop: DrainLoop | None = None  # draining: the loop it is in
        self._fd = -1  # the fd the loop knows it by
        self.pause = _FIRST_PAUSE  # how long it rests after its next fault

    @property
    def running(self) -> bool:
        """True from `begin` until `stop`."""
        return self._loop is not None

    @property
    def session(self) -> Drained:
        return self._session

    def begin(self, nursery: trio.Nursery) -> None:
        """Become the reader: save the fd's flags, make it non-blocking, and join the
        drain loop (started in `nursery` if it is not running)."""
        session = self._session
        fd = session.fd
        if self.saved_flags is None:  # else a drain restarted before the flags were restored
            self.saved_flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, self.saved_flags | os.O_NONBLOCK)
        loop = DrainLoop.current()
        loop.add(self, fd, nursery)
        self._loop, self._fd, self.pause = loop, fd, _FIRST_PAUSE

    def stop(self) -> None:
        """Stop draining, now (idempotent): from here on the loop does not read this fd."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.remove(self, self._fd)
        self._fd = -1

    def pull(self, overwrite: bool, at_most: int | None = None) -> bool:
        """Read what is readable now into the ring; True once the terminal has hung up.

        With `overwrite`, the ring drops its oldest bytes to keep the newest. Without it (the
        sweep), it stops when the ring has no free space: what is left stays in the kernel
        for the next reader. Each read is bounded by FIONREAD, or follows a poll that said
        readable, so it never blocks even if another process clears O_NONBLOCK on the shared
        open file description. With `at_most`, it returns after about that many bytes even
        if more keep coming.
        """
        session = self._session
        fd = session.fd
        _POLL.register(fd, select.POLLIN)
        try:
            return self._pull(fd, session.ring, overwrite, at_most)
        finally:
            _POLL.unregister(fd)

    def _pull(self, fd: int, ring: Ring, overwrite: bool, at_most: int | None) -> bool:
        session = self._session
        ioctl, poll, readable_now = fcntl.ioctl, _POLL.poll, _READABLE
        budget = at_most
        while True:
            try:
                ioctl(fd, FIONREAD, readable_now, True)
                readable = readable_now[0]
                if readable == 0:
                    # FIONREAD misses bytes still in the tty's flip buffer, and a hangup;
                    # poll (which first waits for the flip buffer to be pushed) sees both,
                    # and a read after a poll event cannot block.
                    if not poll(0):
                        return False
                    ioctl(fd, FIONREAD, readable_now, True)
                    readable = readable_now[0] or _HANGUP_READ
                # One more than FIONREAD: a master in packet mode (TIOCPKT) returns a header
                # byte that FIONREAD does not count, and reading exactly FIONREAD would
                # leave one byte behind forever, returning only headers. A read returns as
                # soon as anything is copied, so asking for one more never blocks.
                count = ring.read_from(fd, readable + 1, overwrite)
            except BlockingIOError:
                return False
            except OSError as exc:
                _read_failed(session, exc)
                return True
            if count == 0:
                # End of file, unless a sweep found no room and so did not read at all.
                if overwrite or ring.size < ring.capacity:
                    session.hung_up = True
                    return True
                return False
            if budget is not None:
                budget -= max(count, _READ_COST)  # tiny reads still use up the budget
                if budget <= 0:
                    return False

    def leave_event_loop(self) -> None:
        """Before the fd goes to another process: restore the app's flags. (The drain has
        stopped: the fd is in no readiness set.)"""
        if self.saved_flags is not None:
            fcntl.fcntl(self._session.fd, fcntl.F_SETFL, self.saved_flags)
            self.saved_flags = None

    def close(self) -> None:
        """The master is about to be closed: nothing is read from it again. The drain
        must be stopped first."""
        assert self._loop is None, "stop the drain before closing"


def _read_failed(session: Drained, exc: OSError) -> None:
    """A read failed: the terminal hung up (EIO), or it cannot be read (logged): either
    way, nothing more will come from it."""
    if exc.errno != errno.EIO:
        session.log("read_error", errno=errno.errorcode.get(exc.errno or 0, exc.errno))
    session.hung_up = True


_CURRENT: trio.lowlevel.RunVar[DrainLoop] = trio.lowlevel.RunVar("escrowd.drain")


class DrainLoop:
    """Every draining session of this trio run, and the one task that reads them (see the
    module's docstring). The task runs while any session drains, in the nursery of the
    drain that started it."""

    __slots__ = ("_set", "_readers", "_resting", "_running", "_waiting")

    def __init__(self) -> None:
        self._set: Readiness | None = None
        self._readers: dict[int, Reader] = {}  # by fd: the ones in the set
        self._resting: dict[Reader, float] = {}  # faulted: when each is read again
        self._running = False
        self._waiting = False  # the task waits for the set (or a resting terminal)

    @classmethod
    def current(cls) -> DrainLoop:
        try:
            return _CURRENT.get()
        except LookupError:
            loop = cls()
            _CURRENT.set(loop)
            return loop

    def add(self, reader: Reader, fd: int, nursery: trio.Nursery) -> None:
        if self._set is None:
            self._set = Readiness()
        self._set.add(fd)  # (raises for an fd that cannot be drained: nothing changed)
        self._readers[fd] = reader
        if not self._running:
            self._running = True
            nursery.start_soon(self._run)

    def remove(self, reader: Reader, fd: int) -> None:
        self._resting.pop(reader, None)
        if self._readers.get(fd) is reader:  # (else resting, or out since its hangup)
            del self._readers[fd]
            self._discard(fd)
        if not self._readers and not self._resting and (self._waiting or not self._running):
            # Nothing left to wait for: the set goes, which wakes the task's wait, and it
            # ends (or the task ended already with the nursery it ran in).
            self._close()

    def _discard(self, fd: int) -> None:
        assert self._set is not None
        try:
            self._set.discard(fd)
        except OSError:
            pass  # closed under us (then the kernel has taken it out of the set already)

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:
            self._running = False
            self._waiting = False
            if not self._readers and not self._resting:
                self._close()

    def _close(self) -> None:
        """No session drains: the readiness set goes (a new one comes with the next)."""
        if self._set is not None:
            readiness, self._set = self._set, None
            try:
                trio.lowlevel.notify_closing(readiness.fileno())
            except RuntimeError:
                pass  # outside trio.run (its loop is gone, and waits on nothing)
            readiness.close()

    async def _serve(self) -> None:
        readers, resting = self._readers, self._resting
        while readers or resting:
            assert self._set is not None
            ready, made = self._set.ready, 0
            changed: set[Reader] = set()
            while made < _TURN_READS:
                fds = ready(_ROUND)
                if not fds:
                    break
                made += len(fds)
                for fd in fds:
                    reader = readers.get(fd)
                    if reader is None:
                        continue  # (stopped after the list was taken: never the case now)
                    ring = reader._session.ring
                    try:
                        count = ring.read_from(fd, _LOOP_READ, True)
                    except BlockingIOError:
                        continue  # nothing after all (the set said so before a reader took it)
                    except OSError as exc:
                        if exc.errno != errno.EIO:  # no proof of a hangup: a surprise
                            self._fault(reader, fd, exc)
                            continue
                        count = 0
                    except Exception as exc:
                        self._fault(reader, fd, exc)
                        continue
                    if count == 0:  # hung up (a master's EIO), or end of file
                        reader._session.hung_up = True
                        self._hung_up(reader, fd)
                    elif ring.modes.dirty:
                        changed.add(reader)
            for reader in changed:
                self._record_modes(reader)
            if made >= _TURN_READS:
                await trio.lowlevel.checkpoint()
            else:
                await self._wait()

    async def _wait(self) -> None:
        """Until the set is readable, or a resting terminal is due."""
        assert self._set is not None
        self._waiting = True
        try:
            if not self._resting:
                await trio.lowlevel.wait_readable(self._set.fileno())
                return
            with trio.move_on_at(min(self._resting.values())):
                await trio.lowlevel.wait_readable(self._set.fileno())
        except trio.ClosedResourceError:
            return  # the last drain stopped (`remove`): the task ends, or goes on anew
        finally:
            self._waiting = False
        now = trio.current_time()
        for reader, due in list(self._resting.items()):
            if due <= now:
                del self._resting[reader]
                self._wake(reader)

    def _hung_up(self, reader: Reader, fd: int) -> None:
        """Every byte before the hangup is in the ring: out of the set, and told."""
        del self._readers[fd]
        self._discard(fd)
        try:
            reader._session.drained_to_hangup()
        except Exception as exc:  # one session's surprise must not stop the others
            reader._session.log("internal_error", where="drain", error=repr(exc))

    def _fault(self, reader: Reader, fd: int, exc: Exception) -> None:
        """Never let one terminal's surprise take the holder (and every session) down, nor
        stop draining it (a child must not block): log it, rest, and read it again. A read
        that fails with anything but EIO (EBADF: its fd closed under us, say) is no proof
        that the terminal hung up: the session stays draining, and is tried again."""
        session = reader._session
        if isinstance(exc, OSError):
            session.log("read_error", errno=errno.errorcode.get(exc.errno or 0, exc.errno))
        else:
            session.log("internal_error", where="drain", error=repr(exc))
        if self._readers.get(fd) is reader:
            del self._readers[fd]
            self._discard(fd)
        self._resting[reader] = trio.current_time() + reader.pause
        reader.pause = min(reader.pause * 2, _LONGEST_PAUSE)

    def _wake(self, reader: Reader) -> None:
        fd = reader._session.fd
        try:
            assert self._set is not None
            self._set.add(fd)
        except Exception as exc:  # (closed meanwhile, say): it rests again
            self._fault(reader, fd, exc)
            return
        self._readers[fd] = reader

    def _record_modes(self, reader: Reader) -> None:
        """The modes at the replay's start changed (bytes that set them left the ring):
        recorded once a turn, for a holder that adopts this session."""
        try:
            if reader._session.ring.modes.to_record():
                reader._session.persist()
        except Exception as exc:
            reader._session.log("internal_error", where="drain", error=repr(exc))
