"""The holder's server: accept connections, check the peer, handshake, dispatch requests.

Every connection is served by one task, sequentially: read a request, answer it. A
connection that deposits becomes the custodian of what it deposited; when it ends, for
whatever reason, those sessions start draining (in a shielded `finally`, so even a holder
shutting down does it in order).
"""

from __future__ import annotations

import errno
import os
import resource
import select
import time
import traceback
import uuid

import msgspec
import psutil
import trio

from escrow_client import protocol
from escrow_client.fdpass import TruncatedFds
from escrow_client.liveness import process_start_time
from escrow_client.platform import (
    PEER_HUNG_UP,
    is_pty_master,
    open_fd_count,
    terminal_identity,
)

from . import __version__, handoff, journal
from .adoption import Adoption, adopt
from .config import Config
from .connection import Connection, SendTimeout
from .fdstore import HOLDER_NAME, FdStore, StoreError
from .log import log
from .registry import Registry, RegistryError
from .resume import claim_unrecorded, watch_custodian
from .session import Session

# accept() errors that mean "out of resources for now": pause and retry rather than die.
# Same list and reasoning as trio's serve_listeners: the next accept may well succeed once
# a connection closes, and exiting would take every escrowed session with us.
_ACCEPT_CAPACITY_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
# Out of file descriptors: for this process (EMFILE) or the whole system (ENFILE).
_FD_EXHAUSTION = {errno.EMFILE, errno.ENFILE}
_OUT_OF_FDS = "the holder is out of file descriptors"
# A connection error that only means the peer went away: nothing worth a log line.
_PEER_GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNABORTED}


class Holder:
    def __init__(
        self, config: Config, store: FdStore | None = None, keeper_pid: int | None = None
    ) -> None:
        self.config = config
        self.store = store if store is not None else FdStore(None)
        self.registry = Registry(
            config.max_sessions, config.ring_bytes, config.total_ring_bytes,
            config.max_tombstones, self.store, os.path.dirname(config.socket_path),
            config.max_sessions_per_owner, config.owner_ring_bytes,
        )
        self.instance = uuid.uuid4().hex  # this holder process, as `status` names it
        # Who keeps the fds while no holder runs: "systemd", "keeper" or "none".
        self.keeper_pid = keeper_pid
        self.store_kind = ("none" if not self.store.enabled
                           else "keeper" if keeper_pid else "systemd")
        self.lock_fd: int | None = None  # taken only if its keeper dies (see __main__)
        self.started_at = time.time()
        self.connections: set[Connection] = set()
        self.counters: dict[str, int] = {
            "connections": 0,
            "refused_peers": 0,
            "bad_requests": 0,
            "deposits": 0,
            "releases": 0,
        }
        self._next_conn = 0
        self._nursery: trio.Nursery | None = None
        self._stop_requested = trio.Event()
        self.stopping = False  # stopping in order: requests are refused, custody kept
        self.idle_exited = False
        self.adoption: Adoption | None = None
        # One fd kept in reserve, so that a holder out of fds can still accept a waiting
        # connection long enough to tell it `limit` (instead of leaving it in the listen
        # backlog, where its client times out and takes the holder for wedged).
        self._reserve_fd: int | None = _open_reserve()

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None
        return self._nursery

    async def serve(
        self,
        listener: trio.socket.SocketType,
        stored: dict[str, list[int]] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Adopt what the fd store passed (`stored`), then serve until `request_stop()`, or
        until --idle-exit finds nothing held for that long; then stop in order (see
        `_stop_in_order`) and return. Cancelled instead, it stops at once."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.store.read_answers)  # before adoption stores anything
            self.adoption = await adopt(self, stored or {})
            nursery.start_soon(self._accept_loop, listener)
            nursery.start_soon(self._expire_unclaimed)
            nursery.start_soon(self._idle_exit)
            if self.store.enabled:
                nursery.start_soon(self.store.keep_removing)
            task_status.started()
            await self._stop_requested.wait()
            await self._stop_in_order()
            nursery.cancel_scope.cancel()
        self._flush()

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def _stop_in_order(self) -> None:
        """Stop taking requests; let handoffs under way finish (they get their ack
        deadline); then the serving tasks may be cancelled. Custody does not end with the
        connections: the apps are alive, and a holder adopting these sessions keeps them
        held."""
        self.stopping = True
        limit = self.config.send_deadline + max(self.config.ack_deadline, 0.0) + 1.0
        with trio.move_on_after(limit):
            while any(s.state == "handing_off" and not s.adopted_handoff
                      for s in self.registry.live.values()):
                await trio.sleep(0.01)
        self._end_custody_already_ended()
        with trio.move_on_after(self.config.send_deadline):
            while self.store.removals_pending:  # the store forgets what has ended
                await trio.sleep(0.01)

    def _flush(self) -> None:
        """Every session's record, marked clean, for the next holder (the drains are over:
        the nursery they ran in has exited)."""
        for session in self.registry.live.values():
            session.forget_drain()
            session.persist(clean=True)
        state = self.adoption.holder_state if self.adoption else None
        if self.idle_exited and not self.registry.live:
            # Nothing is kept: a keeper with an empty store stops too.
            self.store.remove(HOLDER_NAME)
        elif state is not None:
            record = state.record()
            if record is not None:
                state.write(msgspec.structs.replace(record, clean=True))
        log("flushed", sessions=len(self.registry.live))

    async def _expire_unclaimed(self) -> None:
        """Release sessions nobody reclaimed within --unclaimed-ttl (a coarse check: it
        sleeps until the next one is due, or a minute at most while none waits)."""
        ttl = self.config.unclaimed_ttl
        if ttl <= 0:
            return
        while True:
            now = time.time()
            waiting = [s for s in self.registry.live.values() if s.state in ("draining", "exited")]
            for session in [s for s in waiting if now - s.state_since >= ttl]:
                if session.state not in ("draining", "exited"):
                    continue  # a retrieve or release got there first
                await session.stop_drain()
                if (
                    self.registry.get(session.owner, session.id) is session
                    and session.state in ("draining", "exited")
                    and not session.has_drain()  # nobody restarted it meanwhile
                ):
                    self.registry.bury(session, "expired", f"unclaimed for {ttl:g}s")
            due = [s.state_since + ttl for s in waiting if s.key in self.registry.live]
            delay = min(due, default=now + min(ttl, 60.0)) - time.time()
            await trio.sleep(max(delay, 0.01))

    async def _idle_exit(self) -> None:
        """Stop the holder once it has held no session and had no connection for
        --idle-exit seconds; never if it is 0."""
        limit = self.config.idle_exit
        if limit <= 0:
            await trio.sleep_forever()
        idle_since: float | None = None
        while True:
            now = trio.current_time()
            if self.registry.live or self.connections:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= limit:
                log("idle_exit", reason=f"nothing held and no connection for {limit:g}s")
                self.idle_exited = True
                self.request_stop()
                return
            await trio.sleep(max(0.05, min(limit / 4, 30.0)))

    async def _accept_loop(self, listener: trio.socket.SocketType) -> None:
        waited = False
        while True:
            try:
                sock, _ = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRORS:
                    raise
                if not waited:
                    # Linux looks for a free fd before it looks at the queue: accept() fails
                    # with EMFILE even when no connection waits. Wait for one (an idle holder
                    # at its fd limit stays idle and quiet), then try again.
                    await trio.lowlevel.wait_readable(listener)
                    waited = True
                    continue
                waited = False
                name = errno.errorcode[exc.errno]
                if exc.errno in _FD_EXHAUSTION and self._reserve_fd is not None:
                    action = await self._refuse_one(listener)
                    log("accept_error", errno=name, action=action)
                    continue
                if self._reserve_fd is None:
                    self._reserve_fd = _open_reserve()  # an fd may have come free meanwhile
                log("accept_error", errno=name, action="pause 100ms")
                await trio.sleep(0.1)
                continue
            waited = False
            self._next_conn += 1
            self.nursery.start_soon(self._serve_connection, sock, self._next_conn)

    async def _refuse_one(self, listener: trio.socket.SocketType) -> str:
        """Out of fds with a connection waiting: spend the reserve fd on accepting it, tell
        it `limit` (or `forbidden`), close it, and take the reserve back. Returns what it
        did, for the log."""
        assert self._reserve_fd is not None
        os.close(self._reserve_fd)
        self._reserve_fd = None
        try:
            # The listener was readable just now: unless that peer gave up, this does not
            # wait. (A short bound all the same: the reserve is out meanwhile.)
            sock: trio.socket.SocketType | None = None
            with trio.move_on_after(0.1):
                sock = (await listener.accept())[0]
            if sock is None:
                return "no connection was waiting after all"
            self._next_conn += 1
            number = self._next_conn
            try:
                conn = Connection(sock, number, self.config.send_deadline)
                self.counters["connections"] += 1
                if conn.peer_uid != os.getuid():
                    self.counters["refused_peers"] += 1
                    log("peer_refused", conn=number, peer_pid=conn.peer_pid,
                        peer_uid=conn.peer_uid, reason="uid differs from the holder's")
                    await conn.send_error("forbidden", "peer uid differs from the holder's uid")
                else:
                    log("conn_refused", conn=number, peer_pid=conn.peer_pid,
                        reason="out of file descriptors")
                    await conn.send_error("limit", _OUT_OF_FDS)
            except OSError:
                pass  # the peer is gone already: nothing to tell it
            finally:
                sock.close()
        except OSError as exc:  # the accept failed again (another fd was taken meanwhile)
            return f"could not accept with the reserve fd: {exc.strerror}"
        finally:
            self._reserve_fd = _open_reserve()
        return "refused a connection with limit"

    # --- one connection -----------------------------------------------------------------

    async def _serve_connection(self, sock: trio.socket.SocketType, number: int) -> None:
        conn: Connection | None = None
        try:
            conn = Connection(sock, number, self.config.send_deadline)
            self.counters["connections"] += 1
            self.connections.add(conn)
            if conn.peer_uid != os.getuid():
                self.counters["refused_peers"] += 1
                log("peer_refused", conn=number, peer_pid=conn.peer_pid, peer_uid=conn.peer_uid,
                    reason="uid differs from the holder's")
                await conn.send_error("forbidden", "peer uid differs from the holder's uid")
                return
            if len(self.connections) > self.config.max_connections:
                log("conn_refused", conn=number, peer_pid=conn.peer_pid,
                    reason="connection limit")
                await conn.send_error("limit", "too many connections")
                return
            if await self._handshake(conn):
                await self._request_loop(conn)
        except EOFError:
            pass  # the peer went away; custody (if any) ends below
        except OSError as exc:
            # Usually the peer went away (EPIPE, ECONNRESET, a send deadline). Anything else
            # ends this connection too, and with it its custody: say so.
            if exc.errno not in _PEER_GONE and not isinstance(exc, SendTimeout):
                log("conn_error", conn=number, owner=(conn.owner or None) if conn else None,
                    error=errno.errorcode.get(exc.errno or 0, repr(exc)),
                    reason=f"connection ended on an error: {exc}")
        except Exception as exc:
            # A bug in serving one connection must not take every session down with the
            # holder: log it, drop this connection, keep serving the others.
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            log("internal_error", conn=number, error=repr(exc),
                where=f"{os.path.basename(frame.filename)}:{frame.lineno}")
        finally:
            with trio.CancelScope(shield=True):
                if conn is not None:
                    self.connections.discard(conn)
                    self._end_custody(conn)
                    conn.close()
                else:
                    sock.close()

    async def _receive(self, conn: Connection) -> tuple[protocol.Request, int | None] | None:
        """The next request, or None when the connection should end. Answers bad input."""
        while True:
            timeout = float("inf") if conn.custodian else self.config.idle_timeout
            try:
                with trio.fail_after(timeout):
                    return await conn.receive(self.config.max_request_bytes)
            except trio.TooSlowError:
                log("conn_idle", conn=conn.number, owner=conn.owner or None,
                    reason="idle timeout")
                return None
            except TruncatedFds as exc:
                if _out_of_fds():
                    log("limit", conn=conn.number, owner=conn.owner or None,
                        reason="out of file descriptors: a received fd was dropped")
                    await conn.send_error("limit", _OUT_OF_FDS)
                else:
                    await self._bad_request(conn, str(exc))
            except protocol.ProtocolError as exc:
                await self._bad_request(conn, str(exc))
                # A broken frame leaves the stream out of step; a bad message in a whole
                # frame does not, and the connection goes on.
                if isinstance(exc, protocol.FrameError):
                    return None

    async def _bad_request(self, conn: Connection, why: str) -> None:
        why = _shorten(why)  # it may quote the peer's bytes back: never 1 MiB of them
        self.counters["bad_requests"] += 1
        log("bad_request", conn=conn.number, owner=conn.owner or None, peer_pid=conn.peer_pid,
            reason=why)
        await conn.send_error("bad_request", why)

    async def _handshake(self, conn: Connection) -> bool:
        got = await self._receive(conn)
        if got is None:
            return False
        hello, fd = got
        if fd is not None:
            os.close(fd)  # a deposit before hello: refused below, its fd closed here
        if not isinstance(hello, protocol.Hello):
            await self._bad_request(conn, f"expected hello first, got {type(hello).__name__}")
            return False
        if hello.version not in protocol.SUPPORTED_VERSIONS:
            self.counters["bad_requests"] += 1
            log("bad_request", conn=conn.number, owner=hello.owner, peer_pid=conn.peer_pid,
                code="unsupported_version", reason=f"unsupported version {hello.version}")
            await conn.send_error(
                "unsupported_version",
                f"protocol version {hello.version} is not supported; this holder speaks "
                f"{', '.join(map(str, protocol.SUPPORTED_VERSIONS))}",
                versions=list(protocol.SUPPORTED_VERSIONS),
            )
            return False
        conn.owner, conn.client = hello.owner, hello.client
        conn.client_timeout = min(max(hello.timeout or 0.0, 0.0), 600.0)
        c = self.config
        if sum(1 for other in self.connections if other.owner == conn.owner) > (
                c.max_connections_per_owner):
            log("conn_refused", conn=conn.number, owner=conn.owner, peer_pid=conn.peer_pid,
                reason="connection limit of its owner")
            await conn.send_error("limit", f"{conn.owner} has {c.max_connections_per_owner} "
                                  "connections open, the most one owner may "
                                  "(--max-connections-per-owner)")
            return False
        await conn.send(
            protocol.Welcome(
                version=protocol.VERSION,
                holder_version=__version__,
                pid=os.getpid(),
                drain_stop_budget=c.drain_stop_budget,
                send_deadline=c.send_deadline,
                ack_deadline=c.ack_deadline,
                limits=c.limits(),
                features=list(protocol.FEATURES),
            )
        )
        return True

    async def _request_loop(self, conn: Connection) -> None:
        while (got := await self._receive(conn)) is not None:
            request, fd = got
            match request:
                case (protocol.Deposit() | protocol.Retrieve() | protocol.RetrieveMany()
                      | protocol.Update()) if self.stopping:
                    if fd is not None:
                        os.close(fd)
                    await conn.send_error("busy", "the holder is restarting; ask again",
                                          getattr(request, "id", None))
                case protocol.Deposit():
                    assert fd is not None
                    await self._deposit(conn, request, fd)
                case protocol.Retrieve() | protocol.RetrieveMany():
                    if not await handoff.retrieve(conn, request, self.registry, self.config,
                                                  self.nursery, lambda: self.stopping):
                        return
                case protocol.Update():
                    await self._update(conn, request)
                case protocol.Ack():
                    await self._late_ack(conn, request)
                case protocol.AckMany():
                    await conn.send_error("ack_late", "no retrieve_many waits for these acks "
                                          "here: the holder kept the sessions; ack each on "
                                          "its own to complete a handoff it took over")
                case protocol.Release(id=sid):
                    await self._release(conn, sid)
                case protocol.List(all_owners=all_owners):
                    owner = None if all_owners else conn.owner
                    try:
                        sessions = self.registry.sessions(owner)
                    except OSError as exc:
                        # Out of fds, looking a child process up (psutil opens /proc files)
                        # can fail: answer, never drop the connection (and its custody).
                        if exc.errno not in _FD_EXHAUSTION:
                            raise
                        await conn.send_error("limit", f"{_OUT_OF_FDS}; ask again later")
                        continue
                    await conn.send(protocol.Sessions(sessions=sessions))
                case protocol.Status():
                    await conn.send(self._status())
                case protocol.Hello():
                    await self._bad_request(conn, "hello was already received")

    # --- requests -------------------------------------------------------------------------

    async def _deposit(self, conn: Connection, request: protocol.Deposit, fd: int) -> None:
        # The received fd is ours until a Session owns it: closed on every other path.
        try:
            if not is_pty_master(fd):
                raise RegistryError("not_a_terminal", "the deposited fd is not a PTY master")
            terminal = _terminal(fd)
            held = self.registry.get(conn.owner, request.id)
            if held is not None and _resumes(held, conn, terminal):
                os.close(fd)  # the holder has this terminal already
                held.take_custody(conn, "custody resumed by its app on a new connection")
                conn.custodian = True
                await self._deposited(conn, held, request.journal)
                return
            claimed = await claim_unrecorded(conn, request.id, terminal, self.registry,
                                             self.nursery)
            if claimed is not None:
                os.close(fd)  # the holder has this terminal already
                conn.custodian = True
                await self._deposited(conn, claimed, request.journal)
                return
            self.registry.check_room((conn.owner, request.id), terminal)
            start_time = _start_time(request.child_pid)
            custodian_start = _start_time(conn.peer_pid)
            try:
                ring = self.registry.new_ring(conn.owner)
            except OSError as exc:
                if exc.errno not in _FD_EXHAUSTION:
                    raise
                raise RegistryError("limit", _OUT_OF_FDS) from None
        except RegistryError as exc:
            os.close(fd)
            log("deposit_refused", session=f"{conn.owner}/{request.id}", code=exc.code,
                reason=str(exc))
            await conn.send_error(exc.code, str(exc), request.id)
            return
        except BaseException:
            os.close(fd)
            raise
        session = Session(conn.owner, request, fd, ring, conn, conn.peer_pid, start_time,
                          terminal, conn.client, self.instance, custodian_start,
                          self.store, self.registry.private_dir)
        self.registry.add(session)
        # Answered only once both fds are safe outside this process (DESIGN §11).
        session.storing = True
        try:
            await self.store.store(session.store_name, [fd, ring.state.fd])
            session.storing = False
        except StoreError as exc:
            log("deposit_refused", session=session.name, code="limit", reason=str(exc))
            self.registry.discard(session)
            await conn.send_error("limit", str(exc), request.id)
            return
        conn.custodian = True
        self.counters["deposits"] += 1
        await self._deposited(conn, session, request.journal)

    async def _deposited(self, conn: Connection, session: Session, with_journal: bool) -> None:
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

    async def _update(self, conn: Connection, request: protocol.Update) -> None:
        session = self.registry.get(conn.owner, request.id)
        if session is None:
            tomb = self.registry.tombstone(conn.owner, request.id)
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

    def _end_custody_already_ended(self) -> None:
        """Stopping: a custodian that has already hung up (an app handing off right now)
        ended its custody, even if its connection task will not get to read that: its
        sessions go to the next holder as draining, not held."""
        for conn in list(self.connections):
            if conn.custodian and _peer_hung_up(conn):
                self.stopping = False  # _end_custody's own check: this one really ends
                try:
                    self._end_custody(conn)
                finally:
                    self.stopping = True

    def _end_custody(self, conn: Connection) -> None:
        """The custodian connection ended: everything it still held starts draining, if
        the app hung it up (it closed custody, or its process died). If this holder ended
        it instead (a send the app did not take in time, a broken frame) the app is alive
        and still reading: its sessions stay held, by nobody connected, while its process
        lives, as after a holder restart, and the app's custody takes them back on a new
        connection. (And while the holder is stopping, the app is not gone either.)"""
        if self.stopping and self.store.enabled:
            return
        held = [s for s in self.registry.live.values()
                if s.custodian is conn and s.state == "held"]
        if not held:
            return
        app_alive = conn.peer_pid is not None and not _peer_hung_up(conn)
        for session in held:
            session.custodian = None
            try:
                if app_alive:
                    session.log("custody", reason=f"conn={conn.number} dropped by the holder: "
                                "held while its app lives", custodian_pid=session.custodian_pid)
                    self.nursery.start_soon(watch_custodian, session, self.nursery)
                else:
                    session.start_drain(self.nursery, f"custodian gone conn={conn.number}")
            except Exception as exc:  # one session's surprise must not stop the others
                session.log("internal_error", where="end of custody", error=repr(exc))

    async def _release(self, conn: Connection, sid: str) -> None:
        session = self.registry.get(conn.owner, sid)
        if session is None:
            tomb = self.registry.tombstone(conn.owner, sid)
            code = tomb.state if tomb is not None else "unknown"
            await conn.send_error(code, f"session {conn.owner}/{sid} is {code}", sid)
            return
        if session.state == "handing_off":
            await conn.send_error("busy", f"session {session.name} is being handed off", sid)
            return
        await session.stop_drain()
        if (self.registry.get(conn.owner, sid) is not session or session.state == "handing_off"
                or session.has_drain()):
            # A retrieve (or another release) got there while the drain was stopping; the
            # retrieve owns the session now and drains it again if its handoff fails (or
            # already has: a new drain runs).
            await conn.send_error("busy", f"session {session.name} changed; ask again", sid)
            return
        self.registry.bury(session, "released", f"release from peer_pid={conn.peer_pid}")
        self.counters["releases"] += 1
        await conn.send(protocol.Released(id=sid))

    async def _late_ack(self, conn: Connection, ack: protocol.Ack) -> None:
        session = self.registry.get(conn.owner, ack.id)
        if (session is not None and session.adopted_handoff
                and session.handoff_id == ack.handoff_id):
            # A handoff a stopped holder began, acked on a new connection: it completes
            # (into custody of this connection, if it was a retrieve into custody).
            session.adopted_handoff = False
            session.log("late_ack", handoff_id=ack.handoff_id, keep=ack.keep,
                        reason="begun by the holder before")
            handoff.complete(session, conn, self.registry, ack.keep, None)
            await conn.send(protocol.Done(id=ack.id))
            return
        if (session is not None and session.state == "handing_off"
                and session.handoff_id == ack.handoff_id):
            # Its own connection is still winding it up (an ack queued there may yet
            # complete it): neither late nor done, yet.
            await conn.send_error("busy", f"handoff {ack.handoff_id} is still under way on "
                                  "its own connection; ask again", ack.id)
            return
        tomb = self.registry.tombstone(conn.owner, ack.id)
        if tomb is not None and tomb.state == "handed_off" and tomb.handoff_id == ack.handoff_id:
            await conn.send(protocol.Done(id=ack.id))
            return
        log("ack_late", session=f"{conn.owner}/{ack.id}", handoff_id=ack.handoff_id,
            reason="no handoff waits for this ack")
        await conn.send_error(
            "ack_late", f"handoff {ack.handoff_id} is no longer waiting for an ack; the "
            "holder kept the session: close your copy", ack.id,
        )

    def _status(self) -> protocol.HolderStatus:
        try:
            rss: int | None = int(psutil.Process().memory_info().rss)
        except (psutil.Error, OSError):  # OSError: out of fds, psutil cannot open /proc
            rss = None
        return protocol.HolderStatus(
            pid=os.getpid(),
            version=__version__,
            started_at=self.started_at,
            socket=self.config.socket_path,
            sessions_by_state=self.registry.count_by_state(),
            counters=dict(self.counters, handoffs=self.registry.handoffs,
                          handoffs_failed=self.registry.handoffs_failed,
                          ring_bytes_used=self.registry.budget.used,
                          active_connections=len(self.connections)),
            limits=self.config.limits(),
            open_fds=open_fd_count(),
            rss_bytes=rss,
            instance=self.instance,
            fd_store=self.store_kind,
            keeper_pid=self.keeper_pid,
            adopted=self.adoption.adopted if self.adoption else 0,
            restarts=self.adoption.restarts if self.adoption else 0,
            unclean_restarts=self.adoption.unclean_restarts if self.adoption else 0,
            adopted_without_record=self.adoption.without_record if self.adoption else 0,
            adopted_renamed=self.adoption.renamed if self.adoption else 0,
        )


def _out_of_fds() -> bool:
    """True when this process is at (or within a couple of) its open-file limit, or the
    system is out of files. (Counting needs an fd of its own, so try to open one first.)"""
    try:
        probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno in _FD_EXHAUSTION
    os.close(probe)
    count = open_fd_count()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return count is not None and soft != resource.RLIM_INFINITY and count >= soft - 2


_MAX_REASON = 300


def _shorten(text: str) -> str:
    """`text`, or its head and tail if it is long. The decoder's messages quote the invalid
    value, which is the peer's to choose; a log line is cut at 4000 bytes, and a cut inside
    a quoted value would leave a line that no longer splits into its pairs."""
    if len(text) <= _MAX_REASON:
        return text
    return f"{text[:200]}...[{len(text) - 260} characters]...{text[-60:]}"


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _resumes(session: Session, conn: Connection, terminal: tuple[int, int] | None) -> bool:
    """A deposit that takes custody back rather than escrowing anew: the session is held by
    nobody connected (the holder restarted and adopted it), and the deposit comes from the
    same process, with the same terminal (DESIGN §11, "Custody survives too")."""
    return (session.state == "held" and session.custodian is None
            and session.custodian_pid == conn.peer_pid
            and terminal is not None and terminal == session.terminal)


def _peer_hung_up(conn: Connection) -> bool:
    """True if the peer has shut down its side, even with requests still unread."""
    poller = select.poll()
    poller.register(conn.sock.fileno(), PEER_HUNG_UP)
    return any(event & PEER_HUNG_UP for _, event in poller.poll(0))


def _terminal(fd: int) -> tuple[int, int] | None:
    """Which terminal a deposit is, or the refusal if that cannot be told."""
    try:
        return terminal_identity(fd)
    except OSError as exc:
        if exc.errno in _FD_EXHAUSTION:
            raise RegistryError("limit", _OUT_OF_FDS) from None
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
        if exc.errno in _FD_EXHAUSTION:
            raise RegistryError("limit", _OUT_OF_FDS) from None
        return None
