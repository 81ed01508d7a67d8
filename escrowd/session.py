"""One escrowed terminal: its PTY master, its state, and the task that drains it.

Resource handling: a Session owns one duplicate of a PTY master (`fd`) from deposit until
it is closed by `close()` (handed off, released, expired); `fd` is -1 afterwards, so a late
mistake is a clean EBADF instead of an action on a reused fd number.

While `held`, the holder does nothing to the fd at all: the app is still its reader and
shares its open file description (and so its O_NONBLOCK flag) with us. Draining starts when
custody ends: the flags are saved, O_NONBLOCK is set, and one task reads everything into the
replay ring. `stop_drain()` returns only once that task has really finished, because a
cancelled `wait_readable` can still return normally once.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import select
import time
import uuid
from termios import FIONREAD

import trio

from escrow_client.liveness import process_alive
from escrow_client.platform import terminal_identity
from escrow_client.protocol import Deposit, SessionInfo

from . import journal
from .fdstore import FdStore, session_name
from .journal import JournalFile
from .log import log
from .ring import Ring
from .statefile import Record

# A read of fewer bytes counts as this many against a slice, so a slice is also bounded in
# reads (64 of them), not only in bytes.
_READ_COST = 4096
# What one drain wake-up reads at most before it lets other tasks run.
_DRAIN_SLICE = 256 * 1024
# Upper bound for one read when FIONREAD says 0 but poll says readable (a hangup, or bytes
# not yet pushed to the line discipline): such a read returns at once.
_HANGUP_READ = 64 * 1024
# Replay gaps and journal ranges a record keeps at most (a session could gather one per
# custody or per unclean restart, for ever).
_MAX_SPOTS = 64
# FIONREAD's answer lands here: the event loop is one thread, and this saves an allocation
# and an unpack on every read of a fast child.
_READABLE = array.array("i", [0])


class Session:
    def __init__(
        self,
        owner: str,
        deposit: Deposit,
        fd: int,
        ring: Ring,
        custodian: object,
        custodian_pid: int | None,
        child_start_time: float | None,
        terminal: tuple[int, int] | None = None,
        client: str = "",
        instance: str = "",
        custodian_start_time: float | None = None,
        store: FdStore | None = None,
        private_dir: str | None = None,
    ) -> None:
        self.token = uuid.uuid4().hex  # names its fds in the store (escrowd.fdstore)
        self.store_name = session_name(self.token)  # the name they are stored under
        self.instance = instance
        self.store = store if store is not None else FdStore(None)
        self.private_dir = private_dir  # where a journal file lives where there is no memfd
        self.owner = owner
        self.id = deposit.id
        self.label = deposit.label
        self.child_pid = deposit.child_pid
        self.child_start_time = child_start_time
        self.cols, self.rows, self.meta = deposit.cols, deposit.rows, deposit.meta
        self.fd = fd
        self.terminal = terminal  # which pty, across devpts instances: one terminal, one session
        self.ring = ring
        self.custodian: object | None = custodian
        self.custodian_pid = custodian_pid
        self.custodian_start_time = custodian_start_time
        self.deposited_at = self.state_since = time.time()
        self.state = "held"
        self.handoff_id: str | None = None
        self.handoff_peer_pid: int | None = None  # the retrieving client's, while handing_off
        self.gap_totals: list[int] = []  # see replay_gaps
        # The app journals from this total on (None: it does not), into `journal`; the
        # totals [from, to) of earlier journals (see escrowd.journal).
        self.journal_from: int | None = None
        self.journal: JournalFile | None = None
        self.journal_copying = False
        self.journal_ranges: list[tuple[int, int]] = []
        self.hung_up = False  # a read failed: the last slave fd is closed
        self.record_lost = False  # adopted without its record (escrowd.adoption)
        self._saved_flags: int | None = None
        self._init_runtime()
        ring.on_layout = self.persist
        self.persist()
        self.log("state", state="held", reason="deposited", child_pid=self.child_pid,
                 label=self.label or None, client=client or None)

    def _init_runtime(self) -> None:
        """What lives only in this process: the drain task, its poller, a custody watch."""
        # handing_off, but its fd not sent yet: the state recorded meanwhile (see persist).
        self.unsent: str | None = None
        self._drain_scope: trio.CancelScope | None = None
        self._drain_done: trio.Event | None = None
        self._poller: select.poll | None = None  # POLLIN on fd, made once per fd
        self._slice_used_up = False  # the last pull() stopped at `at_most`, not at empty
        self.watch_scope: trio.CancelScope | None = None  # an adopted custodian's watch
        self.adopted_handoff = False  # handing_off, begun by a holder that has stopped
        # Deposited, its fds not yet confirmed stored: not listed (nothing may take it for
        # escrowed, not even its own app asking whether its deposit arrived).
        self.storing = False

    @classmethod
    def adopted(cls, fd: int, ring: Ring, record: Record, instance: str,
                store: FdStore | None = None, private_dir: str | None = None,
                journal: JournalFile | None = None) -> Session:
        """A session as a state file recorded it (a holder starting with stored state),
        with the journal file the store kept for it, if any. Its ring must already be
        adopted; the caller resumes it by its state."""
        self = cls.__new__(cls)
        self.token, self.instance = record.token, instance
        self.store_name = session_name(record.token)
        self.store = store if store is not None else FdStore(None)
        self.private_dir = private_dir
        self.owner, self.id, self.label = record.owner, record.id, record.label
        self.child_pid, self.child_start_time = record.child_pid, record.child_start_time
        self.cols, self.rows, self.meta = record.cols, record.rows, record.meta
        self.fd, self.ring = fd, ring
        try:
            self.terminal = terminal_identity(fd)
        except OSError:  # out of fds, say: it cannot be told apart now (never a crash)
            self.terminal = None
        self.custodian = None
        self.custodian_pid = record.custodian_pid
        self.custodian_start_time = record.custodian_start_time
        self.deposited_at, self.state_since = record.deposited_at, record.state_since
        self.state, self.handoff_id = record.state, record.handoff_id
        self.handoff_peer_pid = record.handoff_peer_pid
        self.gap_totals = list(record.gap_totals)
        self.journal_from = record.journal_from
        self.journal, self.journal_copying = journal, record.journal_copying
        self.journal_ranges = [(a, b) for a, b in record.journal_ranges]
        self.hung_up = False
        self.record_lost = record.record_lost
        self._saved_flags = record.saved_flags
        self._init_runtime()
        ring.on_layout = self.persist
        return self

    def take_custody(self, custodian: object, reason: str) -> None:
        """A held session's app is back on a new connection: it is the custodian again,
        and the watch on its old process (an adopted session's) ends."""
        self.custodian = custodian
        if self.watch_scope is not None:
            self.watch_scope.cancel()
        self.persist()
        self.log("custody", reason=reason, custodian_pid=self.custodian_pid)

    def persist(self, clean: bool = False) -> None:
        """Write this session's record into its state file (DESIGN §11): what a holder
        that adopts it needs. `clean` only when this holder stops cleanly."""
        if self.fd < 0:
            return  # closed: its state file is gone with it
        # Bounded, so that a record always fits its slot (the oldest spots go first).
        del self.gap_totals[:-_MAX_SPOTS], self.journal_ranges[:-_MAX_SPOTS]
        state, handoff_id, handoff_peer_pid = self.state, self.handoff_id, self.handoff_peer_pid
        if self.unsent is not None:
            # Claimed by a retrieve whose fd has not left yet: a holder that adopts this
            # file must drain it, not wait for an ack that cannot come.
            state, handoff_id, handoff_peer_pid = self.unsent, None, None
        self.ring.state.write(Record(
            token=self.token, owner=self.owner, id=self.id, label=self.label,
            child_pid=self.child_pid, child_start_time=self.child_start_time,
            cols=self.cols, rows=self.rows, meta=self.meta, state=state,
            deposited_at=self.deposited_at, state_since=self.state_since,
            custodian_pid=self.custodian_pid, custodian_start_time=self.custodian_start_time,
            handoff_id=handoff_id, handoff_peer_pid=handoff_peer_pid,
            saved_flags=self._saved_flags,
            gap_totals=self.gap_totals, instance=self.instance, clean=clean,
            journal_from=self.journal_from, journal_ranges=self.journal_ranges,
            journal_capacity=self.journal.capacity if self.journal is not None else 0,
            journal_copying=self.journal_copying, record_lost=self.record_lost,
            **self.ring.layout(),
        ))

    @property
    def replay_gaps(self) -> list[int]:
        """Where in the replay the bytes of one read may be missing (one spot per unclean
        stop of a holder while it drained this session), oldest first: offsets into
        `ring.contents()`. Spots whose bytes have left the ring are forgotten."""
        oldest = self.ring.total - self.ring.size
        gaps = [total - oldest for total in self.gap_totals if total >= oldest]
        if len(gaps) != len(self.gap_totals):
            self.gap_totals = [total for total in self.gap_totals if total >= oldest]
        return gaps

    @property
    def replay_gap_at(self) -> int | None:
        """The newest of `replay_gaps`, or None: the replay is seamless."""
        gaps = self.replay_gaps
        return gaps[-1] if gaps else None

    @property
    def key(self) -> tuple[str, str]:
        return (self.owner, self.id)

    @property
    def name(self) -> str:
        return f"{self.owner}/{self.id}"

    def log(self, event: str, **fields: object) -> None:
        log(event, session=self.name, **fields)

    def set_state(self, state: str, reason: str, persist: bool = True) -> None:
        """Change state, log it, and (unless the caller records it itself) persist it."""
        if state != self.state:
            self.state, self.state_since = state, time.time()
            if persist:
                self.persist()
            self.log("state", state=state, reason=reason)

    def info(self, liveness: bool = True) -> SessionInfo:
        """What `list` says about it. Without `liveness`, `child_alive` is None (for a
        tombstone, which asks afresh each time it is listed)."""
        return SessionInfo(
            owner=self.owner,
            id=self.id,
            label=self.label,
            state=self.state,  # type: ignore[arg-type]
            child_pid=self.child_pid,
            child_alive=(process_alive(self.child_pid, self.child_start_time) if liveness
                         else None),
            deposited_at=self.deposited_at,
            state_since=self.state_since,
            buffered_bytes=self.ring.size,
            dropped_bytes=self.ring.dropped,
            custodian_pid=self.custodian_pid if self.state == "held" else None,
            handoff_id=self.handoff_id,
            cols=self.cols,
            rows=self.rows,
            meta=self.meta,
            replay_gap_at=self.replay_gap_at,
            replay_gaps=self.replay_gaps,
        )

    # --- draining ---------------------------------------------------------------------

    def start_drain(self, nursery: trio.Nursery, reason: str) -> None:
        """Become the reader: save the fd's flags, make it non-blocking, start the drain."""
        assert self._drain_done is None, "one drain task per session"
        if self.journal_from is not None:
            journal.end(self)  # the app recorded until now; from here on, we read
        if self._saved_flags is None:  # else a drain restarted before the flags were restored
            self._saved_flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, self._saved_flags | os.O_NONBLOCK)
        self._drain_scope = trio.CancelScope()
        self._drain_done = trio.Event()
        self.set_state("draining", reason)
        nursery.start_soon(self._drain, self._drain_scope, self._drain_done)

    async def _drain(self, scope: trio.CancelScope, done: trio.Event) -> None:
        try:
            with scope:
                await self._drain_until_hangup()
        finally:
            done.set()

    async def _drain_until_hangup(self) -> None:
        pause = 0.1
        while True:
            if self._slice_used_up:
                # More is waiting: let every other task have its turn, then go on without
                # a round trip through epoll.
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.wait_readable(self.fd)
            try:
                hung_up = self.pull(overwrite=True, at_most=_DRAIN_SLICE)
            except Exception as exc:
                # Never let one terminal's surprise take the holder (and every session)
                # down, nor stop draining it: a child must not block. Log and retry.
                self._slice_used_up = False
                self.log("internal_error", where="drain", error=repr(exc))
                await trio.sleep(pause)
                pause = min(pause * 2, 5.0)
                continue
            if hung_up:
                # Drain first, then mark: pull() returned only after the read failed, so
                # every byte written before the hangup is in the ring. (A handoff may be
                # stopping this task right now: it reads `hung_up` instead.)
                if self.state == "draining":
                    self.set_state("exited", "terminal hung up")
                return

    def cancel_drain(self) -> None:
        """Ask the drain task to stop; `stop_drain` waits for it."""
        if self._drain_scope is not None and not self._drain_scope.cancel_called:
            self._drain_scope.cancel()

    async def stop_drain(self) -> None:
        """Stop the drain task and wait until it has really finished (idempotent). No
        checkpoint if it has finished already: a handoff of many sessions cancels them all
        first, and they all finish in the one scheduling round the first wait gives."""
        self.cancel_drain()
        done = self._drain_done
        if done is not None and not done.is_set():
            await done.wait()
        if self._drain_done is done:
            # (Else another waiter woke first and has started a new drain: not ours to
            # forget. The caller checks `has_drain()`.)
            self._drain_scope = self._drain_done = None

    def forget_drain(self) -> None:
        """The nursery the drain ran in has exited (the holder is stopping): the task is
        over whatever it was doing."""
        assert self._drain_done is None or self._drain_done.is_set()
        self._drain_scope = self._drain_done = None

    def has_drain(self) -> bool:
        """True from `start_drain` until a `stop_drain` has completed."""
        return self._drain_done is not None

    def pull(self, overwrite: bool, at_most: int | None = None) -> bool:
        """Read what is readable now into the ring; True once the terminal has hung up.

        With `overwrite`, the ring drops its oldest bytes to keep the newest. Without it (the
        sweep), it stops when the ring has no free space: what is left stays in the kernel
        for the next reader. Each read is bounded by FIONREAD, so it never blocks even if
        another process clears O_NONBLOCK on the shared open file description. With
        `at_most`, it returns after about that many bytes even if more keep coming, so one
        fast child cannot keep the event loop from every other session.
        """
        fd, ring = self.fd, self.ring
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
                    self.log("read_error", errno=errno.errorcode.get(exc.errno or 0, exc.errno))
                self.hung_up = True
                return True
            if count == 0:
                # End of file, unless a sweep found no room and so did not read at all.
                if overwrite or ring.size < ring.capacity:
                    self.hung_up = True
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
        trio.lowlevel.notify_closing(self.fd)
        self._poller = None
        if self._saved_flags is not None:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, self._saved_flags)
            self._saved_flags = None

    def close(self) -> None:
        """Close the holder's copy of the master. The drain must be stopped first."""
        assert self._drain_done is None, "stop the drain before closing"
        self._poller = None
        if self.watch_scope is not None:
            self.watch_scope.cancel()
        journal.close_journal(self)
        if self.fd >= 0:
            trio.lowlevel.notify_closing(self.fd)
            fd, self.fd = self.fd, -1
            os.close(fd)
        self.ring.release()
