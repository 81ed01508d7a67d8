"""The custody's watcher thread: it sees the holder go away, and takes custody back.

The watcher polls the custody connection for hang-up. It never reads it, so it steals no
reply from a call in flight. A wake-up pipe brings it round too: for a deposit to settle
(`s`), and for close() (`x`).

When the connection hangs up (the holder crashed, or is being upgraded), the sessions are
unprotected: `protected` turns False and the app's `on_change` callbacks run. The watcher
then reconnects with back-off and takes custody back (`reconnect`): a session the new
holder adopted is resumed (a deposit from the same process and the same terminal), and
one it does not know is deposited again from the kept duplicate. One it refuses (`exists`:
escrowed, but not held for us; `limit`) is asked again later on the same connection; the
others are held on it meanwhile. Once every kept session is held again, `protected` is
True again.

While the connection is good, the watcher settles deposits never answered
(`custody_settle`) whenever it is woken for them, and every second while any is pending.

The watcher holds its custody only by a weak reference (never while it waits), and changes
the custody's connection only under its lock: one call at a time on it.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Protocol

from . import errors, protocol
from .channel import Channel, Connect, Deadline
from .custody_kept import Kept, read_marker
from .fdpass import close_fds
from .platform import PEER_HUNG_UP

BACKOFF_FIRST, BACKOFF_MAX = 0.05, 2.0
_SETTLE_AGAIN = 1.0  # seconds between tries to settle a deposit never answered


class _Timed(Protocol):
    @property
    def timeout(self) -> float: ...


class Watched(Protocol):
    """What the watcher reads and changes of the custody it watches."""

    _channel: Channel | None

    @property
    def _client(self) -> _Timed: ...
    @property
    def _closing(self) -> bool: ...
    @property
    def _lock(self) -> threading.RLock: ...
    @property
    def _wake_r(self) -> int: ...

    def pending(self) -> set[str]: ...
    def _settle(self, deadline: Deadline) -> None: ...
    def _set_protected(self, protected: bool) -> None: ...
    def _reconnect(self, deadline: Deadline, only: set[str] | None = None,
                   channel: Channel | None = None) -> tuple[Channel, set[str]]: ...


def watch(ref: Callable[[], Watched | None]) -> None:
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
        pause = BACKOFF_FIRST
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
            pause = min(pause * 2, BACKOFF_MAX)
        custody._set_protected(True)
        del custody


def _wait(wake: int, seconds: float) -> bool:
    """Sleep up to `seconds`; True if close() woke us instead."""
    if not select.select([wake], [], [], seconds)[0]:
        return False
    return b"x" in os.read(wake, 64)


def reconnect(kept: dict[str, Kept], connect: Connect, deadline: Deadline,
              only: set[str] | None = None, channel: Channel | None = None,
              journals: bool = True) -> tuple[Channel, set[str]]:
    """A new custody connection that holds every kept session again (or `only` those):
    resumed where the holder has them held, deposited again where it does not.
    Returns it with the sessions the holder refused (`exists`: escrowed but not held
    for us; `limit`...): those are not protected, but the others are, on this
    connection. A connection that fails is closed and raised. Without `journals`
    (custody is ending), no journal is mapped again: they stay stopped."""
    if channel is None:
        channel = connect(deadline)
        channel.keep_open = True
    refused: set[str] = set()
    try:
        for sid, session in list(kept.items()):
            if only is not None and sid not in only:
                continue
            try:
                reply, fds = channel.call_for(session.deposit, protocol.Deposited, deadline,
                                              fd=session.fd)
            except (errors.HolderUnavailable, errors.HolderUnresponsive,
                    errors.ProtocolViolation):
                raise
            except errors.EscrowError:
                refused.add(sid)
                session.stop_journal()  # the holder writes that ring now, or none
                continue
            session.pending = False  # deposited, or resumed: settled
            if journals:
                session.set_journal(reply, fds, read_marker(channel))
            else:
                close_fds(fds)
    except BaseException:
        channel.close()
        raise
    return channel, refused
