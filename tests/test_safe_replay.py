"""A replay on a real terminal (docs/design.md §12): `safe_replay` takes out what makes a
terminal answer, `after_replay` resets what a resized terminal resets.

Pure functions, tested on bytes: every question in a list of them is taken out, every
sequence in a list of others passes byte for byte, and, on streams made of both with text
between (hypothesis), nothing else is lost, nothing is left to answer, and taking the
questions out twice is taking them out once. What a real terminal then shows and answers
is tests/test_attach_screen.py's.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from escrow_client import after_replay, safe_replay
from escrow_client.safe_replay import ST

# Each makes a terminal answer (or, XTWINOPS, act on its window), in 7-bit form.
QUESTIONS = [
    b"\x1bZ", b"\x1b[c", b"\x1b[0c", b"\x1b[>c", b"\x1b[>0c", b"\x1b[=c", b"\x1b[=0c",
    b"\x1b[5n", b"\x1b[6n", b"\x1b[n", b"\x1b[?6n", b"\x1b[?15n", b"\x1b[?26n", b"\x1b[?996n",
    b"\x1b[?2026$p", b"\x1b[4$p", b"\x1b[x", b"\x1b[0x", b"\x1b[1x", b"\x1b[>q", b"\x1b[>0q",
    b"\x1b[?u", b"\x1b[?4m", b"\x1b[?1g", b"\x1b[?1;1;0S", b"\x1b[?2;4S", b"\x1b[#R",
    b"\x1b[#S", b"\x1b[1;1;2;2#|", b"\x1b[1$w", b"\x1b[2$w", b"\x1b[1$u", b"\x1b[&u",
    b'\x1b["v', b"\x1b['|", b"\x1b[1'|", b"\x1b[1;1;1;1;2;2*y",
    # XTWINOPS: the reports, then what acts on the window
    b"\x1b[11t", b"\x1b[13t", b"\x1b[13;2t", b"\x1b[14t", b"\x1b[14;2t", b"\x1b[15t",
    b"\x1b[16t", b"\x1b[18t", b"\x1b[19t", b"\x1b[20t", b"\x1b[21t", b"\x1b[1t", b"\x1b[2t",
    b"\x1b[3;10;10t", b"\x1b[4;400;600t", b"\x1b[5t", b"\x1b[7t", b"\x1b[8;25;80t",
    b"\x1b[8;;100t", b"\x1b[9;1t", b"\x1b[10;2t", b"\x1b[24t", b"\x1b[48t",
    # strings, each ended by BEL or ST
    b"\x1b]4;1;?\x07", b"\x1b]4;1;?\x1b\\", b"\x1b]4;1;red;2;?\x07", b"\x1b]5;0;?\x07",
    b"\x1b]10;?\x07", b"\x1b]11;?\x1b\\", b"\x1b]12;?\x07", b"\x1b]10;?;?\x07",
    b"\x1b]17;?\x07", b"\x1b]19;?\x07", b"\x1b]22;?\x07", b"\x1b]50;?\x07", b"\x1b]50;?+1\x07",
    b"\x1b]52;c;?\x07", b"\x1b]52;;?\x1b\\", b"\x1b]60\x07", b"\x1b]61;allowColorOps\x07",
    b"\x1b]62;allowWindowOps\x1b\\", b"\x1b]21;foreground=?\x1b\\",
    b"\x1b]21;cursor=?;background=?\x07", b"\x1b]99;i=1:p=?;\x1b\\",
    b"\x1b]5522;type=read\x07", b"\x1b]1337;ReportCellSize\x07",
    b"\x1bP$qm\x1b\\", b"\x1bP$q r\x1b\\", b'\x1bP$q"p\x1b\\', b"\x1bP+q544e;636f\x1b\\",
    b"\x1bP+Q6e616d65\x1b\\", b"\x1b_Ga=q,i=31;AAAA\x1b\\", b"\x1b_Gi=31,s=1,a=q\x1b\\",
]
# 8-bit forms: UTF-8-encoded C1 (U+009B and the like), then raw C1, which counts only
# after an ASCII byte (each is given one in front, below).
ENCODED_QUESTIONS = [b"\xc2\x9b6n", b"\xc2\x9bc", b"\xc2\x9b>q", b"\xc2\x9a",
                     b"\xc2\x9d11;?\x07", b"\xc2\x9d11;?\xc2\x9c", b"\xc2\x90$qm\x1b\\",
                     b"\xc2\x9fGa=q\xc2\x9c", b"\x1b]11;?\xc2\x9c"]
RAW_QUESTIONS = [b"\x9b6n", b"\x9b?2026$p", b"\x9a", b"\x9d11;?\x07", b"\x9d11;?\x9c",
                 b"\x90$qm\x9c", b"\x9fGa=q\x9c", b"\x1b]11;?\x9c"]
ENQ = b"\x05"
# Not questions: what programs print all day, and what looks close to a question.
OTHERS = [
    b"\x1b[0m", b"\x1b[1;31m", b"\x1b[38;5;196m", b"\x1b[38:2::1:2:3m", b"\x1b[H",
    b"\x1b[12;40H", b"\x1b[2J", b"\x1b[K", b"\x1b[?25l", b"\x1b[?1049h", b"\x1b[?1;69h",
    b"\x1b[1;25r", b"\x1b[r", b"\x1b[s", b"\x1b[u", b"\x1b[3 q", b"\x1b[2q", b"\x1b[>4;1m",
    b"\x1b[>4n", b"\x1b[>n", b"\x1b[22;2t", b"\x1b[23;0t", b"\x1b[22t", b"\x1b[0t",
    b"\x1b[3 t", b"\x1b[1;1;5;5;7$t", b"\x1b[>1t", b"\x1b[2 u", b"\x1b[=1;1u", b"\x1b[>1u",
    b"\x1b[<u", b"\x1b[5S", b"\x1b[?1;3;256S", b"\x1b[?1;2S", b"\x1b[#P", b"\x1b[#Q",
    b"\x1b[#{", b"\x1b[#}", b"\x1b[!p", b'\x1b[62;1"p', b"\x1b[4h", b"\x1b[?2004h",
    b"\x1b[2g", b"\x1b[1c", b"\x1b[1;2c", b"\x1b[?1;2c", b"\x1b[2;1R", b"\x1b[1$y",
    b"\x1b]0;title\x07", "\x1b]2;✓ done\x1b\\".encode(), "\x1b]2;✛ ☓\x07".encode(),
    b"\x1b]8;;https://example.com/?q=1\x1b\\", b"\x1b]11;rgb:00/00/00\x07",
    b"\x1b]4;1;red\x07", b"\x1b]52;c;aGVsbG8=\x07", b"\x1b]7;file://host/tmp\x07",
    b"\x1b]133;A\x07", b"\x1b]2;?\x07", b"\x1b]0;what?\x07", b"\x1b]104\x07",
    b"\x1b]110\x1b\\", b"\x1bPq#0;2;0;0;0#0~~\x1b\\", b"\x1bP+p544e\x1b\\",
    b"\x1bP1$r0m\x1b\\", b"\x1b_Gi=1,a=T;AAAA\x1b\\", b"\x1b(B", b"\x1b)0", b"\x1b7",
    b"\x1b8", b"\x1b=", b"\x1b>", b"\x1bM", b"\x1bc", b"\x1b#8", b"\x1b\\", b"\x1b[",
]
# Text: anything but ESC, ENQ and the bytes of C1 controls.
TEXT = st.binary(max_size=12).map(
    lambda b: bytes(c for c in b if c not in (0x1B, 0x05) and not 0x80 <= c <= 0x9F))


def instead(question: bytes) -> bytes:
    """What `safe_replay` leaves of a question: nothing of ENQ; of one that ended in an
    8-bit control (an ST, DECID), an ST in the same form, raw or UTF-8-encoded; else a
    7-bit ST."""
    if question == ENQ:
        return b""
    if question[-1] < 0x80:
        return ST
    return b"\xc2\x9c" if question[-2:-1] == b"\xc2" else b"\x9c"


@pytest.mark.parametrize("question", QUESTIONS + ENCODED_QUESTIONS + [ENQ])
def test_each_question_is_taken_out(question: bytes) -> None:
    assert safe_replay(b"before" + question + b"after") == b"before" + instead(question) + b"after"
    assert safe_replay(question) == instead(question)


@pytest.mark.parametrize("question", RAW_QUESTIONS)
def test_a_raw_c1_question_is_one_after_ascii_and_not_after_a_utf8_lead(question: bytes) -> None:
    assert safe_replay(b"x" + question) == b"x" + instead(question)
    assert safe_replay(question) == instead(question)  # nothing before it
    if question[0] != 0x1B:  # 0x9b after E2 is the middle of a character, not a CSI
        assert safe_replay(b"\xe2" + question) == b"\xe2" + question


@pytest.mark.parametrize("other", OTHERS)
def test_what_is_no_question_passes_byte_for_byte(other: bytes) -> None:
    assert safe_replay(b"x" + other + b"y") == b"x" + other + b"y"


def test_a_question_cut_at_the_end() -> None:
    """A string cut there is taken out (tmux answers it when the next ESC ends it); a
    control sequence cut there stays: nothing answers it before its final byte."""
    assert safe_replay(b"ok\x1b]11;?") == b"ok" + ST
    assert safe_replay(b"ok\x1bP$qm") == b"ok" + ST
    assert safe_replay(b"ok\x1b[6") == b"ok\x1b[6"
    assert safe_replay(b"ok\x1b[") == b"ok\x1b["
    assert safe_replay(b"ok\x1b") == b"ok\x1b"


def test_a_question_cut_by_what_follows_it() -> None:
    """An ESC, CAN or SUB ends a string: a question in one ends there."""
    assert safe_replay(b"\x1b]11;?\x1b[0m") == ST + b"\x1b[0m"
    assert safe_replay(b"\x1b]11;?\x18x") == ST + b"\x18x"
    assert safe_replay(b"\x1b]11;?\x1b]11;?\x07") == ST + ST


def test_a_sequence_cut_at_the_start_is_text_and_stays() -> None:
    for tail in (b"6n rest", b";?\x07 rest", b"11;?\x1b\\ rest", b"$qm\x1b\\"):
        assert safe_replay(tail) == tail


def test_what_the_question_interrupted_means_what_it_meant() -> None:
    """A question in the middle of a title ends the title, as its own ESC did: taken out
    whole, the title would run on into the text after it."""
    assert safe_replay(b"\x1b]0;tit\x1b[6nle\x07") == b"\x1b]0;tit" + ST + b"le\x07"
    assert safe_replay(b"\x1b[1;\x1b[6n31m") == b"\x1b[1;" + ST + b"31m"


def test_enq_is_taken_out_even_inside_a_sequence() -> None:
    """A terminal executes ENQ where it finds it and goes on with the sequence around it."""
    assert safe_replay(b"a\x05b") == b"ab"
    assert safe_replay(b"\x1b[6\x05n") == ST
    assert safe_replay(b"\x1b[1\x05m") == b"\x1b[1m"


def test_utf8_text_and_its_continuation_bytes_pass() -> None:
    text = "✓ ✛ ☓ — ěščř 漢字 😀 \x9b".encode()  # the last: U+009B, a real CSI
    assert safe_replay(text + b"6n") == "✓ ✛ ☓ — ěščř 漢字 😀 ".encode() + ST
    assert safe_replay("✓✛😀 ✓".encode()) == "✓✛😀 ✓".encode()


def test_it_takes_any_buffer() -> None:
    assert safe_replay(bytearray(b"a\x1b[6n")) == safe_replay(memoryview(b"a\x1b[6n")) == b"a" + ST


def test_a_mebibyte_of_dense_output_takes_milliseconds() -> None:
    """About 6 ms on the 2-core VM of docs/performance.md, for output with an ESC every
    seven bytes; the bound is loose, against a scan by Python byte by byte (seconds)."""
    frame = b"".join(b"\x1b[%d;1H\x1b[1;3%dm%-60s\x1b[0m\x1b[K" % (row, row % 8, b"x" * row)
                     for row in range(1, 41)) + b"\x1b[?25l\x1b[6n\x1b]0;top\x07"
    replay = (frame * (1 + (1 << 20) // len(frame)))[: 1 << 20]
    best = min(_timed(replay) for _ in range(5))
    assert best < 0.1, f"{best * 1000:.1f} ms for 1 MiB"


def _timed(replay: bytes) -> float:
    started = time.perf_counter()
    safe_replay(replay)
    return time.perf_counter() - started


# --- properties --------------------------------------------------------------------------

TOKEN = st.one_of(
    st.tuples(st.sampled_from(QUESTIONS + ENCODED_QUESTIONS + [ENQ]), st.just(True)),
    st.tuples(st.sampled_from(RAW_QUESTIONS).map(lambda q: b"." + q), st.just(True)),
    st.tuples(st.sampled_from(OTHERS[:-1]), st.just(False)),  # not the lone `ESC [`
    st.tuples(TEXT, st.just(False)),
)


@settings(max_examples=400)
@given(st.lists(TOKEN, max_size=30))
def test_only_the_questions_are_lost(tokens: list[tuple[bytes, bool]]) -> None:
    """Questions, other sequences and text, in any order: what comes out is the same with
    each question replaced, and nothing else touched."""
    replay = b"".join(token for token, _ in tokens)
    expected = b"".join(
        (token[:1] + instead(token[1:]) if token[:1] == b"." else instead(token))
        if question else token for token, question in tokens)
    assert safe_replay(replay) == expected


@given(TEXT)
def test_text_without_escape_enq_or_c1_is_unchanged(text: bytes) -> None:
    assert safe_replay(text) == text


@given(st.text(st.characters(blacklist_categories=("Cc", "Cs"))))
def test_utf8_text_is_unchanged(text: str) -> None:
    assert safe_replay(text.encode()) == text.encode()


MIXED = st.lists(st.one_of(st.sampled_from(QUESTIONS + ENCODED_QUESTIONS + RAW_QUESTIONS
                                            + OTHERS + [ENQ]), st.binary(max_size=6)),
                 max_size=20).map(b"".join)


@settings(max_examples=400)
@given(MIXED)
def test_twice_is_once_and_nothing_is_left_to_answer(replay: bytes) -> None:
    """Any bytes at all, questions and others cut and joined anyhow."""
    once = safe_replay(replay)
    assert safe_replay(once) == once
    for question in QUESTIONS + ENCODED_QUESTIONS:
        assert question not in once


# --- after_replay --------------------------------------------------------------------------

def test_after_a_replay_the_scroll_region_is_whole_and_the_cursor_kept() -> None:
    assert after_replay(b"\x1b[?1049h\x1b[1;25r") == b"\x1b7\x1b[r\x1b8"
    assert after_replay(b"") == b"\x1b7\x1b[r\x1b8"


@pytest.mark.parametrize("replay, left_right", [
    (b"\x1b[?69h", True),
    (b"\x1b[?1;69;2004h", True),
    (b"\x1b[?69h\x1b[?69l", False),
    (b"\x1b[?69h\x1bc", False),  # RIS
    (b"\x1b[?69h\x1b[!p", False),  # DECSTR
    (b"\x1b[?1069h\x1b[?691h", False),  # other modes
])
def test_left_and_right_margins_are_reset_only_where_the_replay_left_them_on(
    replay: bytes, left_right: bool
) -> None:
    """`CSI s` is DECSLRM only while DECLRMM is set; otherwise it saves the cursor."""
    assert after_replay(replay) == (b"\x1b7\x1b[r\x1b[s\x1b8" if left_right
                                    else b"\x1b7\x1b[r\x1b8")


def test_origin_mode_is_turned_off_only_where_the_replay_left_it_on() -> None:
    """Last, since it homes the cursor (and the restore would give it back)."""
    assert after_replay(b"\x1b[?6h").endswith(b"\x1b8\x1b[?6l")
    assert after_replay(b"\x1b[?6;69h") == b"\x1b7\x1b[r\x1b[s\x1b8\x1b[?6l"
    assert after_replay(b"\x1b[?6h\x1b[?6l") == b"\x1b7\x1b[r\x1b8"
    assert after_replay(b"\x1b[?69h\x1b[?6;1h\x1b[?6l") == b"\x1b7\x1b[r\x1b[s\x1b8"
