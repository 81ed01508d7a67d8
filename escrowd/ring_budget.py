"""What ring storage is drawn from: the holder-wide `RingBudget`, and an owner's share of it.

Every byte of ring storage (escrowd.ring) is granted here, so total replay memory is
bounded however many sessions there are: no ring grows past its fair share of the total, and
no owner's rings past `--owner-ring-bytes`. Storage already granted is kept; a ring gives
its storage back when it is released.
"""

from __future__ import annotations

from typing import Protocol


class Budget(Protocol):
    """What a ring draws its storage from: the holder's `RingBudget`, or an owner's share
    of it (`OwnerShare`)."""

    rings: int

    def grant(self, wanted: int, current: int = 0) -> int: ...
    def take(self, amount: int) -> None: ...
    def give_back(self, amount: int) -> None: ...


class RingBudget:
    """The holder-wide cap on ring storage, shared by every session.

    No ring grows past its fair share (the total over the rings alive), so that when many
    sessions flood at once the first ones to ask do not take everything and leave the
    rest with no replay at all; and no owner's rings take more than `per_owner` in all
    (`for_owner`), so that one app with many sessions cannot leave another's session with
    none. Storage already granted is kept.
    """

    __slots__ = ("total", "used", "rings", "per_owner", "owners")

    def __init__(self, total_bytes: int, per_owner: int | None = None) -> None:
        self.total = total_bytes
        self.used = 0
        self.rings = 0
        self.per_owner = total_bytes if per_owner is None else per_owner
        self.owners: dict[str, int] = {}  # storage granted, by owner

    def for_owner(self, owner: str) -> OwnerShare:
        return OwnerShare(self, owner)

    def grant(self, wanted: int, current: int = 0) -> int:
        fair = self.total // max(1, self.rings)
        granted = max(0, min(wanted, self.total - self.used, fair - current))
        self.used += granted
        return granted

    def take(self, amount: int) -> None:
        """Storage an adopted ring already has: counted, even past the cap (it was within
        the cap of the holder that granted it)."""
        self.used += amount

    def give_back(self, amount: int) -> None:
        self.used -= amount


class OwnerShare:
    """One owner's share of a `RingBudget`: what it grants, it counts for that owner too,
    and it grants no more than the owner's room under `per_owner`."""

    __slots__ = ("pool", "owner")

    def __init__(self, pool: RingBudget, owner: str) -> None:
        self.pool, self.owner = pool, owner

    @property
    def rings(self) -> int:
        return self.pool.rings

    @rings.setter
    def rings(self, value: int) -> None:
        self.pool.rings = value

    def grant(self, wanted: int, current: int = 0) -> int:
        room = self.pool.per_owner - self.pool.owners.get(self.owner, 0)
        granted = self.pool.grant(min(wanted, max(0, room)), current)
        self._count(granted)
        return granted

    def take(self, amount: int) -> None:
        self.pool.take(amount)
        self._count(amount)

    def give_back(self, amount: int) -> None:
        self.pool.give_back(amount)
        self._count(-amount)

    def _count(self, amount: int) -> None:
        left = self.pool.owners.get(self.owner, 0) + amount
        if left:
            self.pool.owners[self.owner] = left
        else:
            self.pool.owners.pop(self.owner, None)
