"""Adoption: a holder that starts with stored fds takes up what an earlier holder left
(DESIGN §11).

Each stored session is a group of fds under one name (escrowd.fdstore): its PTY master, its
state file and, while an app journals it, the journal file. Nothing stored is believed
until it is checked (escrowd.bounds), and doubt never closes a terminal:

- A valid PTY master is a session. With a state file whose record can be believed (whole,
  every field within bounds, naming the same token), it resumes as it was recorded (below).
  Without one (the file is missing, unreadable, torn, of another session, or out of
  bounds) it is adopted with what can be proven: the terminal itself, a fresh ring, the
  replay marked lost from its start (a gap at 0), its foreground process group as its
  child, and its owner and id if a record still says them, else a name that says its
  record is lost (`escrowd/lost-pts<N>-<token>`). It drains, and stays listed until an
  app or a user releases it (or the unclaimed TTL); a deposit of the same terminal from
  its app takes it back under the app's name (escrowd.server).
- Two copies of one terminal (a group stored again under a new name, and the old one whose
  removal a kill cut off) are one session: the believed (or newer) one is kept, and the
  other copy is closed, since the terminal stays open through the first.
- Two sessions claiming one owner/id both stay: the older is renamed `<id>.dup-<token>`.
- Only what is not a PTY master (a slave, where the holder would read the user's
  keystrokes; a pipe; a state file with no terminal) and what is proven ended (a record
  that says `handed_off`, `released` or `expired`: the app reads that terminal, or nobody
  may) is closed and taken out of the store.
- Anything that goes wrong with one session stays with that session: its master is never
  closed for it, and the next session is adopted all the same. A group that is not
  exactly one master and its believed state file is stored again, each session under a
  new name, before the old name is removed.

Sessions resume by their recorded state:
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

The holder's own state file counts restarts; one that cannot be believed, found beside
stored sessions, makes the counts unknown (None), never 0: a total loss must not read as
"no restart".
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import trio

from escrow_client.fdpass import close_fds
from escrow_client.liveness import process_start_time
from escrow_client.platform import is_pty_master, pty_number
from escrow_client.protocol import TOMBSTONE_STATES

from .bounds import believed_child, holder_record_doubt, record_doubt
from .fdstore import (
    HOLDER_NAME,
    JOURNAL_PREFIX,
    SESSION_PREFIX,
    StoreError,
    journal_name,
    session_name,
)
from .journal import JournalFile
from .log import log
from .pidwatch import wait_exit
from .ring import Ring
from .session import Session
from .statefile import CorruptState, HolderRecord, Record, StateFile, newest_record

if TYPE_CHECKING:
    from .connection import Connection
    from .server import Holder

T = TypeVar("T")
LOST_OWNER = "escrowd"  # the owner of a session adopted with no record that names one
LOST_LABEL = "adopted without its record: its replay from before is lost"


@dataclass
class Adoption:
    """What a holder found in the store at start, for `status`."""

    instance: str
    restarts: int | None = 0  # holders that ran on this store before this one (None: unknown)
    unclean_restarts: int | None = 0  # of them, those that did not stop cleanly
    adopted: int = 0  # sessions taken up by this holder
    without_record: int = 0  # of them, adopted with a fresh ring (no record believed)
    renamed: int = 0  # of them, renamed: another claimed the same owner/id
    refused: int = 0  # stored groups (or fds of them) closed: not a terminal, or ended
    holder_state: StateFile[HolderRecord] | None = None
    # Masters that could not be taken up at all (no state file could be made: out of fds
    # or memory), with the group they are stored in: kept open, left in the store, and
    # taken up later (`_take_up_later`).
    held_back: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Found:
    """A session taken up from one stored group, and how it was."""

    session: Session
    believed: bool  # its record was believed
    group: str  # the name it was stored under
    moved: bool = False  # stored again under its own (new) name
    others: list[int] = field(default_factory=list)


async def adopt(holder: Holder, stored: dict[str, list[int]]) -> Adoption:
    """Count this start in the holder's own state file (stored first, if it is new), then
    take up every stored session (see the module's docstring). Runs before the holder
    accepts its first connection; raises nothing for what it finds."""
    report = Adoption(holder.instance)
    journals = {name[len(JOURNAL_PREFIX):]: stored.pop(name) for name in list(stored)
                if name.startswith(JOURNAL_PREFIX)}
    holder_fds = stored.pop(HOLDER_NAME, [])
    if _holder_state(holder, holder_fds, report, bool(stored or journals)):
        assert report.holder_state is not None
        try:
            await holder.store.store(HOLDER_NAME, [report.holder_state.fd])
        except StoreError as exc:
            log("fd_store", name=HOLDER_NAME, error=str(exc), reason="the restart counts "
                "are not kept for the next holder")
    found: list[_Found] = []
    for name, fds in stored.items():
        found += await _take_up(holder, name, fds, journals, report)
    for token, fds in journals.items():  # no session took them: nothing can write them now
        _refuse(holder, journal_name(token), fds, "a journal of no session", report)
    found = _one_per_terminal(holder, found, report)
    _names_apart(found, report)
    for each in found:
        session = each.session
        holder.registry.live[session.key] = session
        try:
            session.persist()
            _resume(holder, session)
        except Exception as exc:  # this session's alone: it is kept, listed, and retried
            session.log("internal_error", where="adoption", error=repr(exc))
        report.adopted += 1
    if report.held_back:
        holder.nursery.start_soon(_take_up_later, holder, report)
    if report.adopted or report.restarts or report.refused:
        log("adopted", sessions=report.adopted, refused=report.refused,
            without_record=report.without_record or None, renamed=report.renamed or None,
            restarts=report.restarts, unclean_restarts=report.unclean_restarts)
    return report


def _holder_state(holder: Holder, fds: list[int], report: Adoption,
                  sessions_stored: bool) -> bool:
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
            doubt = holder_record_doubt(previous) if previous is not None else None
            if doubt is not None:
                log("adopt_refused", name=HOLDER_NAME, reason=f"its record: {doubt}")
                previous = None
        except CorruptState as exc:
            log("adopt_refused", name=HOLDER_NAME, reason=str(exc))
    store_it = state is None or len(fds) > 1
    if store_it and fds:
        holder.store.remove(HOLDER_NAME)  # unreadable or doubled: stored again, once
    if state is None:
        if not holder.store.enabled:
            return False
        try:
            state = StateFile.create(HolderRecord, 0, "holder", holder.registry.private_dir)
        except OSError as exc:  # out of fds or memory: serve without the counts
            log("holder_state", error=repr(exc), reason="restart counts not kept")
            report.restarts = report.unclean_restarts = None
            return False
    if previous is not None:
        report.restarts = None if previous.restarts is None else previous.restarts + 1
        report.unclean_restarts = (None if previous.unclean_restarts is None else
                                   previous.unclean_restarts + (0 if previous.clean else 1))
    elif fds or sessions_stored:
        # Sessions were kept, but no count can be believed: how many holders came before
        # is not known.
        report.restarts = report.unclean_restarts = None
    state.write(HolderRecord(instance=holder.instance, started_at=time.time(),
                             restarts=report.restarts,
                             unclean_restarts=report.unclean_restarts))
    report.holder_state = state
    return store_it and holder.store.enabled


# --- one stored group ---------------------------------------------------------------------


async def _take_up(holder: Holder, name: str, fds: list[int], journals: dict[str, list[int]],
                   report: Adoption) -> list[_Found]:
    """The sessions in one stored group (see the module's docstring). Every fd of the
    group ends up owned by a session, held back, or closed: never two of these."""
    token = name[len(SESSION_PREFIX):] if name.startswith(SESSION_PREFIX) else None
    masters, files, others = _sort(fds)
    if not masters:
        _refuse(holder, name, fds, "no PTY master: " + (
            f"{len(others)} fd(s) of another kind (not a PTY master: a PTY slave would give "
            "the holder the user's keystrokes)" if others else "a state file alone"), report)
        return []
    if others:
        _refuse(holder, name, others, f"{len(others)} fd(s) that are not a PTY master nor "
                "a state file (a PTY slave would give the holder the user's keystrokes)",
                report, remove=False)
    records, named, why = _records(files, token)
    found: list[_Found] = []
    held_back = False
    for master in masters:
        if records:
            state, record = records.pop(0)
            if record.state in TOMBSTONE_STATES:
                state.close()
                # (With the handoff it names: the holder that recorded it may have died
                # before it logged it.)
                _refuse(holder, name, [master], f"{record.owner}/{record.id} ended "
                        f"({record.state}) before its fds left the store", report,
                        remove=len(masters) == 1, state=record.state,
                        handoff_id=record.handoff_id)
                continue
            try:
                session = _as_recorded(holder, master, state, record, journals)
                found.append(_Found(session, True, name))
                continue
            except Exception as exc:  # taken up all the same, with what can be proven
                why = f"its record could not be taken up: {exc!r}"
        try:
            session = _unrecorded(holder, master, named, why)
            session.store_name = name  # (until it is stored apart under its own)
            found.append(_Found(session, False, name))
            report.without_record += 1
        except Exception as exc:
            # Not even a fresh state file (out of fds or memory): never closed for that.
            report.held_back.append((name, master))
            held_back = True
            log("adopt_held_back", name=name, error=repr(exc), reason="kept open and "
                "stored, for the next holder: no state file could be made for it now")
    for state, _ in records:
        state.close()  # a state file for which no master was stored
    whole = len(found) == 1 and found[0].believed and not others and len(files) == 1
    if found and not whole and not held_back:
        await _store_apart(holder, name, found)
    return found


def _records(files: list[int], token: str | None) -> tuple[
        list[tuple[StateFile[Record], Record]], tuple[str, str] | None, str]:
    """Of a group's regular files, the state files whose record can be believed for
    `token`; an owner/id a record of that token says (believed or not); and why none can
    be, if none can. The files not returned are closed."""
    records: list[tuple[StateFile[Record], Record]] = []
    named: tuple[str, str] | None = None
    why = "no state file was stored with it"
    for fd in files:
        salvaged = newest_record(fd)  # (before StateFile, which closes a file it refuses)
        try:
            state = StateFile(fd, Record)
        except CorruptState as exc:
            why = f"its state file: {exc}"
            if named is None and salvaged is not None and salvaged.token == token:
                named = _name_of(salvaged)
            continue  # (closed by StateFile)
        record = state.record()
        if record is None:
            doubt: str | None = "its state file has no valid record"
        elif record.token != token:
            doubt = f"its state file belongs to {session_name(record.token)}"
        else:
            doubt = record_doubt(record, state.size, state.total)
            named = named or _name_of(record)
        if doubt is not None or record is None:
            why = doubt or why
            state.close()
            continue
        records.append((state, record))
    return records, named, why


def _as_recorded(holder: Holder, master: int, state: StateFile[Record], record: Record,
                 journals: dict[str, list[int]]) -> Session:
    """A session as its (believed) record says. Takes `master` and `state` on success only."""
    record.child_pid = believed_child(record.child_pid)
    ring = Ring(state.size, holder.registry.budget.for_owner(record.owner), state)
    try:
        # A read may have been in flight when the last holder died: a drain's, or (in
        # `handing_off`) the sweep's, or a drain's last read as the handoff stopped it.
        in_flight = not record.clean and record.state in ("draining", "handing_off")
        trimmed = ring.adopt(record.capacity, record.origin, record.total_at_layout,
                             record.length_at_layout, in_flight, record.saturated,
                             record.consumed, record.dropped_base)
    except BaseException:
        ring.release()  # (and the state file with it)
        raise
    session = Session.adopted(master, ring, record, holder.instance, holder.store,
                              holder.registry.private_dir,
                              _journal(holder, record, journals.pop(record.token, [])))
    if in_flight:
        session.gap_totals.append(ring.total)  # one read's bytes may be missing after here
    if session.journal_from is not None and session.journal is None:
        # Its app journals, and the store did not keep the journal: what it recorded is
        # missing here (and a copy of it cut short left bytes that cannot be told whole).
        # A resume starts a journal afresh.
        if session.journal_copying:
            ring.restart(session.journal_from)
        session.gap_totals.append(ring.total)
        session.journal_from, session.journal_copying = None, False
    session.log("adopted", state=record.state, buffered=ring.size, unclean=not record.clean,
                trimmed=trimmed or None, replay_gap_at=session.replay_gap_at)
    return session


def _unrecorded(holder: Holder, master: int, named: tuple[str, str] | None,
                why: str) -> Session:
    """A session with no record to believe: the terminal, a fresh ring and a gap at its
    start, its name if a record said one, its foreground process group as its child. If
    not even a ring can be had (out of memory or fds), it has none: it drains all the
    same, counting what it cannot keep as dropped."""
    token = uuid.uuid4().hex
    if named is None:
        number = _quietly(pty_number, master)
        named = (LOST_OWNER, f"lost-pts{number if number is not None else 'x'}-{token[:8]}")
    child = _quietly(os.tcgetpgrp, master)
    child = child if child is not None and child > 0 else None
    now = time.time()
    record = Record(token=token, owner=named[0], id=named[1], label=LOST_LABEL,
                    child_pid=child, child_start_time=_quietly(process_start_time, child)
                    if child else None, state="draining", deposited_at=now, state_since=now,
                    gap_totals=[0], instance=holder.instance, record_lost=True)
    ring = holder.registry.new_ring(named[0])
    session = Session.adopted(master, ring, record, holder.instance, holder.store,
                              holder.registry.private_dir)
    session.log("adopted", state="draining", reason=f"without its record: {why}",
                replay_gap_at=0)
    return session


async def _store_apart(holder: Holder, group: str, found: list[_Found]) -> None:
    """Store each session of `group` under a name of its own (a new token), then remove the
    group. Each is stored under its new name before its record says that name, and the
    group goes only once every one is: a kill at any point leaves a whole copy of each
    terminal (two copies are made one again by the next adoption, `_one_per_terminal`).
    If a store fails, the group stays stored, and the sessions keep its name."""
    for each in found:
        session = each.session
        token = uuid.uuid4().hex
        try:
            await holder.store.store(session_name(token), [session.fd, session.ring.state.fd])
        except StoreError as exc:
            session.log("fd_store", error=str(exc), reason=f"not stored apart from {group}, "
                        "which stays stored")
            return
        session.token, session.store_name = token, session_name(token)
        session.persist()
        each.moved = True
        _restore_journal(holder, session)
    holder.store.remove(group)


def _restore_journal(holder: Holder, session: Session) -> None:
    """A session stored under a new name has its journal stored under it too (so that its
    removal, by that name, finds it), and the old entry removed."""
    file = session.journal
    if file is None:
        return
    new = journal_name(session.token)
    if holder.store.store_nowait(new, [file.fd]):
        if file.store_name is not None:
            holder.store.remove(file.store_name)
        file.store_name = new


def _journal(holder: Holder, record: Record, fds: list[int]) -> JournalFile | None:
    """The journal file the store kept for a session whose app journals, if it is the one
    its record describes (else it is lost: `journal.end` marks a gap where it was)."""
    if record.journal_from is None or record.journal_capacity <= 0 or len(fds) != 1:
        close_fds(fds)
        if fds:
            holder.store.remove(journal_name(record.token))
        return None
    try:
        return JournalFile.adopt(fds[0], record.journal_capacity,
                                 holder.registry.budget.for_owner(record.owner),
                                 journal_name(record.token))
    except (OSError, ValueError) as exc:
        log("adopt_refused", name=journal_name(record.token), reason=f"its journal: {exc}")
        holder.store.remove(journal_name(record.token))
        return None


# --- across groups --------------------------------------------------------------------------


def _one_per_terminal(holder: Holder, found: list[_Found], report: Adoption) -> list[_Found]:
    """One session per terminal: of two copies of one terminal, the believed one is kept
    (else the newer deposit), and the other copy is closed (the terminal stays open through
    the one kept) and taken out of the store, unless its group still holds another
    session, or a master held back (then the group stays, and goes when that one ends)."""
    kept: dict[tuple[int, int], _Found] = {}
    dropped: list[_Found] = []
    for each in found:
        terminal = each.session.terminal
        other = kept.get(terminal) if terminal is not None else None
        if terminal is None:
            kept[(-2, id(each))] = each
        elif other is None:
            kept[terminal] = each
        else:
            keep, drop = sorted((other, each), key=lambda f: (f.believed,
                                                              f.session.deposited_at),
                                reverse=True)
            kept[terminal] = keep
            dropped.append(drop)
    result = [each for each in found if any(each is k for k in kept.values())]
    needed = {f.session.store_name for f in result} | {group for group, _ in report.held_back}
    for drop in dropped:
        gone = drop.session
        if gone.store_name not in needed:
            holder.store.remove(gone.store_name)
        gone.store_name = ""  # (its copy is closed; the store's, if kept, is another's)
        gone.close()
        report.refused += 1
        survivor = next(k for k in kept.values() if k.session.terminal == gone.terminal)
        log("adopt_refused", name=drop.group, session=gone.name,
            reason=f"another copy of the terminal of {survivor.session.name}")
    return result


def _names_apart(found: list[_Found], report: Adoption) -> None:
    """Two sessions under one owner/id: the believed one keeps the name (of two, the newer
    deposit), the other is renamed `<id>.dup-<token>` (both stay, both are listed)."""
    by_key: dict[tuple[str, str], list[_Found]] = {}
    for each in found:
        by_key.setdefault(each.session.key, []).append(each)
    for claims in by_key.values():
        claims.sort(key=lambda f: (f.believed, f.session.deposited_at), reverse=True)
        sessions = [f.session for f in claims]
        for older in sessions[1:]:
            old_name = older.name
            older.id = f"{older.id[:110]}.dup-{older.token[:8]}"
            report.renamed += 1
            log("adopt_renamed", session=older.name, was=old_name,
                reason=f"{sessions[0].name} was deposited later under the same name")


# --- resuming -------------------------------------------------------------------------------


# How long a session adopted without its record waits before the holder reads it: an app
# whose custody outlived the last holder (it reads the terminal itself) takes it back
# within about a second (escrow_client.custody); reading before would make two readers.
UNRECORDED_GRACE = 2.0


def _resume(holder: Holder, session: Session) -> None:
    if session.state == "draining" and session.record_lost:
        holder.nursery.start_soon(_drain_after_grace, holder, session)
    elif session.state == "draining":
        session.start_drain(holder.nursery, "adopted")
    elif session.state == "exited":
        session.hung_up = True
    elif session.state == "handing_off":
        holder.nursery.start_soon(_await_adopted_ack, holder, session)
    elif session.state == "held":
        holder.nursery.start_soon(watch_custodian, holder, session)


async def _drain_after_grace(holder: Holder, session: Session) -> None:
    await trio.sleep(UNRECORDED_GRACE)
    if (holder.registry.live.get(session.key) is session and session.state == "draining"
            and session.fd >= 0 and not session.has_drain()):
        session.start_drain(holder.nursery, "adopted without its record; not taken back")


async def _take_up_later(holder: Holder, report: Adoption) -> None:
    """Masters held back at adoption (no state file could be made for them then): tried
    again now and then until each is a session, listed and drained. Never closed."""
    pause = 1.0
    while report.held_back:
        await trio.sleep(pause)
        pause = min(pause * 2, 60.0)
        for group, master in list(report.held_back):
            try:
                session = _unrecorded(holder, master, None, "held back at adoption")
            except Exception:
                continue
            session.store_name = group
            report.held_back.remove((group, master))
            report.adopted += 1
            report.without_record += 1
            holder.registry.live[session.key] = session
            try:
                session.persist()
                session.start_drain(holder.nursery, "taken up after being held back")
            except Exception as exc:
                session.log("internal_error", where="adoption", error=repr(exc))


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


# --- helpers --------------------------------------------------------------------------------


def _refuse(holder: Holder, name: str, fds: list[int], why: str, report: Adoption,
            remove: bool = True, **fields: object) -> None:
    close_fds(fds)
    if remove:
        holder.store.remove(name)
    report.refused += 1
    log("adopt_refused", name=name, reason=why, **fields)


def _sort(fds: list[int]) -> tuple[list[int], list[int], list[int]]:
    """PTY masters, regular files (state files, maybe), and the rest."""
    masters, files, others = [], [], []
    for fd in fds:
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            others.append(fd)
            continue
        if stat.S_ISCHR(mode) and _quietly(is_pty_master, fd):
            masters.append(fd)
        elif stat.S_ISREG(mode):
            files.append(fd)
        else:
            others.append(fd)
    return masters, files, others


def _name_of(record: Record) -> tuple[str, str] | None:
    """The owner/id a record says, if they are names at all."""
    bare = Record(token=record.token, owner=record.owner, id=record.id)
    return (record.owner, record.id) if record_doubt(bare, 0, 0) is None else None


def _quietly(call: Callable[..., T], *args: object) -> T | None:
    """`call(*args)`, or None if it raised: what cannot be told is not told."""
    try:
        return call(*args)
    except Exception:
        return None


async def claim_unrecorded(holder: Holder, conn: Connection, sid: str,
                           terminal: tuple[int, int] | None) -> Session | None:
    """A deposit of a terminal this holder took up without its record, from an app that
    has that terminal (it sent it): the app's custody outlived the last holder, and it is
    reading the terminal itself. The session becomes that app's again, under its name,
    held by this connection, and the holder stops reading it at once (two readers would
    split the output). None if the deposit is not such a claim, or the session changed
    meanwhile (then it drains as before)."""
    registry = holder.registry
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
            session.start_drain(holder.nursery, "a claim of it fell through")
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
