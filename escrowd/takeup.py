"""Taking up one stored group: from the fds an earlier holder left in the store under one
name to the session each PTY master among them becomes (escrowd.adoption has the whole
story, and pairs masters with records).

`sort_fds` tells the group's fds apart: PTY masters, regular files (state files, maybe),
and the rest, which adoption closes unread (a PTY slave would give the holder the user's
keystrokes). `believed_records` keeps the state files whose record can be believed for
the group's token (escrowd.bounds holds every field to its bounds) and closes the others,
remembering an owner/id any record of that token says. A master with a believed record
becomes the session `as_recorded` says, its ring adopted as the record lays it out (and
its journal file, if the store kept the one the record describes); a master with none
becomes one `unrecorded`, with only what can be proven: the terminal, a fresh ring whose
replay is lost from its start (a gap at 0), its foreground process group as its child,
and a name that says its record is lost, unless a record still said one.
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from escrow_client.fdpass import close_fds
from escrow_client.liveness import process_start_time
from escrow_client.platform import is_pty_master, pty_number

from .bounds import believed_child, record_doubt
from .fdstore import FdStore, journal_name, session_name
from .journal import JournalFile
from .log import log
from .registry import Registry
from .ring import Ring
from .session import Session
from .statefile import CorruptState, Record, StateFile, newest_record

T = TypeVar("T")
LOST_OWNER = "escrowd"  # the owner of a session adopted with no record that names one
LOST_LABEL = "adopted without its record: its replay from before is lost"


class HolderParts(Protocol):
    """What a session is taken up into: the holder's instance, its fd store and its
    registry (escrowd.server.Holder)."""

    instance: str
    store: FdStore
    registry: Registry


@dataclass
class Found:
    """A session taken up from one stored group, and how it was."""

    session: Session
    believed: bool  # its record was believed
    group: str  # the name it was stored under
    moved: bool = False  # stored again under its own (new) name
    others: list[int] = field(default_factory=list)


def sort_fds(fds: list[int]) -> tuple[list[int], list[int], list[int]]:
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


def believed_records(files: list[int], token: str | None) -> tuple[
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
            # A record believed whole has names that are names; else they are checked alone.
            named = named or ((record.owner, record.id) if doubt is None else _name_of(record))
        if doubt is not None or record is None:
            why = doubt or why
            state.close()
            continue
        records.append((state, record))
    return records, named, why


def as_recorded(holder: HolderParts, master: int, state: StateFile[Record], record: Record,
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
    ring.modes.restore(record.modes, record.modes_pending, record.modes_at)
    session = Session.adopted(master, ring, record, holder.instance, holder.store,
                              holder.registry.private_dir,
                              _journal_of(holder, record, journals.pop(record.token, [])))
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


def unrecorded(holder: HolderParts, master: int, named: tuple[str, str] | None,
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


def _journal_of(holder: HolderParts, record: Record, fds: list[int]) -> JournalFile | None:
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
