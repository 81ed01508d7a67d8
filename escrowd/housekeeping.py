"""The holder's housekeeping: what it does of its own accord, beside answering requests.

- The end of custody: when a custodian connection ends, for whatever reason, the sessions
  it still held start draining if the app hung it up (it closed custody, or died). If the
  holder dropped it instead (a send the app did not take in time, a broken frame), the app
  is alive and reading: they stay held while its process lives (escrowd.resume).
- The unclaimed TTL: a session left draining (or exited) for --unclaimed-ttl, that nobody
  reclaimed, is released, its tombstone `expired`.
- Idle exit: with --idle-exit, a holder that has held nothing and had no connection for
  that long stops.
- Stopping in order: requests are refused (`busy`: escrowd.server), handoffs under way get
  their ack deadline, and the fd store is given time to forget what has ended. Custody
  does not end with the connections (the apps are alive, and the next holder adopts their
  sessions still held), unless the app had hung up already. Then, once the serving tasks
  are cancelled, every session's record is flushed, marked clean, for the next holder.
"""

from __future__ import annotations

import select
import time
from typing import Protocol

import msgspec
import trio

from escrow_client.platform import PEER_HUNG_UP

from .adoption import Adoption
from .config import Config
from .connection import Connection
from .fdstore import HOLDER_NAME, FdStore
from .log import log
from .registry import Registry
from .resume import watch_custodian


class Housekeeper(Protocol):
    """The holder as its housekeeping sees it (escrowd.server.Holder)."""

    config: Config
    store: FdStore
    registry: Registry
    connections: set[Connection]
    adoption: Adoption | None
    stopping: bool  # stopping in order: requests are refused, custody kept
    idle_exited: bool

    @property
    def nursery(self) -> trio.Nursery: ...

    def request_stop(self) -> None: ...


def end_custody(holder: Housekeeper, conn: Connection) -> None:
    """The custodian connection ended: everything it still held starts draining, if
    the app hung it up (it closed custody, or its process died). If this holder ended
    it instead (a send the app did not take in time, a broken frame) the app is alive
    and still reading: its sessions stay held, by nobody connected, while its process
    lives, as after a holder restart, and the app's custody takes them back on a new
    connection. (And while the holder is stopping, the app is not gone either.)"""
    if holder.stopping and holder.store.enabled:
        return
    _custody_ended(holder, conn)


def _custody_ended(holder: Housekeeper, conn: Connection) -> None:
    held = [s for s in holder.registry.live.values()
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
                holder.nursery.start_soon(watch_custodian, session, holder.nursery)
            else:
                session.start_drain(holder.nursery, f"custodian gone conn={conn.number}")
        except Exception as exc:  # one session's surprise must not stop the others
            session.log("internal_error", where="end of custody", error=repr(exc))


async def expire_unclaimed(holder: Housekeeper) -> None:
    """Release sessions nobody reclaimed within --unclaimed-ttl (a coarse check: it
    sleeps until the next one is due, or a minute at most while none waits)."""
    ttl = holder.config.unclaimed_ttl
    if ttl <= 0:
        return
    while True:
        now = time.time()
        waiting = [s for s in holder.registry.live.values() if s.state in ("draining", "exited")]
        for session in [s for s in waiting if now - s.state_since >= ttl]:
            if session.state not in ("draining", "exited"):
                continue  # a retrieve or release got there first
            await session.stop_drain()
            if (
                holder.registry.get(session.owner, session.id) is session
                and session.state in ("draining", "exited")
                and not session.has_drain()  # nobody restarted it meanwhile
            ):
                holder.registry.bury(session, "expired", f"unclaimed for {ttl:g}s")
        due = [s.state_since + ttl for s in waiting if s.key in holder.registry.live]
        delay = min(due, default=now + min(ttl, 60.0)) - time.time()
        await trio.sleep(max(delay, 0.01))


async def idle_exit(holder: Housekeeper) -> None:
    """Stop the holder once it has held no session and had no connection for
    --idle-exit seconds; never if it is 0."""
    limit = holder.config.idle_exit
    if limit <= 0:
        await trio.sleep_forever()
    idle_since: float | None = None
    while True:
        now = trio.current_time()
        if holder.registry.live or holder.connections:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= limit:
            log("idle_exit", reason=f"nothing held and no connection for {limit:g}s")
            holder.idle_exited = True
            holder.request_stop()
            return
        await trio.sleep(max(0.05, min(limit / 4, 30.0)))


async def stop_in_order(holder: Housekeeper) -> None:
    """Stop taking requests; let handoffs under way finish (they get their ack
    deadline); then the serving tasks may be cancelled. Custody does not end with the
    connections: the apps are alive, and a holder adopting these sessions keeps them
    held."""
    holder.stopping = True
    limit = holder.config.send_deadline + max(holder.config.ack_deadline, 0.0) + 1.0
    with trio.move_on_after(limit):
        while any(s.state == "handing_off" and not s.adopted_handoff
                  for s in holder.registry.live.values()):
            await trio.sleep(0.01)
    _end_custody_already_ended(holder)
    with trio.move_on_after(holder.config.send_deadline):
        while holder.store.removals_pending:  # the store forgets what has ended
            await trio.sleep(0.01)


def _end_custody_already_ended(holder: Housekeeper) -> None:
    """Stopping: a custodian that has already hung up (an app handing off right now)
    ended its custody, even if its connection task will not get to read that: its
    sessions go to the next holder as draining, not held."""
    for conn in list(holder.connections):
        if conn.custodian and _peer_hung_up(conn):
            _custody_ended(holder, conn)  # (past end_custody's check: this one really ends)


def flush(holder: Housekeeper) -> None:
    """Every session's record, marked clean, for the next holder (the drains are over:
    the nursery they ran in has exited)."""
    for session in holder.registry.live.values():
        session.forget_drain()
        session.persist(clean=True)
    state = holder.adoption.holder_state if holder.adoption else None
    if holder.idle_exited and not holder.registry.live:
        # Nothing is kept: a keeper with an empty store stops too.
        holder.store.remove(HOLDER_NAME)
    elif state is not None:
        record = state.record()
        if record is not None:
            state.write(msgspec.structs.replace(record, clean=True))
    log("flushed", sessions=len(holder.registry.live))


def _peer_hung_up(conn: Connection) -> bool:
    """True if the peer has shut down its side, even with requests still unread."""
    poller = select.poll()
    poller.register(conn.sock.fileno(), PEER_HUNG_UP)
    return any(event & PEER_HUNG_UP for _, event in poller.poll(0))
