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
epoll wait, whatever the number of sessions; with none draining, the task has ended. The
set itself is made once, as the holder starts (`prepare`), and kept: a drain needs no new
fd, so a holder at its fd limit still drains a session whose custody ends.

The loop reads an fd only right after the readiness set said it was readable (or hung up).
With the holder the terminal's only reader, the bytes are still there, so the read does
not block even if the app cleared O_NONBLOCK on the shared description: a master's line
discipline returns whatever it holds at once (its termios is its own: a tcsetattr on the
master sets the slave's, so nobody can give it a VMIN to wait for), and a hung-up master
returns EIO at once. A second reader breaks that, and Linux has no per-call non-blocking
read for a tty: one case has one, a session adopted without its record, which starts
draining after a grace (escrowd.resume) even if its app's custody still reads it; if that
app also cleared O_NONBLOCK, a read can block the holder until the terminal has bytes.
Asking the set costs one system call for all the ready fds, and it polls each, which is
what pushes the bytes a pty still holds in its flip buffer to the reader (FIONREAD does not
see those: right after a read it is mostly 0 while a fast child writes on). So the loop
makes one read, and a share of one epoll wait, per read: no FIONREAD, no poll. The sweep
before a handoff (escrowd.sweep) must read everything there is, and asks FIONREAD.

Starting a drain registers the master, and stopping it unregisters it, synchronously: no
task to cancel or wait for. No read can be in flight when a drain stops: the loop reads only
between two of its own checkpoints, and any other task (a handoff stopping the drain) runs
only while the loop waits at one; once unregistered, no later ready list names that fd, and
each fd of a list already taken is looked up again before it is read. Starting a drain
never raises: a terminal the loop cannot take in (no fd to make the set, say) rests, and is
tried again, draining all the while.

A hangup is drained to its last byte before it is told: a pty master returns EIO only once
it has nothing left to read, so every byte written before the hangup is in the ring when
the session hears of it (`Drained.drained_to_hangup`). A surprise from one terminal (a read
that fails otherwise, or any exception from a read into its ring) is logged, and that
terminal rests out of the set for a pause (0.1 s, doubling up to 5 s, woken at every turn
of the loop, busy or not) and is then read again, still draining, once its fd is proved to
be its terminal still: the loop and every other session go on.

An fd closed while in the set (only a bug elsewhere in the holder does that: a session's
master is closed after its drain stops) leaves epoll an entry no number can name again, as
long as another process holds the open file: it would be ready forever. The loop knows it
by a ready fd with no reader, a read that fails EBADF, a read that finds nothing where the
set said there was something, or a number two sessions claim; then it makes the set anew
with every reader proved (by its pty's identity) to be its terminal still, and stops reading
a number that names another file now (logged `drain_lost`, the session left draining: its
terminal did not hang up that anyone knows). Between the close and that surprise, one read
may go to whatever file got the number: the check at every read that would close that gap
is a system call a read, and the gap is a bug's.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Protocol

import trio

from escrow_client.platform import is_pty_master, terminal_identity

from .readiness import Readiness
from .ring import Ring
from .sweep import sweep

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

class Drained(Protocol):
    """What the reader reads and tells of a session (escrowd.session.Session)."""

    fd: int
    ring: Ring
    hung_up: bool
    terminal: tuple[int, int] | None

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
        drain loop (started in `nursery` if it is not running). Never raises: a terminal
        the loop cannot take in now rests and is tried again, draining all the while."""
        loop = DrainLoop.current()
        self._loop, self._fd, self.pause = loop, -1, _FIRST_PAUSE
        loop.join(self, nursery)

    def enter(self, check: bool) -> int:
        """The fd, made non-blocking with the app's flags saved; with `check`, first
        proved to be the session's terminal still (after a surprise)."""
        session = self._session
        fd = session.fd
        if check:
            its = _is_its_terminal(session, fd)
            if its is False:
                raise _NotItsTerminal()
            if its is None:
                raise OSError(errno.EMFILE, "cannot tell which file the fd is")
        if self.saved_flags is None:  # else a drain restarted before the flags were restored
            self.saved_flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, self.saved_flags | os.O_NONBLOCK)
        return fd

    def stop(self) -> None:
        """Stop draining, now (idempotent): from here on the loop does not read this fd."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.remove(self, self._fd)
        self._fd = -1

    def pull(self, overwrite: bool, at_most: int | None = None) -> bool:
        """The sweep before a handoff (escrowd.sweep): what is readable now, into the
        ring; True once the terminal has hung up."""
        return sweep(self._session, overwrite, at_most)

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


_CURRENT: trio.lowlevel.RunVar[DrainLoop] = trio.lowlevel.RunVar("escrowd.drain")


class _NotItsTerminal(Exception):
    """The session's fd number names another file now (closed under the loop)."""


class DrainLoop:
    """Every draining session of this trio run, and the one task that reads them (see the
    module's docstring). The task runs while any session drains, in the nursery of the
    drain that started it; the readiness set is made once and kept for the run."""

    __slots__ = ("_set", "_readers", "_resting", "_running", "_waiting", "_nap")

    def __init__(self) -> None:
        self._set: Readiness | None = None
        self._readers: dict[int, Reader] = {}  # by fd: the ones in the set
        self._resting: dict[Reader, float] = {}  # faulted: when each is read again
        self._running = False
        self._waiting = False  # the task waits for the set (or a resting terminal)
        self._nap: trio.CancelScope | None = None  # its wait while there is no set

    @classmethod
    def current(cls) -> DrainLoop:
        try:
            return _CURRENT.get()
        except LookupError:
            loop = cls()
            _CURRENT.set(loop)
            trio.lowlevel.spawn_system_task(loop._close_at_the_end)
            return loop

    async def _close_at_the_end(self) -> None:
        """The set is the run's: closed as the run ends (which cancels system tasks)."""
        try:
            await trio.sleep_forever()
        finally:
            if self._set is not None:
                readiness, self._set = self._set, None
                trio.lowlevel.notify_closing(readiness.fileno())
                readiness.close()

    def prepare(self) -> None:
        """Make the readiness set now, while an fd is to be had (the holder, as it
        starts): kept for the run, so that no later drain needs a new fd."""
        if self._set is None:
            try:
                self._set = Readiness()
            except OSError:
                pass  # (then the first drain makes it, or its reader rests until it can)

    def join(self, reader: Reader, nursery: trio.Nursery) -> None:
        """Read `reader` from now on. Never raises: a terminal that cannot be registered
        (no fd left for the set, say) rests, and is tried again, still draining."""
        try:
            self._register(reader, reader.enter(check=False))
        except Exception as exc:
            self._fault(reader, -1, exc)
        if not self._running:
            self._running = True
            nursery.start_soon(self._run)

    def _register(self, reader: Reader, fd: int) -> None:
        if self._set is None:
            self._set = Readiness()
        self._set.add(fd)  # (raises for an fd that cannot be drained: nothing changed)
        other = self._readers.get(fd)
        self._readers[fd] = reader
        reader._fd = fd
        if other is not None and other is not reader:
            # Two sessions by one number: the other's fd was closed under the loop, and
            # this one's master got its number. The other's entry is stale: rebuild.
            other._fd = -1
            other.session.log("drain_lost", fd=fd, why="its fd names another terminal")
            self._rebuild()

    def remove(self, reader: Reader, fd: int) -> None:
        self._resting.pop(reader, None)
        if fd >= 0 and self._readers.get(fd) is reader:  # (else resting, lost, hung up)
            del self._readers[fd]
            self._discard(fd)
        if not self._readers and not self._resting and (self._waiting or not self._running):
            # Nothing left to wait for: the task's wait is woken, and it ends (or the task
            # ended already with the nursery it ran in). The set stays, empty, for the
            # next drain: making one needs an fd, which may be the one fd not to be had.
            if self._set is not None:
                try:
                    trio.lowlevel.notify_closing(self._set.fileno())
                except RuntimeError:
                    pass  # outside trio.run (its loop is gone, and waits on nothing)
            if self._nap is not None:
                self._nap.cancel()

    def _discard(self, fd: int) -> None:
        assert self._set is not None
        try:
            self._set.discard(fd)
        except OSError:
            pass  # closed under us: its entry may stay (a dup elsewhere): see `_rebuild`

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:
            self._running = False
            self._waiting = False

    async def _serve(self) -> None:
        readers, resting = self._readers, self._resting
        while readers or resting:
            if resting:  # at every turn: a busy loop never waits, and they must come back
                self._wake_due()
            made, stale = 0, False
            changed: set[Reader] = set()
            ready = self._set.ready if self._set is not None else None
            while ready is not None and made < _TURN_READS and not stale:
                fds = ready(_ROUND)
                if not fds:
                    break
                made += len(fds)
                for fd in fds:
                    reader = readers.get(fd)
                    if reader is None:
                        stale = True  # an fd closed in the set: its entry is ready forever
                        continue
                    ring = reader._session.ring
                    try:
                        count = ring.read_from(fd, _LOOP_READ, True)
                    except BlockingIOError:
                        # Said readable, and nothing: another reader, or another file by
                        # this number now. Which one is worth three system calls.
                        stale = self._check(reader, fd) or stale
                        continue
                    except OSError as exc:
                        if exc.errno == errno.EBADF:  # closed under us: its entry stays
                            stale = True
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
            if stale:
                self._rebuild()
            if made >= _TURN_READS or stale:
                await trio.lowlevel.checkpoint()
            else:
                await self._wait()

    async def _wait(self) -> None:
        """Until the set is readable, or a resting terminal is due."""
        self._waiting = True
        try:
            if self._set is None:  # (it could not be made: every reader rests)
                if not self._resting:
                    return
                with trio.CancelScope(deadline=min(self._resting.values())) as self._nap:
                    await trio.sleep_forever()
            elif not self._resting:
                await trio.lowlevel.wait_readable(self._set.fileno())
            else:
                with trio.move_on_at(min(self._resting.values())):
                    await trio.lowlevel.wait_readable(self._set.fileno())
        except trio.ClosedResourceError:
            pass  # the last drain stopped (`remove`): the task ends, or goes on anew
        finally:
            self._waiting = False
            self._nap = None

    def _wake_due(self) -> None:
        now = trio.current_time()
        for reader, due in list(self._resting.items()):
            if due <= now:
                del self._resting[reader]
                self._rejoin(reader)

    def _rejoin(self, reader: Reader) -> None:
        """Back into the set after a surprise, once its fd is proved to be its terminal
        still."""
        try:
            self._register(reader, reader.enter(check=True))
        except _NotItsTerminal:
            fd, reader._fd = reader._session.fd, -1
            reader._session.log("drain_lost", fd=fd, why="its fd names another file")
        except Exception as exc:  # (cannot tell now, or cannot be added): it rests again
            self._fault(reader, -1, exc)

    def _check(self, reader: Reader, fd: int) -> bool:
        """Whether `fd` is the reader's terminal still; if not, it is out (True)."""
        if _is_its_terminal(reader._session, fd) is not False:
            return False
        del self._readers[fd]
        reader._fd = -1
        reader._session.log("drain_lost", fd=fd, why="its fd names another file")
        return True

    def _rebuild(self) -> None:
        """An fd was closed while in the set (a bug elsewhere in the holder): epoll keeps
        its entry while another process holds the open file, and no number can name it
        again, so it would be ready forever. The set goes, and a new one has every reader
        back, each proved first to be its terminal still (O(n), and rare)."""
        if self._set is not None:
            readiness, self._set = self._set, None
            trio.lowlevel.notify_closing(readiness.fileno())
            readiness.close()  # (first: its fd is then free for the new one)
        self.prepare()
        readers = list(self._readers.values())
        self._readers.clear()
        for reader in readers:
            self._rejoin(reader)

    def _hung_up(self, reader: Reader, fd: int) -> None:
        """Every byte before the hangup is in the ring: out of the set, and told."""
        del self._readers[fd]
        reader._fd = -1
        self._discard(fd)
        try:
            reader._session.drained_to_hangup()
        except Exception as exc:  # one session's surprise must not stop the others
            reader._session.log("internal_error", where="drain", error=repr(exc))

    def _fault(self, reader: Reader, fd: int, exc: Exception) -> None:
        """Never let one terminal's surprise take the holder (and every session) down, nor
        stop draining it (a child must not block): log it, rest, and read it again once
        its fd is proved to be its terminal still. A read that fails with anything but
        EIO (EBADF: its fd closed under us, say) is no proof that the terminal hung up:
        the session stays draining."""
        session = reader._session
        if isinstance(exc, OSError):
            session.log("read_error", errno=errno.errorcode.get(exc.errno or 0, exc.errno))
        else:
            session.log("internal_error", where="drain", error=repr(exc))
        if fd >= 0 and self._readers.get(fd) is reader:
            del self._readers[fd]
            self._discard(fd)
        reader._fd = -1
        self._resting[reader] = trio.current_time() + reader.pause
        reader.pause = min(reader.pause * 2, _LONGEST_PAUSE)

    def _record_modes(self, reader: Reader) -> None:
        """The modes at the replay's start changed (bytes that set them left the ring):
        recorded once a turn, for a holder that adopts this session."""
        try:
            if reader._session.ring.modes.to_record():
                reader._session.persist()
        except Exception as exc:
            reader._session.log("internal_error", where="drain", error=repr(exc))


def _is_its_terminal(session: Drained, fd: int) -> bool | None:
    """Whether `fd` is the session's terminal: False only with proof (another terminal,
    no terminal, no fd by that number), None when it cannot be told now (no fd left)."""
    if fd < 0:
        return False
    try:
        have = terminal_identity(fd)
    except OSError as exc:
        return False if exc.errno == errno.EBADF else None
    if have is not None and session.terminal is not None:
        return have == session.terminal
    try:
        return is_pty_master(fd)  # no identity to compare: whether it is a master at all
    except OSError as exc:
        return False if exc.errno == errno.EBADF else None
