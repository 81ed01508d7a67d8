"""The detach key: how the user leaves an attached session without ending it (docs/design.md §13).

A control key (`^\\` by default), given on the command line in caret notation or as
`C-x`, or `none`. One press detaches: once `DOUBLE_PRESS` seconds pass with nothing after
it, or at once when another key follows. Two presses in a row send the key itself to the
program, so that a program that needs that key still gets it. Escape is never a detach
key: it begins the sequences of arrow and function keys.
"""

from __future__ import annotations

import re

DEFAULT_DETACH_KEY = "^\\"
# A second press of the detach key within this many seconds sends the key itself to the
# program; a single press detaches once this has passed (or at once, when another key
# follows it).
DOUBLE_PRESS = 0.3

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
    """Finds the detach key in what the user types. One press detaches: once `double_press`
    seconds pass with nothing after it, or at once when another key follows. Two presses
    in a row send the key itself to the program. With `key` None, everything goes through."""

    def __init__(self, key: int | None, double_press: float = DOUBLE_PRESS) -> None:
        self.key = key
        self.double_press = double_press
        self._pressed_at: float | None = None

    def feed(self, data: bytes, now: float) -> tuple[bytes, bool]:
        """What of `data` (typed at `now`) goes to the program, and whether to detach now.
        Whatever follows the press that detaches is not for the session: it is dropped."""
        if self.key is None:
            return data, False
        out = bytearray()
        i = 0
        while i < len(data):
            if self._pressed_at is not None:
                if data[i] != self.key:
                    return bytes(out), True
                out.append(self.key)  # pressed twice: the key itself
                self._pressed_at = None
                i += 1
                continue
            press = data.find(self.key, i)
            if press < 0:
                out += data[i:]
                break
            out += data[i:press]
            self._pressed_at = now
            i = press + 1
        return bytes(out), False

    def cancel(self) -> None:
        """Forget a press that was waiting (its detach was refused)."""
        self._pressed_at = None

    def wait(self, now: float) -> float | None:
        """Seconds until a press waiting for a second one detaches (0 once it does); None
        when no press is waiting."""
        if self._pressed_at is None:
            return None
        return max(0.0, self._pressed_at + self.double_press - now)
