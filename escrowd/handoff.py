"""The handoff: giving escrowed PTY masters back to a relaunched app (docs/design.md §4, §12).

One `retrieve` names one session, one `retrieve_many` several (an app reclaiming all its
sessions at launch, over one connection); both go the same way. Read top to bottom, this is
the whole of it:

1. Refuse what cannot be handed off, each with its own answer: a `held` session (its app
   still reads it) answers `custody_held`, one `handing_off` answers `busy`, a tombstone
   answers its state.
2. Stop the drains and wait for each task to have really finished; then sweep what is
   readable into each ring's free space (never evicting, so nothing is lost and nothing is
   delivered twice: what the sweep leaves stays in the kernel for the new reader). All of
   it inside `drain_stop_budget`.
3. Restore the app's file status flags, take each fd out of trio's epoll, and send a
   `handoff` per session with its fd attached, each inside `send_deadline`. A replay whose
   ring wrapped starts at a clean boundary (`replay_trimmed`), then with a preamble that
   puts the terminal in the modes in force there, set by bytes the ring no longer holds
   (`restored_modes`: escrowd.ring_modes). To a client that asked for `replay_file`, a
   chunk's replays go in one sealed file sent with each of its handoffs instead
   (escrowd.replay_file); each session is recorded handing_off only as its own fd leaves.
   A `retrieve_many` goes through steps 1 to 3 a chunk of sessions at a time, so that the
   app takes in the first handoffs while the holder stops the next drains.
4. Keep the holder's copies, unread, until the app's `ack` for each arrives (inside the ack
   deadline, never shorter than the client's own timeout; one `ack_many` may carry them
   all, answered by one `done_many`). Only then is a session the
   app's: without `keep`, the holder closes its copy and leaves a `handed_off` tombstone;
   with `keep` (retrieve into custody) it keeps its copy and the session is `held` by this
   connection, so that no moment exists in which a crash of the app loses it. Each ack is
   answered `done` (the holder's copies of sessions handed off for good are closed after
   it: the app need not wait for that). A sendmsg that succeeded proves only that the
   kernel queued the fd; the ack proves the app has it.

Any failure after step 1 (a send fails, the peer hangs up, an ack never comes, a wrong
message comes instead) puts every session not yet acked back as it was, on the same fd with
its ring untouched, and starts a fresh drain. Nothing here ever ends a session's escrow
without an ack.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

from escrow_client import protocol

from . import journal
from .config import Config
from .connection import Connection, SendTimeout
from .log import batched, log
from .registry import Registry
from .replay_file import ChunkReplays, segments
from .session import Session
from .trim import clean_start

# Sessions claimed, stopped and sent at a time in a `retrieve_many`.
_CHUNK = 32
# The least time a chunk's drains get to stop, even once the request's budget is spent.
_MIN_STOP = 0.05


@dataclass
class _Claim:
    """A session this retrieve is handing off: its state before (`draining` or
    `exited`), and whether the app has acked it."""

    session: Session
    prior: str
    handoff_id: str = ""
    acked: bool = False


async def retrieve(
    conn: Connection,
    request: protocol.Retrieve | protocol.RetrieveMany,
    registry: Registry,
    config: Config,
    nursery: trio.Nursery,
    stopping: Callable[[], bool] = lambda: False,
) -> bool:
    """Answer one `retrieve` or `retrieve_many`. Returns False when the connection is no
    longer usable (a failed send leaves the peer mid-frame) and must be closed. Once
    `stopping()` (the holder is stopping in order), ids not claimed yet answer `busy`.

    Cancellation: if cancelled mid-handoff (the holder is shutting down), every session
    not acked is put back before the cancellation propagates.
    """
    ids = [request.id] if isinstance(request, protocol.Retrieve) else request.ids
    keep, with_journal, by_file = request.keep, request.journal, request.replay_file
    if with_journal and not keep:
        await conn.send_error("bad_request", "journal needs keep: a journal is written only "
                              "by the custodian")
        return True
    if len(set(ids)) != len(ids):
        await conn.send_error("bad_request", "retrieve_many names a session twice")
        return True

    claims: list[_Claim] = []
    buried: list[Session] = []  # handed off for good: the holder's copies, closed last
    layouts: dict[str, protocol.Journal | None] = {}
    why = "handoff interrupted"
    try:
        # Steps 1 to 3 go a chunk of sessions at a time: the app takes in the first
        # handoffs while the holder stops the next drains. One drain-stop budget for the
        # whole request, as the client's deadline counts on (though each chunk gets a
        # moment at least: sends took some of it). Once a drain failed to stop in time,
        # the rest are not tried.
        if len(ids) > _CHUNK:
            conn.widen_send_buffer()
        stop_by = trio.current_time() + config.drain_stop_budget
        stuck = False
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            if stuck or stopping():
                for sid in chunk:
                    if stuck:
                        await conn.send_error("drain_stop_timeout", "other drains could not "
                                              "be stopped in time; ask again", sid)
                    else:
                        await conn.send_error("busy", "the holder is restarting; ask again",
                                              sid)
                continue
            ready, stuck = await _claim_and_stop(
                conn, chunk, claims, keep, registry, nursery,
                max(stop_by, trio.current_time() + min(_MIN_STOP, config.drain_stop_budget)))
            # Step 3: send the fds (and, to a client that asked, the chunk's replays in one
            # sealed file: escrowd.replay_file).
            replays = ChunkReplays() if by_file else None
            try:
                cut = [_replay(claim.session, replays) for claim in ready]
                file_fd = replays.seal() if replays is not None else None
                for claim, replay in zip(ready, cut, strict=True):
                    message, fds = _handoff(claim, with_journal, replay)
                    layouts[claim.session.id] = message.journal
                    if message.replay_file is not None:
                        if file_fd is None:
                            assert replays is not None
                            message.replay = replays.inline(message.replay_file)
                            message.replay_file = None
                        else:
                            fds.append(file_fd)
                    try:
                        await conn.send(message, fd=fds[0] if len(fds) == 1 else fds)
                    except OSError as exc:
                        why = f"handoff send failed: {_why(exc)}"
                        return False  # the peer may hold half a frame: out of step
            finally:
                if replays is not None:
                    replays.close()

        # Step 4: wait for the acks.
        pending = {claim.session.id: claim for claim in claims}
        with trio.move_on_after(max(config.ack_deadline, conn.client_timeout)) as waiting:
            while pending:
                try:
                    reply, fd = await conn.receive(config.max_request_bytes)
                except (OSError, EOFError, protocol.ProtocolError) as exc:
                    why = f"no ack: {_why(exc)}"
                    # A bad message in a whole frame leaves the stream in step: answered,
                    # and the connection goes on (a late ack gets `ack_late`).
                    if isinstance(exc, protocol.ProtocolError) and not isinstance(
                        exc, protocol.FrameError
                    ):
                        _put_back_all(claims, registry, nursery, why)
                        await conn.send_error("bad_request", f"expected ack: {exc}")
                        return True
                    return False
                if fd is not None:
                    os.close(fd)  # only a deposit carries one, and a deposit is not an ack
                if isinstance(reply, protocol.AckMany):
                    acks = reply.acks
                elif isinstance(reply, protocol.Ack):
                    acks = {reply.id: reply.handoff_id}
                else:
                    acks = {}
                if not acks or any(pending.get(sid) is None
                                   or pending[sid].session.handoff_id != handoff_id
                                   for sid, handoff_id in acks.items()):
                    waited = ", ".join(str(c.session.handoff_id) for c in pending.values())
                    why = f"expected ack for handoff {waited}, got {type(reply).__name__}"
                    log("bad_request", conn=conn.number, peer_pid=conn.peer_pid, reason=why,
                        sessions=",".join(sorted(pending)))
                    _put_back_all(claims, registry, nursery, why)
                    await conn.send_error("bad_request", f"expected ack for handoff {waited}",
                                          next(iter(pending)) if len(pending) == 1 else None)
                    return True
                # (Not `batched`: each completion is logged right after it is recorded, as
                # a kill between the two would leave it recorded and never logged.)
                for sid in acks:
                    acked = pending.pop(sid)
                    complete(acked.session, conn, registry, keep, layouts[sid], close=False)
                    acked.acked = True
                    if not keep:
                        buried.append(acked.session)
                if isinstance(reply, protocol.AckMany):
                    await conn.send(protocol.DoneMany(ids=list(acks)))
                else:
                    await conn.send(protocol.Done(id=next(iter(acks))))
        if waiting.cancelled_caught:
            why = "no ack: deadline"
        return True
    finally:
        _put_back_all(claims, registry, nursery, why)
        for session in buried:
            registry.let_go(session)  # after `done`: the app need not wait for this


async def _claim_and_stop(
    conn: Connection, ids: list[str], claims: list[_Claim], keep: bool, registry: Registry,
    nursery: trio.Nursery, stop_by: float,
) -> tuple[list[_Claim], bool]:
    """Steps 1 and 2 for `ids`: answer each that cannot be handed off, claim the others
    (added to `claims` at once, so that a failure from here on puts them back), stop their
    drains by `stop_by` (trio's clock) and sweep. Returns the claims ready to send, and
    whether a drain could not be stopped in time."""
    # Step 1: refuse, or claim.
    ready: list[_Claim] = []
    refusals: list[tuple[str, str, str]] = []
    with batched():
        for sid in ids:
            session, refusal = _claim(conn, sid, registry, nursery)
            if refusal is not None:
                refusals.append(refusal)
                continue
            assert session is not None
            claim = _Claim(session, session.state)
            claims.append(claim)
            ready.append(claim)
            session.unsent = session.state  # recorded only at its own send (step 3)
            session.handoff_id = claim.handoff_id = os.urandom(16).hex()  # shown by `list`
            session.handoff_peer_pid = conn.peer_pid  # who may hold the fd if we die now
            session.set_state("handing_off", f"retrieve handoff_id={session.handoff_id} "
                              f"peer_pid={conn.peer_pid}" + (" into custody" if keep else ""),
                              persist=False)
            session.cancel_drain()  # now: not after a checkpoint where it could read
    for code, text, sid in refusals:
        await conn.send_error(code, text, sid)

    # Step 2: stop the drains (every one was told to stop already, so they finish
    # together), then sweep into free space only.
    with trio.move_on_at(stop_by):
        for claim in ready:
            await claim.session.stop_drain()
            claim.session.pull(overwrite=False)
    stuck = False
    for claim in list(ready):
        session = claim.session
        if session.hung_up:
            claim.prior = "exited"
        if session.has_drain():
            # Its drain did not stop in time: put back, to drain again. (A drain now stops
            # at once, escrowd.drain; the answer stays for the budget the protocol states.)
            stuck = True
            ready.remove(claim)
            claims.remove(claim)
            _put_back(session, claim.prior, registry, nursery, "drain stop took too long")
            await conn.send_error("drain_stop_timeout",
                                  f"could not stop draining {session.name} in time",
                                  session.id)
    return ready, stuck


def _claim(conn: Connection, sid: str, registry: Registry, nursery: trio.Nursery
           ) -> tuple[Session | None, tuple[str, str, str] | None]:
    """The session to hand off, or why it cannot be: (code, message, id)."""
    session = registry.get(conn.owner, sid)
    if (session is not None and session.state == "handing_off" and session.adopted_handoff
            and session.handoff_peer_pid and session.handoff_peer_pid == conn.peer_pid):
        # A handoff that a holder which then died began for this very process, which asks
        # for the session again: that fd never reached it (a client that got it acks it,
        # on a new connection, rather than ask again), or the holder died before sending
        # it. That handoff is over: without this, the session stayed unread for as long as
        # the app lived.
        if session.watch_scope is not None:
            session.watch_scope.cancel()
        session.adopted_handoff = False
        session.handoff_id = session.handoff_peer_pid = None
        registry.handoffs_failed += 1
        session.start_drain(nursery, "its client asked for it again: the handoff a stopped "
                            "holder began never reached it")
    if session is None:
        tomb = registry.tombstone(conn.owner, sid)
        if tomb is not None:
            return None, (tomb.state, f"session {conn.owner}/{sid} is {tomb.state}", sid)
        return None, ("unknown", f"no session {conn.owner}/{sid} is known", sid)
    if session.state == "held":
        return None, ("custody_held", f"session {session.name} is still held by its app", sid)
    if session.state == "handing_off":
        return None, ("busy", f"session {session.name} is being handed off", sid)
    return session, None


@dataclass
class _Replay:
    """A handoff's replay, cut (escrowd.trim) and with its modes' preamble: its bytes, or
    where they are in the chunk's replay file."""

    data: bytes
    where: protocol.ReplayFile | None
    trimmed: int
    preamble: int
    restored: list[str]
    start: int  # the number of its first byte of the session's own (`ring.total` counts)


def _replay(session: Session, replays: ChunkReplays | None) -> _Replay:
    """The replay a claimed session's handoff carries. With `replays`, it goes there, as
    views of the ring: the caller seals them into a file before anything awaits."""
    ring = session.ring
    parts: list[memoryview | bytes] = list(segments(ring))
    trimmed, head = 0, b""
    if ring.dropped_since_delivery:
        # Only a ring that lost its oldest bytes can start inside a line, a sequence or a
        # character; a replay that starts where the app stopped reading does not.
        whole = b"".join(parts)
        trimmed = clean_start(whole)
        parts, head = [memoryview(whole)[trimmed:]], whole[:trimmed]
    preamble, restored = ring.modes.replay_start(head).preamble()
    parts.insert(0, preamble)
    where = replays.add(parts) if replays is not None else None
    return _Replay(b"" if where is not None else b"".join(parts), where, trimmed,
                   len(preamble), restored, ring.total - ring.size + trimmed)


def _handoff(claim: _Claim, with_journal: bool, replay: _Replay
             ) -> tuple[protocol.Handoff, list[int]]:
    """The `handoff` message for a claimed session, and the fds it carries. Takes the fd
    out of the event loop."""
    session, ring = claim.session, claim.session.ring
    session.unsent = None
    session.persist()  # handing_off, recorded before the fd can leave
    session.leave_event_loop()
    info = session.info()
    info.state = claim.prior  # type: ignore[assignment]
    trimmed = replay.trimmed
    if trimmed or replay.preamble:
        shift = replay.preamble - trimmed
        info.replay_gaps = [at + shift for at in info.replay_gaps if at >= trimmed]
        info.replay_gap_at = info.replay_gaps[-1] if info.replay_gaps else None
    granted = journal.grant(session) if with_journal else None
    layout = granted[0] if granted is not None else None
    message = protocol.Handoff(
        handoff_id=session.handoff_id or "",
        session=info,
        replay=replay.data,
        replay_file=replay.where,
        dropped_bytes=ring.dropped_since_delivery,
        replay_trimmed=trimmed,
        replay_journaled=journal.journaled(session, replay.start),
        journal=layout,
        restored_modes=replay.restored,
        replay_preamble=replay.preamble,
    )
    fds = [session.fd] if granted is None else [session.fd, granted[1]]
    return message, fds


def complete(session: Session, conn: Connection, registry: Registry, keep: bool,
             layout: protocol.Journal | None, close: bool = True) -> None:
    """The app acked: the session is its. With `keep` the holder keeps its copy and the
    session is held by `conn` (the app journals into it if `layout` was granted); without,
    the holder's copy is closed (by the caller, with `registry.let_go`, if not `close`)."""
    handoff_id = session.handoff_id
    registry.handoffs += 1
    if not keep:
        registry.bury(session, "handed_off", f"acked handoff_id={handoff_id}", close)
        return
    session.handoff_id = session.handoff_peer_pid = None
    session.adopted_handoff = False
    session.custodian_pid = conn.peer_pid
    session.custodian_start_time = conn.peer_start_time()
    if layout is not None:
        journal.begin(session)
    else:
        session.ring.consume()  # delivered: the next replay starts where this one ended
    session.set_state("held", f"acked handoff_id={handoff_id} into custody", persist=False)
    session.take_custody(conn, f"retrieved into custody by conn={conn.number}")  # persists
    conn.custodian = True


def _put_back_all(claims: list[_Claim], registry: Registry, nursery: trio.Nursery,
                  reason: str) -> None:
    """Every claimed session the app has not acked goes back (before the app is told
    anything, so that what it asks next finds them draining again)."""
    for claim in claims:
        # (Only a handoff still its own: once put back, the session may have been claimed
        # by another retrieve while this one was sending its error.)
        if not claim.acked and claim.session.handoff_id == claim.handoff_id:
            _put_back(claim.session, claim.prior, registry, nursery, reason)


def _put_back(
    session: Session, prior: str, registry: Registry, nursery: trio.Nursery, reason: str
) -> None:
    """Undo a handoff that did not complete: same fd, same ring, a fresh drain."""
    if session.fd < 0 or session.state != "handing_off":
        return
    session.unsent = None
    registry.handoffs_failed += 1
    session.handoff_id = session.handoff_peer_pid = None
    if session.journal_from is None:
        # A journal granted with the handoff that did not complete: never begun, never
        # read (whatever the client may write there).
        journal.close_journal(session)
    if prior == "exited":
        session.set_state("exited", reason)
    elif session.has_drain():
        # Its drain was told to stop and has not finished yet: let it finish, then drain
        # again, so that the terminal is never left without a reader.
        session.set_state("draining", reason)
        nursery.start_soon(_drain_again_when_stopped, session, registry, nursery)
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
