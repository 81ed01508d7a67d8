"""The replay ring (escrowd.ring), unit by unit, with real pipes.

Every byte goes through a real `os.pipe()`: known bytes are written to the write end and the
ring reads them with `Ring.read_from(read_end, at_most, overwrite)`, exactly as the drain
reads a PTY master. The read end is non-blocking, so a read the ring should not have made
fails with BlockingIOError instead of hanging the test.

The model is simple: in overwrite mode (draining), a ring with enough budget holds the newest
`limit` bytes of everything written and counts the rest, exactly, in `dropped`. In sweep mode
(overwrite=False, just before a handoff) it never evicts: what does not fit stays in the pipe,
in order, for the next reader.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from escrowd.ring import MIN_CAPACITY, Layout, Ring, RingBudget
from escrowd.statefile import MAX_READ, Record, StateFile

PIPE_CHUNK = 32 * 1024  # stays well under the default pipe capacity (64 KiB): writes never block
PLENTY = 1 << 30


@contextmanager
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def stream(n: int, seed: int = 0) -> bytes:
    """`n` bytes that are unlike each other, so any reordering or loss shows."""
    return random.Random(seed).randbytes(n)


def drain(ring: Ring, pipe_ends: tuple[int, int], data: bytes, at_most: int = 1 << 30) -> None:
    """Write `data` through the pipe and let the ring consume all of it (overwrite mode),
    `at_most` bytes per read at most."""
    r, w = pipe_ends
    for start in range(0, len(data), PIPE_CHUNK):
        chunk = data[start : start + PIPE_CHUNK]
        assert os.write(w, chunk) == len(chunk)
        left = len(chunk)
        while left:
            n = ring.read_from(r, min(at_most, left), overwrite=True)
            assert 0 < n <= left
            left -= n


def sweep(ring: Ring, r: int, available: int) -> int:
    """Sweep-mode reads until the ring takes no more (or the pipe is empty); bytes read."""
    taken = 0
    while taken < available:
        n = ring.read_from(r, available - taken, overwrite=False)
        if n == 0:
            break
        taken += n
    return taken


def pending(r: int) -> bytes:
    """Everything still in the pipe."""
    out = bytearray()
    while True:
        try:
            chunk = os.read(r, 1 << 16)
        except BlockingIOError:
            return bytes(out)
        out += chunk


# --- overwrite (draining) ---------------------------------------------------------------------


def test_contents_in_order_across_wrap_around() -> None:
    """Odd-sized writes into a full ring wrap round the end of its storage again and again
    (each read then lands in two regions); the contents stay the newest bytes, in order."""
    ring = Ring(MIN_CAPACITY, RingBudget(PLENTY))
    data = stream(10 * 7001, seed=1)
    with pipe() as ends:
        for start in range(0, len(data), 7001):
            drain(ring, ends, data[start : start + 7001])
            written = data[: start + 7001]
            assert ring.contents() == written[-MIN_CAPACITY:]
            assert ring.dropped == len(written) - len(ring.contents())
    assert ring.capacity == MIN_CAPACITY
    assert ring.size == MIN_CAPACITY


def test_overwrite_keeps_the_newest_limit_bytes() -> None:
    limit = MIN_CAPACITY
    ring = Ring(limit, RingBudget(PLENTY))
    data = stream(100_000, seed=2)
    with pipe() as ends:
        drain(ring, ends, data, at_most=4096)  # the size of a PTY read
        assert pending(ends[0]) == b""
    assert ring.contents() == data[-limit:]
    assert ring.size == limit
    assert ring.dropped == len(data) - limit


def test_overwrite_below_the_limit_drops_nothing() -> None:
    """A ring below its limit, with budget to spare, must grow rather than drop: 30 000 bytes
    into a 64 KiB ring are all kept. (A read bigger than the free space of the current
    storage must not overwrite the oldest bytes while the ring could still grow.)"""
    ring = Ring(64 * 1024, RingBudget(PLENTY))
    data = stream(30_000, seed=3)
    with pipe() as ends:
        drain(ring, ends, data[:10_000])
        drain(ring, ends, data[10_000:])
    assert ring.dropped == 0
    assert ring.contents() == data


def test_overwrite_below_the_limit_drops_nothing_with_pty_sized_reads() -> None:
    """The same, the way the drain really reads a PTY: at most about 4 KiB per read. The
    ring fills its first 16 KiB of storage and the next read straddles the end."""
    ring = Ring(1 << 20, RingBudget(PLENTY))
    data = stream(20_000, seed=4)
    with pipe() as ends:
        drain(ring, ends, data, at_most=4095)
    assert ring.dropped == 0
    assert ring.contents() == data


# --- sweep (before a handoff) ------------------------------------------------------------------


def test_sweep_fills_free_space_only_and_leaves_the_rest_in_order() -> None:
    limit = MIN_CAPACITY
    ring = Ring(limit, RingBudget(PLENTY))
    data = stream(limit + 5000, seed=5)
    with pipe() as (r, w):
        drain(ring, (r, w), data[:10_000])
        os.write(w, data[10_000:])
        taken = sweep(ring, r, len(data) - 10_000)
        assert taken == limit - 10_000
        assert ring.dropped == 0
        assert ring.contents() == data[:limit]  # the oldest bytes are all still there
        assert pending(r) == data[limit:]  # the rest waits, in order, for the next reader


def test_sweep_of_a_full_ring_returns_0_without_reading() -> None:
    limit = MIN_CAPACITY
    ring = Ring(limit, RingBudget(PLENTY))
    data = stream(limit + 300, seed=6)
    with pipe() as (r, w):
        drain(ring, (r, w), data[:limit])
        os.write(w, data[limit:])
        assert ring.read_from(r, 300, overwrite=False) == 0
        assert ring.contents() == data[:limit]
        assert ring.dropped == 0
        assert pending(r) == data[limit:]


def test_sweep_grows_a_full_ring_that_is_below_its_limit() -> None:
    ring = Ring(4 * MIN_CAPACITY, RingBudget(PLENTY))
    data = stream(3 * MIN_CAPACITY, seed=7)
    with pipe() as (r, w):
        drain(ring, (r, w), data[:MIN_CAPACITY])
        assert ring.capacity == MIN_CAPACITY
        os.write(w, data[MIN_CAPACITY:])
        assert sweep(ring, r, len(data) - MIN_CAPACITY) == len(data) - MIN_CAPACITY
    assert ring.contents() == data
    assert ring.dropped == 0


# --- storage: growth, budget, release ----------------------------------------------------------


def test_growth_doubles_up_to_the_limit() -> None:
    limit = 100_000
    budget = RingBudget(PLENTY)
    ring = Ring(limit, budget)
    assert ring.capacity == 0
    seen = []
    with pipe() as ends:
        for i in range(12):
            # Fill exactly what is free, so every growth happens on a full ring.
            free = ring.capacity - ring.size
            drain(ring, ends, stream(free or 1000, seed=100 + i))
            if not seen or seen[-1] != ring.capacity:
                seen.append(ring.capacity)
    assert seen == [MIN_CAPACITY, 2 * MIN_CAPACITY, 4 * MIN_CAPACITY, limit]
    assert budget.used == limit


def test_a_limit_below_the_minimum_capacity_is_the_capacity() -> None:
    ring = Ring(1000, RingBudget(PLENTY))
    data = stream(5000, seed=8)
    with pipe() as ends:
        drain(ring, ends, data)
    assert ring.capacity == 1000
    assert ring.contents() == data[-1000:]
    assert ring.dropped == 4000


def test_growth_is_bounded_by_the_budget() -> None:
    budget = RingBudget(40_000)
    ring = Ring(1 << 20, budget)
    data = stream(200_000, seed=9)
    with pipe() as ends:
        drain(ring, ends, data, at_most=4096)
    assert ring.capacity == 40_000
    assert budget.used == 40_000
    assert ring.contents() == data[-40_000:]
    assert ring.dropped == len(data) - 40_000

    # A second ring on the spent budget gets no storage at all, and still consumes.
    other = Ring(1 << 20, budget)
    with pipe() as ends:
        drain(other, ends, data[:50_000])
        assert pending(ends[0]) == b""
    assert other.capacity == 0
    assert other.contents() == b""
    assert other.dropped == 50_000
    assert budget.used == 40_000


@pytest.mark.parametrize("budget_bytes, limit", [(0, 1 << 20), (PLENTY, 0)],
                         ids=["no_budget", "zero_limit"])
def test_a_ring_without_storage_still_consumes(budget_bytes: int, limit: int) -> None:
    """A child must never block on a full terminal: with no storage, the bytes are read
    and counted as dropped. A sweep, which must never lose a byte, reads nothing."""
    ring = Ring(limit, RingBudget(budget_bytes))
    data = stream(150_000, seed=10)
    with pipe() as (r, w):
        drain(ring, (r, w), data)
        assert pending(r) == b""
        assert ring.dropped == len(data)
        assert ring.size == 0
        assert ring.contents() == b""

        os.write(w, b"kept in the kernel")
        assert ring.read_from(r, 100, overwrite=False) == 0
        assert pending(r) == b"kept in the kernel"


def test_release_returns_the_budget() -> None:
    budget = RingBudget(3 * MIN_CAPACITY)
    first = Ring(1 << 20, budget)
    with pipe() as ends:
        drain(first, ends, stream(100_000, seed=11))
    assert budget.used == 3 * MIN_CAPACITY
    first.release()
    assert budget.used == 0
    assert first.capacity == first.size == 0
    assert first.contents() == b""

    # The storage is there for someone else now.
    second = Ring(1 << 20, budget)
    data = stream(3 * MIN_CAPACITY, seed=12)
    with pipe() as ends:
        drain(second, ends, data[:MIN_CAPACITY])
        drain(second, ends, data[MIN_CAPACITY:2 * MIN_CAPACITY])
        drain(second, ends, data[2 * MIN_CAPACITY:])
    assert second.capacity == 3 * MIN_CAPACITY
    assert second.contents() == data


def test_a_wrapped_ring_that_grows_keeps_its_bytes_in_order() -> None:
    """A ring that wrapped while out of budget (its newest bytes at the start of its
    storage, its oldest at the end) grows once budget is free again: the newest part moves
    up behind the oldest, and the replay stays every held byte, in the order read. Were it
    not moved, the replay would show the oldest bytes, then whatever the new storage held,
    in place of the newest."""
    budget = RingBudget(2 * MIN_CAPACITY)
    other = Ring(1 << 20, budget)  # holds half the budget while `ring` wraps
    ring = Ring(4 * MIN_CAPACITY, budget)
    first, then = stream(20_000, seed=14), stream(3000, seed=15)
    with pipe() as ends:
        drain(other, ends, stream(MIN_CAPACITY, seed=16))
        drain(ring, ends, first, at_most=4096)
        assert ring.capacity == MIN_CAPACITY  # its fair share: no more
        # Wrapped: the next byte goes mid-storage, the oldest held one right after it.
        assert ring.position(ring.total) == len(first) - MIN_CAPACITY
        other.release()
        drain(ring, ends, then)
    assert ring.capacity == 2 * MIN_CAPACITY
    assert ring.contents() == first[-MIN_CAPACITY:] + then, \
        "after growing, the replay is not the held bytes in the order read"
    assert ring.dropped == len(first) - MIN_CAPACITY


def test_read_errors_change_nothing() -> None:
    """EAGAIN (and EIO from a hung-up PTY) propagate with the ring unchanged."""
    ring = Ring(MIN_CAPACITY, RingBudget(PLENTY))
    data = stream(5000, seed=13)
    with pipe() as ends:
        drain(ring, ends, data)
        with pytest.raises(BlockingIOError):
            ring.read_from(ends[0], 100, overwrite=True)
    assert ring.contents() == data
    assert ring.dropped == 0


# --- delivered by a retrieve into custody ---------------------------------------------------


def test_drops_delivered_before_are_not_counted_again() -> None:
    """A retrieve into custody without a journal delivers the replay, drops and all, and
    the ring starts empty (`consume`). Once custody ends it drains a little more: the next
    replay is just that, and nothing is missing at its start. Counted again, the earlier
    drops would make the next app cut the head off a replay that lost nothing
    (`replay_trimmed`) and tell the user output was lost that was not."""
    ring = Ring(MIN_CAPACITY, RingBudget(PLENTY))
    flood, after = stream(50_000, seed=30), b"after custody\r\n"
    with pipe() as ends:
        drain(ring, ends, flood, at_most=4096)
        lost = len(flood) - MIN_CAPACITY
        assert ring.dropped_since_delivery == ring.dropped == lost
        ring.consume()
        assert ring.contents() == b""
        assert ring.dropped_since_delivery == 0, "drops delivered already are still counted"
        drain(ring, ends, after)
        assert ring.contents() == after
        assert ring.dropped_since_delivery == 0, "drops delivered already counted again"
        assert ring.dropped == lost  # what was delivered is not counted as dropped
        # What is lost from here on is counted, and only that.
        more = stream(MIN_CAPACITY + 500, seed=31)
        drain(ring, ends, more)
    assert ring.contents() == (after + more)[-MIN_CAPACITY:]
    assert ring.dropped_since_delivery == len(after) + 500
    assert ring.dropped == lost + len(after) + 500


# --- against a model ---------------------------------------------------------------------------

_LIMITS = st.sampled_from([1, 100, 4096, MIN_CAPACITY - 1, MIN_CAPACITY, 20_000, 50_000, 70_000])
_WRITES = st.lists(
    st.tuples(st.integers(1, 40_000), st.integers(1, 70_000)), min_size=1, max_size=12
)


@settings(max_examples=150, deadline=None)
@given(limit=_LIMITS, writes=_WRITES, seed=st.integers(0, 2**32))
def test_overwrite_matches_the_model(limit: int, writes: list[tuple[int, int]], seed: int) -> None:
    """Random write sizes and read sizes: the ring holds exactly the newest `limit` bytes of
    everything written, and `dropped` is exactly the rest."""
    ring = Ring(limit, RingBudget(PLENTY))
    model = b""
    total = 0
    with pipe() as ends:
        for i, (size, at_most) in enumerate(writes):
            data = stream(size, seed=seed + i)
            drain(ring, ends, data, at_most=at_most)
            total += size
            model = (model + data)[-limit:]
            assert ring.contents() == model
            assert ring.size == len(model)
            assert ring.dropped == total - len(model)


@settings(max_examples=100, deadline=None)
@given(limit=_LIMITS, size=st.integers(1, 60_000), seed=st.integers(0, 2**32))
def test_sweep_matches_the_model(limit: int, size: int, seed: int) -> None:
    """Sweeping alone never evicts: the ring takes the oldest bytes up to its limit and the
    rest stays in the pipe, in order."""
    ring = Ring(limit, RingBudget(PLENTY))
    data = stream(size, seed=seed)
    with pipe() as (r, w):
        os.write(w, data)
        taken = sweep(ring, r, size)
        assert taken == min(size, limit)
        assert ring.contents() == data[:taken]
        assert ring.dropped == 0
        assert pending(r) == data[taken:]


def test_no_ring_grows_past_its_fair_share_of_the_budget() -> None:
    """Incident: with 500 sessions flooding at once under a 4 MiB cap, the first ~100 to
    ask took all of it and the other 400 came back with no replay at all. A ring now grows
    only up to the total over the rings alive."""
    budget = RingBudget(64 * 1024)
    rings = [Ring(64 * 1024, budget) for _ in range(4)]
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        for ring in rings:
            os.write(w, b"x" * 60_000)
            _drain_pipe(ring, r)
        assert [ring.capacity for ring in rings] == [16 * 1024] * 4
        assert budget.used == 64 * 1024
        for ring in rings[:2]:
            ring.release()
        assert budget.rings == 2
        os.write(w, b"y" * 60_000)
        _drain_pipe(rings[2], r)
        assert rings[2].capacity == 32 * 1024  # the fair share is larger now
    finally:
        os.close(r)
        os.close(w)


def _drain_pipe(ring: Ring, fd: int) -> None:
    try:
        while ring.read_from(fd, 60_000, overwrite=True):
            pass
    except BlockingIOError:
        pass


# --- adoption after an unclean stop (docs/design.md §11) --------------------------------


def adopted_copy(ring: Ring, unclean: bool = True) -> tuple[Ring, int]:
    """What a holder started after a SIGKILL makes of `ring`'s state file: a second ring on
    the same file, adopting the layout `ring` last published. Returns it and what it
    dropped."""
    state = StateFile(os.dup(ring.state.fd), Record)
    other = Ring(ring.limit, RingBudget(PLENTY), state)
    layout = ring.layout()
    trimmed = other.adopt(layout["capacity"], layout["origin"], layout["total_at_layout"],
                          layout["length_at_layout"], unclean, layout["saturated"])
    return other, trimmed


def test_an_unclean_stop_drops_nothing_from_a_ring_that_could_still_grow() -> None:
    """Incident pinned: a holder adopting after a SIGKILL dropped up to 8 KiB of the oldest
    replay of any ring within a read of its current storage (12 KiB in 16 KiB), though such
    a ring grows before it reads and so never overwrites: the replay of every draining
    session lost its start at every crash. Only a ring that could grow no more may have
    been overwritten by the read in flight."""
    ring = Ring(1 << 20, RingBudget(PLENTY))
    data = stream(12_000, seed=20)
    with pipe() as ends:
        drain(ring, ends, data, at_most=4096)
    assert ring.capacity == MIN_CAPACITY and not ring.saturated
    other, trimmed = adopted_copy(ring)
    assert trimmed == 0
    assert other.contents() == data and other.dropped == 0


def test_a_ring_that_can_grow_no_more_says_so_before_it_overwrites() -> None:
    """At its limit, or out of budget, the layout says `saturated` before the first read
    that may overwrite; a holder adopting it after an unclean stop drops the oldest bytes
    the read in flight may have overwritten (and a clean stop drops nothing)."""
    layouts: list[Layout] = []
    for ring in (Ring(MIN_CAPACITY, RingBudget(PLENTY)), Ring(1 << 20, RingBudget(20_000))):
        ring.on_layout = lambda ring=ring: layouts.append(ring.layout())  # type: ignore[misc]
        with pipe() as ends:
            drain(ring, ends, stream(60_000, seed=21), at_most=4096)
        assert ring.saturated and layouts[-1]["saturated"]
        held = ring.size
        other, trimmed = adopted_copy(ring)
        assert trimmed == min(held, held + MAX_READ - ring.capacity) > 0
        assert other.contents() == ring.contents()[trimmed:]
        clean, none = adopted_copy(ring, unclean=False)
        assert none == 0 and clean.contents() == ring.contents()
