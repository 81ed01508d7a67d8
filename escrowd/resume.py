"""Adopted sessions after adoption: each goes on as its recorded state says, and whatever it
waits on is watched here (escrowd.adoption takes them up; its docstring has the whole story).

Nothing here reads a terminal that someone else may be reading: two readers would split
its output. So a session held by an app that is not connected stays held while that app's
process lives (`watch_custodian`: its process is watched with escrowd.pidwatch, and only
positive proof that it died starts the drain); a handoff a stopped holder began waits for
its ack while the retrieving process lives (the ack deadline if its pid was not recorded);
and a session adopted without its record waits `UNRECORDED_GRACE` before it drains,
because an app whose custody outlived the last holder may be reading it and is about to
take it back: its deposit of that terminal makes the session the app's again, under the
app's name (`claim_unrecorded`).
"""

from __future__ import annotations

import trio

from .config import Config
from .connection import Connection
from .pidwatch import wait_exit
from .registry import Registry
from .session import Session

# How long a session adopted without its record waits before the holder reads it: an app
# whose custody outlived the last holder (it reads the terminal itself) takes it back
# within about a second (escrow_client.custody); reading before would make two readers.
UNRECORDED_GRACE = 2.0


def resume(session: Session, registry: Registry, config: Config,
           nursery: trio.Nursery) -> None:
    """Go on as the adopted session's recorded state says (in `nursery`)."""
    if session.state == "draining" and session.record_lost:
        nursery.start_soon(_drain_after_grace, session, registry, nursery)
    elif session.state == "draining":
        session.start_drain(nursery, "adopted")
    elif session.state == "exited":
        session.hung_up = True
    elif session.state == "handing_off":
        nursery.start_soon(_await_adopted_ack, session, registry, config, nursery)
    elif session.state == "held":
        nursery.start_soon(watch_custodian, session, nursery)


async def _drain_after_grace(session: Session, registry: Registry,
                             nursery: trio.Nursery) -> None:
    await trio.sleep(UNRECORDED_GRACE)
    if (registry.live.get(session.key) is session and session.state == "draining"
            and session.fd >= 0 and not session.has_drain()):
        session.start_drain(nursery, "adopted without its record; not taken back")


async def watch_custodian(session: Session, nursery: trio.Nursery) -> None:
    """Held by an app with no connection to this holder (it held custody of a holder
    before, or the holder dropped its connection): drain once that app is gone."""
    pid = session.custodian_pid
    with trio.CancelScope() as scope:
        session.watch_scope = scope
        if pid is not None:
            await wait_exit(pid, session.custodian_start_time)
        if session.state == "held" and session.custodian is None and session.fd >= 0:
            session.start_drain(nursery, f"custodian pid={pid} exited")
    if session.watch_scope is scope:
        session.watch_scope = None


async def _await_adopted_ack(session: Session, registry: Registry, config: Config,
                             nursery: trio.Nursery) -> None:
    """A handoff was under way when the last holder stopped: the fd may be in the client's
    hands now. The client may still ack it (on a new connection, see the holder's late-ack
    handling); until it does, nothing here reads the terminal while that client's process
    lives (it may be reading it: two readers would split the output). When it is gone
    without an ack, the session drains again. (No client pid recorded: the ack deadline.)"""
    session.adopted_handoff = True
    pid = session.handoff_peer_pid
    with trio.CancelScope() as scope:
        session.watch_scope = scope
        if pid is not None:
            await wait_exit(pid, None)
        else:
            await trio.sleep(config.ack_deadline)
        if session.fd >= 0 and session.state == "handing_off" and session.adopted_handoff:
            session.adopted_handoff = False
            session.handoff_id = session.handoff_peer_pid = None
            registry.handoffs_failed += 1
            session.start_drain(nursery, "the client of a handoff a stopped holder "
                                "began went away without its ack")
    if session.watch_scope is scope:
        session.watch_scope = None


async def claim_unrecorded(conn: Connection, sid: str, terminal: tuple[int, int] | None,
                           registry: Registry, nursery: trio.Nursery) -> Session | None:
    """A deposit of a terminal this holder took up without its record, from an app that
    has that terminal (it sent it): the app's custody outlived the last holder, and it is
    reading the terminal itself. The session becomes that app's again, under its name,
    held by this connection, and the holder stops reading it at once (two readers would
    split the output). None if the deposit is not such a claim, or the session changed
    meanwhile (then it drains as before)."""
    if terminal is None:
        return None
    session = next((s for s in registry.live.values()
                    if s.record_lost and s.terminal == terminal), None)
    key = (conn.owner, sid)
    if (session is None or session.state not in ("draining", "exited")
            or (key != session.key and key in registry.live)):
        return None
    had_drain = session.has_drain()
    await session.stop_drain()
    if (registry.live.get(session.key) is not session or session.has_drain()
            or session.state not in ("draining", "exited") or session.fd < 0
            or (key != session.key and key in registry.live)):
        if (had_drain and registry.live.get(session.key) is session and session.fd >= 0
                and session.state == "draining" and not session.has_drain()):
            session.start_drain(nursery, "a claim of it fell through")
        return None
    was = session.name
    session.leave_event_loop()  # the app's flags back, before the app reads on
    if key != session.key:
        registry.rename(session, key)
    session.record_lost = False
    session.label = ""
    session.custodian_pid = conn.peer_pid
    session.custodian_start_time = conn.peer_start_time()
    session.set_state("held", f"claimed by its app (was {was})", persist=False)
    session.take_custody(conn, f"its app deposited the terminal again on conn={conn.number}")
    return session
