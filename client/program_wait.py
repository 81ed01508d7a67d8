"""Waiting for a program the holder started to end (`wait`, PROTOCOL.md section 12.10).

A wait may block for as long as the program runs, so it has a deadline of its own: the
connection and the handshake keep the client's timeout (the invariant checked at
handshake holds), and only the answer to `wait` is waited for longer, by polling the
socket, never by a socket timeout (which would trip the circuit breaker: a program that
runs on is no holder that hangs). A holder that goes away meanwhile (a restart) is asked
again on a new connection, until the wait's own deadline; its successor may be slow to
answer (it adopts every session first, or the keeper is stopped), so after a drop a late
answer is asked again too, past the breaker and without leaving it tripped.
"""

from __future__ import annotations

import select
import time

from . import breaker, errors, protocol
from .channel import Deadline
from .client import EscrowClient

# How long a wait whose holder went away asks for its successor (a keeper restarts a holder
# that died at once; adopting many sessions takes it seconds).
_REASK_FOR = 30.0


class WaitTimeout(errors.EscrowError):
    """The program had not ended when the wait's deadline passed."""

    code = "wait_timeout"


def wait(client: EscrowClient, session_id: str,
         timeout: float | None = None) -> protocol.ExitStatus | str:
    """How the program of `session_id` ended (an ExitStatus, or "unknown" when nobody can
    know), once it has. Raises SessionUnknown, NotAProgram (the holder did not start it),
    WaitTimeout after `timeout` seconds (None: no limit)."""
    until = None if timeout is None else time.monotonic() + timeout
    gone_since: float | None = None  # the holder went away under the wait then
    while True:
        try:
            return _wait_once(client, session_id, until, gone_since is None)
        except (errors.HolderUnavailable, errors.HolderUnresponsive) as exc:
            # A holder restarting (a drop): its successor is asked, for a while. Nothing
            # listening, or no answer, from the start is an error at once.
            if gone_since is None and not (isinstance(exc, errors.HolderUnavailable)
                                           and exc.dropped):
                raise
            if isinstance(exc, errors.HolderUnresponsive) and exc.timed_out:
                breaker.untrip(client.socket_path)
            now = time.monotonic()
            gone_since = now if gone_since is None else gone_since
            if until is not None and now >= until:
                raise WaitTimeout(f"the program of {client.owner}/{session_id} had not "
                                  "ended in time", session_id) from None
            if now - gone_since > _REASK_FOR:
                raise
            time.sleep(0.1)
        else:
            gone_since = None


def _wait_once(client: EscrowClient, session_id: str, until: float | None,
               use_breaker: bool) -> protocol.ExitStatus | str:
    with client._connect(Deadline(client.timeout), use_breaker) as channel:
        channel.send(protocol.Wait(id=session_id), Deadline(client.timeout))
        poller = select.poll()
        poller.register(channel.sock, select.POLLIN)
        while not poller.poll(_ms(until)):
            if until is not None and time.monotonic() >= until:
                raise WaitTimeout(f"the program of {client.owner}/{session_id} had not "
                                  "ended in time", session_id)
        reply, _ = channel.receive(Deadline(client.timeout))
    if not isinstance(reply, protocol.Waited):
        raise errors.ProtocolViolation(f"expected waited, got {type(reply).__name__}")
    return reply.exit_status


def _ms(until: float | None) -> int:
    if until is None:
        return 1000
    return max(0, min(1000, int((until - time.monotonic()) * 1000) + 1))
