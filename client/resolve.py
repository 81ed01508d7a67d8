"""Resolving a handoff whose `done` never came (docs/design.md §4 step 8).

The ack went out and no answer came back (a timeout, a dropped connection, a holder that
restarted under us). We hold our copy of the master, unread, and do not guess whose it is:
we ask on a fresh connection, past the circuit breaker, within the client's timeout, and
the holder's list decides (`resolve`):

- our handoff completed (`handed_off` with our handoff id), or the holder has no copy left
  (it is gone, or lists the session released, expired or not at all): the fd is ours;
  so it is when the holder cannot tell us (it has our ack queued, if anything);
- our handoff still under way (`handing_off`, adopted by a holder that restarted): acked
  again on a fresh connection, which completes it;
- the holder kept the session and drains it, or another client has it: our copy is
  closed, and that is raised. We must never become a second reader.

A retrieve into custody (`keep`) is stricter (`resolve_kept`): the session is ours only if
the holder has it held for this process, or has no copy at all (then the custody deposits
it again).
"""

from __future__ import annotations

import os
import time

from . import errors, protocol
from .channel import Connect, Deadline
from .retrieved import Retrieved


def resolve(result: Retrieved, connect: Connect, timeout: float) -> Retrieved:
    """`done` never came: ask on a fresh connection who owns the fd (docs/design.md §4 step 8).
    We still hold our copy, unread."""
    sid = result.session.id
    deadline = Deadline(timeout)
    while True:
        try:
            # Past the breaker: the timeout that brought us here has just opened it,
            # and this question must really be asked.
            with connect(deadline, use_breaker=False) as channel:
                reply, _ = channel.call(protocol.List(), deadline)
        except errors.HolderUnavailable:
            return result  # the holder is gone and took its copy with it: ours
        except errors.EscrowError:
            return result  # cannot tell; the holder has our ack queued, if anything
        if not isinstance(reply, protocol.Sessions):
            return result
        info = next((s for s in reply.sessions if s.id == sid), None)
        state = info.state if info is not None else "unknown"
        if state == "handed_off" and info is not None:
            if info.handoff_id == result.handoff_id:
                result.confirmed = True
                return result
            result.close()  # somebody else's handoff, not ours
            raise errors.HandedOff(f"session {sid} was handed off to another client", sid)
        if state == "handing_off" and info is not None and info.handoff_id not in (
            None, result.handoff_id
        ):
            result.close()  # another client's handoff: ours was put back first
            raise errors.Busy(f"session {sid} is being handed off to another client", sid)
        if state == "handing_off":
            # Ours. A holder that restarted (and adopted it) completes it on an ack sent
            # here; one still acting on our hang-up answers `busy`, and we ask again.
            if _ack_again(result, connect, deadline):
                return result
            if deadline.remaining() > 0.02:
                time.sleep(0.02)
                continue
            return result  # our ack is queued there, if anything: keep the fd
        if state in ("draining", "exited", "held") and info is not None and (
            info.deposited_at != result.session.deposited_at
        ):
            return result  # a new deposit reused the id: ours was handed off, keep it
        if state in ("draining", "exited", "held"):
            result.close()  # the holder kept it and drains it: we must not read too
            raise errors.HolderUnresponsive(
                f"handoff of {sid} was not confirmed; the session is still escrowed "
                f"({state}): retrieve it again", sid,
            )
        # released, expired or unknown: the holder has no copy left; ours is the only one.
        return result


def resolve_kept(result: Retrieved, connect: Connect, timeout: float) -> Retrieved:
    """`done` never came for a retrieve into custody. Ask the holder (again and again,
    within the timeout) who has the session:
    - held for this process: ours (a custody that reconnects resumes it);
    - our handoff, still under way: acked again on a fresh connection (a holder that
      restarted completes it; the session is then ours alone, and the custody deposits
      it again, with a journal of its own if one was asked);
    - unknown to it, released or expired: the holder has no copy; ours is the only
      one, kept (the custody deposits it again);
    - anything else (draining again, another's): our copy is closed.
    If it cannot be asked at all, our copy is closed: the session may be draining."""
    sid = result.session.id
    deadline = Deadline(timeout)
    asked, info = False, None
    while True:
        try:
            with connect(deadline, use_breaker=False) as channel:
                reply, _ = channel.call(protocol.List(), deadline)
            assert isinstance(reply, protocol.Sessions)
            asked = True
            info = next((s for s in reply.sessions if s.id == sid), None)
        except errors.EscrowError:
            asked, info = False, None
        ours_under_way = (info is not None and info.state == "handing_off"
                          and info.handoff_id == result.handoff_id)
        if (asked and not ours_under_way) or deadline.remaining() < 0.05:
            break
        if ours_under_way and _ack_again(result, connect, deadline):
            return _alone(result)
        time.sleep(0.05)
    if asked and (info is None or info.state in ("released", "expired")):
        return _alone(result)
    if info is not None and info.state == "held" and info.custodian_pid == os.getpid():
        result.confirmed = True
        return result
    result.close()
    raise errors.HolderUnresponsive(
        f"retrieving {sid} into custody was not confirmed; it is still escrowed "
        f"({info.state if info else 'state unknown'}): retrieve it again", sid)


def _alone(result: Retrieved) -> Retrieved:
    """The holder has no copy left: the session is ours alone, out of escrow (and of
    any journal the handoff offered)."""
    if result.journal_fd is not None:
        os.close(result.journal_fd)
    result.journal, result.journal_fd = None, None
    result.confirmed = result.deposit_again = True
    return result


def _ack_again(result: Retrieved, connect: Connect, deadline: Deadline) -> bool:
    """Ack `result` on a fresh connection: True once the holder answered `done`.
    `ack_late` means the holder kept the session: our copy is closed and that raised.
    Anything else (`busy`: the first connection's handoff is still being wound up;
    no answer) is False, and the caller asks again."""
    sid = result.session.id
    try:
        with connect(deadline, use_breaker=False) as channel:
            reply, _ = channel.call(protocol.Ack(id=sid, handoff_id=result.handoff_id),
                                    deadline)
    except errors.AckLate:
        result.close()  # the holder is draining it again: we must not read too
        raise
    except errors.EscrowError:
        return False
    if isinstance(reply, protocol.Done):
        result.confirmed = True
        return True
    return False
