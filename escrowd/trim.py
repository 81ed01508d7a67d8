"""Where a wrapped replay may start (docs/design.md §12, "A clean start").

A ring that wrapped dropped its oldest bytes wherever the count fell: its replay may begin in
the middle of a line, of an escape sequence or of a UTF-8 character. Written as it is to a
fresh terminal, that shows as debris: `31m`, the rest of a window title or of an image's
base64, a U+FFFD, half a line. `clean_start` says how much of the head to cut.

What can be known from the middle of a stream, in the parser every terminal follows (DEC's,
as in xterm): ESC begins a new sequence from any state, even inside another one or a string;
CAN and SUB cancel whatever was in progress; a string (OSC, DCS, SOS, PM, APC) ends only at
ST (`ESC \\`) or BEL (xterm's end of an OSC; no other string holds one), and a line feed
inside one is just part of it. Nothing else is certain: `31mhello` may be the end of a CSI
or plain text. Two assumptions, true of what programs print, fill the gap: no CSI or ESC
sequence holds a line feed or a BEL, and a string holds no ESC other than its ST. C1
controls (0x80-0x9F) are not interpreted: in UTF-8 they are continuation bytes, and
terminals in UTF-8 mode treat them so.
"""

from __future__ import annotations

import re

# A screenful of text with its colour codes (80 x 24 cells are 1,920 bytes): more than the
# longest line most programs print, SGR codes and all, so a replay almost always starts on
# a whole line. Yet at most 0.4% of a full default ring (1 MiB) and a quarter of the
# smallest (16 KiB). A line longer than this has lost its head anyway: keeping the rest
# torn beats cutting more of the replay away.
DEFAULT_LIMIT = 4096

ESC, BEL, LF, CAN, SUB = 0x1B, 0x07, 0x0A, 0x18, 0x1A
_SYNC = re.compile(rb"[\x07\x18\x1a\x1b]")  # the bytes that say where the parser is
# What may be left of a CSI after its ESC (`[`, parameters, intermediates, a final byte),
# or of an ESC sequence (intermediates, a final byte: `(B`, `7`).
_TAIL = re.compile(rb"\[?[0-?]*[ -/]*[@-~]|[ -/]*[0-~]")
_CONTINUATION = bytes(range(0x80, 0xC0))
_STRING_OPENERS = b"]PX^_"  # after ESC: OSC, DCS, SOS, PM, APC
_GROUND, _ESCAPE, _CSI, _STRING = range(4)


def clean_start(replay: bytes | memoryview, limit: int = DEFAULT_LIMIT) -> int:
    """How many leading bytes of `replay`, the contents of a ring that wrapped, to cut so
    that the rest starts outside any escape sequence or string and not inside a UTF-8
    character (of UTF-8 text). Between 0 and `len(replay)`; 0 for an empty replay.

    Rules, in order:
    - A line start: just after the first line feed that is not inside a string, when one
      is among the first `limit` bytes. A line feed before the first ESC, BEL, CAN or SUB
      counts unless that byte ends a string (BEL, ST, CAN, SUB): then the line feed may
      have been inside it (a title, an image's base64) and only one after counts.
    - Otherwise the first position known to be clean: just after the terminator of the
      string the replay started in; else past the continuation bytes it starts with, or
      past what may be the end of a CSI or ESC sequence (`1;31m`, `[0m`, `(B`). That guess
      may cut a letter or two of text that was clean, never leave debris.
    - A replay that really started at a line start loses its first line all the same:
      nothing in the bytes tells it from one torn there. Call this only for a ring that
      wrapped.
    - A replay with nothing to go by among its first `limit` bytes (all continuation bytes,
      or a string longer than that) loses at most `limit` bytes, and the rest is shown as
      it is: cutting more could not make it clean and would only lose more.

    Only the first `limit` bytes are looked at (and one more, to tell an ST at the edge),
    so the cost does not depend on the size of the ring.
    """
    window = bytes(replay[: limit + 1])
    found = _SYNC.search(window, 0, limit)
    if found is None:
        sync, ends_string = min(len(window), limit), False
    else:
        sync = found.start()
        ends_string = window[sync] != ESC or window[sync + 1 : sync + 2] == b"\\"
    if ends_string:
        # BEL, ST, CAN or SUB: what came before may have been a string, where a line feed
        # is no line start. After it, the parser is in ground state whatever it was in.
        start = fallback = sync + (2 if window[sync] == ESC else 1)
    else:
        # An ESC that starts a sequence, or nothing: the replay did not start inside a
        # string (a string holds no ESC but its ST's), so before `sync` come at most the
        # end of a short sequence, then text, and a line feed there is a line start.
        line = window.find(b"\n", 0, sync)
        if line >= 0:
            return line + 1
        start, fallback = sync, _tail(window[:sync])
    line_start = _line_start(window, start, limit)
    return fallback if line_start is None else line_start


def _tail(text: bytes) -> int:
    """How much to skip of `text`, which is not inside a string: the rest of a UTF-8
    character, or what may be the end of a CSI or ESC sequence."""
    rest = len(text) - len(text.lstrip(_CONTINUATION))
    if rest:
        return rest
    match = _TAIL.match(text)
    return match.end() if match else 0


def _line_start(window: bytes, start: int, limit: int) -> int | None:
    """Just after the first line feed in ground state from `start` (where the parser is in
    ground state, or at an ESC) and before `limit`, following DEC's parser; None if none."""
    end = min(len(window), limit)
    if window.find(b"\n", start, end) < 0:
        return None  # the common case of a full-screen program's output, at no cost
    state = _GROUND
    for i in range(start, end):
        byte = window[i]
        if byte == ESC:
            state = _ESCAPE  # from any state; inside a string it starts ST
        elif byte in (CAN, SUB):
            state = _GROUND
        elif state == _GROUND:
            if byte == LF:
                return i + 1
        elif state == _ESCAPE:
            if byte == 0x5B:  # [
                state = _CSI
            elif byte in _STRING_OPENERS:
                state = _STRING
            elif 0x30 <= byte <= 0x7E:  # a final byte (`\` makes ST, which ends a string)
                state = _GROUND
            # an intermediate (0x20-0x2F) or a C0 control: still in the sequence
        elif state == _CSI:
            if 0x40 <= byte <= 0x7E:
                state = _GROUND
        elif byte == BEL:  # in a string: BEL ends an OSC
            state = _GROUND
    return None
