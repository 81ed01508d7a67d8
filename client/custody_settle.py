"""Deposits never answered: whether the holder has them is not known.

A deposit whose request left whole and then got no answer (the connection dropped, the
deadline passed, the answer made no sense) may or may not be escrowed. The custody never
guesses: it keeps its copy of the master, marks the session `pending`, says `protected`
False, and raises `DepositIndeterminate`. A request that never wholly left reached
nobody: its failure is raised as it came (`HolderUnavailable`), and nothing is kept.

Settling, by the watcher whenever it is idle and every second while anything is pending:
the holder's list is asked on a connection of its own. A session held by this process
arrived; one the holder does not know (or knows only as a tombstone) did not, and is
deposited again; one in any other state is someone else's now, or changing, and stays
pending for the next try. A holder that restarted settles them all by reconnection, as
every other kept session.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from . import errors, protocol
from .channel import Connect, Deadline
from .custody_kept import Kept


def maybe_received(exc: errors.EscrowError) -> bool:
    """Whether a request that failed this way may have reached the holder: sent, then the
    connection dropped, the deadline passed, or the answer made no sense."""
    if not exc.request_sent:
        return False
    if isinstance(exc, errors.HolderUnavailable):
        return exc.dropped
    if isinstance(exc, errors.HolderUnresponsive):
        return exc.timed_out
    return True


def indeterminate(kept: Kept, cause: errors.EscrowError) -> errors.DepositIndeterminate:
    """What the app is told of a deposit kept pending."""
    return errors.DepositIndeterminate(
        f"the deposit of {kept.deposit.id} got no answer ({cause}): whether the holder "
        "has it is not known. This custody keeps its copy of the master and settles it "
        "(takes it back, or deposits it again) as soon as it reaches a holder; "
        "`protected` is False until then, and release() gives it up.",
        kept.deposit.id, cause=cause)


def settle(pending: dict[str, Kept], connect: Connect, deadline: Deadline,
           deposit_again: Callable[[Kept], None]) -> bool:
    """Settle `pending` (see above), depositing again on the custody's connection with
    `deposit_again`. False if the holder could not be asked, or a deposit again failed."""
    try:
        with connect(deadline) as asking:
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
            deposit_again(kept)
        except errors.EscrowError:
            return False
        kept.pending = False
    return True
