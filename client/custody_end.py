"""The end of custody, and its confirmation: the holder drains every session held.

Custody ends when its connection closes (`Custody.close()`, or the process dying): the
holder starts draining every session held by it. `close()` does not take that on trust:
it closes our side, waits for the holder to close its own (by then it has acted on our
going away), and asks the holder's list, on a connection of its own, whether each session
is out of our hands. A session still listed as held by this process (a holder that
restarted before it saw the end, and resumed it), or not listed at all (a holder that lost
it), is taken into custody again on a new connection (`custody_watch.reconnect`), and
that custody ended in turn, with back-off, within the client's timeout; a holder that
cannot be asked is asked again. What is still not confirmed then raises
`HolderUnavailable`: those sessions may be held by nobody, or not escrowed at all.

The app's journal writes have stopped before this starts (then each ring is the
holder's), and they stay stopped through any custody taken back here.
"""

from __future__ import annotations

import os
import time

from . import errors, protocol
from .channel import Channel, Connect, Deadline
from .custody_kept import Kept
from .custody_watch import BACKOFF_FIRST, BACKOFF_MAX, reconnect


def end_and_confirm(channel: Channel | None, kept: dict[str, Kept], connect: Connect,
                    timeout: float) -> None:
    """End custody on `channel` (which this closes) and see it confirmed (see above)."""
    deadline = Deadline(timeout)
    pause = BACKOFF_FIRST
    while True:
        if channel is not None:
            channel.finish(deadline)
            channel = None
        unconfirmed = _still_held(kept, connect, deadline)
        if not unconfirmed:
            return
        if deadline.remaining() <= 0:
            raise errors.HolderUnavailable(
                f"the holder did not confirm the end of custody of "
                f"{', '.join(sorted(unconfirmed))}: they may still be held by nobody")
        # The holder restarted before it saw the end: take custody back, end it again.
        time.sleep(min(pause, max(deadline.remaining(), 0)))
        pause = min(pause * 2, BACKOFF_MAX)
        try:
            channel, _ = reconnect(kept, connect, deadline, only=unconfirmed, journals=False)
        except errors.EscrowError:
            continue


def _still_held(kept: dict[str, Kept], connect: Connect, deadline: Deadline) -> set[str]:
    """Sessions of ours whose end of custody the holder has not confirmed: still held
    by this process, not escrowed at all (a holder that lost them), never known to have
    arrived (a deposit that got no answer, listed only as a tombstone: an earlier
    session's of the same id), or that it cannot be asked about. Empty: the holder is
    draining every one of them."""
    ids = list(kept)
    if not ids:
        return set()
    try:
        with connect(deadline) as channel:
            reply, _ = channel.call(protocol.List(), deadline)
        assert isinstance(reply, protocol.Sessions)
        listed = {s.id: s for s in reply.sessions}
    except errors.EscrowError:
        return set(ids)
    unconfirmed = set()
    for sid in ids:
        info = listed.get(sid)
        if info is None:
            unconfirmed.add(sid)  # gone with a holder: to be deposited again
        elif info.state == "held" and info.custodian_pid == os.getpid():
            unconfirmed.add(sid)  # the end was not seen: resumed, and ended again
        elif kept[sid].pending and info.state in protocol.TOMBSTONE_STATES:
            unconfirmed.add(sid)  # it never arrived: to be deposited again
        # Draining, exited, being retrieved, or ended by someone (released, handed
        # off): the holder has seen to it.
    return unconfirmed
