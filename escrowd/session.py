"""One escrowed terminal: its PTY master, its state, and the task that drains it.

Resource handling: a Session owns one duplicate of a PTY master (`fd`) from deposit until
it is closed by `close()` (handed off, released, expired); `fd` is -1 afterwards, so a late
mistake is a clean EBADF instead of an action on a reused fd number.

While `held`, the holder does nothing to the fd at all: the app is still its reader and
shares its open file description (and so its O_NONBLOCK flag) with us. Draining starts when
custody ends: the flags are saved, O_NONBLOCK is set, and the holder's one drain loop reads
everything into the replay ring (escrowd.drain). `stop_drain()` takes the terminal out of
that loop at once: no read is ever in flight when it runs.
"""

from __future__ import annotations

import os
import time
import uuid

import trio

from escrow_client.liveness import process_alive
from escrow_client.platform import terminal_identity
from escrow_client.protocol import Deposit, ProgramEnd, SessionInfo

from . import journal
from .drain import Reader
from .fdstore import FdStore, session_name
from .journal import JournalFile
from .log import log
from .ring import Ring
from .statefile import Record

# Replay gaps and journal ranges a record keeps at most (a session could gather one per
# custody or per unclean restart, for ever).
_MAX_SPOTS = 64


class Session:
    # Slots: a holder keeps thousands of these, and a __dict__ each was 1.6 KB.
    __slots__ = ("token", "store_name", "instance", "store", "private_dir", "owner", "id",
                 "label", "child_pid", "child_start_time", "cols", "rows", "meta", "fd",
                 "terminal", "ring", "custodian", "custodian_pid", "custodian_start_time",
                 "deposited_at", "state_since", "state", "handoff_id", "handoff_peer_pid",
                 "gap_totals", "journal_from", "journal", "journal_copying",
                 "journal_ranges", "hung_up", "record_lost", "unsent", "reader",
                 "watch_scope", "adopted_handoff", "storing", "started", "exit_status")

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
        started: bool = False,
    ) -> None:
        now = time.time()
        # `started` is in the very first record: one adopted after a crash is never taken
        # for an app's (escrowd.programs).
        record = Record(token=uuid.uuid4().hex, owner=owner, id=deposit.id, started=started,
                        label=deposit.label, child_pid=deposit.child_pid,
                        child_start_time=child_start_time, cols=deposit.cols,
                        rows=deposit.rows, meta=deposit.meta, deposited_at=now,
                        state_since=now, custodian_pid=custodian_pid,
                        custodian_start_time=custodian_start_time)
        self._as_recorded(fd, ring, record, terminal, instance, store, private_dir, None)
        self.custodian: object | None = custodian
        self.persist()
        self.log("state", state="held", reason="deposited", child_pid=self.child_pid,
                 label=self.label or None, client=client or None)

    @classmethod
    def adopted(cls, fd: int, ring: Ring, record: Record, instance: str,
                store: FdStore | None = None, private_dir: str | None = None,
                journal: JournalFile | None = None) -> Session:
        """A session as a state file recorded it (a holder starting with stored state),
        with the journal file the store kept for it, if any. Its ring must already be
        adopted; the caller resumes it by its state."""
        self = cls.__new__(cls)
        try:
            terminal = terminal_identity(fd)
        except OSError:  # out of fds, say: it cannot be told apart now (never a crash)
            terminal = None
        self._as_recorded(fd, ring, record, terminal, instance, store, private_dir, journal)
        return self

    def _as_recorded(self, fd: int, ring: Ring, record: Record,
                     terminal: tuple[int, int] | None, instance: str, store: FdStore | None,
                     private_dir: str | None, journal: JournalFile | None) -> None:
        """A session as `record` says it is (a new deposit's, or one a state file kept),
        with no custodian connected."""
        self.token = record.token  # names its fds in the store (escrowd.fdstore)
        self.store_name = session_name(record.token)  # the name they are stored under
        self.instance = instance
        self.store = store if store is not None else FdStore(None)
        self.private_dir = private_dir  # where a journal file lives where there is no memfd
        self.owner, self.id, self.label = record.owner, record.id, record.label
        self.child_pid, self.child_start_time = record.child_pid, record.child_start_time
        self.cols, self.rows, self.meta = record.cols, record.rows, record.meta
        self.fd = fd
        self.terminal = terminal  # which pty, across devpts instances: one terminal, one session
        self.ring = ring
        self.custodian = None
        self.custodian_pid = record.custodian_pid
        self.custodian_start_time = record.custodian_start_time
        self.deposited_at, self.state_since = record.deposited_at, record.state_since
        self.state = record.state
        # While handing_off: the handoff, and the retrieving client's pid.
        self.handoff_id, self.handoff_peer_pid = record.handoff_id, record.handoff_peer_pid
        self.gap_totals = list(record.gap_totals)  # see replay_gaps
        # The app journals from this total on (None: it does not), into `journal`; the
        # totals [from, to) of earlier journals (see escrowd.journal).
        self.journal_from = record.journal_from
        self.journal, self.journal_copying = journal, record.journal_copying
        self.journal_ranges = [(a, b) for a, b in record.journal_ranges]
        self.hung_up = False  # a read failed: the last slave fd is closed
        self.record_lost = record.record_lost  # adopted without its record (escrowd.adoption)
        # The holder started its program, and how it ended (escrowd.programs).
        self.started: bool = record.started
        self.exit_status: ProgramEnd = record.exit_status
        self._init_runtime(record.saved_flags)
        ring.on_layout = self.persist

    def _init_runtime(self, saved_flags: int | None) -> None:
        """What lives only in this process: the drain's reader, a custody watch (and the
        app's fd flags, which the record keeps too)."""
        # handing_off, but its fd not sent yet: the state recorded meanwhile (see persist).
        self.unsent: str | None = None
        self.reader = Reader(self, saved_flags)  # the drain's reading side (escrowd.drain)
        self.watch_scope: trio.CancelScope | None = None  # an adopted custodian's watch
        self.adopted_handoff = False  # handing_off, begun by a holder that has stopped
        # Deposited, its fds not yet confirmed stored: not listed (nothing may take it for
        # escrowed, not even its own app asking whether its deposit arrived).
        self.storing = False

    def take_custody(self, custodian: object, reason: str) -> None:
        """A held session's app is back on a new connection: it is the custodian again,
        and the watch on its old process (an adopted session's) ends."""
        self.custodian = custodian
        if self.watch_scope is not None:
            self.watch_scope.cancel()
        self.persist()
        self.log("custody", reason=reason, custodian_pid=self.custodian_pid)

    def persist(self, clean: bool = False) -> None:
        """Write this session's record into its state file (docs/design.md §11): what a holder
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
            saved_flags=self.reader.saved_flags,
            gap_totals=self.gap_totals, instance=self.instance, clean=clean,
            journal_from=self.journal_from, journal_ranges=self.journal_ranges,
            journal_capacity=self.journal.capacity if self.journal is not None else 0,
            journal_copying=self.journal_copying, record_lost=self.record_lost,
            started=self.started, exit_status=self.exit_status,
            **self.ring.layout(), **self.ring.modes.stored(),
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
        gaps = self.replay_gaps
        return SessionInfo(
            owner=self.owner, id=self.id, label=self.label,
            state=self.state,  # type: ignore[arg-type]
            child_pid=self.child_pid,
            child_alive=(process_alive(self.child_pid, self.child_start_time) if liveness
                         else None),
            deposited_at=self.deposited_at, state_since=self.state_since,
            buffered_bytes=self.ring.size, dropped_bytes=self.ring.dropped,
            custodian_pid=self.custodian_pid if self.state == "held" else None,
            handoff_id=self.handoff_id, cols=self.cols, rows=self.rows, meta=self.meta,
            replay_gap_at=gaps[-1] if gaps else None, replay_gaps=gaps,
            started=self.started, exit_status=self.exit_status,
        )

    # --- draining (the reading itself: escrowd.drain) -----------------------------------

    def start_drain(self, nursery: trio.Nursery, reason: str) -> None:
        """Become the reader: save the fd's flags, make it non-blocking, and drain it in
        the holder's drain loop (escrowd.drain; started in `nursery` if it is not running)."""
        assert not self.reader.running, "one drain per session"
        if self.journal_from is not None:
            journal.end(self)  # the app recorded until now; from here on, we read
        self.reader.begin(nursery)
        self.set_state("draining", reason)

    def drained_to_hangup(self) -> None:
        """The drain read the terminal to its hangup: every byte written before it is in
        the ring, so now it may be said. (A handoff that stopped the drain reads `hung_up`
        instead.)"""
        if self.state == "draining":
            self.set_state("exited", "terminal hung up")

    def cancel_drain(self) -> None:
        """Stop draining, now: the drain loop does not read this terminal again."""
        self.reader.stop()

    async def stop_drain(self) -> None:
        """Stop draining (idempotent). It is over when this returns, without a checkpoint:
        the drain loop never has a read in flight while another task runs (escrowd.drain).
        The caller checks `has_drain()` all the same, as a wait may come before it."""
        self.reader.stop()

    def forget_drain(self) -> None:
        """The nursery the drain ran in has exited (the holder is stopping)."""
        self.reader.stop()

    def has_drain(self) -> bool:
        """True from `start_drain` until a `stop_drain`."""
        return self.reader.running

    def pull(self, overwrite: bool, at_most: int | None = None) -> bool:
        """Read what is readable now into the ring; True once the terminal has hung up
        (`Reader.pull`: without `overwrite`, only into free space)."""
        return self.reader.pull(overwrite, at_most)

    def leave_event_loop(self) -> None:
        """Before the fd goes to another process: restore the app's flags (the drain has
        stopped, so it is read no more)."""
        self.reader.leave_event_loop()

    def close(self) -> None:
        """Close the holder's copy of the master. The drain must be stopped first."""
        self.reader.close()
        if self.watch_scope is not None:
            self.watch_scope.cancel()
        journal.close_journal(self)
        if self.fd >= 0:
            # (No notify_closing: trio never waits on a terminal; the drain loop's set
            # forgot it when the drain stopped.)
            fd, self.fd = self.fd, -1
            os.close(fd)
        self.ring.release()
