"""The detach key in every encoding a terminal sends it in (docs/design.md §13): its byte,
kitty's keyboard protocol (with each of its flags), fixterms' CSI u, xterm's modifyOtherKeys;
one press detaches, two send the key to the program as the second came, a key held down is
one press, and a key split across reads is still the key. Pure logic: what a terminal would
send is written here byte by byte (tests/test_leaving.py sends it from a real terminal).
"""

from __future__ import annotations

import pytest

from escrow_client.attach import DetachKey
from escrow_client.detach_key import PASTE_IDLE
from escrow_client.key_events import CSI, KeyEvent, ctrl_codes, parse

CTRL_BACKSLASH = 0x1C

# Ctrl-\ pressed once, as each terminal mode sends it.
PRESSES = {
    "legacy": b"\x1c",
    "kitty": b"\x1b[92;5u",  # disambiguate (flag 1)
    "kitty-event-types": b"\x1b[92;5:1u",  # report event types (2): press is :1
    "kitty-alternates": b"\x1b[92::92;5u",  # report alternate keys (4): the base layout key
    "kitty-num-lock": b"\x1b[92;133u",  # Num Lock on (128) changes nothing
    "kitty-base-layout": b"\x1b[1092::92;5u",  # another layout: the key at \\'s place
    "modify-other-keys": b"\x1b[27;5;92~",  # xterm, modifyOtherKeys 2
    "ctrl-4": b"\x1b[52;5u",  # Ctrl-4, which sends 0x1c as Ctrl-\\ does
}


def test_the_keys_that_send_a_control_byte() -> None:
    assert ctrl_codes(0x1C) == {ord("\\"), ord("4")}
    assert ctrl_codes(0x01) == {ord("a")}
    assert ctrl_codes(0x1D) == {ord("]"), ord("5")}
    assert ctrl_codes(0x7F) == {ord("?"), ord("8")}
    assert ctrl_codes(0x00) == {ord(" "), ord("@"), ord("2")}


@pytest.mark.parametrize("sequence, event", [
    (b"\x1b[92;5u", KeyEvent(92, None, 4)),
    (b"\x1b[92;5:3u", KeyEvent(92, None, 4, 3)),
    (b"\x1b[97:65:97;6;65u", KeyEvent(97, 97, 5)),
    (b"\x1b[27;5;92~", KeyEvent(92, None, 4)),
    (b"\x1b[57442;5u", KeyEvent(57442, None, 4)),
    (b"\x1b[92u", KeyEvent(92, None, 0)),
    (b"\x1b[?1u", None),  # the answer to kitty's query, not a key
    (b"\x1b[>1u", None),
    (b"\x1b[1;5A", None),  # Ctrl-Up
    (b"\x1b[200~", None),
    (b"\x1b[12;40R", None),  # a cursor position report
    (b"\x1b[27;5~", None),
])
def test_parse(sequence: bytes, event: KeyEvent | None) -> None:
    assert CSI.fullmatch(sequence)
    assert parse(sequence) == event


@pytest.mark.parametrize("encoding", PRESSES)
def test_one_press_detaches_in_every_encoding(encoding: str) -> None:
    k = DetachKey(CTRL_BACKSLASH, double_press=0.3)
    assert k.feed(b"ls" + PRESSES[encoding], 10.0) == (b"ls", False)
    assert k.wait(10.1) == pytest.approx(0.2)
    assert k.feed(b"", 10.3) == (b"", True)
    # Another key after it detaches at once; what follows the press is not for the session.
    k = DetachKey(CTRL_BACKSLASH)
    assert k.feed(b"a" + PRESSES[encoding] + b"\x1b[98;5u", 20.0) == (b"a", True)


@pytest.mark.parametrize("encoding", PRESSES)
def test_two_presses_send_the_key_as_it_came(encoding: str) -> None:
    press = PRESSES[encoding]
    k = DetachKey(CTRL_BACKSLASH, double_press=0.3)
    assert k.feed(press, 10.0) == (b"", False)
    assert k.feed(press + b"x", 10.2) == (press + b"x", False)
    assert k.wait(10.2) is None


def test_a_key_held_down_is_one_press_and_its_release_no_other_key() -> None:
    """With kitty's event types: press, repeats (:2), release (:3). The repeats and the
    release neither detach at once nor send the key: the press detaches in its time."""
    k = DetachKey(CTRL_BACKSLASH, double_press=0.3)
    assert k.feed(b"\x1b[92;5:1u", 10.0) == (b"", False)
    for t in (10.05, 10.08, 10.11):
        assert k.feed(b"\x1b[92;5:2u", t) == (b"", False)
    assert k.feed(b"\x1b[92;5:3u", 10.15) == (b"", False)
    assert k.feed(b"", 10.3) == (b"", True)


def test_a_press_with_kittys_report_all_keys() -> None:
    """With "report all keys" the Ctrl key itself is reported, and releases of every key:
    none of them is another key typed. They go to the program only if it gets the key."""
    ctrl_down, ctrl_up = b"\x1b[57442;5u", b"\x1b[57442;5:3u"
    press, release = b"\x1b[92;5u", b"\x1b[92;5:3u"
    k = DetachKey(CTRL_BACKSLASH, double_press=0.3)
    assert k.feed(ctrl_down + press + release, 10.0) == (ctrl_down, False)
    assert k.feed(ctrl_up + ctrl_down, 10.1) == (b"", False)
    # The second press: the program gets it and what waited with the first, in order;
    # then its release, which it is owed.
    assert k.feed(press, 10.2) == (ctrl_up + ctrl_down + press, False)
    assert k.feed(release + ctrl_up, 10.25) == (release + ctrl_up, False)
    # A single press: detached in its time, and what waited with it dropped.
    assert k.feed(ctrl_down + press + release + ctrl_up, 11.0) == (ctrl_down, False)
    assert k.feed(b"", 11.3) == (b"", True)


def test_other_keys_and_answers_go_through() -> None:
    k = DetachKey(CTRL_BACKSLASH)
    through = (b"\x1b[97;5u"  # Ctrl-a
               b"\x1b[92u"  # a plain backslash, under "report all keys"
               b"\x1b[92;6u"  # Ctrl-Shift-\\ is another key
               b"\x1b[27;5;93~"  # Ctrl-], modifyOtherKeys
               b"\x1b[?1u\x1b[A\x1b[<0;10;5M"  # an answer, an arrow, a mouse report
               b"\x1b[\x1bx\x1b")  # a broken sequence, and an Escape at the very end
    assert k.feed(through, 10.0) == (through, False)
    assert k.wait(10.0) is None


def test_a_key_split_across_reads_is_the_key() -> None:
    """Every cut of a detach press (after `ESC [`) waits for its end, whatever encoding."""
    for press in PRESSES.values():
        for cut in range(2, len(press)):
            k = DetachKey(CTRL_BACKSLASH, double_press=0.3)
            assert k.feed(b"a" + press[:cut], 10.0) == (b"a", False), (press, cut)
            assert k.wait(10.0) is not None
            assert k.feed(press[cut:], 10.01) == (b"", False), (press, cut)
            assert k.feed(b"", 10.31) == (b"", True), (press, cut)


def test_a_cut_off_sequence_goes_through_in_its_time() -> None:
    k = DetachKey(CTRL_BACKSLASH)
    assert k.feed(b"x\x1b[1;5", 10.0) == (b"x", False)
    assert k.wait(10.0) == pytest.approx(0.05)
    assert k.feed(b"", 10.02) == (b"", False)  # not yet
    assert k.wait(10.02) == pytest.approx(0.03)
    assert k.feed(b"", 10.05) == (b"\x1b[1;5", False)
    assert k.wait(10.05) is None


def test_nothing_pasted_is_the_detach_key() -> None:
    k = DetachKey(CTRL_BACKSLASH)
    paste = b"\x1b[200~one\x1ctwo\x1b[92;5uthree\x1b[201~"
    assert k.feed(paste, 10.0) == (paste, False)
    assert k.wait(10.0) is None
    # A paste split across reads, its end cut off: pasted bytes go on at once, and it is a
    # paste until its end, however long the end takes to come whole.
    assert k.feed(b"\x1b[200~a\x1c\x1b[20", 11.0) == (b"\x1b[200~a\x1c\x1b[20", False)
    assert k.wait(11.0) is None
    assert k.feed(b"1~\x1c", 11.5) == (b"1~", False)  # then the key, after it
    assert k.feed(b"", 11.81) == (b"", True)


def test_a_paste_whose_end_never_comes_ends_all_the_same() -> None:
    """A paste start typed by hand (or a paste cut short) must not hide the detach key for
    the rest of the attachment: once nothing has come for PASTE_IDLE, it has ended."""
    k = DetachKey(CTRL_BACKSLASH)
    assert k.feed(b"\x1b[200~typed by hand", 10.0) == (b"\x1b[200~typed by hand", False)
    assert k.feed(b"\x1c", 10.0 + PASTE_IDLE / 2) == (b"\x1c", False)  # still pasted
    assert k.feed(b"\x1c", 10.0 + PASTE_IDLE * 2) == (b"", False)  # the paste is over
    assert k.feed(b"", 10.0 + PASTE_IDLE * 2 + 0.31) == (b"", True)


def test_a_refused_detach_forgets_the_press() -> None:
    k = DetachKey(CTRL_BACKSLASH)
    assert k.feed(b"\x1b[92;5u", 10.0) == (b"", False)
    assert k.feed(b"", 10.3) == (b"", True)
    k.cancel()
    assert k.wait(10.3) is None
    assert k.feed(b"x", 10.4) == (b"x", False)
