"""Custody: the app keeps its sessions escrowed for as long as it runs, and knows whether
they are (docs/design.md §3, §11 "Custody survives too").

A `Custody` is a custodian connection: sessions deposited through it stay `held` (the app is
their reader) until it closes, by `close()` or the process dying; then the holder drains
them (`close()` sees that confirmed: `custody_end`). It keeps a duplicate of every master it
deposited (one extra fd per session in the app), so that it can give it again
(`custody_kept`; the state of a custody is its `Hold`, in `custody_hold`).

A watcher thread (`custody_watch`) sees the holder go away (a crash, an upgrade): the
sessions are unprotected, `protected` turns False and `on_change` callbacks run. It
reconnects with back-off and takes custody back: a session the new holder adopted is
resumed (a deposit from the same process and the same terminal), one it does not know is
deposited again from the kept duplicate. Then `protected` is True again. A deposit that
got no answer is kept, and settled (`custody_settle`).

Retrieving into custody (docs/design.md §12): `retrieve` and `reclaim_all` take sessions back and
keep them escrowed, held by this custody, in one step: no moment exists in which a crash of
the app loses them.

Journal: a session deposited (or retrieved) with `journal=True` gets its replay ring mapped
here, and `record` (or `read`, which reads and records) appends what the app read, so that
after a crash the replay holds what the session printed before it too.

Forking: a child of the app never holds custody (docs/design.md §3): at fork, the child closes every
custody socket and kept duplicate, and runs no watcher (threads do not survive fork).
"""

from __future__ import annotations

import os

import msgspec

from . import errors, protocol
from .channel import Channel, Deadline
from .custody_end import end_and_confirm
from .custody_hold import Hold
from .custody_kept import Kept, read_marker
from .custody_settle import maybe_received
from .reclaim import DEFAULT_CUSTODY_GRACE, DEFAULT_RECLAIM_DEADLINE, ReclaimReport, reclaim
from .retrieved import Retrieved


class Custody(Hold):
    """Resource handling: owns its connection, the duplicates it keeps and its watcher
    thread; `close()` ends custody (and raises if the holder did not confirm it), or the
    process ending does. (`protected`, `pending()` and `on_change()` are its `Hold`'s.)"""

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
        kept = Kept(message, os.dup(fd))  # close-on-exec, as every fd Python makes
        try:
            with self._lock:
                self._usable_channel()
                try:
                    reply, fds = self._call(message, protocol.Deposited, fd)
                except (errors.HolderUnavailable, errors.HolderUnresponsive,
                        errors.ProtocolViolation) as exc:
                    if not maybe_received(exc) or session_id in self._kept:
                        raise
                    self._keep_pending(kept, exc)  # (raises DepositIndeterminate)
                kept.set_journal(reply, fds, read_marker(self._channel))
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
            self._call(protocol.Update(id=session_id, cols=cols, rows=rows, meta=meta),
                       protocol.Updated)
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
                self._call(protocol.Release(id=session_id), protocol.Released)
            except errors.SessionUnknown:
                if kept is None or not kept.pending:
                    raise  # (a deposit that never arrived has nothing to release)
            finally:
                if kept is not None:
                    kept.close()
        if kept is not None and kept.pending:
            self._wake(b"s")  # the watcher says whether custody is protected again

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
        if not self._stop_watcher():
            return
        # The app's journal writes stop before custody ends: then the ring is the holder's.
        for kept in self._kept.values():
            kept.stop_journal()
        try:
            channel, self._channel = self._channel, None
            end_and_confirm(channel, self._kept, self._client._connect, self._client.timeout)
        finally:
            self._close_kept()

    def __enter__(self) -> Custody:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _needs(channel: Channel, feature: str) -> None:
    if feature not in channel.welcome.features:
        raise errors.UnsupportedVersion(
            f"the holder on {channel.socket_path} (version {channel.welcome.holder_version}) "
            f"cannot {feature}: it is older than this client; upgrade it (escrowctl upgrade)")

