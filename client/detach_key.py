"""The detach key: how the user leaves an attached session without ending it (docs/design.md §13).

A control key (`^\\` by default), given on the command line in caret notation or as
`C-x`, or `none`. One press detaches: once `DOUBLE_PRESS` seconds pass with nothing after
it, or at once when another key follows. Two presses in a row send the key itself to the
program, so that a program that needs that key still gets it. Escape is never a detach
key: it begins the sequences of arrow and function keys.

The key is found as the byte a terminal sends for it, and as the escape sequence it sends
instead once a program has turned on kitty's keyboard protocol or xterm's modifyOtherKeys
(`key_events`): under those, a detach key looked for as a byte would never come, and the
user could not leave. Its second press goes to the program in the encoding it came in.
"""

from __future__ import annotations

import re

from . import key_events

DEFAULT_DETACH_KEY = "^\\"
# A second press of the detach key within this many seconds sends the key itself to the
# program; a single press detaches once this has passed (or at once, when another key
# follows it).
DOUBLE_PRESS = 0.3
# A terminal writes a key's escape sequence at once; one cut off by the end of a read waits
# this long for the rest, and then goes to the program as it is.
SPLIT_WAIT = 0.05
# A bracketed paste whose end has not come this long after its last bytes has ended: a
# terminal sends a paste whole, and a paste start typed by hand must not hide the key.
PASTE_IDLE = 1.0

_KEY_RE = re.compile(r"(?:\^|c-|ctrl[-+])(.)", re.IGNORECASE)


def parse_key(text: str) -> int | None:
    """A detach key as given on the command line: a control key in caret notation (`^\\`,
    `^]`, `^A`, `^?`) or as `C-x` / `Ctrl-x` (any case), or `none` for no detach key.
    Returns its byte, or None for `none`. Raises ValueError for anything else, and for
    Escape (`^[`), which begins the sequences of arrow and function keys."""
    if text.lower() == "none":
        return None
    m = _KEY_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a control key: give it as ^X or C-x "
                         f"(e.g. {DEFAULT_DETACH_KEY}), or none")
    char = m[1].upper()
    if char == "?":
        return 0x7F
    if not "@" <= char <= "_":
        raise ValueError(f"{text!r} is not a control key (^@, ^A-^Z, ^[, ^\\, ^], ^^, ^_, ^?)")
    if char == "[":
        raise ValueError(f"{text!r} is Escape, which begins the arrow and function keys; "
                         "choose another key")
    return ord(char) - 0x40


def key_name(key: int | None) -> str:
    """How `parse_key` spells `key` (`^\\`), or `none`."""
    if key is None:
        return "none"
    return "^?" if key == 0x7F else "^" + chr(key + 0x40)


class DetachKey:
    """Finds the detach key in what the user types, as a byte or as a key event of a keyboard
    protocol (`key_events`). One press detaches: once `double_press` seconds pass with
    nothing after it, or at once when another key follows. Two presses in a row send the
    key itself to the program, as the second came (a byte, or its escape sequence). With
    `key` None, everything goes through.

    What is not a key typed does not count as one following a press: the key's own repeats
    and release (a key held down is one press: they are dropped, as the press is), the
    release of any other key, a modifier key alone (these wait with the press, and go to
    the program only if a second press follows).
    Nothing inside a bracketed paste is the detach key: pasted text goes to the program at
    once, and the paste's end is found even when split between reads; a paste whose end
    does not come within `PASTE_IDLE` of its last bytes (or a paste start typed by hand)
    ends there.
    A CSI sequence cut off at the end of a read waits up to `SPLIT_WAIT` for its end."""

    def __init__(self, key: int | None, double_press: float = DOUBLE_PRESS) -> None:
        self.key = key
        self.double_press = double_press
        self._codes = key_events.ctrl_codes(key) if key is not None else frozenset()
        self._pressed_at: float | None = None  # a press, waiting for what comes next
        self._held = bytearray()  # what is not a key typed, since that press
        self._passing = False  # the last press went to the program: its release follows
        self._partial = b""  # a CSI sequence cut off at the end of the last read
        self._partial_at = 0.0
        self._in_paste = False
        self._paste_tail = b""  # the last bytes of a paste, to find its end across reads
        self._paste_seen = 0.0  # when the paste last sent something

    def feed(self, data: bytes, now: float) -> tuple[bytes, bool]:
        """What of `data` (typed at `now`) goes to the program, and whether to detach now.
        Whatever follows the press that detaches is not for the session: it is dropped.
        `feed(b"", now)`, once `wait` says 0, gives what was waiting for its time."""
        if self.key is None:
            return data, False
        if self._in_paste and data:
            if now >= self._paste_seen + PASTE_IDLE:
                self._in_paste = False  # an end that never came: a paste is sent at once
            self._paste_seen = now
        out = bytearray()
        if self._pressed_at is not None and now >= self._pressed_at + self.double_press:
            return self._detach(out)
        partial, since, self._partial = self._partial, self._partial_at, b""
        if partial and not data and now >= since + SPLIT_WAIT:
            # Cut off for good: what it began is not the detach key.
            return self._detach(out) if self._other(partial, out) else (bytes(out), False)
        data = partial + data
        i = 0
        while i < len(data):
            at, kind = self._next(data, i)
            if self._other(data[i:at], out):
                return self._detach(out)
            if kind == "end":
                break
            if kind == "pasted":  # the paste's end went on with it
                i = at
                continue
            if kind == "partial":
                self._partial, self._partial_at = data[at:], since if partial and at == 0 else now
                break
            if kind == "key":
                self._press(data[at : at + 1], now, out)
                i = at + 1
                continue
            whole = key_events.CSI.match(data, at)
            if whole is None:  # not a CSI sequence after all: two bytes like any others
                if self._other(data[at : at + 2], out):
                    return self._detach(out)
                i = at + 2
            elif self._sequence(whole[0], now, out):
                return self._detach(out)
            else:
                i = whole.end()
        return bytes(out), False

    def cancel(self) -> None:
        """Forget a press that was waiting (its detach was refused)."""
        self._pressed_at = None
        self._held.clear()

    def wait(self, now: float) -> float | None:
        """Seconds until something waiting is due (0 once it is: then call `feed(b"", now)`);
        None when nothing waits."""
        due = []
        if self._pressed_at is not None:
            due.append(self._pressed_at + self.double_press)
        if self._partial:
            due.append(self._partial_at + SPLIT_WAIT)
        return max(0.0, min(due) - now) if due else None

    # --- what the input is made of ----------------------------------------------------

    def _next(self, data: bytes, i: int) -> tuple[int, str]:
        """Where the next thing that may matter is, from `i`, and what: the detach key's
        byte ("key"), a CSI sequence ("csi"), one cut off by the end of `data` ("partial"),
        or nothing more ("end"). In a paste, only its end matters."""
        if self._in_paste:
            # Pasted bytes go on at once; only the paste's end is looked for, across reads
            # too (its first bytes may have gone on with the read before).
            tail, end = self._paste_tail, len(key_events.PASTE_END)
            found = (tail + data[i:]).find(key_events.PASTE_END)
            if found < 0:
                self._paste_tail = (tail + data[i:])[-(end - 1):]
                return len(data), "end"
            self._in_paste, self._paste_tail = False, b""
            return i + found - len(tail) + end, "pasted"
        csi = data.find(b"\x1b[", i)
        key = data.find(self.key, i) if self.key is not None else -1
        if key >= 0 and (csi < 0 or key < csi):
            return key, "key"
        if csi < 0:
            return len(data), "end"
        return csi, "partial" if key_events.PARTIAL_CSI.match(data, csi) else "csi"

    def _sequence(self, seq: bytes, now: float, out: bytearray) -> bool:
        """A whole CSI sequence; True if it follows a press and so detaches."""
        if seq == key_events.PASTE_START:
            self._in_paste, self._paste_tail, self._paste_seen = True, b"", now
            return self._other(seq, out)
        event = key_events.parse(seq)
        if event is None:
            return self._other(seq, out)
        if event.is_ctrl_key(self._codes):
            if event.event == key_events.PRESS:
                self._press(seq, now, out)
            elif self._passing:  # the repeats and the release of a press the program got
                out += seq
                self._passing = event.event != key_events.RELEASE
            return False
        if event.neutral:
            (self._held if self._pressed_at is not None else out).extend(seq)
            return False
        return self._other(seq, out)

    def _press(self, encoded: bytes, now: float, out: bytearray) -> None:
        if self._pressed_at is None:
            self._pressed_at, self._passing = now, False
            return
        out += self._held + encoded  # pressed twice: the key itself, as it came
        self.cancel()
        self._passing = True

    def _other(self, data: bytes, out: bytearray) -> bool:
        """Bytes that are not the detach key; True if they follow a press: detach."""
        if not data:
            return False
        if self._pressed_at is not None:
            return True
        out += data
        return False

    def _detach(self, out: bytearray) -> tuple[bytes, bool]:
        self.cancel()
        self._partial, self._in_paste, self._passing = b"", False, False
        return bytes(out), True
