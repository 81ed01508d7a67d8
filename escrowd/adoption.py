"""Adoption: a holder that starts with stored fds takes up what an earlier holder left
(docs/design.md §11).

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
  its app takes it back under the app's name (escrowd.resume).
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

Sessions resume by their recorded state (escrowd.resume):
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
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import trio

from escrow_client.fdpass import close_fds
from escrow_client.protocol import TOMBSTONE_STATES

from .bounds import holder_record_doubt
from .config import Config
from .fdstore import (
    HOLDER_NAME,
    JOURNAL_PREFIX,
    SESSION_PREFIX,
    StoreError,
    journal_name,
    session_name,
)
from .log import log
from .resume import resume
from .session import Session
from .statefile import CorruptState, HolderRecord, StateFile
from .takeup import Found, HolderParts, as_recorded, believed_records, sort_fds, unrecorded


class Adopter(HolderParts, Protocol):
    """The holder that adopts (escrowd.server.Holder): what sessions are taken up into,
    the nursery they resume in, and the config their waits take deadlines from."""

    config: Config

    @property
    def nursery(self) -> trio.Nursery: ...


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


async def adopt(holder: Adopter, stored: dict[str, list[int]]) -> Adoption:
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
    found: list[Found] = []
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
            resume(session, holder.registry, holder.config, holder.nursery)
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


def _holder_state(holder: Adopter, fds: list[int], report: Adoption,
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


async def _take_up(holder: Adopter, name: str, fds: list[int], journals: dict[str, list[int]],
                   report: Adoption) -> list[Found]:
    """The sessions in one stored group (see the module's docstring). Every fd of the
    group ends up owned by a session, held back, or closed: never two of these."""
    token = name[len(SESSION_PREFIX):] if name.startswith(SESSION_PREFIX) else None
    masters, files, others = sort_fds(fds)
    if not masters:
        _refuse(holder, name, fds, "no PTY master: " + (
            f"{len(others)} fd(s) of another kind (not a PTY master: a PTY slave would give "
            "the holder the user's keystrokes)" if others else "a state file alone"), report)
        return []
    if others:
        _refuse(holder, name, others, f"{len(others)} fd(s) that are not a PTY master nor "
                "a state file (a PTY slave would give the holder the user's keystrokes)",
                report, remove=False)
    records, named, why = believed_records(files, token)
    found: list[Found] = []
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
                session = as_recorded(holder, master, state, record, journals)
                found.append(Found(session, True, name))
                continue
            except Exception as exc:  # taken up all the same, with what can be proven
                why = f"its record could not be taken up: {exc!r}"
        try:
            session = unrecorded(holder, master, named, why)
            session.store_name = name  # (until it is stored apart under its own)
            found.append(Found(session, False, name))
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


async def _take_up_later(holder: Adopter, report: Adoption) -> None:
    """Masters held back at adoption (no state file could be made for them then): tried
    again now and then until each is a session, listed and drained. Never closed."""
    pause = 1.0
    while report.held_back:
        await trio.sleep(pause)
        pause = min(pause * 2, 60.0)
        for group, master in list(report.held_back):
            try:
                session = unrecorded(holder, master, None, "held back at adoption")
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


async def _store_apart(holder: Adopter, group: str, found: list[Found]) -> None:
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


def _restore_journal(holder: Adopter, session: Session) -> None:
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


# --- across groups --------------------------------------------------------------------------


def _one_per_terminal(holder: Adopter, found: list[Found], report: Adoption) -> list[Found]:
    """One session per terminal: of two copies of one terminal, the believed one is kept
    (else the newer deposit), and the other copy is closed (the terminal stays open through
    the one kept) and taken out of the store, unless its group still holds another
    session, or a master held back (then the group stays, and goes when that one ends)."""
    kept: dict[tuple[int, int], Found] = {}
    dropped: list[Found] = []
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
    kept_ids = {id(k) for k in kept.values()}  # (by identity: a Found compares by value)
    result = [each for each in found if id(each) in kept_ids]
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


def _names_apart(found: list[Found], report: Adoption) -> None:
    """Two sessions under one owner/id: the believed one keeps the name (of two, the newer
    deposit), the other is renamed `<id>.dup-<token>` (both stay, both are listed)."""
    by_key: dict[tuple[str, str], list[Found]] = {}
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


# --- helpers --------------------------------------------------------------------------------


def _refuse(holder: Adopter, name: str, fds: list[int], why: str, report: Adoption,
            remove: bool = True, **fields: object) -> None:
    close_fds(fds)
    if remove:
        holder.store.remove(name)
    report.refused += 1
    log("adopt_refused", name=name, reason=why, **fields)


