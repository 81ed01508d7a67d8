"""Ring.append (the journal's copy at custody end, the sweep's stored bytes): whatever the
ring's capacity, however large each piece, the ring holds exactly the newest bytes.

A ring's capacity is its grant from the pool, which may be the pool's small remainder, far
under one 8 KiB chunk of an append: such a chunk wrapped over its own new bytes, and wrote
past the ring's capacity.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from escrowd.ring import Ring, RingBudget


def stream(size: int, seed: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(size))


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 20_000),
       pieces=st.lists(st.integers(0, 20_000), min_size=1, max_size=6),
       seed=st.integers(0, 250))
def test_any_appends_to_a_ring_of_any_capacity_leave_the_newest_bytes(
    budget: int, pieces: list[int], seed: int
) -> None:
    ring = Ring(1 << 20, RingBudget(budget))
    try:
        written = b""
        for i, size in enumerate(pieces):
            data = stream(size, seed + i)
            ring.append(memoryview(data))
            written += data
        held = min(len(written), ring.capacity)
        assert ring.size == held
        assert ring.contents() == written[len(written) - held:]
        assert ring.total == len(written)
        assert ring.dropped == len(written) - held
    finally:
        ring.release()


def test_one_append_larger_than_a_small_ring() -> None:
    """The reviewer's case, by hand: 100 bytes, then 10,240, into a ring of 1,000."""
    ring = Ring(1 << 20, RingBudget(1000))
    try:
        data = bytes(range(256)) * 40
        ring.append(memoryview(b"A" * 100))
        ring.append(memoryview(data))
        assert ring.contents() == data[-ring.capacity:]
    finally:
        ring.release()
