"""The holder's side of a journal (DESIGN §12): an app that holds a session records what it
reads into the session's ring, and the holder takes the ring over when custody ends.

The rule that makes the hand-over lose and duplicate nothing: the app writes the ring only
while it holds custody, the holder only once custody has ended (a session's drain starts
there, `Session.start_drain`). Every byte comes off the terminal once, read either by the
app (and recorded) or by the holder (and drained), so the ring has each byte once, in the
order the terminal gave them. The holder's counters are stale while the app writes; `end`
takes the app's.

`journal_from` and `journal_ranges` (in the session's record, so they survive a holder
restart) say which bytes the app recorded: `replay_journaled` in a handoff counts them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from escrow_client import protocol

if TYPE_CHECKING:
    from .session import Session


def grant(session: Session) -> protocol.Journal | None:
    """Lay the ring out for an app to write (all the storage the budget grants, since the
    app cannot grow it) and say where it writes; None if the ring has no storage at all.
    The holder must not be draining the session."""
    ring = session.ring
    if session.journal_from is None:
        ring.grow_fully()
    if ring.capacity == 0:
        return None
    total = ring.state.total  # ours, or the app's if it is writing already (a resume)
    return protocol.Journal(capacity=ring.capacity, total=total, position=ring.position(total))


def begin(session: Session) -> None:
    """The app holds the session and writes its ring from now on."""
    if session.journal_from is None:
        session.journal_from = session.ring.total
        session.persist()


def end(session: Session) -> None:
    """Custody ended: the ring is the holder's again, with what the app recorded in it. An
    app killed in the middle of a write leaves a spot where that write's bytes are missing
    (a gap), and the oldest bytes it may have overwritten are dropped; one killed with a
    read in flight, a gap (what it read may not have reached the ring)."""
    start = session.journal_from
    if start is None:
        return
    ring = session.ring
    torn, reading = ring.state.writing > ring.state.total, ring.state.reading
    dropped = ring.resync()
    if torn or reading:
        session.gap_totals.append(ring.total)
    session.journal_from = None
    if ring.total > start:
        session.journal_ranges.append((start, ring.total))
    journaled(session, ring.total - ring.size)  # forgets ranges no longer in the ring
    session.persist()
    session.log("journal_end", recorded=ring.total - start, torn_write=torn,
                read_in_flight=reading or None, dropped=dropped or None)


def journaled(session: Session, replay_from: int) -> int:
    """How many bytes of a replay that starts at byte number `replay_from` the app
    recorded. Ranges wholly before the ring's oldest byte are forgotten."""
    ranges = [(a, b) for a, b in session.journal_ranges if b > replay_from]
    if len(ranges) != len(session.journal_ranges):
        session.journal_ranges = ranges
    return sum(b - max(a, replay_from) for a, b in ranges)
