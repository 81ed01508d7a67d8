"""The requests a connection makes, each answered on that connection (escrowd.server reads
them and dispatches them; a retrieve is escrowd.handoff's).

- `deposit`: a PTY master to escrow. Refused, and its fd closed, unless it is a PTY master
  whose terminal can be told and there is room for it. A deposit of a terminal the holder
  has already takes custody back instead: its app, back on a new connection after the
  holder restarted, or an app claiming a session adopted without its record
  (escrowd.resume). A new session is answered `deposited` only once its fds are safe in
  the fd store (docs/design.md §11); the connection becomes its custodian, and is sent the journal
  file if it asked for one (escrowd.journal).
- `update`: a session's size or meta, kept in its record (`limit` if they would not fit).
- `release`: ends a session (not one being handed off: `busy`); its tombstone says
  `released`.
- a late `ack`, on a connection that has no handoff waiting: it completes a handoff a
  stopped holder began; one completed already is `done` again; any other is `ack_late`,
  and the holder keeps the session.
- `list` and `status`: the sessions and tombstones, and how the holder is.
- `start`: the holder starts a program on a new PTY itself (escrowd.programs) and hands
  its master to the connection as a retrieve into custody does (escrowd.handoff).
- `wait`: answered `waited` once such a program has ended.

Out of file descriptors, a request is answered `limit` (escrowd.fdlimit), never by
dropping the connection, and with it its custody.
"""

from __future__ import annotations

import os
import socket
from typing import Protocol

import psutil
import trio

from escrow_client import protocol
from escrow_client.liveness import process_start_time
from escrow_client.platform import is_pty_master, open_fd_count, terminal_identity

from . import __version__, handoff, journal, programs
from .adoption import Adoption
from .config import Config
from .connection import Connection
from .fdlimit import FD_EXHAUSTION, OUT_OF_FDS
from .fdstore import FdStore, StoreError
from .log import log
from .registry import Registry, RegistryError
from .resume import claim_unrecorded
from .session import Session


class Answerer(Protocol):
    """The holder as its requests see it (escrowd.server.Holder): what they change, and
    what `status` tells."""

    config: Config
    store: FdStore
    registry: Registry
    instance: str
    counters: dict[str, int]
    connections: set[Connection]
    started_at: float
    store_kind: str
    keeper_pid: int | None
    adoption: Adoption | None
    programs: programs.Programs
    stopping: bool

    @property
    def nursery(self) -> trio.Nursery: ...


async def deposit(holder: Answerer, conn: Connection, request: protocol.Deposit,
                  fd: int) -> None:
    """Escrow the PTY master `fd` as `request` says, or take custody of a session the
    holder has already (see the module's docstring); answer either way."""
    # The received fd is ours until a Session owns it: closed on every other path.
    try:
        if not is_pty_master(fd):
            raise RegistryError("not_a_terminal", "the deposited fd is not a PTY master")
        terminal = _terminal(fd)
        held = holder.registry.get(conn.owner, request.id)
        if held is not None and _resumes(held, conn, terminal):
            os.close(fd)  # the holder has this terminal already
            fd = -1  # (a failed answer below must not close its number again)
            held.take_custody(conn, "custody resumed by its app on a new connection")
            conn.custodian = True
            await _deposited(conn, held, request.journal)
            return
        claimed = await claim_unrecorded(conn, request.id, terminal, holder.registry,
                                         holder.nursery)
        if claimed is not None:
            os.close(fd)  # the holder has this terminal already
            fd = -1  # (a failed answer below must not close its number again)
            conn.custodian = True
            await _deposited(conn, claimed, request.journal)
            return
        holder.registry.check_room((conn.owner, request.id), terminal)
        start_time = _start_time(request.child_pid)
        custodian_start = _start_time(conn.peer_pid)
        try:
            ring = holder.registry.new_ring(conn.owner)
        except OSError as exc:
            if exc.errno not in FD_EXHAUSTION:
                raise
            raise RegistryError("limit", OUT_OF_FDS) from None
    except RegistryError as exc:
        if fd >= 0:
            os.close(fd)
        log("deposit_refused", session=f"{conn.owner}/{request.id}", code=exc.code,
            reason=str(exc))
        await conn.send_error(exc.code, str(exc), request.id)
        return
    except BaseException:
        if fd >= 0:  # (by then the number may be a journal's, or a draining master)
            os.close(fd)
        raise
    session = Session(conn.owner, request, fd, ring, conn, conn.peer_pid, start_time,
                      terminal, conn.client, holder.instance, custodian_start,
                      holder.store, holder.registry.private_dir)
    holder.registry.add(session)
    # Answered only once both fds are safe outside this process (docs/design.md §11).
    session.storing = True
    try:
        await holder.store.store(session.store_name, [fd, ring.state.fd])
        session.storing = False
    except StoreError as exc:
        log("deposit_refused", session=session.name, code="limit", reason=str(exc))
        holder.registry.discard(session)
        await conn.send_error("limit", str(exc), request.id)
        return
    conn.custodian = True
    holder.counters["deposits"] += 1
    await _deposited(conn, session, request.journal)


async def _deposited(conn: Connection, session: Session, with_journal: bool) -> None:
    """Answer a deposit; with the state file, where the app records, if it asked for a
    journal (or journals already: a resume)."""
    if not with_journal:  # (never an fd that was not asked for)
        await conn.send(protocol.Deposited(id=session.id))
        return
    granted = journal.grant(session)
    if granted is None:  # no ring storage to be had: escrowed, but not journaled
        await conn.send(protocol.Deposited(id=session.id))
        return
    layout, journal_fd = granted
    journal.begin(session)
    await conn.send(protocol.Deposited(id=session.id, journal=layout), fd=journal_fd)


async def start(holder: Answerer, conn: Connection, request: protocol.Start) -> bool:
    """Start `request`'s program on a new PTY as session owner/id and hand its master to
    `conn` into custody, or answer why not. False as `handoff.retrieve` returns it."""
    ring = None
    try:
        holder.registry.check_room((conn.owner, request.id))
        try:
            ring = holder.registry.new_ring(conn.owner)
        except OSError as exc:
            if exc.errno not in FD_EXHAUSTION:
                raise
            raise RegistryError("limit", OUT_OF_FDS) from None
        master, child = programs.spawn(request)
    except RegistryError as exc:
        if ring is not None:
            ring.release()
        log("start_refused", session=f"{conn.owner}/{request.id}", code=exc.code,
            reason=str(exc))
        await conn.send_error(exc.code, str(exc), request.id)
        return True
    except BaseException:  # (spawn closed the master it made)
        if ring is not None:
            ring.release()
        raise
    deposit = protocol.Deposit(id=request.id, label=request.label, child_pid=child.pid,
                               cols=request.cols, rows=request.rows, meta=request.meta)
    try:
        terminal = terminal_identity(master)
    except OSError:  # out of fds, say: it cannot be told apart now (never a crash)
        terminal = None
    session = Session(conn.owner, deposit, master, ring, None, None,
                      process_start_time(child.pid), terminal, conn.client, holder.instance,
                      None, holder.store, holder.registry.private_dir, started=True)
    holder.programs.track(session, child)  # from here on, its ending is recorded
    holder.registry.add(session)
    session.storing = True
    try:
        await holder.store.store(session.store_name, [master, ring.state.fd])
        session.storing = False
    except StoreError as exc:
        log("start_refused", session=session.name, code="limit", reason=str(exc))
        holder.registry.discard(session)  # its terminal hangs up: the program ends
        await conn.send_error("limit", str(exc), request.id)
        return True
    session.start_drain(holder.nursery, f"started by the holder, pid {child.pid}")
    holder.counters["starts"] = holder.counters.get("starts", 0) + 1
    return await handoff.retrieve(
        conn, protocol.Retrieve(id=request.id, keep=True, journal=request.journal),
        holder.registry, holder.config, holder.nursery, lambda: holder.stopping)


async def wait(holder: Answerer, conn: Connection, request: protocol.Wait) -> bool:
    """Answer `waited` once the program of session `request.id` has ended. A peer that
    hangs up meanwhile ends the wait (False: the connection is done); one that sends
    anything else is told `busy`, and its request is read next."""
    result: list[protocol.ExitStatus | str | RegistryError] = []
    async with trio.open_nursery() as nursery:
        async def ending() -> None:
            try:
                result.append(await holder.programs.ending(conn.owner, request.id))
            except RegistryError as exc:
                result.append(exc)
            nursery.cancel_scope.cancel()

        async def peer() -> None:
            await trio.lowlevel.wait_readable(conn.sock)
            nursery.cancel_scope.cancel()

        nursery.start_soon(ending)
        nursery.start_soon(peer)
    if not result:
        try:
            if not await conn.sock.recv(1, socket.MSG_PEEK):
                return False
        except OSError:
            return False
        await conn.send_error("busy", "the wait was ended by another request; ask again",
                              request.id)
        return True
    got = result[0]
    if isinstance(got, RegistryError):
        await conn.send_error(got.code, str(got), request.id)
    else:
        await conn.send(protocol.Waited(id=request.id, exit_status=got))  # type: ignore[arg-type]
    return True


async def update(holder: Answerer, conn: Connection, request: protocol.Update) -> None:
    """Record a session's new size or meta, if they fit its record."""
    session = holder.registry.get(conn.owner, request.id)
    if session is None:
        tomb = holder.registry.tombstone(conn.owner, request.id)
        code = tomb.state if tomb is not None else "unknown"
        await conn.send_error(code, f"session {conn.owner}/{request.id} is {code}",
                              request.id)
        return
    before = (session.cols, session.rows, session.meta)
    if request.cols is not None:
        session.cols = request.cols
    if request.rows is not None:
        session.rows = request.rows
    if request.meta is not None:
        session.meta = request.meta
    try:
        session.persist()
    except ValueError as exc:  # the record would not fit its state file
        session.cols, session.rows, session.meta = before
        await conn.send_error("limit", f"cannot record that for {session.name}: {exc}",
                              request.id)
        return
    await conn.send(protocol.Updated(id=request.id))


async def release(holder: Answerer, conn: Connection, sid: str) -> None:
    """End a session its owner lets go of (never one being handed off)."""
    session = holder.registry.get(conn.owner, sid)
    if session is None:
        tomb = holder.registry.tombstone(conn.owner, sid)
        code = tomb.state if tomb is not None else "unknown"
        await conn.send_error(code, f"session {conn.owner}/{sid} is {code}", sid)
        return
    if session.state == "handing_off":
        await conn.send_error("busy", f"session {session.name} is being handed off", sid)
        return
    await session.stop_drain()
    if (holder.registry.get(conn.owner, sid) is not session or session.state == "handing_off"
            or session.has_drain()):
        # A retrieve (or another release) got there while the drain was stopping; the
        # retrieve owns the session now and drains it again if its handoff fails (or
        # already has: a new drain runs).
        await conn.send_error("busy", f"session {session.name} changed; ask again", sid)
        return
    holder.registry.bury(session, "released", f"release from peer_pid={conn.peer_pid}")
    holder.counters["releases"] += 1
    await conn.send(protocol.Released(id=sid))


async def late_ack(holder: Answerer, conn: Connection, ack: protocol.Ack) -> None:
    """An `ack` on a connection that has no handoff waiting for it."""
    session = holder.registry.get(conn.owner, ack.id)
    if (session is not None and session.adopted_handoff
            and session.handoff_id == ack.handoff_id):
        # A handoff a stopped holder began, acked on a new connection: it completes
        # (into custody of this connection, if it was a retrieve into custody).
        session.adopted_handoff = False
        session.log("late_ack", handoff_id=ack.handoff_id, keep=ack.keep,
                    reason="begun by the holder before")
        handoff.complete(session, conn, holder.registry, ack.keep, None)
        await conn.send(protocol.Done(id=ack.id))
        return
    if (session is not None and session.state == "handing_off"
            and session.handoff_id == ack.handoff_id):
        # Its own connection is still winding it up (an ack queued there may yet
        # complete it): neither late nor done, yet.
        await conn.send_error("busy", f"handoff {ack.handoff_id} is still under way on "
                              "its own connection; ask again", ack.id)
        return
    tomb = holder.registry.tombstone(conn.owner, ack.id)
    if tomb is not None and tomb.state == "handed_off" and tomb.handoff_id == ack.handoff_id:
        await conn.send(protocol.Done(id=ack.id))
        return
    log("ack_late", session=f"{conn.owner}/{ack.id}", handoff_id=ack.handoff_id,
        reason="no handoff waits for this ack")
    await conn.send_error(
        "ack_late", f"handoff {ack.handoff_id} is no longer waiting for an ack; the "
        "holder kept the session: close your copy", ack.id,
    )


async def late_ack_many(conn: Connection) -> None:
    """An `ack_many` on a connection that has no `retrieve_many` waiting for it."""
    await conn.send_error("ack_late", "no retrieve_many waits for these acks here: the "
                          "holder kept the sessions; ack each on its own to complete a "
                          "handoff it took over")


async def list_sessions(holder: Answerer, conn: Connection, all_owners: bool) -> None:
    """The connection's owner's sessions and tombstones (every owner's, if asked)."""
    owner = None if all_owners else conn.owner
    try:
        sessions = holder.registry.sessions(owner)
    except OSError as exc:
        # Out of fds, looking a child process up (psutil opens /proc files) can fail:
        # answer, never drop the connection (and its custody).
        if exc.errno not in FD_EXHAUSTION:
            raise
        await conn.send_error("limit", f"{OUT_OF_FDS}; ask again later")
        return
    await conn.send(protocol.Sessions(sessions=sessions))


async def status(holder: Answerer, conn: Connection) -> None:
    """How the holder is: its counts, limits, fd store and restarts."""
    try:
        rss: int | None = int(psutil.Process().memory_info().rss)
    except (psutil.Error, OSError):  # OSError: out of fds, psutil cannot open /proc
        rss = None
    await conn.send(protocol.HolderStatus(
        pid=os.getpid(),
        version=__version__,
        started_at=holder.started_at,
        socket=holder.config.socket_path,
        sessions_by_state=holder.registry.count_by_state(),
        counters=dict(holder.counters, handoffs=holder.registry.handoffs,
                      handoffs_failed=holder.registry.handoffs_failed,
                      ring_bytes_used=holder.registry.budget.used,
                      active_connections=len(holder.connections)),
        limits=holder.config.limits(),
        open_fds=open_fd_count(),
        rss_bytes=rss,
        instance=holder.instance,
        fd_store=holder.store_kind,
        keeper_pid=holder.keeper_pid,
        adopted=holder.adoption.adopted if holder.adoption else 0,
        restarts=holder.adoption.restarts if holder.adoption else 0,
        unclean_restarts=holder.adoption.unclean_restarts if holder.adoption else 0,
        adopted_without_record=holder.adoption.without_record if holder.adoption else 0,
        adopted_renamed=holder.adoption.renamed if holder.adoption else 0,
    ))


def _resumes(session: Session, conn: Connection, terminal: tuple[int, int] | None) -> bool:
    """A deposit that takes custody back rather than escrowing anew: the session is held by
    nobody connected (the holder restarted and adopted it), and the deposit comes from the
    same process, with the same terminal (docs/design.md §8, "Custody")."""
    return (session.state == "held" and session.custodian is None
            and session.custodian_pid == conn.peer_pid
            and terminal is not None and terminal == session.terminal)


def _terminal(fd: int) -> tuple[int, int] | None:
    """Which terminal a deposit is, or the refusal if that cannot be told."""
    try:
        return terminal_identity(fd)
    except OSError as exc:
        if exc.errno in FD_EXHAUSTION:
            raise RegistryError("limit", OUT_OF_FDS) from None
        raise RegistryError("not_a_terminal", f"cannot tell which terminal the deposited fd "
                            f"is: {exc.strerror or exc}") from None


def _start_time(child_pid: int | None) -> float | None:
    """The child's start time, recorded at deposit; `limit` if the holder is out of fds
    (psutil reads /proc, which takes one), None if it cannot be told otherwise."""
    if not child_pid:
        return None
    try:
        return process_start_time(child_pid)
    except OSError as exc:
        if exc.errno in FD_EXHAUSTION:
            raise RegistryError("limit", OUT_OF_FDS) from None
        return None
