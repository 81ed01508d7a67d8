"""The retrieve path: taking sessions back over one connection (docs/design.md §4 step 8, §12).

One `retrieve` names one session, one `retrieve_many` several; both go the same way:

1. Check the timeout invariant (docs/design.md §4 step 2): never start a retrieve we would give up
   on while the holder is still legitimately stopping the drain and sending. A client
   timeout (or a reclaim deadline) too short for that is an `EscrowConfigError`, and a
   retrieve with too little of its deadline left is not sent.
2. Take every `handoff` first, each fd checked to be a terminal; one that was not asked
   for, comes twice or is no terminal is not acked (the holder keeps its copies).
3. Send one ack for all (the holder's answers never pile up unread meanwhile), only now
   that we hold the fds; never read them before `done`.
4. Read `done`: the sessions are ours (or, with `keep`, escrowed and held by this
   connection: a custody's). A refusal of the ack (`ack_late`) means the holder kept them:
   our copies are closed, so that we never become a second reader.

A `done` that never comes is not guessed at: it is asked about on a fresh connection
(`resolve`). A session not acked yet is closed and stays the holder's. No path loses a
session, and no path leaves two readers.
"""

from __future__ import annotations

import os
from typing import Protocol

from . import errors, protocol
from .channel import Channel, Connect, Deadline
from .fdpass import close_fds
from .platform import REPLAY_FILES
from .replay_map import ReplayMaps
from .resolve import resolve, resolve_kept
from .retrieved import Retrieved


class RetrieveMany(Protocol):
    """`retrieve_many_on` with the client's parts bound (`EscrowClient._retrieve_many_on`)."""

    def __call__(
        self, channel: Channel, ids: list[str], deadline: Deadline, keep: bool = False,
        journal: bool = False, replay_file: bool = False,
    ) -> tuple[dict[str, Retrieved], dict[str, errors.EscrowError]]: ...


def check_invariant(
    welcome: protocol.Welcome, budget: float, what: str = "client timeout"
) -> None:
    """docs/design.md §4 step 2: never start a retrieve we would give up on while the holder is
    still legitimately stopping the drain and sending."""
    holder_needs = welcome.drain_stop_budget + welcome.send_deadline
    if budget <= holder_needs:
        raise errors.EscrowConfigError(
            f"{what} {budget:.3g}s must exceed the holder's drain_stop_budget "
            f"({welcome.drain_stop_budget:.3g}s) + send_deadline "
            f"({welcome.send_deadline:.3g}s) = {holder_needs:.3g}s; raise the {what}"
        )


def retrieve_many_on(
    channel: Channel, ids: list[str], deadline: Deadline, keep: bool = False,
    journal: bool = False, replay_file: bool = False, *, timeout: float, connect: Connect,
    start: protocol.Start | None = None,
) -> tuple[dict[str, Retrieved], dict[str, errors.EscrowError]]:
    """Retrieve `ids` over `channel` in one request (docs/design.md §4, §12): every handoff
    comes first, then every ack goes out, then every `done` comes back. Returns what
    was taken back and, per id, what was not. With `keep` the sessions stay escrowed,
    held by `channel` (a custody connection).

    A `done` that does not come is resolved on a fresh connection (`resolve`); with
    `keep`, a session is ours only if the holder has it held for this process (a
    custody that reconnects resumes it), else our copy is closed and it stays escrowed.
    With `replay_file`, where this platform and the holder can, each replay is read in
    place from the sealed file the holder sends (escrow_client.replay_map): a read-only
    memoryview instead of bytes. With `start` (and `keep`), that is the request instead:
    the holder starts the program and hands its new session off the same way.
    Raises (after closing every fd it received) only for what spoils the whole call."""
    w = channel.welcome
    if start is None:  # (a session the holder starts has no drain to stop yet)
        check_invariant(w, timeout)
    if start is None and deadline.remaining() <= w.drain_stop_budget + w.send_deadline:
        raise errors.HolderUnresponsive(
            f"not enough time left to retrieve {', '.join(ids[:3])} (the holder may need "
            f"{w.drain_stop_budget + w.send_deadline:.3g}s)", ids[0],
        )
    wanted = set(ids)
    by_file = replay_file and REPLAY_FILES and "replay_file" in w.features
    request: protocol.Message = (
        protocol.Retrieve(id=ids[0], keep=keep, journal=journal, replay_file=by_file)
        if len(ids) == 1 else
        protocol.RetrieveMany(ids=ids, keep=keep, journal=journal, replay_file=by_file))
    if start is not None:
        request = start
    maps = ReplayMaps()
    got: dict[str, Retrieved] = {}
    failed: dict[str, errors.EscrowError] = {}
    refused = False  # a handoff failed our checks: never acked
    acked: list[Retrieved] = []
    try:
        channel.send(request, deadline)
        while len(got) + len(failed) < len(wanted):
            try:
                reply, fds = channel.receive(deadline)
            except errors.EscrowError as exc:
                sid = exc.session_id
                if sid not in wanted or sid in got or sid in failed:
                    raise
                failed[sid] = exc  # refused: it stays escrowed
                continue
            if not isinstance(reply, protocol.Handoff):
                close_fds(fds)
                raise errors.ProtocolViolation(
                    f"expected handoff, got {type(reply).__name__}")
            sid = reply.session.id
            if sid not in wanted or sid in got or sid in failed:
                # Not one answer per id: nothing more on this connection can be matched.
                close_fds(fds)
                raise errors.ProtocolViolation(
                    f"the holder handed off {sid} unasked, or twice")
            try:
                replay = _checked_replay(reply, fds, by_file, maps)
            except errors.ProtocolViolation as exc:
                # That session fails alone (PROTOCOL.md 12.7): not acked, it stays the
                # holder's; the others are still ours to take.
                close_fds(fds)
                # (Without its traceback, which would hold this frame, its replay
                # mappings included, in a cycle only the collector breaks.)
                failed[sid] = exc.with_traceback(None)
                refused = True
                continue
            got[sid] = Retrieved(
                fds[0], reply.session, replay, reply.dropped_bytes, reply.handoff_id,
                confirmed=False, replay_trimmed=reply.replay_trimmed,
                replay_journaled=reply.replay_journaled, journal=reply.journal,
                journal_fd=fds[1] if reply.journal is not None else None,
                restored_modes=tuple(reply.restored_modes),
                replay_preamble=reply.replay_preamble)
        # One ack for all (the holder's answers never pile up unread meanwhile).
        if len(got) == 1:
            (result,) = got.values()
            ack: protocol.Message = protocol.Ack(
                id=result.session.id, handoff_id=result.handoff_id, keep=keep)
        elif got:
            ack = protocol.AckMany(acks={sid: r.handoff_id for sid, r in got.items()},
                                   keep=keep)
        if got:
            acked.extend(got.values())
            channel.send(ack, deadline)
        if refused:
            # The holder would wait out its ack deadline for those, and take our next
            # request for the wrong frame (PROTOCOL.md 12.7): a `status` now is that frame,
            # on purpose, and ends the wait in step. (Never an ack: no holder can take it
            # for one.)
            channel.send(protocol.Status(), deadline)
        if got:
            _receive_done(channel, set(got), got, failed, deadline)
        if refused:
            _receive_refusal(channel, deadline)
    except (errors.HolderUnresponsive, errors.HolderUnavailable,
            errors.ProtocolViolation) as exc:
        if isinstance(exc, errors.ProtocolViolation):
            channel.out_of_step()  # (a custody's watcher then takes custody back)
        elif not keep:
            channel.close()
        for result in list(got.values()):
            if result.confirmed:
                continue
            if result not in acked:
                got.pop(result.session.id).close()  # never acked: still the holder's
                failed[result.session.id] = exc
                continue
            try:
                got[result.session.id] = (resolve_kept(result, connect, timeout) if keep
                                          else resolve(result, connect, timeout))
            except errors.EscrowError as unresolved:
                got.pop(result.session.id)
                failed[result.session.id] = unresolved
        for sid in wanted - set(got) - set(failed):
            failed[sid] = exc
    except BaseException as exc:
        for result in list(got.values()):
            if result not in acked:
                got.pop(result.session.id).close()  # no ack left us: the holder's
        if not acked:
            raise
        # Interrupted (Ctrl-C, SystemExit) after acks: the holder may well have handed
        # them off, so closing our copies could hang the terminals up for good. Keep
        # them open and give them to whoever catches this.
        exc.retrieved = next(iter(got.values()), None)  # type: ignore[attr-defined]
        exc.retrieved_all = got  # type: ignore[attr-defined]
        raise
    return got, failed

def _receive_done(channel: Channel, waiting: set[str], got: dict[str, Retrieved],
                  failed: dict[str, errors.EscrowError], deadline: Deadline) -> None:
    """Read the answer to the ack of `waiting`: `done` (or `done_many`) confirms them;
    a refusal (`ack_late`, `bad_request`) means the holder kept them and drains them
    again, so our copies are closed: we must not become a second reader."""
    try:
        done, _ = channel.receive(deadline)
    except (errors.HolderUnresponsive, errors.HolderUnavailable,
            errors.ProtocolViolation):
        raise
    except errors.EscrowError as exc:
        for sid in waiting:
            got.pop(sid).close()
            failed[sid] = exc
        return
    ids = ([done.id] if isinstance(done, protocol.Done)
           else done.ids if isinstance(done, protocol.DoneMany) else [])
    if set(ids) != waiting:
        raise errors.ProtocolViolation(f"expected done, got {done!r:.80}")
    for sid in ids:
        got[sid].confirmed = True


def _checked_replay(reply: protocol.Handoff, fds: list[int], by_file: bool,
                    maps: ReplayMaps) -> bytes | memoryview:
    """The replay of a handoff that passes the checks of PROTOCOL.md 12.2 step 6 and 12.8
    (its terminal, its replay file and range), the file's fd closed; ProtocolViolation
    otherwise (the caller closes the other fds)."""
    replay: bytes | memoryview = reply.replay
    if reply.replay_file is not None:
        if not by_file or reply.replay:
            raise errors.ProtocolViolation(
                f"the holder sent {reply.session.id}'s replay in a file unasked, or twice")
        replay = maps.take(fds.pop(), reply.replay_file)  # (closes that fd)
    if not os.isatty(fds[0]):
        raise errors.ProtocolViolation(
            f"the holder handed off {reply.session.id} as a non-terminal")
    return replay


def _receive_refusal(channel: Channel, deadline: Deadline) -> None:
    """The answer to the `status` that ends the holder's wait for the handoffs we refused:
    `error` (the holder took it for the wrong frame it is, and put them back first), or
    `holder_status` (its ack deadline had passed: they were back already). Anything else
    is the stream out of step."""
    try:
        reply, fds = channel.receive(deadline)
    except (errors.HolderUnresponsive, errors.HolderUnavailable,
            errors.ProtocolViolation):
        raise
    except errors.EscrowError:
        return
    close_fds(fds)
    if not isinstance(reply, protocol.HolderStatus):
        raise errors.ProtocolViolation(
            f"expected the answer to status, got {type(reply).__name__}")
