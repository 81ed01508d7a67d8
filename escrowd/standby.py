"""The keeper's warm standby: the next holder, started before it is needed, so that when the
serving holder dies the keeper's store is served again without an exec and a holder's
imports in between (docs/design.md §11; the standby's own side is escrowd.takeover).

Once a holder has said READY, the keeper starts one standby (escrowd.spawn.fork_standby):
`escrowd --bare` as a holder is started, with nothing passed but one end of a stream socket
whose other end the keeper keeps. It loads every module a holder loads, says `R`, and waits.
When the serving holder has exited (and been reaped: two holders never serve at once; the
keeper holds the lock for both, and neither takes it), the keeper sends the ready standby,
over that socket, what an exec would pass (`hand_over`): an order naming the fds, then the
fds in batches, with a deadline for the whole. From then on it is the keeper's holder, and
the next standby is started once it says READY.

What a standby costs when it fails is a fresh exec, as before there were standbys:
- A standby that dies while it waits (or before it is ready) is reaped and replaced, with
  back-off if it keeps dying: it held nothing.
- A takeover that is not sent and taken (TAKEN) within its deadline (the standby died,
  hangs, is frozen, or is out of room) SIGKILLs the standby before anything else starts,
  and the keeper execs a holder; the dead standby is reaped when it is gone. One that took
  over and died, or was not READY within the keeper's deadline (escrowd.keeper), is a
  failed takeover too: the next holder is exec'd at once, and standbys are used again once
  an exec'd holder has served (`exec_next`).
- An upgrade (SIGHUP) that passed its trial run discards the standby, which runs the code
  that was installed when it started, and starts one of the new code before the old holder
  is stopped (`renew`): a standby older than the installed code never serves after an
  upgrade. (Code installed with no upgrade asked for is served by the next exec'd holder,
  as it always was, and by no standby started before it.)
- Stopping, the keeper kills its standby.

Under systemd there is no keeper and no standby: systemd starts each holder by exec.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time

from escrow_client.platform import SEND_FLAGS

from .log import log
from .names import rights_for
from .spawn import fork_standby

# The standby says READY once loaded; each batch of fds rides on one BATCH byte; it says
# TAKEN once it has every fd of a takeover.
READY, BATCH, TAKEN = b"R", b"F", b"T"
MAX_FDS_PER_MESSAGE = 253  # SCM_MAX_FD
# For a whole takeover to be sent and taken; a standby that takes longer is killed. Taken,
# not sent: the kernel queues a takeover of 70,000 fds for a standby that never reads.
TAKEOVER_DEADLINE = 2.0
# A standby starts this long after its holder is ready, so that loading it (a holder's
# imports: a core for 150 ms and more) does not slow the new holder's first requests.
START_DELAY = 1.0
_BACKOFF_FIRST, _BACKOFF_MAX = 0.5, 60.0


class Standby:
    """One standby process. Resource handling: owns `sock`, the keeper's end of its
    socket."""

    def __init__(self, pid: int, sock: socket.socket, generation: int) -> None:
        self.pid = pid
        self.sock = sock
        self.generation = generation
        self.started = time.monotonic()
        self.ready = False
        self.polled = True  # registered with the keeper's poller


class Standbys:
    """The keeper's standby, if any, and when the next may start; its socket is registered
    with the keeper's `poller` while it may speak. Resource handling: owns the standby (its
    socket, and the process until it is reaped)."""

    def __init__(self, poller: select.poll) -> None:
        self.poller = poller
        self.current: Standby | None = None
        self.generation = 0  # the installed code, as far as the keeper knows: + 1 an upgrade
        self.start_at = 0.0
        self.backoff = _BACKOFF_FIRST
        self.exec_next = False  # a takeover failed: the next holder is exec'd
        self.delayed = False  # start_at already counts START_DELAY for the next standby
        self.dying: list[int] = []  # standbys killed, not yet reaped

    @property
    def ready(self) -> bool:
        return self.current is not None and self.current.ready

    def keep(self, argv: list[str], env: dict[str, str]) -> None:
        """Start a standby of `argv` with `env` (a holder's, less what is passed at
        takeover) if none runs and its back-off is over."""
        now = time.monotonic()
        if self.current is None and not self.delayed:
            self.start_at, self.delayed = max(self.start_at, now + START_DELAY), True
        if self.current is not None or now < self.start_at:
            return
        self.delayed = False
        try:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            log("keeper_standby_not_started", error=exc.strerror or repr(exc))
            self.start_at = now + self.backoff
            return
        try:
            pid = fork_standby(argv, env, theirs.fileno(), mine)
        except OSError as exc:
            mine.close()
            log("keeper_standby_not_started", error=exc.strerror or repr(exc))
            self.start_at = now + self.backoff
            return
        finally:
            theirs.close()
        mine.setblocking(False)
        self.current = Standby(pid, mine, self.generation)
        self.poller.register(mine, select.POLLIN)
        log("keeper_started_standby", standby_pid=pid)

    def readable(self) -> None:
        """The standby said something: `R` (ready), or nothing (EOF: it is dying; `reap`
        finds out)."""
        standby = self.current
        if standby is None:
            return
        try:
            data = standby.sock.recv(16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.poller.unregister(standby.sock)  # (else EOF wakes the keeper until reaped)
            standby.polled = False
        elif data.startswith(READY) and not standby.ready:
            standby.ready = True
            self.backoff = _BACKOFF_FIRST
            log("keeper_standby_ready", standby_pid=standby.pid,
                loaded=round(time.monotonic() - standby.started, 3))

    def fileno(self) -> int | None:
        return self.current.sock.fileno() if self.current is not None else None

    def reap(self) -> None:
        """Reap the standby if it exited, and say when the next may start; and those killed,
        once they are gone."""
        for pid in list(self.dying):
            try:
                done = os.waitpid(pid, os.WNOHANG)[0]
            except ChildProcessError:
                done = pid
            if done:
                self.dying.remove(pid)
                log("keeper_standby_reaped", standby_pid=pid)
        standby = self.current
        if standby is None:
            return
        try:
            pid, status = os.waitpid(standby.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = standby.pid, 0
        if pid == 0:
            return
        self._forget(standby)
        log("keeper_standby_exited", standby_pid=standby.pid,
            code=os.waitstatus_to_exitcode(status), was_ready=standby.ready,
            retry_in=0 if standby.ready else round(self.backoff, 3))
        self.start_at = time.monotonic() + (0.0 if standby.ready else self.backoff)
        if not standby.ready:
            self.backoff = min(self.backoff * 2, _BACKOFF_MAX)

    def hand_over(self, fds: list[int], names: list[str], fdstore: int,
                  watchdog: float) -> int | None:
        """Tell the standby to serve (`hand_over`) if one is ready, of the installed code,
        and no takeover failed since an exec'd holder last served; its pid if it took
        everything. None otherwise: a standby that failed is SIGKILLed by then, so that
        it cannot serve beside the holder exec'd instead."""
        standby = self.current
        if (standby is None or not standby.ready or standby.generation != self.generation
                or self.exec_next):
            return None
        self.current = None
        if standby.polled:  # (not if its EOF was read: it died with the holder, say)
            self.poller.unregister(standby.sock)
            standby.polled = False
        try:
            hand_over(standby, fds, names, fdstore, watchdog)
        except OSError as exc:
            log("keeper_standby_failed", standby_pid=standby.pid, error=repr(exc),
                reason="starting a holder by exec instead")
            self._kill(standby)
            return None
        standby.sock.close()
        return standby.pid

    def drop(self, renew: bool = False) -> None:
        """Kill and reap the standby (the keeper stops). `renew`: the installed code changed
        (an upgrade passed its trial run), and no standby started before may serve."""
        if renew:
            self.generation += 1
            # At once: the old holder waits for it to stop (escrowd.keeper).
            self.start_at, self.backoff, self.delayed = 0.0, _BACKOFF_FIRST, True
        standby, self.current = self.current, None
        if standby is not None:
            if standby.polled:
                self.poller.unregister(standby.sock)
            self._kill(standby)

    def _kill(self, standby: Standby) -> None:
        kill(standby)
        self.dying.append(standby.pid)

    def _forget(self, standby: Standby) -> None:
        if standby.polled:
            self.poller.unregister(standby.sock)
        standby.sock.close()
        if self.current is standby:
            self.current = None


def hand_over(standby: Standby, fds: list[int], names: list[str], fdstore: int,
              watchdog: float) -> None:
    """Tell `standby` to serve with `fds` (the listener and every stored fd, named `names`,
    then its end of the notify channel), and have it say it took them all, within
    TAKEOVER_DEADLINE; the keeper keeps its own copies. OSError (TimeoutError,
    BrokenPipeError...) if not all of it was sent and taken: then the standby must be killed
    before any other holder starts."""
    deadline = time.monotonic() + TAKEOVER_DEADLINE
    sock = standby.sock
    order = "\n".join((f"FDS={len(fds)}", f"LISTEN_FDNAMES={':'.join(names)}",
                       f"FDSTORE={fdstore}", f"WATCHDOG_SECONDS={watchdog!r}")).encode()
    _send(sock, len(order).to_bytes(4, "big") + order, [], deadline)
    for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
        _send(sock, BATCH, fds[start:start + MAX_FDS_PER_MESSAGE], deadline)
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the standby did not take the takeover in time")
    sock.settimeout(left)
    answer = sock.recv(1)  # TimeoutError if it does not come
    if answer != TAKEN:
        raise ConnectionError(f"the standby answered {answer!r} to its takeover")


def _send(sock: socket.socket, data: bytes, fds: list[int], deadline: float) -> None:
    view = memoryview(data)
    rights = rights_for(fds)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the standby did not take the takeover in time")
        sock.settimeout(left)
        sent = sock.sendmsg([view], rights, SEND_FLAGS)
        view, rights = view[sent:], []  # the fds went with the first byte


def kill(standby: Standby) -> None:
    """SIGKILL `standby`, so that nothing it was sent can be served by it once this returns
    (a process sent SIGKILL never runs its own code again), and close its socket. It is
    reaped later (`Standbys.reap`): one that cannot die at once (in D state, frozen, or a
    zombie its tracer holds) must not hang the keeper's loop."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(standby.pid, signal.SIGKILL)
    standby.sock.close()
    log("keeper_standby_killed", standby_pid=standby.pid)
