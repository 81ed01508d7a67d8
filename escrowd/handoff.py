"""The handoff: giving an escrowed PTY master back to a relaunched app (DESIGN §4).

Read top to bottom, this is the whole of it:

1. Refuse what cannot be handed off: a `held` session (its app still reads it) answers
   `custody_held`, one `handing_off` answers `busy`, a tombstone answers its state.
2. Stop the drain and wait for the task to have really finished; then sweep what is
   readable into the ring's free space (never evicting, so nothing is lost and nothing is
   delivered twice: what the sweep leaves stays in the kernel for the new reader). Both fit
   inside `drain_stop_budget`.
3. Restore the app's file status flags, take the fd out of trio's epoll, and send `handoff`
   with the fd attached, inside `send_deadline`.
4. Keep the holder's copy, unread, until the app's `ack` arrives (inside the ack deadline,
   never shorter than the client's own timeout). Only then close it, leave a `handed_off`
   tombstone and answer `done`: a sendmsg that succeeded proves only that the kernel queued
   the fd; the ack proves the app has it.

Any failure after step 1 (the send fails, the peer hangs up, the ack never comes, a wrong
message comes instead) puts the session back as it was, on the same fd with its ring
untouched, and starts a fresh drain. Nothing here ever marks a session handed off without
an ack.
"""

from __future__ import annotations

import os
import uuid

import trio

from escrow_client import protocol

from .config import Config
from .connection import Connection, SendTimeout
from .log import log
from .registry import Registry
from .session import Session


async def retrieve(
    conn: Connection, sid: str, registry: Registry, config: Config, nursery: trio.Nursery
) -> bool:
    """Answer one `retrieve`. Returns False when the connection is no longer usable (a
    failed send leaves the peer mid-frame) and must be closed.

    Cancellation: if cancelled mid-handoff (the holder is shutting down), the session is
    put back before the cancellation propagates.
    """
    session = registry.get(conn.owner, sid)
    if session is None:
        tomb = registry.tombstone(conn.owner, sid)
        if tomb is not None:
            await conn.send_error(tomb.state, f"session {conn.owner}/{sid} is {tomb.state}", sid)
        else:
            await conn.send_error("unknown", f"no session {conn.owner}/{sid} is known", sid)
        return True
    if session.state == "held":
        await conn.send_error(
            "custody_held", f"session {session.name} is still held by its app", sid
        )
        return True
    if session.state == "handing_off":
        await conn.send_error("busy", f"session {session.name} is being handed off", sid)
        return True

    prior = session.state  # draining or exited
    handoff_id = uuid.uuid4().hex
    session.handoff_id = handoff_id  # visible in `list` while under way
    session.handoff_peer_pid = conn.peer_pid  # who may hold the fd if the holder dies now
    session.set_state("handing_off", f"retrieve handoff_id={handoff_id} peer_pid={conn.peer_pid}")
    acked = False
    try:
        # Step 2: stop the drain, then sweep into free space only.
        with trio.move_on_after(config.drain_stop_budget):
            await session.stop_drain()
            session.pull(overwrite=False)
        if session.hung_up:
            prior = "exited"
        if session.has_drain():
            # The drain task did not finish in time. Let it finish in the background and
            # drain again after it, so the terminal is never left without a reader.
            _put_back(session, prior, registry, nursery, "drain stop took too long")
            nursery.start_soon(_drain_again_when_stopped, session, registry, nursery)
            await conn.send_error(
                "drain_stop_timeout", f"could not stop draining {session.name} in time", sid
            )
            return True

        # Step 3: send the fd.
        session.leave_event_loop()
        info = session.info()
        info.state = prior  # type: ignore[assignment]
        message = protocol.Handoff(
            handoff_id=handoff_id,
            session=info,
            replay=session.ring.contents(),
            dropped_bytes=session.ring.dropped,
        )
        try:
            await conn.send(message, fd=session.fd)
        except OSError as exc:
            _put_back(session, prior, registry, nursery, f"handoff send failed: {_why(exc)}")
            return False  # the peer may hold half a frame: the stream is out of step

        # Step 4: wait for the ack.
        try:
            with trio.fail_after(max(config.ack_deadline, conn.client_timeout)):
                reply, fd = await conn.receive(config.max_request_bytes)
        except (OSError, EOFError, protocol.ProtocolError, trio.TooSlowError) as exc:
            _put_back(session, prior, registry, nursery, f"no ack: {_why(exc)}")
            # A timeout or a bad message in a whole frame leaves the stream in step: the
            # connection goes on, and a late ack gets `ack_late`.
            if isinstance(exc, trio.TooSlowError | protocol.ProtocolError) and not isinstance(
                exc, protocol.FrameError
            ):
                if isinstance(exc, protocol.ProtocolError):
                    await conn.send_error("bad_request", f"expected ack: {exc}", sid)
                return True
            return False
        if fd is not None:
            os.close(fd)  # only a deposit carries one, and a deposit is not an ack
        if not (
            isinstance(reply, protocol.Ack) and reply.id == sid and reply.handoff_id == handoff_id
        ):
            why = f"expected ack for handoff {handoff_id}, got {type(reply).__name__}"
            log("bad_request", conn=conn.number, session=session.name, peer_pid=conn.peer_pid,
                reason=why)
            _put_back(session, prior, registry, nursery, why)
            await conn.send_error("bad_request", f"expected ack for handoff {handoff_id}", sid)
            return True

        registry.bury(session, "handed_off", f"acked handoff_id={handoff_id}")
        registry.handoffs += 1
        acked = True
        await conn.send(protocol.Done(id=sid))
        return True
    finally:
        if not acked and session.state == "handing_off":
            _put_back(session, prior, registry, nursery, "handoff interrupted")


def _put_back(
    session: Session, prior: str, registry: Registry, nursery: trio.Nursery, reason: str
) -> None:
    """Undo a handoff that did not complete: same fd, same ring, a fresh drain."""
    if session.fd < 0 or session.state != "handing_off":
        return
    registry.handoffs_failed += 1
    session.handoff_id = session.handoff_peer_pid = None
    if prior == "exited":
        session.set_state("exited", reason)
    elif session.has_drain():
        session.set_state("draining", reason)  # _drain_again_when_stopped takes it on
    else:
        session.start_drain(nursery, reason)


async def _drain_again_when_stopped(
    session: Session, registry: Registry, nursery: trio.Nursery
) -> None:
    await session.stop_drain()
    if registry.get(session.owner, session.id) is session and session.state == "draining":
        if not session.has_drain():
            session.start_drain(nursery, "drain restarted after a slow stop")


def _why(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError | SendTimeout):
        return "deadline"
    if isinstance(exc, EOFError):
        return "peer closed"
    return str(exc) or type(exc).__name__
