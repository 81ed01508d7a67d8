"""Key events: how a terminal sends a control key, whichever keyboard protocol is on
(docs/design.md §13).

A terminal sends Ctrl-\\ as the byte 0x1c, until a program turns a keyboard protocol on;
then the same key comes as an escape sequence, and a detach key looked for as a byte alone
would never be seen. The sequences that can carry a control key:

    CSI code[:shifted[:base]] ; mods[:event] [; text] u    kitty's keyboard protocol
    CSI code ; mods u                                     fixterms; xterm, formatOtherKeys 1
    CSI 27 ; mods ; code ~                                xterm's modifyOtherKeys (mode 2)

`code` is the key's Unicode code point, unshifted (92 for `\\`), `base` the key of the same
place on a US keyboard, and `mods` 1 + a bit field (4 is Ctrl; 64 and 128 are Caps Lock and
Num Lock, which change nothing here); `event` is 1 for a press, 2 a repeat, 3 a release
(kitty, with its "report event types" flag). So Ctrl-\\ is `CSI 92;5u`, or `CSI 92;5:1u`,
`CSI 27;5;92~`. Which keys send which control byte with Ctrl, where the terminal sends
bytes, is kitty's table (`ctrl_codes`): Ctrl-4 sends 0x1c as Ctrl-\\ does.

Everything else a terminal sends in a CSI sequence (arrows, mouse and focus reports, answers
to queries: `CSI ? 1 u` is the answer to kitty's query, not a key) is not a key event here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRESS, REPEAT, RELEASE = 1, 2, 3
CTRL = 4  # in mods - 1
_LOCKS = 64 | 128  # Caps Lock, Num Lock

# A whole CSI sequence: parameters, intermediates, a final byte (ECMA-48 5.4).
CSI = re.compile(rb"\x1b\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]")
# The beginning of one, cut off at the end of a read; longer than any key event, it is not.
PARTIAL_CSI = re.compile(rb"\x1b\[[\x30-\x3f]{0,40}\Z")
PASTE_START, PASTE_END = b"\x1b[200~", b"\x1b[201~"  # bracketed paste

# kitty's codes for the modifier and lock keys themselves (reported with "report all keys").
_MODIFIER_KEYS = range(57441, 57455)
_LOCK_KEYS = range(57358, 57361)

# kitty's table of the ASCII keys that send a C0 byte with Ctrl (its "legacy ctrl mapping"),
# beyond the letters, which send their place in the alphabet.
_CTRL_SYMBOLS = {
    0x00: " @2", 0x1B: "[3", 0x1C: "\\4", 0x1D: "]5", 0x1E: "^6~", 0x1F: "_/7", 0x7F: "?8",
}


def ctrl_codes(byte: int) -> frozenset[int]:
    """The code points of the keys that send `byte` when pressed with Ctrl."""
    codes = {ord(c) for c in _CTRL_SYMBOLS.get(byte, "")}
    if 1 <= byte <= 26:
        codes.add(0x60 + byte)  # Ctrl-a is 0x01 (kitty reports the lower-case key)
    return frozenset(codes)


@dataclass(frozen=True)
class KeyEvent:
    """A key as kitty's protocol, fixterms or modifyOtherKeys report it."""

    code: int
    base: int | None  # the key at the same place on a US keyboard, if the terminal said
    mods: int  # the bit field: mods as sent, less 1
    event: int = PRESS

    def is_ctrl_key(self, codes: frozenset[int]) -> bool:
        """One of `codes` with Ctrl alone (locks aside)."""
        return (self.mods & ~_LOCKS) == CTRL and (self.code in codes or self.base in codes)

    @property
    def neutral(self) -> bool:
        """Not a key typed: a release, or a modifier or lock key by itself."""
        return self.event == RELEASE or self.code in _MODIFIER_KEYS or self.code in _LOCK_KEYS


_NUMBERS = re.compile(rb"[0-9:;]*")


def parse(sequence: bytes) -> KeyEvent | None:
    """The key event a whole CSI sequence (from `CSI`) reports, or None if it is none."""
    final, params = sequence[-1:], sequence[2:-1]
    if not _NUMBERS.fullmatch(params):
        return None  # a private marker (`?`, `>`...): an answer, not a key
    try:
        fields = [[int(n) if n else None for n in f.split(b":")] for f in params.split(b";")]
    except ValueError:
        return None
    if final == b"~" and len(fields) == 3 and fields[0] == [27]:
        match fields[1], fields[2]:  # modifyOtherKeys: CSI 27 ; mods ; code ~
            case [int(mods)], [int(code)]:
                return KeyEvent(code, None, mods - 1)
        return None
    if final != b"u" or len(fields) > 3:
        return None
    key, *alternates = fields[0]
    modifiers, *event = fields[1] if len(fields) > 1 else [None]
    if key is None or len(alternates) > 2 or len(event) > 1:
        return None
    base = alternates[1] if len(alternates) == 2 else None
    return KeyEvent(key, base, (modifiers or 1) - 1, event[0] or PRESS if event else PRESS)
