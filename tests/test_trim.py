"""Where a wrapped replay may start (escrowd.trim, docs/design.md §12 "A clean start").

Each unit test is a replay whose ring wrapped at a known spot: inside a CSI, an OSC title, a
DCS string, a UTF-8 character, a line. The property test builds output from whole tokens
(characters, controls, sequences, strings), so the clean offsets are known without a
parser: the token boundaries. For every cut of it, what `clean_start` keeps must begin on
one of them, decode as UTF-8, and begin at the first whole line when one is in reach.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from escrowd.trim import DEFAULT_LIMIT, clean_start

E = b"\x1b"
ST = b"\x1b\\"


def kept(replay: bytes, limit: int = DEFAULT_LIMIT) -> bytes:
    return replay[clean_start(replay, limit) :]


# Inside an escape sequence.


def test_inside_a_csi_with_a_line_feed_soon_after_starts_at_the_next_line() -> None:
    assert kept(b"1;31mhello\x1b[0m\nnext line\n") == b"next line\n"


def test_inside_a_csi_with_no_line_feed_cuts_its_end() -> None:
    assert kept(b"[0mX") == b"X"  # the ring cut just after the ESC
    assert kept(b";31mred") == b"red"
    assert kept(b"mX") == b"X"  # only the final byte was left
    assert kept(b"?25h\x1b[1mbold") == b"\x1b[1mbold"  # private parameters
    assert kept(b" q$ ") == b"$ "  # an intermediate (DECSCUSR)


def test_inside_an_esc_sequence_cuts_its_end() -> None:
    assert kept(b"(Bplain") == b"plain"
    assert kept(b"Bplain") == b"plain"
    assert kept(b"7") == b""  # ESC 7 (save the cursor): a final byte that is a digit


def test_inside_an_osc_title_ended_by_bel() -> None:
    assert kept(b"host:~\x07$ ls\nfile\n") == b"file\n"
    assert kept(b"host:~\x07$ ") == b"$ "


def test_inside_an_osc_title_ended_by_st() -> None:
    assert kept(b"host:~" + ST + b"$ ls\nfile\n") == b"file\n"
    assert kept(b"host:~" + ST + b"$ ") == b"$ "
    assert kept(ST + b"$ ") == b"$ "  # the ring cut just before the ST
    assert kept(b"\\$ ") == b"$ "  # or inside it


def test_a_line_feed_inside_a_string_is_not_a_line_start() -> None:
    # An image's base64, wrapped at 76 columns, inside an OSC 1337 or a DCS.
    assert kept(b"QUJD\nREVG\x07shown\nnext\n") == b"next\n"
    assert kept(b"#0~~-\n#1@@" + ST + b"after\nnext\n") == b"next\n"
    assert kept(b"QUJD\nREVG\x07$ ") == b"$ "


def test_a_string_after_the_first_line_feed_does_not_hide_it() -> None:
    assert kept(b"rld\n\x1b]0;title\nmore\x07$ ") == b"\x1b]0;title\nmore\x07$ "


def test_a_bell_may_have_ended_a_string_so_the_lines_before_it_are_not_trusted() -> None:
    # The price of telling a title's end from a bell: one more line is cut.
    assert kept(b"one\ntwo\x07three\nfour") == b"four"


def test_cancel_ends_any_sequence() -> None:
    assert kept(b"31;1\x18text\nmore") == b"more"
    assert kept(b"tle\nstill title\x1aplain") == b"plain"


# Inside a UTF-8 character.


def test_inside_a_utf8_character_skips_its_continuation_bytes() -> None:
    for char in "é€😀":
        encoded = char.encode()
        for torn in range(1, len(encoded)):
            assert kept(encoded[torn:] + b"abc") == b"abc"
            assert kept(encoded[torn:] + "日本".encode()) == "日本".encode()


def test_inside_a_utf8_character_with_a_line_feed_soon_after_starts_at_the_next_line() -> None:
    assert kept("€uro\nnext".encode()[1:]) == b"next"


def test_all_continuation_bytes_cut_at_most_the_limit() -> None:
    assert clean_start(b"\x80\xbf" * 5) == 10
    assert clean_start(b"\xbf" * 10_000) == DEFAULT_LIMIT
    assert clean_start(b"\xbf" * 100, limit=16) == 16


# Lines.


def test_mid_line_starts_at_the_next_line() -> None:
    assert kept(b"orld\nnext line\n") == b"next line\n"
    assert kept(b"orld\r\nnext line\r\n") == b"next line\r\n"


def test_a_replay_that_starts_at_a_line_start_still_loses_its_first_line() -> None:
    # Nothing in the bytes tells a line start from a line torn there.
    assert kept(b"first line\nsecond line\n") == b"second line\n"
    assert kept(b"\x1b[1mfirst\x1b[0m\nsecond\n") == b"second\n"


def test_a_line_feed_past_the_limit_is_not_waited_for() -> None:
    long_line = b"0m" + b"y" * 10_000 + b"\nnext"
    assert clean_start(long_line) == 2  # only the end of the CSI
    assert kept(b"0m" + b"y" * 8 + b"\nnext", limit=8) == b"y" * 8 + b"\nnext"
    assert kept(b"0m" + b"y" * 8 + b"\nnext", limit=11) == b"next"
    assert kept(b"\xa9" + b"y" * 10_000 + b"\x1b[1m\nnext") == b"y" * 10_000 + b"\x1b[1m\nnext"


def test_a_sequence_after_a_long_stretch_is_looked_at_only_within_the_limit() -> None:
    replay = b"host:~" + b"z" * 10_000 + b"\x07$ "
    assert clean_start(replay) == 1  # the title's end is out of reach: cut what may be a CSI's
    assert clean_start(replay, limit=len(replay)) == len(replay) - 2


# Edges.


def test_empty() -> None:
    assert clean_start(b"") == 0
    assert clean_start(memoryview(b"")) == 0


def test_a_memoryview_is_read_like_bytes() -> None:
    replay = b"1;31mhello\nnext"
    assert clean_start(memoryview(replay)) == clean_start(replay) == 11


def test_never_more_than_the_replay() -> None:
    for replay in (b"x", b"\n", b"\x07", E, ST, b"\x1b[", b"\xbf", b"1;3"):
        assert 0 <= clean_start(replay) <= len(replay)


# The property: for every cut of real-looking output.


def _text() -> st.SearchStrategy[bytes]:
    chars = st.sampled_from(["a", "Z", "m", "x", " ", "1", ";", "[", "\\", "é", "€", "😀", "中"])
    return chars.map(str.encode)


def _sequences() -> st.SearchStrategy[bytes]:
    sgr = st.lists(st.sampled_from(["0", "1", "31", "38;5;208", "48;2;1;2;3"]), max_size=3).map(
        lambda params: b"\x1b[" + ";".join(params).encode() + b"m"
    )
    other = st.sampled_from(
        [b"\x1b[H", b"\x1b[12;40H", b"\x1b[?25h", b"\x1b[2 q", b"\x1b[K", b"\x1b(B", b"\x1b7",
         b"\x1b8", b"\x1b=", b"\x1bM"]
    )
    title = st.lists(st.sampled_from(["t", "~", ":", " ", "é", "😀", "\n"]), max_size=8).map(
        lambda chars: "".join(chars).encode()
    )
    osc = st.tuples(st.sampled_from([b"0;", b"2;"]), title, st.sampled_from([b"\x07", ST])).map(
        lambda parts: b"\x1b]" + parts[0] + parts[1] + parts[2]
    )
    payload = st.lists(st.sampled_from([b"#0", b"~~", b"@", b"-", b"\n", b"!3?"]), max_size=10)
    dcs = payload.map(lambda parts: b"\x1bPq" + b"".join(parts) + ST)
    apc = st.just(b"\x1b_Gf=100;QUJD" + ST)
    return st.one_of(sgr, other, osc, dcs, apc)


_LINE_ENDS = [b"\n", b"\r\n"]
_CONTROLS = [b"\r", b"\t", b"\x08"]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(_text(), _sequences(), st.sampled_from(_LINE_ENDS + _CONTROLS)),
        max_size=80,
    ),
    limit=st.sampled_from([DEFAULT_LIMIT, 64]),
)
def test_every_cut_of_real_output_keeps_a_clean_start(tokens: list[bytes], limit: int) -> None:
    data = b"".join(tokens)
    clean = {0}  # the token boundaries
    line_starts = []  # just after a line feed that is not inside a string
    for token in tokens:
        clean.add(max(clean) + len(token))
        if token in _LINE_ENDS:
            line_starts.append(max(clean))
    for cut in range(len(data) + 1):
        replay = data[cut:]
        trimmed = clean_start(replay, limit)
        assert 0 <= trimmed <= len(replay)
        start = cut + trimmed
        assert start in clean, (replay, trimmed)
        data[start:].decode("utf-8", errors="strict")
        reachable = [line for line in line_starts if cut < line <= cut + limit]
        if reachable:  # no string here is longer than the limit, so its end is in sight
            assert start == reachable[0], (replay, trimmed)
