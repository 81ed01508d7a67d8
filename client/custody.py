"""Custody: the app keeps its sessions escrowed for as long as it runs, and knows whether
they are (DESIGN §3, §11 "Custody survives too").

A `Custody` is a custodian connection: sessions deposited through it stay `held` (the app is
their reader) until it closes, by `close()` or the process dying; then the holder drains
them. It keeps a duplicate of every master it deposited (one extra fd per session in the
app), so that it can give it again.

A watcher thread polls the connection for hang-up (it never reads, so it steals no reply
from a call in flight). When the holder goes away (a crash, an upgrade), the sessions are
unprotected: `protected` turns False and `on_change` callbacks run. The watcher reconnects
with back-off and takes custody back: a session the new holder adopted is resumed (a
deposit from the same process and the same terminal), one it does not know is deposited
again from the kept duplicate. Then `protected` is True again.

Retrieving into custody (DESIGN §12): `retrieve` and `reclaim_all` take sessions back and
keep them escrowed, held by this custody, in one step: no moment exists in which a crash of
the app loses them.

Journal: a session deposited (or retrieved) with `journal=True` gets its replay ring mapped
here, and `record` (or `read`, which reads and records) appends what the app read, so that
after a crash the replay holds what the session printed before it too.

Forking: a child of the app never holds custody (DESIGN §3): at fork, the child closes every
custody socket and kept duplicate, and runs no watcher (threads do not survive fork).
"""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from . import errors, protocol
from .channel import Channel, Deadline
from .fdpass import close_fds
from .journal import JournalError, JournalWriter
from .platform import PEER_HUNG_UP
from .reclaim import DEFAULT_CUSTODY_GRACE, DEFAULT_RECLAIM_DEADLINE, ReclaimReport, reclaim
from .retrieved import Retrieved

if TYPE_CHECKING:
    from .client import EscrowClient

_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 2.0
_SETTLE_AGAIN = 1.0  # seconds between tries to settle a deposit never answered

# Strong references: custody lasts until close() or the process ends, never merely until
# the Custody object is garbage-collected.
_open: set[Custody] = set()


def _forget_in_child() -> None:
    for custody in list(_open):
        custody._drop_in_child()


os.register_at_fork(after_in_child=_forget_in_child)


@dataclass
class _Kept:
    """A deposited session: the request that deposited it, our duplicate of its master,
    and its journal if it has one."""

    deposit: protocol.Deposit
    fd: int
    journal: JournalWriter | None = None
    pending: bool = False  # sent, never answered: escrowed or not, it is not known yet

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        os.close(self.fd)


class Custody:
    """Resource handling: owns its connection, the duplicates it keeps and its watcher
    thread; `close()` ends custody (and raises if the holder did not confirm it), or the
    process ending does."""

    def __init__(self, client: EscrowClient, channel: Channel) -> None:
        self._client = client
        channel.keep_open = True
        self._channel: Channel | None = channel
        self._lock = threading.RLock()  # one call at a time on the connection
        self._kept: dict[str, _Kept] = {}
        self._callbacks: list[Callable[[bool], None]] = []
        self._protected = True
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        _open.add(self)
        self._watcher = threading.Thread(target=_watch, args=(weakref.ref(self),),
                                         name="escrow-custody", daemon=True)
        self._watcher.start()

    # --- what the app calls ------------------------------------------------------------------

    def deposit(
        self,
        session_id: str,
        fd: int,
        child_pid: int | None = None,
        label: str = "",
        cols: int = 0,
        rows: int = 0,
        meta: dict[str, str] | None = None,
        journal: bool = False,
    ) -> None:
        """Give the holder a duplicate of `fd` (a PTY master). The caller keeps reading its
        own copy while this custody lasts; the holder does not touch it. With `journal`,
        what the app passes to `record` (or reads with `read`) goes into the session's
        replay too (if the holder has ring storage for it: see `journaled`)."""
        message = protocol.Deposit(id=session_id, label=label, child_pid=child_pid, cols=cols,
                                   rows=rows, meta=meta or {}, journal=journal)
        kept = _Kept(message, os.dup(fd))  # close-on-exec, as every fd Python makes
        try:
            with self._lock:
                self._usable_channel()
                try:
                    reply, fds = self._call(message, fd)
                except (errors.HolderUnavailable, errors.HolderUnresponsive,
                        errors.ProtocolViolation) as exc:
                    if not _maybe_received(exc) or session_id in self._kept:
                        raise
                    self._keep_pending(kept, exc)  # (raises DepositIndeterminate)
                self._set_journal(kept, reply, fds)
                self._kept[session_id] = kept
        except errors.DepositIndeterminate:
            raise
        except BaseException:
            kept.close()
            raise

    def retrieve(self, session_id: str, journal: bool = False) -> Retrieved:
        """Take one session back into this custody (`retrieve{keep}`): the caller gets the
        fd and the replay, and the session stays escrowed, held here, as if deposited.
        Raises as `EscrowClient.retrieve` does (CustodyHeld with no retry...)."""
        with self._lock:
            channel = self._usable_channel()
            _needs(channel, "keep")
            got, failed = self._client._retrieve_many_on(
                channel, [session_id], Deadline(self._client.timeout), True, journal)
            self._keep_retrieved(got, journal)
        if session_id in failed:
            raise failed[session_id]
        return got[session_id]

    def reclaim_all(
        self, deadline: float | None = None, grace: float | None = None, journal: bool = False
    ) -> ReclaimReport:
        """`EscrowClient.reclaim_all`, into this custody: every session of the owner comes
        back over this connection and stays escrowed, held here. What the app does at
        launch: reclaim, write each replay, repaint, read."""
        total = DEFAULT_RECLAIM_DEADLINE if deadline is None else deadline
        with self._lock:
            channel = self._usable_channel()
            _needs(channel, "keep")
            try:
                report = reclaim(
                    channel, Deadline(total), total,
                    DEFAULT_CUSTODY_GRACE if grace is None else grace, True, journal,
                    timeout=self._client.timeout, connect=self._client._connect,
                    retrieve_many=self._client._retrieve_many_on)
            except BaseException as exc:
                partial = getattr(exc, "reclaim_report", None)
                if partial is not None:
                    self._keep_retrieved(partial.retrieved, journal)
                raise
            self._keep_retrieved(report.retrieved, journal)
        return report

    def update(self, session_id: str, cols: int | None = None, rows: int | None = None,
               meta: dict[str, str] | None = None) -> None:
        """The session's size or meta changed: `list` shows what is given from now on
        (and a deposit made again after a holder restart carries it)."""
        with self._lock:
            self._call(protocol.Update(id=session_id, cols=cols, rows=rows, meta=meta))
            kept = self._kept.get(session_id)
            if kept is not None:
                changes = {k: v for k, v in (("cols", cols), ("rows", rows), ("meta", meta))
                           if v is not None}
                kept.deposit = msgspec.structs.replace(kept.deposit, **changes)

    def journaled(self, session_id: str) -> bool:
        """True if what is recorded for this session goes into its replay."""
        kept = self._kept.get(session_id)
        return kept is not None and kept.journal is not None

    def record(self, session_id: str, data: bytes | bytearray | memoryview) -> None:
        """Append what the app read from the session's terminal to its replay (one copy
        into shared memory). Nothing happens for a session without a journal. Call it
        for every read, in order, and only while this custody is open. (A crash between
        the app's read and this call loses that read unmarked; `read` marks it.)"""
        kept = self._kept.get(session_id)
        writer = kept.journal if kept is not None else None
        if writer is not None:
            writer.record(data)

    def read(self, session_id: str, size: int = 65536) -> bytes:
        """Read from the session's terminal and record it: `os.read` on the master (with
        its blocking mode), then `record`, the read marked in flight in between so that a
        crash there leaves a gap marked in the replay. EIO once the terminal hung up, as
        os.read."""
        kept = self._kept.get(session_id)
        if kept is None:
            raise errors.SessionUnknown(f"session {session_id} is not held by this custody",
                                        session_id)
        writer = kept.journal
        return os.read(kept.fd, size) if writer is None else writer.read(kept.fd, size)

    def release(self, session_id: str) -> None:
        """The user closed the session: the holder drops its copy. (Whatever the holder
        answers, this custody never gives it again: a session whose deposit is not known
        to have arrived is given up too, and released wherever it did arrive.)"""
        with self._lock:
            kept = self._kept.pop(session_id, None)
            try:
                self._call(protocol.Release(id=session_id))
            except errors.SessionUnknown:
                if kept is None or not kept.pending:
                    raise  # (a deposit that never arrived has nothing to release)
            finally:
                if kept is not None:
                    kept.close()
        if kept is not None and kept.pending:
            self._wake(b"s")  # the watcher says whether custody is protected again

    @property
    def protected(self) -> bool:
        """True only while every session deposited here is escrowed right now (the holder
        that holds them is connected to this custody, and no deposit is indeterminate)."""
        return self._protected

    def pending(self) -> set[str]:
        """Sessions whose deposit was never answered (DepositIndeterminate), not settled
        yet."""
        return {sid for sid, kept in self._kept.items() if kept.pending}

    def on_change(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(protected)` from the watcher thread each time protection lapses
        (the holder went away) and each time it comes back."""
        self._callbacks.append(callback)

    def fileno(self) -> int:
        """The custody connection's fd, for an app that watches it in its own loop: it
        turns readable (hang-up) when the holder goes away. It changes when custody is
        taken back on a new connection; -1 while there is none."""
        channel = self._channel
        return channel.sock.fileno() if channel is not None else -1

    def close(self) -> None:
        """End custody: the holder starts draining every session held here. Returns once
        the holder has confirmed it (a holder that restarted meanwhile is asked again), and
        raises HolderUnavailable if it cannot be confirmed within the client's timeout:
        then the sessions may still be held by nobody, or not escrowed at all."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake(b"x")
        if threading.current_thread() is not self._watcher:  # close() from a callback
            self._watcher.join()
        _open.discard(self)
        # The app's journal writes stop before custody ends: then the ring is the holder's.
        for kept in self._kept.values():
            if kept.journal is not None:
                kept.journal.close()
                kept.journal = None
        try:
            self._end_and_confirm()
        finally:
            for kept in self._kept.values():
                kept.close()
            self._kept.clear()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> Custody:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the connection ------------------------------------------------------------------------

    def _usable_channel(self) -> Channel:
        channel = self._channel
        if channel is None or self._closing:
            raise errors.HolderUnavailable(
                f"custody of {self._client.owner} is being taken back from a holder that went "
                "away; ask again in a moment")
        return channel

    def _call(
        self, message: protocol.Message, fd: int | None = None
    ) -> tuple[protocol.Response, list[int]]:
        # A timeout leaves the connection open (closing it would end custody of every
        # session on it while the app lives): the next call puts it back in step. A
        # holder that went away is the watcher's to notice (the socket hangs up).
        return self._usable_channel().call(message, Deadline(self._client.timeout), fd=fd)

    def _set_journal(self, kept: _Kept, reply: protocol.Response, fds: list[int],
                     channel: Channel | None = None) -> None:
        """Map the state file a `deposited` carried on `channel` (this custody's, unless
        given) (replacing an earlier mapping: a new holder may have given a new file).
        Without one, the session has no journal."""
        layout = reply.journal if isinstance(reply, protocol.Deposited) else None
        writer = kept.journal
        marks = _read_marker(channel or self._channel)
        try:
            if layout is not None and fds:
                if writer is not None:
                    writer.remap(fds.pop(0), layout, marks)  # the same writer: none lost
                else:
                    writer = JournalWriter(fds.pop(0), layout, marks)
            elif writer is not None:
                writer.close()  # no journal on this holder: we must not write that ring
                writer = None
        except JournalError:
            writer = None  # escrowed all the same; only the journal is off
        close_fds(fds)
        kept.journal = writer

    def _keep_retrieved(self, got: dict[str, Retrieved], journal: bool) -> None:
        """Sessions retrieved into this custody: keep a duplicate of each (and its journal)
        so that a holder restart cannot take them from us either."""
        for sid, result in got.items():
            if not result.confirmed or sid in self._kept:
                continue
            info = result.session
            deposit = protocol.Deposit(id=sid, label=info.label, child_pid=info.child_pid,
                                       cols=info.cols, rows=info.rows, meta=info.meta,
                                       journal=journal)
            kept = _Kept(deposit, os.dup(result.fd))
            if result.journal is not None and result.journal_fd is not None:
                fd, result.journal_fd = result.journal_fd, None
                try:
                    kept.journal = JournalWriter(fd, result.journal,
                                                 _read_marker(self._channel))
                except JournalError:
                    pass
            self._kept[sid] = kept
            if result.deposit_again:
                try:
                    reply, fds = self._call(deposit, kept.fd)
                    self._set_journal(kept, reply, fds)
                except errors.EscrowError:
                    pass  # not protected now; the watcher deposits it when it reconnects

    def _keep_pending(self, kept: _Kept, cause: errors.EscrowError) -> None:
        """A deposit that may or may not have arrived: keep the copy, say protection is
        lapsed, have the watcher settle it, and tell the app so."""
        kept.pending = True
        self._kept[kept.deposit.id] = kept
        self._set_protected(False)
        if isinstance(cause, errors.HolderUnresponsive):
            self._wake(b"s")  # the connection may still be good: settle on it
        raise errors.DepositIndeterminate(
            f"the deposit of {kept.deposit.id} got no answer ({cause}): whether the holder "
            "has it is not known. This custody keeps its copy of the master and settles it "
            "(takes it back, or deposits it again) as soon as it reaches a holder; "
            "`protected` is False until then, and release() gives it up.",
            kept.deposit.id, cause=cause)

    def _settle(self, deadline: Deadline) -> None:
        """Deposits never answered, on a connection that is still good: the holder's list
        says whether each arrived (held by this process: it did); one that did not is
        deposited again. Any doubt left stays pending, for the next try. Run by the
        watcher while it is idle (nothing refused): with nothing pending, custody is
        protected."""
        with self._lock:
            pending = {sid: k for sid, k in self._kept.items() if k.pending}
            if self._channel is None:
                return
            if pending and not self._settle_these(pending, deadline):
                return
        if not self.pending():
            self._set_protected(True)

    def _settle_these(self, pending: dict[str, _Kept], deadline: Deadline) -> bool:
        """False if the holder could not be asked, or a deposit again failed."""
        try:
            with self._client._connect(deadline) as asking:
                reply, _ = asking.call(protocol.List(), deadline)
        except errors.EscrowError:
            return False
        assert isinstance(reply, protocol.Sessions)
        listed = {s.id: s for s in reply.sessions}
        for sid, kept in pending.items():
            info = listed.get(sid)
            if info is not None and info.state == "held" and (
                    info.custodian_pid == os.getpid()):
                kept.pending = False  # it arrived (held here, on this connection)
                continue
            if info is not None and info.state not in protocol.TOMBSTONE_STATES:
                continue  # someone else's now, or changing: not ours to say yet
            try:
                reply, fds = self._call(kept.deposit, kept.fd)
            except errors.EscrowError:
                return False
            self._set_journal(kept, reply, fds)
            kept.pending = False
        return True

    def _wake(self, why: bytes) -> None:
        try:
            os.write(self._wake_w, why)
        except OSError:
            pass

    def _end_and_confirm(self) -> None:
        deadline = Deadline(self._client.timeout)
        pause = _BACKOFF_FIRST
        while True:
            if self._channel is not None:
                self._channel.finish(deadline)
                self._channel = None
            unconfirmed = self._still_held(deadline)
            if not unconfirmed:
                return
            if deadline.remaining() <= 0:
                raise errors.HolderUnavailable(
                    f"the holder did not confirm the end of custody of "
                    f"{', '.join(sorted(unconfirmed))}: they may still be held by nobody")
            # The holder restarted before it saw the end: take custody back, end it again.
            time.sleep(min(pause, max(deadline.remaining(), 0)))
            pause = min(pause * 2, _BACKOFF_MAX)
            try:
                self._channel, _ = self._reconnect(deadline, only=unconfirmed)
            except errors.EscrowError:
                continue

    def _still_held(self, deadline: Deadline) -> set[str]:
        """Sessions of ours whose end of custody the holder has not confirmed: still held
        by this process, not escrowed at all (a holder that lost them), or that it cannot
        be asked about. Empty: the holder is draining every one of them."""
        if not self._kept:
            return set()
        try:
            with self._client._connect(deadline) as channel:
                reply, _ = channel.call(protocol.List(), deadline)
            assert isinstance(reply, protocol.Sessions)
            listed = {s.id: s for s in reply.sessions}
        except errors.EscrowError:
            return set(self._kept)
        unconfirmed = set()
        for sid in self._kept:
            info = listed.get(sid)
            if info is None:
                unconfirmed.add(sid)  # gone with a holder: to be deposited again
            elif info.state == "held" and info.custodian_pid == os.getpid():
                unconfirmed.add(sid)  # the end was not seen: resumed, and ended again
            # Draining, exited, being retrieved, or ended by someone (released, handed
            # off): the holder has seen to it.
        return unconfirmed

    def _reconnect(self, deadline: Deadline, only: set[str] | None = None,
                   channel: Channel | None = None) -> tuple[Channel, set[str]]:
        """A new custody connection that holds every kept session again (or `only` those):
        resumed where the holder has them held, deposited again where it does not.
        Returns it with the sessions the holder refused (`exists`: escrowed but not held
        for us; `limit`...): those are not protected, but the others are, on this
        connection. A connection that fails is closed and raised."""
        if channel is None:
            channel = self._client._connect(deadline)
            channel.keep_open = True
        refused: set[str] = set()
        try:
            for sid, kept in list(self._kept.items()):
                if only is not None and sid not in only:
                    continue
                try:
                    reply, fds = channel.call(kept.deposit, deadline, fd=kept.fd)
                except (errors.HolderUnavailable, errors.HolderUnresponsive,
                        errors.ProtocolViolation):
                    raise
                except errors.EscrowError:
                    refused.add(sid)
                    if kept.journal is not None:  # the holder writes that ring now, or none
                        kept.journal.close()
                        kept.journal = None
                    continue
                kept.pending = False  # deposited, or resumed: settled
                if self._closing:
                    close_fds(fds)  # close() stopped the journals: they stay stopped
                else:
                    self._set_journal(kept, reply, fds, channel)
        except BaseException:
            channel.close()
            raise
        return channel, refused

    # --- the watcher -----------------------------------------------------------------------------

    def _set_protected(self, protected: bool) -> None:
        if protected and any(kept.pending for kept in self._kept.values()):
            return  # a deposit is not settled: not protected, whatever else is
        if protected == self._protected or (protected and self._closing):
            return
        self._protected = protected
        for callback in list(self._callbacks):
            try:
                callback(protected)
            except Exception:  # an app's callback must not stop the watcher
                pass

    def _drop_in_child(self) -> None:
        """After fork, in the child: this custody is the parent's. Close our copies of its
        socket and duplicates; the child never sends a byte on them. (The lock may have
        been held by the parent's watcher, which does not exist here: a new one.)"""
        self._lock = threading.RLock()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for kept in self._kept.values():
            try:
                if kept.journal is not None:
                    kept.journal.close_after_fork()
                    kept.journal = None
                kept.close()
            except OSError:
                pass
        self._kept.clear()
        self._closing = True
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        _open.discard(self)


def _maybe_received(exc: errors.EscrowError) -> bool:
    """Whether a request that failed this way may have reached the holder: sent, then the
    connection dropped, the deadline passed, or the answer made no sense."""
    if not exc.request_sent:
        return False
    if isinstance(exc, errors.HolderUnavailable):
        return exc.dropped
    if isinstance(exc, errors.HolderUnresponsive):
        return exc.timed_out
    return True


def _read_marker(channel: Channel | None) -> bool:
    """Whether the holder on `channel` reads a journal's `reading` mark (section 10.6)."""
    return channel is not None and "journal_reading" in channel.welcome.features


def _needs(channel: Channel, feature: str) -> None:
    if feature not in channel.welcome.features:
        raise errors.UnsupportedVersion(
            f"the holder on {channel.socket_path} (version {channel.welcome.holder_version}) "
            f"cannot {feature}: it is older than this client; upgrade it (escrowctl upgrade)")


def _watch(ref: weakref.ref[Custody]) -> None:
    """The watcher thread: wait for the connection to hang up (or for a call that found it
    no good, or for close()); then take custody back, with back-off, until every kept
    session is held again or custody is closed."""
    while True:
        custody = ref()
        if custody is None or custody._closing:
            return
        channel, wake = custody._channel, custody._wake_r
        # A deposit to settle is asked about again now and then, until it is settled.
        settle_in = _SETTLE_AGAIN if custody.pending() else None
        del custody
        poller = select.poll()
        poller.register(wake, select.POLLIN)
        if channel is not None:
            poller.register(channel.sock.fileno(), PEER_HUNG_UP)
        events = dict(poller.poll(None if settle_in is None else int(settle_in * 1000)))
        woken = os.read(wake, 64) if wake in events else b""
        if b"x" in woken:
            return
        custody = ref()
        if custody is None or custody._closing:
            return
        if woken == b"s" * len(woken) and not events.keys() - {wake}:
            # Only a deposit to settle (or none: woken by nothing), on a connection that
            # has not hung up.
            custody._settle(Deadline(custody._client.timeout))
            del custody
            continue
        with custody._lock:
            if custody._closing:
                return
            if custody._channel is channel and channel is not None:
                channel.close()
            custody._channel = None
        custody._set_protected(False)
        pause = _BACKOFF_FIRST
        refused: set[str] | None = None  # None: every kept session still to be taken back
        while not custody._closing:
            try:
                with custody._lock:
                    if custody._closing:
                        return
                    # Sessions taken back stay on this connection; the refused ones are
                    # asked again on it, later.
                    custody._channel, refused = custody._reconnect(
                        Deadline(custody._client.timeout), refused, custody._channel)
                if not refused:
                    break
            except errors.EscrowError:
                with custody._lock:
                    custody._channel, refused = None, None  # closed: start over
            if _wait(custody._wake_r, pause):
                return
            pause = min(pause * 2, _BACKOFF_MAX)
        custody._set_protected(True)
        del custody


def _wait(wake: int, seconds: float) -> bool:
    """Sleep up to `seconds`; True if close() woke us instead."""
    if not select.select([wake], [], [], seconds)[0]:
        return False
    return b"x" in os.read(wake, 64)
