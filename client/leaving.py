"""Leaving: what the local terminal gets back when an attachment ends (docs/design.md §13).

A program in the session switches modes on in the terminal that shows it, with escape
sequences: the alternate screen, mouse and focus reports, bracketed paste, application
keys, a keyboard protocol. Detached in the middle of its life it never switches them off,
and the user's shell would get a terminal that sends mouse reports for clicks, brackets
around pastes and escape sequences for Ctrl-C. So whatever the way out (the detach key, a
signal, the terminal's hang-up, the program's end, an error), escrowctl switches them all off
(`LEAVE`): a full reset (RIS) would do it too, and also wipe the screen the user comes back
to. Each is a sequence a terminal that does not know it ignores.

Two of them need care:

- kitty's keyboard protocol keeps a stack of flags for each screen, and keeps the
  alternate screen's for the next program there (a `less` run later would get keys it
  cannot read). Both stacks are popped empty (more pops than a stack holds empty it, and
  empty is no flags), the alternate one from the alternate screen, and the flags set to
  none on each, for a terminal that keeps them outside the stack. xterm's modifyOtherKeys
  goes back to the terminal's own setting (`CSI > 4 m`), not to off.
- Leaving the alternate screen: a program that entered it with 1049 had the terminal save
  the cursor, and leaving with 1049 puts it back, below what the user had on the screen,
  where escrowctl's next words belong. Leaving with 1049 a screen entered otherwise, or
  not at all, would restore whatever cursor was saved last, anywhere; so the way in is
  watched in what is written to the terminal (`AlternateScreen`), and only then is 1049
  used. Otherwise 1047 leaves the cursor where it is.

Not given back: origin mode (setting or resetting it moves the cursor home), colours and
the title set by OSC (the user's own theme may have set them), and what a sequence cut in
two by the end of a write did to the watch of the alternate screen.
"""

from __future__ import annotations

import re

_KITTY_NONE = b"\x1b[<99u\x1b[=0;1u"  # the stack popped empty, and the flags none
_MAIN_SCREEN = b"\x1b[?1047l"

LEAVE = (
    # One synchronized update (it ends the program's, if one was under way): nothing of
    # the way between shows.
    b"\x1b[?2026h"
    b"\x1b[?1047h" + _KITTY_NONE + _MAIN_SCREEN + _KITTY_NONE +
    b"\x1b[>4m"  # modifyOtherKeys: the terminal's own setting
    b"\x1b[?69l\x1b7\x1b[r\x1b8"  # no margins (resetting them homes the cursor: saved)
    b"\x1b[?1l\x1b>"  # normal cursor keys and keypad
    b"\x1b[?9l\x1b[?1000l\x1b[?1001l\x1b[?1002l\x1b[?1003l"  # no mouse reports...
    b"\x1b[?1005l\x1b[?1006l\x1b[?1015l\x1b[?1016l"  # ...in any encoding
    b"\x1b[?1004l\x1b[?2004l"  # no focus reports, no bracketed paste
    # No reports of a theme change (2031: `CSI ? 997 ; n n`) or of a resize (2048), which
    # the shell would get as typed; 7-bit controls in what the terminal sends (S7C1T).
    b"\x1b[?2031l\x1b[?2048l\x1b F"
    b"\x1b[4l\x1b[?7h\x1b(B\x0f"  # replace mode, autowrap, ASCII in G0 and G0 in use
    b"\x1b[0m\x1b[?25h\x1b[0 q"  # plain text; a visible cursor, of the terminal's own shape
    b"\x1b[?2026l"
)
# LEAVE, for a program on the alternate screen it entered with 1049.
LEAVE_1049 = LEAVE.replace(_MAIN_SCREEN, b"\x1b[?1049l", 1)

# The ways in and out of the alternate screen, and RIS (which leaves it).
_SWITCH = re.compile(rb"\x1b\[\?(1049|1047|47)([hl])|\x1bc")


class AlternateScreen:
    """Which way the program entered the alternate screen, from what is written to the
    terminal (`seen`): b"1049", b"1047" or b"47", or None on the main screen."""

    def __init__(self) -> None:
        self.entered_by: bytes | None = None

    def seen(self, data: bytes) -> None:
        if b"\x1b" not in data:
            return
        for m in _SWITCH.finditer(data):
            self.entered_by = m[1] if m[2] == b"h" else None

    def leave(self) -> bytes:
        """What to write to give the terminal back."""
        return LEAVE_1049 if self.entered_by == b"1049" else LEAVE
