"""A custody's hold on its sessions: the connection they are held on, the duplicates kept
of them, and whether they are protected right now (docs/design.md §8, "Custody").

`Custody` is what the app calls; a `Hold` is what keeps its sessions held between the
calls, and what the watcher (`custody_watch`) works on:

- the connection (`_channel`): one call at a time on it, under the lock. The watcher
  replaces it when the holder goes away, and says whether the sessions are `protected`;
- the kept sessions (`_kept`, see `custody_kept`): one for each session deposited or
  retrieved here, given again to every new holder;
- deposits never answered (`pending`), settled by the watcher (`custody_settle`);
- the wake-up pipe, by which a call, a deposit to settle or close() brings the watcher
  round.

Forking: a child of the app never holds custody (docs/design.md §3): at fork, the child closes every
custody socket and kept duplicate, and runs no watcher (threads do not survive fork).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar

from . import errors, protocol
from .channel import Channel, Deadline
from .custody_kept import Kept, read_marker
from .custody_settle import indeterminate, settle
from .custody_watch import Watched, reconnect, watch
from .retrieved import Retrieved

# Strong references: custody lasts until close() or the process ends, never merely until
# the Custody object is garbage-collected.
_open: set[Hold] = set()
_R = TypeVar("_R", bound=protocol.Message)


def _forget_in_child() -> None:
    for custody in list(_open):
        custody._drop_in_child()


os.register_at_fork(after_in_child=_forget_in_child)


class CustodyClient(Protocol):
    """What a custody needs of the `EscrowClient` that opened it: the owner, the timeout,
    fresh connections, and the retrieve path."""

    @property
    def owner(self) -> str: ...
    @property
    def timeout(self) -> float: ...

    def _connect(self, deadline: Deadline, use_breaker: bool = True) -> Channel: ...
    def _retrieve_many_on(
        self, channel: Channel, ids: list[str], deadline: Deadline, keep: bool = False,
        journal: bool = False, replay_file: bool = False,
    ) -> tuple[dict[str, Retrieved], dict[str, errors.EscrowError]]: ...


class Hold:
    """The state of one custody, and what the app's calls and the watcher both do to it.
    Resource handling: owns its connection, the duplicates it keeps, the wake-up pipe and
    the watcher thread."""

    def __init__(self, client: CustodyClient, channel: Channel) -> None:
        self._client = client
        channel.keep_open = True
        self._channel: Channel | None = channel
        self._lock = threading.RLock()  # one call at a time on the connection
        self._kept: dict[str, Kept] = {}
        self._callbacks: list[Callable[[bool], None]] = []
        self._protected = True
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        _open.add(self)
        watched: Callable[[], Watched | None] = weakref.ref(self)
        self._watcher = threading.Thread(target=watch, args=(watched,),
                                         name="escrow-custody", daemon=True)
        self._watcher.start()

    # --- protection ----------------------------------------------------------------------

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

    # --- the connection --------------------------------------------------------------------

    def _usable_channel(self) -> Channel:
        channel = self._channel
        if channel is None or self._closing:
            raise errors.HolderUnavailable(
                f"custody of {self._client.owner} is being taken back from a holder that went "
                "away; ask again in a moment")
        return channel

    def _call(
        self, message: protocol.Message, expected: type[_R], fd: int | None = None
    ) -> tuple[_R, list[int]]:
        # A timeout leaves the connection open (closing it would end custody of every
        # session on it while the app lives): the next call puts it back in step. A
        # holder that went away is the watcher's to notice (the socket hangs up), and so
        # is an answer of the wrong type, which shuts the connection down: believed, it
        # would call a session held that the holder never took.
        return self._usable_channel().call_for(message, expected,
                                               Deadline(self._client.timeout), fd=fd)

    def _wake(self, why: bytes) -> None:
        try:
            os.write(self._wake_w, why)
        except OSError:
            pass

    # --- keeping sessions ------------------------------------------------------------------

    def _deposit_again(self, kept: Kept) -> None:
        reply, fds = self._call(kept.deposit, protocol.Deposited, kept.fd)
        kept.set_journal(reply, fds, read_marker(self._channel))

    def _keep_retrieved(self, got: dict[str, Retrieved], journal: bool) -> None:
        """Sessions retrieved into this custody: keep a duplicate of each (and its journal)
        so that a holder restart cannot take them from us either."""
        for sid, result in got.items():
            if not result.confirmed or sid in self._kept:
                continue
            kept = Kept.retrieved(result, journal, read_marker(self._channel))
            self._kept[sid] = kept
            if result.deposit_again:
                try:
                    self._deposit_again(kept)
                except errors.EscrowError:
                    pass  # not protected now; the watcher deposits it when it reconnects

    def _keep_pending(self, kept: Kept, cause: errors.EscrowError) -> None:
        """A deposit that may or may not have arrived: keep the copy, say protection is
        lapsed, have the watcher settle it, and tell the app so."""
        kept.pending = True
        self._kept[kept.deposit.id] = kept
        self._set_protected(False)
        if isinstance(cause, errors.HolderUnresponsive):
            self._wake(b"s")  # the connection may still be good: settle on it
        raise indeterminate(kept, cause)

    # --- what the watcher does -------------------------------------------------------------

    def _settle(self, deadline: Deadline) -> None:
        """Deposits never answered, on a connection that is still good (`custody_settle`).
        Run by the watcher while it is idle (nothing refused): with nothing pending,
        custody is protected."""
        with self._lock:
            pending = {sid: k for sid, k in self._kept.items() if k.pending}
            if self._channel is None:
                return
            if pending and not settle(pending, self._client._connect, deadline,
                                      self._deposit_again):
                return
        if not self.pending():
            self._set_protected(True)

    def _reconnect(self, deadline: Deadline, only: set[str] | None = None,
                   channel: Channel | None = None) -> tuple[Channel, set[str]]:
        """`custody_watch.reconnect` of the sessions kept here (their journals stay
        stopped once close() has begun)."""
        return reconnect(self._kept, self._client._connect, deadline, only, channel,
                         journals=not self._closing)

    # --- the end -----------------------------------------------------------------------------

    def _stop_watcher(self) -> bool:
        """close() begins: the watcher stops (unless close() was called from it, in a
        callback), and a fork no longer has this custody to forget. False if close() had
        begun already."""
        with self._lock:
            if self._closing:
                return False
            self._closing = True
        self._wake(b"x")
        if threading.current_thread() is not self._watcher:  # close() from a callback
            self._watcher.join()
        _open.discard(self)
        return True

    def _close_kept(self) -> None:
        """close() ends: our duplicates, their journals and the wake-up pipe are closed."""
        for kept in self._kept.values():
            kept.close()
        self._kept.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

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
