"""After a replay: what a terminal resets when it is resized, reset on the terminal the
replay was written to (docs/design.md §12, "A replay on a real terminal").

A replay was drawn at the sizes the session had while it printed, and it sets what the
program set for those sizes: vim at 25 rows leaves `CSI 1 ; 25 r`, its scroll region, the
whole of that screen. Written to a terminal of 35 rows, that region is rows 1-25 of 35:
what the program draws below it never scrolls there, and a line feed on row 25 scrolls
only the rows above it. A program's repaint does not set it again (vim sets a region only
to scroll, and believes it whole otherwise), because a terminal that is resized resets
it: xterm resets both margins and origin mode (`ScreenResize`), tmux the scroll region
when the rows change (`screen_resize_y`) and the tab stops when the columns do.

`after_replay` is what to write after the replay and before the repaint: the same resets.
It is meant for every replay, at any size: the repaint that follows is itself a resize
(client/repaint.py), so the program draws as for a resized terminal, and the size the
replay was drawn at is not known anyway (a ring may hold several). Sent:

- the scroll region reset to the whole screen (`CSI r`, DECSTBM);
- the left and right margins reset (`CSI s`, DECSLRM), only when the replay left
  DECLRMM set (`CSI ? 69 h`): without it, `CSI s` saves the cursor instead;
- around those, the cursor saved and restored (`ESC 7`, `ESC 8`), because DECSTBM and
  DECSLRM home it, and a shell redraws its prompt on the row the cursor is on. This costs
  the program's own saved cursor, if a save in the replay was waiting for its restore;
- origin mode off (`CSI ? 6 l`), as xterm does, only when the replay left it on: turning
  it off homes the cursor too, and a program that set it draws by cursor addressing.

Not sent: tab stops (tmux resets them when the width changes, xterm never; a program
that sets its own, rare, sets them again after a resize), and the cursor's position,
which the program sets as it repaints.
"""

from __future__ import annotations

SAVE_CURSOR, RESTORE_CURSOR = b"\x1b7", b"\x1b8"
WHOLE_SCROLL_REGION = b"\x1b[r"
WHOLE_LEFT_RIGHT_MARGINS = b"\x1b[s"  # DECSLRM while DECLRMM is set
ORIGIN_MODE_OFF = b"\x1b[?6l"


# DECOM (6) and DECLRMM (69) set or reset, alone or among other modes; and what resets every
# mode (RIS, DECSTR). The last of them in a replay says whether the mode is left set.
_MODES = (b"6", b"69")
# Compiled when first used. Those with a 6 among their parameters, which are then split:
# the 6 or 69 found by the pattern itself (`(?:[0-9;]*;)?(?:69|6)(?:;[0-9;]*)?`) was
# looked for again at each `;` and each try ran to the end, 26 s for 64 KiB of `6;`. The
# first 6 is kept (an atomic group) and the rest taken possessively: one pass.
_MODE = rb"\x1b\[\?((?>[0-9;]*?6)[0-9;]*+)([hl])"
_RESETS = (b"\x1bc", b"\x1b[!p")


def _left_set(replay: bytes) -> set[bytes]:
    """The modes of `_MODES` that `replay` leaves set."""
    reset = max(replay.rfind(every) for every in _RESETS)
    import re  # here, not at import: escrowctl imports this module with the package

    last: dict[bytes, bool] = {}
    for found in re.compile(_MODE).finditer(replay, reset + 1):
        for mode in found.group(1).split(b";"):
            if mode in _MODES:
                last[mode] = found.group(2) == b"h"
    return {mode for mode, on in last.items() if on}


def after_replay(replay: bytes | bytearray | memoryview) -> bytes:
    """The bytes to write to a terminal right after `replay` (and before the program is
    made to repaint): the margins and origin mode reset to what a resized terminal has,
    the cursor where the replay left it (unless origin mode was on)."""
    left_set = _left_set(bytes(replay))
    resets = WHOLE_SCROLL_REGION
    if b"69" in left_set:
        resets += WHOLE_LEFT_RIGHT_MARGINS
    return (SAVE_CURSOR + resets + RESTORE_CURSOR
            + (ORIGIN_MODE_OFF if b"6" in left_set else b""))
