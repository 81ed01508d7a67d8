"""What the local terminal answers after an attach's replay, kept from the program
(client/replies.py, docs/design.md §13).

`Replies` is fed what the terminal sends, read by read, with the time of each read: these
tests give it bytes and times. That the terminal's answer to `ASK` reaches no program on a
real screen is tests/test_attach_screen.py's.
"""

from __future__ import annotations

from random import Random

from hypothesis import given
from hypothesis import strategies as st

from escrow_client.replies import WAIT, Replies

ANSWER = b"\x1b[?62;22c"  # a terminal's answer to ASK (tmux's is ESC [ ? 1 ; 2 c)
REPLIES = [  # what a terminal answers the replay's questions
    b"\x1b[2;1R", b"\x1b[?2;1R", b"\x1b[0n", b"\x1b[?10n", b"\x1b[>84;0;0c", b"\x1b[>0;10;1c",
    b"\x1b[?2026;2$y", b"\x1b[4;1$y", b"\x1b[8;24;80t", b"\x1b[4;480;640t", b"\x1b[1t",
    b"\x1b[?1u", b"\x1b[?1;0;256S", b"\x1b[>4;2m", b"\x1b[2;1;1;112;112;1;0x",
    b"\x1b]11;rgb:0000/0000/0000\x07", b"\x1b]11;rgb:0000/0000/0000\x1b\\",
    b"\x1b]52;c;aGVsbG8=\x07", b"\x1b]l\xe2\x9c\x93 title\x1b\\", b"\x1bP1$r0m\x1b\\",
    b"\x1bP>|tmux 3.3a\x1b\\", b"\x1bP1+r544e=787465726d\x1b\\", b"\x1bP!|00000000\x1b\\",
    b"\x1b_Gi=31;OK\x1b\\", b"\xc2\x9b2;1R", b"\xc2\x9d11;rgb:0000/0000/0000\xc2\x9c",
    b"\xc2\x901$r0m\xc2\x9c",
]
KEYS = [  # what a user types meanwhile: all of it is for the program
    b"a", b"ls -l", b"\r", b"\x7f", b"\x03", b"\x1c", b"\x1b[A", b"\x1b[1;5D", b"\x1bOP",
    b"\x1b[15~", b"\x1b[200~pasted\x1b[201~", b"\x1bx", b"\x1b[<0;12;5M", b"\x1b[<0;12;5m",
    b"\x1b[I", b"\x1b[97;5u", b"\x1b[Z", "é✓".encode(), b"\x1b[27;5;9~",
]


def test_with_nothing_asked_everything_passes() -> None:
    replies = Replies(None)
    assert replies.feed(b"\x1b[2;1R" + ANSWER + b"x", 0.0) == b"\x1b[2;1R" + ANSWER + b"x"
    assert replies.wait(0.0, None) is None and not replies.due(10.0)


def test_replies_are_dropped_until_the_answer_and_pass_after_it() -> None:
    replies = Replies(0.0)
    assert replies.feed(b"\x1b[2;1Ra\x1b[>84;0;0cb", 0.01) == b"ab"
    assert replies.feed(b"c" + ANSWER + b"d\x1b[3;1R", 0.02) == b"cd\x1b[3;1R"
    assert replies.feed(b"\x1b[2;1R" + ANSWER, 0.03) == b"\x1b[2;1R" + ANSWER  # the program's


def test_a_reply_cut_between_reads_is_kept_back_then_dropped() -> None:
    replies = Replies(0.0)
    assert replies.feed(b"x\x1b[2;", 0.01) == b"x"
    assert replies.wait(0.01, None) == WAIT - 0.01
    assert replies.feed(b"1R\x1b]11;rgb:0/0", 0.02) == b""
    assert replies.feed(b"/0\x1b", 0.03) == b""
    assert replies.feed(b"\\" + ANSWER[:3], 0.04) == b""
    assert replies.feed(ANSWER[3:] + b"y", 0.05) == b"y"


def test_what_was_kept_back_and_is_no_reply_goes_to_the_program() -> None:
    replies = Replies(0.0)
    assert replies.feed(b"\x1b", 0.01) == b""  # Escape, or the start of a reply
    assert replies.feed(b"[A", 0.02) == b"\x1b[A"  # an arrow key
    assert replies.feed(b"\x1b", 0.03) == b""
    assert not replies.due(0.5) and replies.due(WAIT)
    assert replies.wait(0.5, 0.1) == 0.1 and replies.wait(0.5, 2.0) == WAIT - 0.5
    assert replies.feed(b"", WAIT) == b"\x1b"  # Escape after all, a second late at most
    assert replies.wait(WAIT, None) is None


def test_after_the_wait_only_the_answer_is_dropped() -> None:
    """A terminal slow to show the replay (a slow link) answers late: its answer to ASK
    is still its first answer to `CSI c`, and still dropped, once."""
    replies = Replies(0.0)
    assert replies.feed(b"\x1b[2;1R", WAIT + 1) == b"\x1b[2;1R"
    assert replies.feed(b"a" + ANSWER + b"b", WAIT + 2) == b"ab"
    assert replies.feed(ANSWER, WAIT + 3) == ANSWER


def test_an_attach_that_ends_waits_for_the_answer_for_what_is_left_of_the_wait() -> None:
    replies = Replies(0.0)
    assert replies.awaited(0.25) == WAIT - 0.25
    assert replies.feed(b"x" + ANSWER, 0.5) == b"x"
    assert replies.awaited(0.5) is None  # it came
    assert Replies(0.0).awaited(WAIT) is None  # it did not, and the wait is over
    assert Replies(None).awaited(0.0) is None  # nothing was asked


def test_no_control_key_is_kept_back_or_dropped_with_a_reply() -> None:
    """The detach key (a control key) goes through at once, even after what may begin a
    string reply."""
    replies = Replies(0.0)
    assert replies.feed(b"\x1b]0;x\x1c", 0.01) == b"\x1b]0;x\x1c"
    assert replies.feed(b"\x1bP\x1c", 0.02) == b"\x1bP\x1c"


def test_what_is_lost_a_key_that_is_a_reply() -> None:
    """Shift-F3 on xterm's default keyboard is a cursor report's shape: typed in the first
    second, it is dropped. Nothing else typed is."""
    replies = Replies(0.0)
    assert replies.feed(b"\x1b[1;2R", 0.1) == b""


def test_the_answer_in_utf8_encoded_c1_form() -> None:
    replies = Replies(0.0)
    assert replies.feed(b"\xc2\x9b?1;2cz", 0.1) == b"z"
    assert replies.feed(ANSWER, 0.2) == ANSWER


@given(st.lists(st.sampled_from(KEYS), max_size=8), st.lists(st.sampled_from(REPLIES),
       max_size=8), st.lists(st.sampled_from(KEYS + REPLIES), max_size=8), st.randoms())
def test_keys_pass_and_replies_do_not_however_the_reads_fall(
    keys: list[bytes], replies: list[bytes], after: list[bytes], random: Random
) -> None:
    """Keys and replies mixed in any order, then the answer, then anything (the program's
    own): read in pieces cut anywhere, the keys before the answer and all that came after
    it pass, in order, and nothing else."""
    before = keys + replies
    random.shuffle(before)
    stream = b"".join(before) + ANSWER + b"".join(after)
    cuts = sorted(random.sample(range(len(stream) + 1), 5))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    filtered = Replies(0.0)
    out = b"".join(filtered.feed(read, 0.1) for read in reads)
    assert out == b"".join(k for k in before if k in KEYS) + b"".join(after)
