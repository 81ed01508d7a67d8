"""Every session the holder knows about: the live ones, and tombstones of the ended ones.

A tombstone (`handed_off`, `released`, `expired`) keeps a snapshot of the session so that a
question about it gets a true answer for a while. When tombstones are evicted (oldest first,
past `max_tombstones`) the answer becomes `unknown`, never something else.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from escrow_client.liveness import process_alive
from escrow_client.protocol import SessionInfo

from .fdstore import FdStore
from .ring import Ring, RingBudget
from .session import Session
from .statefile import Record, StateFile

Key = tuple[str, str]
Terminal = tuple[int, int]  # platform.terminal_identity: (devpts instance, pts number)


class RegistryError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Registry:
    """Resource handling: the live sessions' fds are the registry's (through each Session);
    `bury` closes them and takes them out of the fd store (`store`) too."""

    def __init__(
        self, max_sessions: int, ring_bytes: int, total_ring_bytes: int, max_tombstones: int,
        store: FdStore | None = None, private_dir: str | None = None,
        max_sessions_per_owner: int | None = None, owner_ring_bytes: int | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_per_owner = max_sessions if max_sessions_per_owner is None else (
            max_sessions_per_owner)
        self.ring_bytes = ring_bytes
        self.budget = RingBudget(total_ring_bytes, owner_ring_bytes)
        self.max_tombstones = max_tombstones
        self.store = store if store is not None else FdStore(None)
        self.private_dir = private_dir  # where a state file lives where there is no memfd
        self.live: dict[Key, Session] = {}
        # A tombstone keeps the child's start time too, so `child_alive` stays a fact about
        # now rather than a snapshot from when the session ended.
        self.tombstones: OrderedDict[Key, tuple[SessionInfo, float | None]] = OrderedDict()
        self.handoffs = 0  # completed (acked) handoffs, for holder_status
        self.handoffs_failed = 0  # handoffs put back: send failed, no ack, interrupted

    def check_room(self, key: Key, terminal: Terminal | None = None) -> None:
        """Raise `exists` or `limit` if a session with `key` (on that terminal) cannot be
        added now. One terminal under two ids would have two readers splitting its output."""
        if key in self.live:
            raise RegistryError("exists", f"a live session {key[0]}/{key[1]} already exists")
        if terminal is not None:
            for other in self.live.values():
                if other.terminal == terminal:
                    raise RegistryError(
                        "exists", f"that terminal is already escrowed as {other.name}"
                    )
        if len(self.live) >= self.max_sessions:
            raise RegistryError(
                "limit", f"the holder is at its limit of {self.max_sessions} session(s)"
            )
        if sum(1 for k in self.live if k[0] == key[0]) >= self.max_per_owner:
            raise RegistryError(
                "limit", f"{key[0]} holds {self.max_per_owner} session(s), the most one owner "
                "may (--max-sessions-per-owner)")

    def new_ring(self, owner: str = "") -> Ring:
        """A ring in a new state file of its own, drawing on `owner`'s share of the
        budget."""
        state = StateFile.create(Record, self.ring_bytes, "session", self.private_dir)
        return Ring(self.ring_bytes, self.budget.for_owner(owner), state)

    def add(self, session: Session) -> None:
        self.check_room(session.key)
        self.tombstones.pop(session.key, None)  # a relaunched app reuses its ids
        self.live[session.key] = session

    def rename(self, session: Session, key: Key) -> None:
        """File a live session under another owner/id (free: `check_room` first)."""
        assert self.live.get(session.key) is session and key not in self.live
        del self.live[session.key]
        session.owner, session.id = key
        self.tombstones.pop(key, None)
        self.live[key] = session

    def get(self, owner: str, sid: str) -> Session | None:
        return self.live.get((owner, sid))

    def tombstone(self, owner: str, sid: str) -> SessionInfo | None:
        entry = self.tombstones.get((owner, sid))
        return None if entry is None else _fresh(entry)

    def discard(self, session: Session) -> None:
        """Take back a session that was never answered `deposited` (its fds could not be
        stored): no tombstone, as if it had never come."""
        assert self.live.get(session.key) is session
        del self.live[session.key]
        self.store.remove(session.store_name)
        session.close()

    def bury(self, session: Session, state: str, reason: str, close: bool = True) -> None:
        """End a live session: close the holder's copy (and the store's) and keep a
        tombstone. The drain must have been stopped first. With `close` False the caller
        lets go of the copies itself, soon, with `let_go` (a handoff answers the app
        first)."""
        assert self.live.get(session.key) is session, "bury only the live session itself"
        info = session.info(liveness=False)  # (a tombstone's is asked afresh: `_fresh`)
        # The state file says it ended before the store is told to drop it: a holder that
        # finds it stored anyway (the removal did not get out) knows not to adopt it.
        session.set_state(state, reason)
        if close:
            self.let_go(session)
        info.state = state  # type: ignore[assignment]
        info.state_since = session.state_since
        info.buffered_bytes = 0
        info.custodian_pid = None
        info.meta = {}  # tombstones are many and long-lived; keep them small
        del self.live[session.key]
        self.tombstones[session.key] = (info, session.child_start_time)
        while len(self.tombstones) > self.max_tombstones:
            self.tombstones.popitem(last=False)

    def let_go(self, session: Session) -> None:
        """Close a buried session's copies: the holder's, and the store's."""
        self.store.remove(session.store_name)
        session.close()

    def sessions(self, owner: str | None) -> list[SessionInfo]:
        """Live sessions and tombstones of `owner` (every owner if None). One session that
        cannot be described (a liveness question that failed, say) is listed without
        `child_alive`, and never keeps the others from being listed."""
        infos = [_info(s) for s in self.live.values()
                 if owner in (None, s.owner) and not s.storing]
        infos += [_fresh(t) for t in self.tombstones.values() if owner in (None, t[0].owner)]
        return infos

    def count_by_state(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for session in self.live.values():
            counts[session.state] = counts.get(session.state, 0) + 1
        for tomb, _ in self.tombstones.values():
            counts[tomb.state] = counts.get(tomb.state, 0) + 1
        return counts


def _info(session: Session) -> SessionInfo:
    try:
        return session.info()
    except OSError:
        raise  # out of fds: the caller answers `limit`
    except Exception as exc:
        session.log("internal_error", where="list", error=repr(exc))
        return session.info(liveness=False)


def _fresh(entry: tuple[SessionInfo, float | None]) -> SessionInfo:
    info, start_time = entry
    return msgspec.structs.replace(
        info, child_alive=process_alive(info.child_pid, start_time)
    )
