"""What a session prints is whatever its program writes: bytes made to make a pattern
backtrack must cost what any other bytes cost. `escrowctl attach` runs safe_replay and
after_replay on the replay while the terminal is raw (Ctrl-C is a byte then, and SIGTERM
waits for them), Replies on what the terminal sends, and the holder's mode scanner runs on
every session's output: a pattern that tries again at each repetition of a separator takes
time quadratic in the input, minutes for these 256 KiB.

Each shape below is a repetition that some pattern once tried again and again (or one close
to it), unterminated so that every try fails at the end. Each call takes a few ms; the bound
is loose, against the minutes of a quadratic scan.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from escrow_client import after_replay, safe_replay
from escrow_client.leaving import AlternateScreen
from escrow_client.replies import Replies
from escrow_client.safe_replay import ST
from escrowd.modes import Scanner

SIZE = 256 * 1024
BOUND = 2.0  # seconds


def repeated(head: bytes, unit: bytes, tail: bytes = b"") -> bytes:
    """`head`, then `unit` again and again, then `tail`: SIZE bytes or about."""
    return head + unit * ((SIZE - len(head) - len(tail)) // len(unit)) + tail


SHAPES: dict[str, bytes] = {
    "modes with 6": repeated(b"\x1b[?", b"6;", b"x"),
    "modes with 69": repeated(b"\x1b[?", b"69;", b"x"),
    "many mode sets": repeated(b"", b"\x1b[?6"),
    "osc 4 ?": repeated(b"\x1b]4", b";?", b"\x01"),
    "osc 4 ? encoded": repeated(b"\xc2\x9d4", b";?", b"\x01"),
    "osc 4 ? raw": repeated(b"\x9d4", b";?", b"\x01"),
    "osc 11 fields": repeated(b"\x1b]11", b";x", b"\x01"),
    "osc 21 =?": repeated(b"\x1b]21;", b"=?", b"\x01"),
    "osc 99 p=?": repeated(b"\x1b]99;", b"p=?", b"\x80"),
    "osc 5522 type=read": repeated(b"\x1b]5522;", b"type=read", b"\x7f"),
    "osc 1337 Report": repeated(b"\x1b]1337;", b"Report", b"\x01"),
    "apc a=q": repeated(b"\x1b_G", b"a=q,", b"\x01"),
    "apc a=q encoded": repeated(b"\xc2\x9fG", b"a=q,", b"\x01"),
    "dcs $q": repeated(b"\x1bP$q", b"$q", b"\x01"),
    "csi zeros": repeated(b"\x1b[", b"0", b"x"),
    "csi zeros encoded": repeated(b"\xc2\x9b", b"0", b"z"),
    "csi window ops": repeated(b"\x1b[", b"1;", b"t"),
    "csi graphics": repeated(b"\x1b[?1", b";1", b"S"),
    "esc": repeated(b"", b"\x1b"),
    "csi introducers": repeated(b"", b"\x1b["),
    "osc introducers": repeated(b"", b"\x1b]"),
    "osc 4 introducers": repeated(b"", b"\x1b]4;"),
    "encoded osc introducers": repeated(b"", b"\xc2\x9d"),
    "encoded dcs introducers": repeated(b"", b"\xc2\x90"),
    "encoded apc introducers": repeated(b"", b"\xc2\x9fa"),
    "encoded csi introducers": repeated(b"", b"\xc2\x9b"),
    "raw osc introducers": repeated(b"", b"a\x9d"),
    "enq": repeated(b"", b"\x05"),
    "questions": repeated(b"", b"\x1b[c"),
    "csi parameters": repeated(b"\x1b[", b"1;", b"z"),
    "screen switches": repeated(b"", b"\x1b[?1049"),
}


def _replies(data: bytes) -> None:
    Replies(0.0).feed(data, 0.5)  # within WAIT: every reply is looked for


def _scanned_in_pieces(data: bytes) -> None:
    scanner = Scanner()
    for start in range(0, len(data), 4096):  # as the holder reads: a piece at a time
        scanner.feed(data, start, min(len(data), start + 4096))


FUNCTIONS: dict[str, Callable[[bytes], object]] = {
    "safe_replay": safe_replay,
    "after_replay": after_replay,
    "Replies": _replies,
    "Scanner": lambda data: Scanner().feed(data),
    "Scanner in pieces": _scanned_in_pieces,
    "AlternateScreen": lambda data: AlternateScreen().seen(data),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_hostile_bytes_take_linear_time(function: str, shape: str) -> None:
    data = SHAPES[shape]
    started = time.perf_counter()
    FUNCTIONS[function](data)
    took = time.perf_counter() - started
    assert took < BOUND, f"{function} on {shape!r}: {took:.1f} s for {len(data)} bytes"


# A string that asks, what makes it ask, and a field of its that does not.
ASKING = [(b"\x1b]4", b";?", b";x"), (b"\x1b]21;", b"=?", b"a=b"), (b"\x1b]99;", b"p=?", b"i=1:"),
          (b"\x1b]5522;", b"type=read", b"x=y:"), (b"\x1b_G", b"a=q,", b"i=1,")]


@pytest.mark.parametrize(("head", "asks", "field"), ASKING)
def test_a_long_string_asks_wherever_its_question_is(head: bytes, asks: bytes,
                                                     field: bytes) -> None:
    for body in (asks + field * 1000, field * 1000 + asks, field * 500 + asks + field * 500):
        assert safe_replay(b"a" + head + body + b"\x1b\\b") == b"a" + ST + b"b"
    kept = b"a" + head + field * 1000 + b"\x1b\\b"
    assert safe_replay(kept) == kept


def test_a_long_list_of_modes_is_read_whole() -> None:
    assert after_replay(b"\x1b[?" + b"1;" * 1000 + b"69;" + b"2;" * 1000 + b"h") == (
        b"\x1b7\x1b[r\x1b[s\x1b8")
    assert after_replay(b"\x1b[?" + b"16;" * 1000 + b"h") == b"\x1b7\x1b[r\x1b8"
