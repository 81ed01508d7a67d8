"""Adoption: a holder that starts with stored fds takes up what an earlier holder left
(DESIGN §11).

Each stored session is a pair of fds under one name (escrowd.fdstore): its PTY master and its
state file. A pair is adopted only if the state file is whole (magic, layout version,
checksum, a valid record naming the same token) and the master is a PTY master; anything
unpaired, corrupt or doubled is closed, logged and taken out of the store, and the rest is
adopted all the same. Each session resumes by the state it recorded:

- `draining`: drains on, with its ring. After an unclean stop, one read may have been in
  flight: the oldest bytes it may have overwritten (only a ring that could grow no more
  overwrites) are dropped, and `replay_gap_at` marks where its bytes would have been. The
  same holds for `handing_off`, whose sweep reads too.
- `exited`: stays exited, its tail in the ring.
- `handing_off`: waits for the ack of its recorded handoff (a client may still send it on
  a new connection) while the retrieving process lives (the ack deadline if its pid was
  not recorded), then drains again.
- `held`: stays held while its custodian process lives (escrowd.pidwatch), and drains the
  moment there is positive proof that it died. An app that comes back takes custody again
  on a new connection.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from escrow_client.fdpass import close_fds
from escrow_client.platform import is_pty_master
from escrow_client.protocol import TOMBSTONE_STATES

from .fdstore import HOLDER_NAME, JOURNAL_PREFIX, SESSION_PREFIX, journal_name, session_name
from .journal import JournalFile
from .log import log
from .pidwatch import wait_exit
from .ring import Ring
from .session import Session
from .statefile import CorruptState, HolderRecord, Record, StateFile

if TYPE_CHECKING:
    from .server import Holder


@dataclass
class Adoption:
    """What a holder found in the store at start, for `status`."""

    instance: str
    restarts: int = 0  # holders that ran on this store before this one
    unclean_restarts: int = 0  # of them, those that did not stop cleanly
    adopted: int = 0  # sessions taken up by this holder
    refused: int = 0  # stored pairs closed as corrupt, unpaired or doubled
    holder_state: StateFile[HolderRecord] | None = None


async def adopt(holder: Holder, stored: dict[str, list[int]]) -> Adoption:
    """Count this start in the holder's own state file (stored first, if it is new), then
    take up every stored session (see the module's docstring). Runs before the holder
    accepts its first connection."""
    report = Adoption(holder.instance)
    if _holder_state(holder, stored.pop(HOLDER_NAME, []), report):
        assert report.holder_state is not None
        await holder.store.store(HOLDER_NAME, [report.holder_state.fd])
    found: dict[tuple[str, str], Session] = {}
    journals = {name[len(JOURNAL_PREFIX):]: stored.pop(name) for name in list(stored)
                if name.startswith(JOURNAL_PREFIX)}
    for name, fds in stored.items():
        if not name.startswith(SESSION_PREFIX):
            _refuse(holder, name, fds, "not a name this holder stores", report)
            continue
        session = _pair(holder, name, fds, report, journals)
        if session is None:
            continue
        other = found.get(session.key)
        if other is not None:
            # Two stored sessions under one key: the newer deposit is the live one.
            older, session = sorted((other, session), key=lambda s: s.deposited_at)
            older.close()
            _refuse(holder, session_name(older.token), [], f"an older deposit of "
                    f"{older.name} left in the store", report)
        found[session.key] = session
    for token, fds in journals.items():  # no session took them: nothing can write them now
        _refuse(holder, journal_name(token), fds, "a journal of no session", report)
    for session in found.values():
        holder.registry.live[session.key] = session
        session.persist()
        _resume(holder, session)
        report.adopted += 1
    if report.adopted or report.restarts:
        log("adopted", sessions=report.adopted, refused=report.refused,
            restarts=report.restarts, unclean_restarts=report.unclean_restarts)
    return report


def _holder_state(holder: Holder, fds: list[int], report: Adoption) -> bool:
    """The holder's own state file: count this start, and whether the last holder stopped
    cleanly. A new one if there was none (or it is unreadable). Returns True when the file
    must be stored (it is new, or the store had more than one): a file the store already
    keeps stays there, untouched, and sees the new record (the store's copy is the same
    file). Taking it out to store it again would lose it, and every count, to a kill in
    between."""
    state: StateFile[HolderRecord] | None = None
    previous: HolderRecord | None = None
    for fd in fds:
        if state is not None:
            os.close(fd)  # only one is ever stored
            continue
        try:
            state = StateFile(fd, HolderRecord)
            previous = state.record()
        except CorruptState as exc:
            log("adopt_refused", name=HOLDER_NAME, reason=str(exc))
    store_it = state is None or len(fds) > 1
    if store_it and fds:
        holder.store.remove(HOLDER_NAME)  # unreadable or doubled: stored again, once
    if state is None:
        if not holder.store.enabled:
            return False
        state = StateFile.create(HolderRecord, 0, "holder", holder.registry.private_dir)
    if previous is not None:
        report.restarts = previous.restarts + 1
        report.unclean_restarts = previous.unclean_restarts + (0 if previous.clean else 1)
    state.write(HolderRecord(instance=holder.instance, started_at=time.time(),
                             restarts=report.restarts,
                             unclean_restarts=report.unclean_restarts))
    report.holder_state = state
    return store_it and holder.store.enabled


def _pair(holder: Holder, name: str, fds: list[int], report: Adoption,
          journals: dict[str, list[int]]) -> Session | None:
    masters = [fd for fd in fds if _is_char_device(fd)]
    files = [fd for fd in fds if _is_regular_file(fd)]
    if len(masters) != 1 or len(files) != 1 or len(fds) != 2:
        _refuse(holder, name, fds, f"expected a PTY master and a state file, got "
                f"{len(masters)} terminal(s) and {len(files)} file(s) of {len(fds)}", report)
        return None
    master, file_fd = masters[0], files[0]
    if not is_pty_master(master):
        _refuse(holder, name, fds, "the stored terminal is not a PTY master", report)
        return None
    try:
        state = StateFile(file_fd, Record)
    except CorruptState as exc:
        _refuse(holder, name, [master], f"corrupt state file: {exc}", report)
        return None
    record = state.record()
    why = None
    if record is None:
        why = "the state file has no valid record"
    elif session_name(record.token) != name:
        why = f"the state file belongs to {session_name(record.token)}"
    elif record.state in TOMBSTONE_STATES:
        why = f"{record.owner}/{record.id} ended ({record.state}) before its fds left the store"
    if why is not None or record is None:
        state.close()
        _refuse(holder, name, [master], why or "", report)
        return None
    ring = Ring(state.size, holder.registry.budget, state)
    # A read may have been in flight when the last holder died: a drain's, or (in
    # `handing_off`) the sweep's, or a drain's last read as the handoff stopped it.
    in_flight = not record.clean and record.state in ("draining", "handing_off")
    trimmed = ring.adopt(record.capacity, record.origin, record.total_at_layout,
                         record.length_at_layout, in_flight, record.saturated,
                         record.consumed, record.dropped_base)
    session = Session.adopted(master, ring, record, holder.instance, holder.store,
                              holder.registry.private_dir,
                              _journal(holder, record, journals.pop(record.token, [])))
    if in_flight:
        session.gap_totals.append(ring.total)  # one read's bytes may be missing after here
    session.log("adopted", state=record.state, buffered=ring.size, unclean=not record.clean,
                trimmed=trimmed or None, replay_gap_at=session.replay_gap_at)
    return session


def _journal(holder: Holder, record: Record, fds: list[int]) -> JournalFile | None:
    """The journal file the store kept for a session whose app journals, if it is the one
    its record describes (else it is lost: `journal.end` marks a gap where it was)."""
    if record.journal_from is None or record.journal_capacity <= 0 or len(fds) != 1:
        close_fds(fds)
        if fds:
            holder.store.remove(journal_name(record.token))
        return None
    try:
        return JournalFile.adopt(fds[0], record.journal_capacity, holder.registry.budget)
    except (OSError, ValueError) as exc:
        log("adopt_refused", name=journal_name(record.token), reason=f"its journal: {exc}")
        holder.store.remove(journal_name(record.token))
        return None


def _resume(holder: Holder, session: Session) -> None:
    if session.state == "draining":
        session.start_drain(holder.nursery, "adopted")
    elif session.state == "exited":
        session.hung_up = True
    elif session.state == "handing_off":
        holder.nursery.start_soon(_await_adopted_ack, holder, session)
    elif session.state == "held":
        holder.nursery.start_soon(watch_custodian, holder, session)


async def watch_custodian(holder: Holder, session: Session) -> None:
    """Held by an app with no connection to this holder (it held custody of a holder
    before, or the holder dropped its connection): drain once that app is gone."""
    pid = session.custodian_pid
    with trio.CancelScope() as scope:
        session.watch_scope = scope
        if pid is not None:
            await wait_exit(pid, session.custodian_start_time)
        if session.state == "held" and session.custodian is None and session.fd >= 0:
            session.start_drain(holder.nursery, f"custodian pid={pid} exited")
    if session.watch_scope is scope:
        session.watch_scope = None


async def _await_adopted_ack(holder: Holder, session: Session) -> None:
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
            await trio.sleep(holder.config.ack_deadline)
        if session.fd >= 0 and session.state == "handing_off" and session.adopted_handoff:
            session.adopted_handoff = False
            session.handoff_id = session.handoff_peer_pid = None
            holder.registry.handoffs_failed += 1
            session.start_drain(holder.nursery, "the client of a handoff a stopped holder "
                                "began went away without its ack")
    if session.watch_scope is scope:
        session.watch_scope = None


def _refuse(holder: Holder, name: str, fds: list[int], why: str,
            report: Adoption) -> None:
    close_fds(fds)
    holder.store.remove(name)
    report.refused += 1
    log("adopt_refused", name=name, reason=why)


def _is_char_device(fd: int) -> bool:
    try:
        return stat.S_ISCHR(os.fstat(fd).st_mode)
    except OSError:
        return False


def _is_regular_file(fd: int) -> bool:
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False
