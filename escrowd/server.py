"""The holder's server: accept connections, check the peer, handshake, dispatch requests.

Every connection is served by one task, sequentially: read a request, answer it. A
connection that deposits becomes the custodian of what it deposited; when it ends, for
whatever reason, those sessions start draining (in a shielded `finally`, so even a holder
shutting down does it in order).

`Holder` ties the holder together: the nursery every task runs in, the registry of
sessions, the fd store and the config. `Holder.serve` is its whole life: adopt what the
fd store kept (escrowd.adoption), accept connections, keep house (escrowd.housekeeping)
until asked to stop, then stop in order. Each connection's requests are answered by
escrowd.requests (a retrieve by escrowd.handoff). Out of fds, the accept loop still
accepts a waiting connection, with a reserve fd, to tell it `limit` (escrowd.fdlimit).
"""

from __future__ import annotations

import errno
import os
import time
import traceback
import uuid

import trio

from escrow_client import protocol
from escrow_client.fdpass import TruncatedFds
from escrow_client.platform import REPLAY_FILES

from . import __version__, handoff, housekeeping, orphans, requests
from .adoption import Adoption, adopt
from .config import Config
from .connection import Connection, SendTimeout
from .drain import DrainLoop
from .fdlimit import FD_EXHAUSTION, OUT_OF_FDS, open_reserve, out_of_fds
from .fdstore import FdStore
from .log import log
from .programs import Programs
from .registry import Registry

# accept() errors that mean "out of resources for now": pause and retry rather than die.
# Same list and reasoning as trio's serve_listeners: the next accept may well succeed once
# a connection closes, and exiting would take every escrowed session with us.
_ACCEPT_CAPACITY_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
# A connection error that only means the peer went away: nothing worth a log line.
_PEER_GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNABORTED}


class Holder:
    """One holder process. Resource handling: the sessions' fds are the registry's; the
    holder owns the reserve fd, and the listener is its caller's."""

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
        # The programs it started (escrowd.programs), and where the keeper keeps the
        # statuses of those orphaned by a holder that died (escrowd.orphans).
        self.programs = Programs(self.registry, orphans.exits_dir(config.socket_path)
                                 if keeper_pid else None)
        # One fd kept in reserve, so that a holder out of fds can still accept a waiting
        # connection long enough to tell it `limit` (instead of leaving it in the listen
        # backlog, where its client times out and takes the holder for wedged).
        self._reserve_fd: int | None = open_reserve()

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
        escrowd.housekeeping) and return. Cancelled instead, it stops at once."""
        DrainLoop.current().prepare()  # its one fd, before the first drain needs it
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.store.read_answers)  # before adoption stores anything
            self.adoption = await adopt(self, stored or {})
            self.programs.adopt(list(self.registry.live.values()))
            nursery.start_soon(self.programs.run)
            nursery.start_soon(self._accept_loop, listener)
            nursery.start_soon(housekeeping.expire_unclaimed, self)
            nursery.start_soon(housekeeping.idle_exit, self)
            if self.store.enabled:
                nursery.start_soon(self.store.keep_removing)
            task_status.started()
            await self._stop_requested.wait()
            await housekeeping.stop_in_order(self)
            nursery.cancel_scope.cancel()
        housekeeping.flush(self)

    def request_stop(self) -> None:
        self._stop_requested.set()

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
                if exc.errno in FD_EXHAUSTION and self._reserve_fd is not None:
                    action = await self._refuse_one(listener)
                    log("accept_error", errno=name, action=action)
                    continue
                if self._reserve_fd is None:
                    self._reserve_fd = open_reserve()  # an fd may have come free meanwhile
                log("accept_error", errno=name, action="pause 100ms")
                await trio.sleep(0.1)
                continue
            waited = False
            self._next_conn += 1
            self.nursery.start_soon(_serve_connection, self, sock, self._next_conn)

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
                    await conn.send_error("limit", OUT_OF_FDS)
            except OSError:
                pass  # the peer is gone already: nothing to tell it
            finally:
                sock.close()
        except OSError as exc:  # the accept failed again (another fd was taken meanwhile)
            return f"could not accept with the reserve fd: {exc.strerror}"
        finally:
            self._reserve_fd = open_reserve()
        return "refused a connection with limit"


# --- one connection ---------------------------------------------------------------------


async def _serve_connection(holder: Holder, sock: trio.socket.SocketType, number: int) -> None:
    conn: Connection | None = None
    try:
        conn = Connection(sock, number, holder.config.send_deadline)
        holder.counters["connections"] += 1
        holder.connections.add(conn)
        if conn.peer_uid != os.getuid():
            holder.counters["refused_peers"] += 1
            log("peer_refused", conn=number, peer_pid=conn.peer_pid, peer_uid=conn.peer_uid,
                reason="uid differs from the holder's")
            await conn.send_error("forbidden", "peer uid differs from the holder's uid")
            return
        if len(holder.connections) > holder.config.max_connections:
            log("conn_refused", conn=number, peer_pid=conn.peer_pid,
                reason="connection limit")
            await conn.send_error("limit", "too many connections")
            return
        if await _handshake(holder, conn):
            await _request_loop(holder, conn)
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
                holder.connections.discard(conn)
                housekeeping.end_custody(holder, conn)
                conn.close()
            else:
                sock.close()


async def _receive(holder: Holder, conn: Connection) -> tuple[protocol.Request, int | None] | None:
    """The next request, or None when the connection should end. Answers bad input."""
    while True:
        timeout = float("inf") if conn.custodian else holder.config.idle_timeout
        try:
            with trio.fail_after(timeout):
                return await conn.receive(holder.config.max_request_bytes)
        except trio.TooSlowError:
            log("conn_idle", conn=conn.number, owner=conn.owner or None,
                reason="idle timeout")
            return None
        except TruncatedFds as exc:
            if out_of_fds():
                log("limit", conn=conn.number, owner=conn.owner or None,
                    reason="out of file descriptors: a received fd was dropped")
                await conn.send_error("limit", OUT_OF_FDS)
            else:
                await _bad_request(holder, conn, str(exc))
        except protocol.ProtocolError as exc:
            await _bad_request(holder, conn, str(exc))
            # A broken frame leaves the stream out of step; a bad message in a whole
            # frame does not, and the connection goes on.
            if isinstance(exc, protocol.FrameError):
                return None


async def _bad_request(holder: Holder, conn: Connection, why: str) -> None:
    why = _shorten(why)  # it may quote the peer's bytes back: never 1 MiB of them
    holder.counters["bad_requests"] += 1
    log("bad_request", conn=conn.number, owner=conn.owner or None, peer_pid=conn.peer_pid,
        reason=why)
    await conn.send_error("bad_request", why)


async def _handshake(holder: Holder, conn: Connection) -> bool:
    got = await _receive(holder, conn)
    if got is None:
        return False
    hello, fd = got
    if fd is not None:
        os.close(fd)  # a deposit before hello: refused below, its fd closed here
    if not isinstance(hello, protocol.Hello):
        await _bad_request(holder, conn, f"expected hello first, got {type(hello).__name__}")
        return False
    if hello.version not in protocol.SUPPORTED_VERSIONS:
        holder.counters["bad_requests"] += 1
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
    c = holder.config
    if sum(1 for other in holder.connections if other.owner == conn.owner) > (
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
            # (No replays by reference where there is no memfd: escrowd.replay_file.)
            features=[f for f in protocol.FEATURES if REPLAY_FILES or f != "replay_file"],
        )
    )
    return True


async def _request_loop(holder: Holder, conn: Connection) -> None:
    while (got := await _receive(holder, conn)) is not None:
        request, fd = got
        match request:
            case (protocol.Deposit() | protocol.Retrieve() | protocol.RetrieveMany()
                  | protocol.Update() | protocol.Start()) if holder.stopping:
                if fd is not None:
                    os.close(fd)
                await conn.send_error("busy", "the holder is restarting; ask again",
                                      getattr(request, "id", None))
            case protocol.Deposit():
                assert fd is not None
                await requests.deposit(holder, conn, request, fd)
            case protocol.Retrieve() | protocol.RetrieveMany():
                if not await handoff.retrieve(conn, request, holder.registry, holder.config,
                                              holder.nursery, lambda: holder.stopping):
                    return
            case protocol.Start():
                if not await requests.start(holder, conn, request):
                    return
            case protocol.Wait():
                if not await requests.wait(holder, conn, request):
                    return
            case protocol.Update():
                await requests.update(holder, conn, request)
            case protocol.Ack():
                await requests.late_ack(holder, conn, request)
            case protocol.AckMany():
                await requests.late_ack_many(conn)
            case protocol.Release(id=sid):
                await requests.release(holder, conn, sid)
            case protocol.List(all_owners=all_owners):
                await requests.list_sessions(holder, conn, all_owners)
            case protocol.Status():
                await requests.status(holder, conn)
            case protocol.Hello():
                await _bad_request(holder, conn, "hello was already received")


_MAX_REASON = 300


def _shorten(text: str) -> str:
    """`text`, or its head and tail if it is long. The decoder's messages quote the invalid
    value, which is the peer's to choose; a log line is cut at 4000 bytes, and a cut inside
    a quoted value would leave a line that no longer splits into its pairs."""
    if len(text) <= _MAX_REASON:
        return text
    return f"{text[:200]}...[{len(text) - 260} characters]...{text[-60:]}"
