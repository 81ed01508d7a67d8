"""The terminal modes a replay starts in (escrowd.modes, escrowd.ring_modes; docs/design.md §12).

The scanner, unit by unit: each sequence sets what a terminal sets, the resets reset what
theirs do, what is not a mode change changes nothing. Properties (hypothesis): a stream cut
anywhere, in any number of pieces, gives the state it gives whole; arbitrary bytes never
raise and leave a bounded state that a record can keep; a preamble puts a fresh terminal in
exactly the modes it was made from.

Then a real ring, fed through a real pipe in reads of every size: whatever it wrapped over,
delivered, grew past or skipped, the modes it says are in force at its oldest byte are those
of the stream up to that byte, read whole; and a record of them restores them in a holder
that adopts the ring.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ring import pipe

from escrowd.modes import LONGEST, MODE_NAMES, STACK, Modes, Scanner
from escrowd.ring import MIN_CAPACITY, Ring, RingBudget
from escrowd.ring_modes import RingModes
from escrowd.statefile import Record, StateFile

E = b"\x1b"
CSI = b"\x1b["


def scanned(*pieces: bytes) -> Scanner:
    scanner = Scanner()
    for piece in pieces:
        scanner.feed(piece)
    return scanner


def modes(*pieces: bytes) -> Modes:
    return scanned(*pieces).modes


# --- each sequence ------------------------------------------------------------------------


VIM_START = (CSI + b"?1049h" + CSI + b"22;0;0t" + CSI + b"?1h" + E + b"=" + CSI + b"?2004h"
             + CSI + b"?1004h" + CSI + b"?25l" + CSI + b"1;24r" + CSI + b"H" + CSI + b"2J")


def test_a_full_screen_programs_start_sets_its_modes() -> None:
    m = modes(b"$ vim notes.txt\r\n", VIM_START, b"~\r\n~\r\n")
    assert (m.alternate, m.cursor, m.cursor_keys, m.keypad, m.bracketed_paste,
            m.focus_events, m.margins) == (1049, False, True, True, True, True, (1, 24))
    preamble, names = m.preamble()
    assert names == ["alternate_screen", "scroll_region", "cursor_keys", "keypad",
                     "focus_events", "bracketed_paste", "cursor_hidden"]
    assert preamble == (CSI + b"?1049h" + CSI + b"1;24r" + CSI + b"?1h" + E + b"="
                        + CSI + b"?1004h" + CSI + b"?2004h" + CSI + b"?25l")


def test_its_exit_sets_them_back() -> None:
    exit_ = (CSI + b"r" + CSI + b"?25h" + CSI + b"?1004l" + CSI + b"?2004l" + CSI + b"?1l"
             + E + b">" + CSI + b"?1049l")
    assert modes(VIM_START, exit_).preamble() == (b"", [])


def test_modes_set_together_in_one_sequence() -> None:
    m = modes(CSI + b"?1049;25;1000;1006h" + CSI + b"?1049;1000;1006;;7l")
    assert (m.alternate, m.mouse, m.encoding, m.autowrap, m.cursor) == (0, 0, 0, False, True)
    m = modes(CSI + b"?1000;1006;6h")
    assert (m.mouse, m.encoding, m.origin) == (1000, 1006, True)


def test_the_alternate_screen_is_left_by_any_of_its_modes() -> None:
    for enter in (47, 1047, 1049):
        m = modes(CSI + b"?%dh" % enter)
        assert m.alternate == enter and m.preamble()[0] == CSI + b"?%dh" % enter
        assert modes(CSI + b"?%dh" % enter, CSI + b"?47l").alternate == 0
    assert modes(CSI + b"?1049h", CSI + b"?47h").alternate == 1049  # already there


def test_mouse_tracking_is_one_mode_at_a_time_and_any_reset_ends_it() -> None:
    assert modes(CSI + b"?1000h" + CSI + b"?1003h").mouse == 1003
    assert modes(CSI + b"?1002h" + CSI + b"?1000l").mouse == 0
    assert modes(CSI + b"?1002h" + CSI + b"?1001l").mouse == 0
    assert modes(CSI + b"?1002h" + CSI + b"?1001h").mouse == 0  # highlight: not restored
    assert modes(CSI + b"?9h").preamble() == (CSI + b"?9h", ["mouse"])


def test_the_mouse_encoding_is_one_at_a_time_and_only_its_own_reset_ends_it() -> None:
    assert modes(CSI + b"?1005h" + CSI + b"?1006h").encoding == 1006
    assert modes(CSI + b"?1006h" + CSI + b"?1005l").encoding == 1006
    assert modes(CSI + b"?1006h" + CSI + b"?1006l").encoding == 0


def test_kitty_keyboard_flags_are_a_stack_per_screen() -> None:
    main_push = CSI + b">1u"
    m = modes(main_push, CSI + b"?1049h", CSI + b">3u", CSI + b">31u")
    assert m.keyboard == ((1,), (3, 31))
    preamble, names = m.preamble()
    assert names == ["alternate_screen", "kitty_keyboard"]
    assert preamble == main_push + CSI + b"?1049h" + CSI + b">3u" + CSI + b">31u"
    m = modes(main_push, CSI + b"?1049h", CSI + b">3u", CSI + b"<u", CSI + b"?1049l")
    assert m.keyboard == ((1,), ())
    # The alternate screen keeps its own, for the next program there.
    kept = modes(CSI + b"?1049h", CSI + b">5u", CSI + b"?1049l")
    assert kept.keyboard == ((), (5,))
    assert kept.preamble() == (CSI + b"?1047h" + CSI + b">5u" + CSI + b"?1047l",
                               ["kitty_keyboard"])
    assert modes(CSI + b"?1049h", CSI + b">5u", CSI + b"?1049l", CSI + b"?1049h",
                 CSI + b"<u").keyboard == ((), ())


def test_kitty_keyboard_pops_sets_and_bounds() -> None:
    assert modes(CSI + b">1u" + CSI + b">2u" + CSI + b"<5u").keyboard == ((), ())
    assert modes(CSI + b">1u" + CSI + b">2u" + CSI + b"<u").keyboard == ((1,), ())
    pushes = b"".join(CSI + b">%du" % i for i in range(1, 12))
    assert modes(pushes).keyboard == (tuple(range(12 - STACK, 12)), ())  # oldest dropped
    assert modes(CSI + b"=5u").keyboard == ((5,), ())  # on an empty stack: one entry
    assert modes(CSI + b">1u" + CSI + b"=4;2u").keyboard == ((5,), ())
    assert modes(CSI + b">7u" + CSI + b"=2;3u").keyboard == ((5,), ())
    assert modes(CSI + b">7u" + CSI + b"=2;9u").keyboard == ((7,), ())  # no such way
    assert modes(CSI + b">255u").keyboard == ((31,), ())  # the five flags there are
    assert modes(CSI + b"?u" + CSI + b"u").keyboard == ((), ())  # a query; SCORC


def test_modify_other_keys() -> None:
    assert modes(CSI + b">4;2m").preamble() == (CSI + b">4;2m", ["modify_other_keys"])
    assert modes(CSI + b">4;2m" + CSI + b">4m").modify_other_keys == 0
    assert modes(CSI + b">4;2m" + CSI + b">m").modify_other_keys == 0
    assert modes(CSI + b">4;1m" + CSI + b">4n").modify_other_keys == 0
    assert modes(CSI + b">4;1m" + CSI + b">1;2m").modify_other_keys == 1  # another resource
    assert modes(CSI + b">4;9m").modify_other_keys == 0


def test_scroll_margins() -> None:
    assert modes(CSI + b"5;20r").margins == (5, 20)
    assert modes(CSI + b"5;20r" + CSI + b"r").margins is None
    assert modes(CSI + b"5r").preamble() == (CSI + b"5r", ["scroll_region"])
    assert modes(CSI + b"1r").margins is None  # the whole screen, said so
    assert modes(CSI + b"5;20r" + CSI + b"20;5r").margins == (5, 20)  # ignored: impossible
    assert modes(CSI + b"5;20r" + CSI + b"1;99999r").margins == (5, 20)


def test_cursor_style() -> None:
    assert modes(CSI + b"5 q").preamble() == (CSI + b"5 q", ["cursor_style"])
    assert modes(CSI + b"5 q" + CSI + b" q").cursor_style == 0
    assert modes(CSI + b"5 q" + CSI + b"9 q").cursor_style == 5


def test_ris_resets_everything_and_decstr_what_a_soft_reset_resets() -> None:
    everything = (VIM_START + CSI + b"?1000;1006h" + CSI + b">1u" + CSI + b">4;2m"
                  + CSI + b"3 q" + CSI + b"?6h")
    assert modes(everything, E + b"c").preamble() == (b"", [])
    soft = modes(everything, CSI + b"!p")
    assert soft.names() == ["alternate_screen", "kitty_keyboard", "mouse", "mouse_encoding",
                            "focus_events", "bracketed_paste", "modify_other_keys"]


def test_what_is_not_a_mode_change_changes_nothing() -> None:
    noise = [
        CSI + b"1;31m", CSI + b"0m", CSI + b"38;5;208m", CSI + b"12;1H", CSI + b"2J",
        CSI + b"?25$p", CSI + b"?u", CSI + b"6n", CSI + b"c", CSI + b">c", CSI + b"4h",
        CSI + b"?2026h",  # synchronized output: a frame's, never restored
        E + b"]0;title\x07", E + b"P$q q" + E + b"\\", E + b"(0", E + b"7", E + b"8",
        CSI + b"?" + b"1" * 70 + b"h",  # parameters longer than any terminal takes
        CSI + b"?25\x18l", CSI + b"?25\x1al",  # CAN and SUB cancel a sequence
        CSI + b"?25\nl",  # (a terminal would run the LF and go on: programs never do)
        "\u00e9\u203a\u00a0".encode(), b"\x9b?25l",  # C1 CSI is a UTF-8 continuation byte
    ]
    for piece in noise:
        assert modes(piece) == Modes(), piece


def test_an_esc_inside_a_sequence_starts_the_next_one() -> None:
    assert modes(CSI + b"?10" + CSI + b"?25l").cursor is False
    assert modes(E + CSI + b"?25l").cursor is False


def test_a_sequence_cut_between_pieces_is_finished_by_the_next() -> None:
    for sequence in (CSI + b"?1049h", E + b"=", CSI + b">4;2m", CSI + b"5;20r",
                     CSI + b"3 q", CSI + b"!p", CSI + b">1u", E + b"c"):
        whole = CSI + b"?25l" + CSI + b"?1000h" + b"text" + sequence + b"more"
        for cut in range(len(whole) + 1):
            for second in range(cut, len(whole) + 1):
                pieces = scanned(whole[:cut], whole[cut:second], whole[second:])
                assert pieces.modes == modes(whole), (sequence, cut, second)
                assert pieces.pending == b""


def test_a_start_at_the_end_is_pending_until_the_stream_goes_on() -> None:
    scanner = scanned(b"text", CSI + b"?104")
    assert scanner.pending == CSI + b"?104" and scanner.modes == Modes()
    scanner.feed(b"9")
    assert scanner.pending == CSI + b"?1049"
    scanner.feed(b"h and on")
    assert scanner.pending == b"" and scanner.modes.alternate == 1049
    assert scanned(CSI + b"1;3").pending == CSI + b"1;3"  # may be a DECSTBM
    assert scanned(CSI + b"1;3", b"1m").pending == b""
    scanner = scanned(CSI + b"?25")
    scanner.lose()  # bytes missing here
    scanner.feed(b"l")
    assert scanner.modes.cursor is True


def test_what_a_record_keeps_is_checked_when_it_is_read_back() -> None:
    m = modes(VIM_START, CSI + b">1u", CSI + b">2u", CSI + b"?1002;1015h", CSI + b"4 q")
    assert Modes.from_stored(m.stored()) == m
    assert Modes.from_stored([]) == Modes() and Modes().stored() == []
    good = m.stored()
    bad = [
        [2, *good[1:]], good[:5], [*good, 0], [1, 1048, *good[2:]], [1, 0, 128, *good[3:]],
        [*good[:3], 1001, *good[4:]], [*good[:4], 1007, *good[5:]],
        [*good[:5], 20, 5, *good[7:]], [*good[:5], 0, 70000, *good[7:]],
        [*good[:5], 1, 0, *good[7:]], [*good[:7], 4, *good[8:]], [*good[:8], 7, *good[9:]],
        [*good[:9], 9, *good[10:]], [*good[:9], 1, 32, 0], [*good[:9], 2, 1, 0],
        [*good[:9], -1, 0],
    ]
    for values in bad:
        assert Modes.from_stored(values) is None, values
    assert Scanner.valid_pending(CSI + b"?10") and Scanner.valid_pending(b"")
    for pending in (b"x", CSI + b"?25l", CSI + b"?" + b"1" * 70, E + E):
        assert not Scanner.valid_pending(pending), pending


# --- properties -----------------------------------------------------------------------------


SEQUENCES = [
    CSI + b"?%dh" % m for m in (1, 6, 7, 25, 47, 66, 1000, 1002, 1003, 1004, 1005, 1006,
                                1015, 1016, 1047, 1049, 2004, 9, 1001)
] + [
    CSI + b"?%dl" % m for m in (1, 6, 7, 25, 47, 66, 1000, 1002, 1003, 1004, 1005, 1006,
                                1015, 1016, 1047, 1049, 2004, 9, 1001)
] + [
    E + b"=", E + b">", E + b"c", CSI + b"!p", CSI + b">1u", CSI + b">5u", CSI + b"<u",
    CSI + b"<2u", CSI + b"=3u", CSI + b"=1;2u", CSI + b"=1;3u", CSI + b">4;2m",
    CSI + b">4;1m", CSI + b">4m", CSI + b">4n", CSI + b"5;20r", CSI + b"r", CSI + b"3r",
    CSI + b"2 q", CSI + b" q", CSI + b"?1049;25;1000h", CSI + b"1;31m", CSI + b"H",
    CSI + b"?25", CSI + b"?", CSI, E, b"\x18", b"\r\n", b"text ", "\u00e9".encode(),
]
TOKEN = st.one_of(st.sampled_from(SEQUENCES), st.binary(max_size=12))
STREAM = st.lists(TOKEN, max_size=40).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(STREAM, st.lists(st.integers(0, 400), max_size=8))
def test_any_stream_cut_anywhere_gives_the_state_it_gives_whole(
    data: bytes, cuts: list[int]
) -> None:
    whole = scanned(data)
    points = sorted({min(cut, len(data)) for cut in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    cut = scanned(*pieces)
    assert cut.modes == whole.modes and cut.pending == whole.pending


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6))
def test_arbitrary_bytes_never_raise_and_leave_a_bounded_state(pieces: list[bytes]) -> None:
    scanner = scanned(*pieces)
    m = scanner.modes
    assert len(scanner.pending) < LONGEST and Scanner.valid_pending(scanner.pending)
    assert all(len(stack) <= STACK for stack in m.keyboard)
    assert Modes.from_stored(m.stored()) == m


@settings(max_examples=400, deadline=None)
@given(STREAM)
def test_a_preamble_puts_a_fresh_terminal_in_the_modes_it_was_made_from(data: bytes) -> None:
    m = modes(data)
    preamble, names = m.preamble()
    assert modes(preamble) == m
    assert names == [name for name in MODE_NAMES if name in names]  # in the order listed
    assert len(names) == len(set(names))


# --- a real ring ----------------------------------------------------------------------------




class Stream:
    """Everything that went into a ring, in order, with the stretches it skipped: what the
    modes at any byte number are, read whole."""

    def __init__(self) -> None:
        self.parts: list[bytes | int] = []  # bytes put in, or a count of bytes skipped

    def at(self, total: int) -> Scanner:
        scanner, counted = Scanner(), 0
        for part in self.parts:
            if counted >= total:
                break
            if isinstance(part, int):
                scanner.lose()
                counted += part
            else:
                scanner.feed(part[: total - counted])
                counted += min(len(part), total - counted)
        return scanner


def oldest(ring: Ring) -> int:
    return ring.total - ring.size


# Filler sizes from a few that matter (hypothesis would keep to small ones): some reads
# fill a ring, or grow it, in a few steps.
FILLER = st.sampled_from([0, 10, 700, 4000, 9000, 20_000])
OP = st.one_of(
    st.tuples(st.just("read"), st.lists(TOKEN, max_size=6).map(b"".join), FILLER,
              st.integers(1, 12000)),
    st.tuples(st.just("append"), st.lists(TOKEN, max_size=6).map(b"".join), FILLER,
              st.just(0)),
    st.tuples(st.just("consume"), st.just(b""), st.just(0), st.just(0)),
    st.tuples(st.just("skip"), st.just(b""), st.integers(1, 5000), st.just(0)),
    st.tuples(st.just("replay"), st.just(b""), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(OP, min_size=3, max_size=30), st.sampled_from([MIN_CAPACITY, 48 * 1024]))
def test_the_modes_at_the_oldest_byte_are_those_of_the_stream_up_to_it(
    ops: list[tuple[str, bytes, int, int]], limit: int
) -> None:
    """Reads of any size (fewer bytes than asked for, too), appends (a journal's copy),
    deliveries, skips, growth and wraps: the ring's modes at its oldest byte are always
    those of everything before it, read whole."""
    ring = Ring(limit, RingBudget(1 << 30))
    stream = Stream()
    with pipe() as (r, w):
        for op, tokens, filler, at_most in ops:
            data = tokens + b"f" * filler
            if op == "read":
                stream.parts.append(data)
                os.write(w, data)
                while data:
                    n = ring.read_from(r, at_most, overwrite=True)
                    data = data[n:]
            elif op == "append":
                stream.parts.append(data)
                ring.append(memoryview(data))
            elif op == "consume":
                ring.consume()
            elif op == "skip":
                stream.parts.append(filler)
                ring.skip(filler)
            else:
                assert ring.modes.replay_start(b"") == stream.at(oldest(ring)).modes
    expected = stream.at(oldest(ring))
    assert ring.modes.replay_start(b"") == expected.modes
    assert ring.modes.scanner.pending == expected.pending
    head = ring.contents()[:100]
    assert ring.modes.replay_start(head) == stream.at(oldest(ring) + len(head)).modes
    ring.release()


def read_in(ring: Ring, w: int, r: int, data: bytes, at_most: int = 8000) -> None:
    os.write(w, data)
    while data:
        data = data[ring.read_from(r, at_most, overwrite=True):]


def test_delivered_bytes_are_read_before_an_append_writes_over_them() -> None:
    """A retrieve into custody delivered the replay (`consume`): its bytes are read for
    their modes only once their slots are written over."""
    ring = Ring(MIN_CAPACITY, RingBudget(1 << 30))
    with pipe() as (r, w):
        read_in(ring, w, r, VIM_START + b"x" * 9500 + CSI + b"?2004l")
    ring.consume()
    ring.append(memoryview(b"z" * 15_000))
    ring.append(memoryview(b"z" * 4000))
    m = ring.modes.replay_start(b"")
    assert m.alternate == 1049 and not m.bracketed_paste
    ring.release()


def test_delivered_bytes_are_read_before_the_ring_grows_past_them() -> None:
    """Growing, a ring keeps only what it holds, in a new layout: delivered bytes not read
    yet are read first. (Here they run across the end of the old storage, whose slots the
    new layout gives to other bytes.)"""
    ring = Ring(64 * 1024, RingBudget(1 << 30))
    with pipe() as (r, w):
        read_in(ring, w, r, VIM_START + b"x" * 9000)
        ring.consume()
        tail = CSI + b"?2004l" + b"y" * 600  # ends 200 bytes past the storage's end
        read_in(ring, w, r, b"y" * (MIN_CAPACITY + 200 - ring.total - len(tail)) + tail)
        ring.consume()
        assert ring.capacity == MIN_CAPACITY and ring.position(ring.total) == 200
        read_in(ring, w, r, b"z" * 15_000)
        read_in(ring, w, r, b"z" * 4000)
        assert ring.capacity > MIN_CAPACITY
    m = ring.modes.replay_start(b"")
    assert m.alternate == 1049 and not m.bracketed_paste
    ring.release()


def test_bytes_at_risk_across_the_end_of_the_storage_are_saved_whole() -> None:
    ring = Ring(MIN_CAPACITY, RingBudget(1 << 30))
    stream = b"x" * (MIN_CAPACITY + 10) + CSI + b"?1049h" + b"y" * 20_000
    with pipe() as (r, w):
        for start in range(0, len(stream), 4000):
            read_in(ring, w, r, stream[start : start + 4000], at_most=4000)
    assert oldest(ring) > MIN_CAPACITY + 20
    assert ring.modes.replay_start(b"").alternate == 1049
    ring.release()


def test_a_ring_with_no_storage_reads_what_it_drops() -> None:
    ring = Ring(MIN_CAPACITY, RingBudget(0))
    with pipe() as (r, w):
        os.write(w, VIM_START)
        ring.read_from(r, 4096, overwrite=True)
    assert ring.capacity == 0 and ring.dropped == len(VIM_START)
    assert ring.modes.replay_start(b"") == modes(VIM_START)
    ring.append(memoryview(CSI + b"?25h"))
    assert ring.modes.replay_start(b"").cursor is True
    ring.release()


def test_plain_text_is_never_copied_out_before_it_is_overwritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = Ring(MIN_CAPACITY, RingBudget(1 << 30))
    saved: list[bytes | None] = []
    save = RingModes.save

    def recording(self: RingModes, upto: int) -> bytes | None:
        saved.append(save(self, upto))
        return saved[-1]

    monkeypatch.setattr(RingModes, "save", recording)
    with pipe() as (r, w):
        for _ in range(8):
            os.write(w, b"x" * 4000)
            while ring.read_from(r, 4000, overwrite=True) == 0:
                pass
        os.write(w, CSI + b"?1049h" + b"y" * 3990)
        ring.read_from(r, 4000, overwrite=True)
        for _ in range(5):
            os.write(w, b"x" * 4000)
            ring.read_from(r, 4000, overwrite=True)
    assert ring.dropped > 0 and ring.modes.replay_start(b"").alternate == 1049
    copies = [s for s in saved if s is not None]
    assert len(copies) == 1 and CSI + b"?1049h" in copies[0]
    ring.release()


@pytest.mark.parametrize("read_on", [0, 20_000])
def test_a_record_of_the_modes_restores_them_in_a_ring_adopted_from_it(read_on: int) -> None:
    """The record's fields (escrowd.statefile) taken up by a holder that adopts the ring:
    the same modes at the oldest byte. A record older than the ring's oldest byte (bytes
    that changed no mode left the ring after it was written: a change would have been
    recorded) goes on from the oldest byte, with its modes."""
    ring = Ring(MIN_CAPACITY, RingBudget(1 << 30))
    with pipe() as (r, w):
        for data in (VIM_START + b"x" * 3000, CSI + b"?2004l" + b"y" * 4000, b"z" * 4000,
                     b"w" * 4000, b"v" * 4000, b"u" * 3000):
            os.write(w, data)
            ring.read_from(r, 8000, overwrite=True)
        before = ring.modes.replay_start(b"")
        record = ring.modes.stored()
        for _ in range(read_on // 4000):
            os.write(w, b"t" * 4000)
            ring.read_from(r, 8000, overwrite=True)
    assert before.alternate == 1049 and not before.cursor and not before.bracketed_paste
    assert not ring.modes.dirty and (record["modes_at"] < oldest(ring)) == (read_on > 0)
    other = Ring(ring.limit, RingBudget(1 << 30), StateFile(os.dup(ring.state.fd), Record))
    layout = ring.layout()
    other.adopt(layout["capacity"], layout["origin"], layout["total_at_layout"],
                layout["length_at_layout"], False, layout["saturated"])
    other.modes.restore(record["modes"], record["modes_pending"], record["modes_at"])
    assert other.modes.replay_start(b"") == ring.modes.replay_start(b"") == before
    assert other.modes.scanned == oldest(other)
    ring.release()
    other.release()
