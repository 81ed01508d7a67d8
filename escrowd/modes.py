"""The terminal modes a program set, read from its output without a terminal emulator
(docs/design.md §12, "The modes a replay starts in").

A full-screen program switches its terminal into modes once, at its start: the alternate
screen, a hidden cursor, application cursor keys and keypad, mouse reports, bracketed paste,
a keyboard protocol. A replay whose ring has lost those bytes, written to a fresh terminal,
leaves it in none of them: vim is drawn on the main screen with the cursor it hid, and its
exit has no main screen to go back to. `Modes` is the state those sequences set, as a
terminal keeps it; `Scanner` finds them in output fed to it in pieces; `Modes.preamble` is
what sets them again on a terminal fresh from a reset.

What is followed, as xterm (and tmux, and kitty for its keyboard protocol) keep it:
- DEC private modes (`CSI ? Pm h` / `l`): the alternate screen (1049, 1047, 47), the cursor
  (25), cursor keys (1), the keypad (66, and `ESC =` / `ESC >`), origin mode (6), autowrap
  (7), mouse tracking (9, 1000, 1002, 1003: one of them at a time, any reset ends it; 1001
  only ends it), the mouse encoding (1005, 1006, 1015, 1016: one at a time), focus events
  (1004), bracketed paste (2004);
- the scroll margins (DECSTBM `CSI t ; b r`), the cursor style (DECSCUSR `CSI n SP q`);
- kitty's keyboard protocol: a stack of flags per screen, main and alternate (`CSI > f u`
  pushes, `CSI < n u` pops, `CSI = f ; m u` changes the top), 8 deep, pushing onto a full
  stack dropping its oldest, as kitty does; xterm's modifyOtherKeys (`CSI > 4 ; n m`,
  `CSI > 4 n`);
- RIS (`ESC c`) resets all of it; DECSTR (`CSI ! p`) what DEC's soft reset resets and xterm
  agrees on: the cursor shown and its style, cursor keys, keypad, origin mode, margins.

Scanning follows DEC's parser where it matters and no further (the same reading as
escrowd.trim): ESC starts a sequence anywhere, so a sequence is a match that begins at an
ESC and holds none after it; CAN, SUB and any other control byte inside one spoil it (a
terminal would execute a C0 control there and go on: programs do not print that); C1
controls (0x9B for CSI) are not read, since in UTF-8 they are continuation bytes; strings
(OSC, DCS) are not told apart, since a string holds no ESC but its ST's. Parameters are
bounded (64 characters after `?`, 24 elsewhere): a longer sequence is not one a program
prints, and is ignored.

The cost is in the bytes, not the parsing: one regular expression over each piece that
holds an ESC, none over one that does not (a `find`, which is memchr). Only sequences that
change a mode are matched at all, so a match is rare and its handling does not count.
A piece may end inside a sequence: the scanner keeps that start (at most `LONGEST` bytes)
and finishes it with the next piece, so any stream cut anywhere gives the state it gives
whole (tests/test_modes.py checks that for arbitrary streams and cuts).
"""

from __future__ import annotations

import functools
import mmap
import re

LONGEST = 68  # the longest sequence matched: ESC [ ? 64 parameter bytes, a final byte
STACK = 8  # kitty keeps this many keyboard flag sets per screen
_ESC = b"\x1b"

# Every sequence that changes a mode, and nothing else (an SGR, a cursor move, a query all
# fail, cheaply: no alternative backtracks, and no group is captured, which would halve the
# speed: `_apply` reads the match itself). Each alternative ends with its final byte, and no
# two can match at one place, so where a match ends does not depend on what follows.
_SEQUENCE = re.compile(
    rb"\x1b(?:\[(?:"
    rb"\?[0-9;]{1,64}+[hl]"  # DEC private modes, set or reset
    rb"|[<=>][0-9;]{0,24}+u"  # kitty's keyboard protocol
    rb"|>[0-9;]{0,24}+[mn]"  # xterm's key modifiers (XTMODKEYS), set or disabled
    rb"|!p"  # DECSTR
    rb"|[0-9;]{0,24}+(?:r| q)"  # DECSTBM, DECSCUSR
    rb")|[c=>])"  # RIS, DECKPAM, DECKPNM
)
# What may be the start of one of them, cut at the end of a piece (every proper prefix,
# and a few that are not: a false start is dropped by the next piece).
_PARTIAL = re.compile(
    rb"\x1b(?:\[(?:\?[0-9;]{0,64}|[<=>][0-9;]{0,24}|!|[0-9;]{0,24} ?)?)?")

ALTERNATE = (47, 1047, 1049)
TRACKING = (9, 1000, 1002, 1003)  # the mouse reports; 1001 (highlight) is only switched off
ENCODINGS = (1005, 1006, 1015, 1016)
_FLAGS = {1: "cursor_keys", 6: "origin", 7: "autowrap", 25: "cursor", 66: "keypad",
          1004: "focus_events", 2004: "bracketed_paste"}
MAX_ROW = 65535  # a margin past this is not a terminal's (the protocol's own bound on rows)


# What a scanner reads: bytes, or a ring's storage in its state file (escrowd.ring_modes).
Buffer = bytes | bytearray | mmap.mmap


class Modes:
    """The modes a terminal is in, as its output set them (defaults: a terminal just reset).
    `alternate` is the mode that entered the alternate screen (0: the main screen); `mouse`
    and `encoding` the mouse tracking and encoding modes (0: none); `margins` the scroll
    region's top and bottom rows as set, 1-based, a bottom of 0 the last row (None: the
    whole screen); `keyboard` the kitty flag
    stacks of the main and the alternate screen, top last."""

    __slots__ = ("alternate", "cursor", "cursor_keys", "keypad", "origin", "autowrap",
                 "mouse", "encoding", "focus_events", "bracketed_paste", "margins",
                 "keyboard", "modify_other_keys", "cursor_style")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """RIS: a terminal's defaults."""
        self.alternate = self.mouse = self.encoding = 0
        self.cursor = self.autowrap = True
        self.cursor_keys = self.keypad = self.origin = False
        self.focus_events = self.bracketed_paste = False
        self.margins: tuple[int, int] | None = None
        self.keyboard: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self.modify_other_keys = self.cursor_style = 0

    def soft_reset(self) -> None:
        """DECSTR."""
        self.cursor, self.cursor_style = True, 0
        self.cursor_keys = self.keypad = self.origin = False
        self.margins = None

    def copy(self) -> Modes:
        other = Modes.__new__(Modes)
        for name in Modes.__slots__:
            setattr(other, name, getattr(self, name))
        return other

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Modes) and self.stored() == other.stored()

    def __repr__(self) -> str:
        return f"Modes({', '.join(self.names()) or 'defaults'})"

    # --- what the sequences do ------------------------------------------------------------

    def private(self, params: bytes, on: bool) -> None:
        """`CSI ? params h` (`on`) or `l`."""
        for mode in _private_modes(params):
            if mode in _FLAGS:
                setattr(self, _FLAGS[mode], on)
            elif mode in ALTERNATE:
                if on and not self.alternate:
                    self.alternate = mode
                elif not on:
                    self.alternate = 0
            elif mode in TRACKING or mode == 1001:
                self.mouse = mode if on and mode != 1001 else 0
            elif mode in ENCODINGS:
                if on:
                    self.encoding = mode
                elif self.encoding == mode:
                    self.encoding = 0

    def kitty(self, kind: bytes, params: bytes) -> None:
        """`CSI > f u`, `CSI < n u`, `CSI = f ; m u` on the current screen's stack."""
        numbers = _numbers(params, 2)
        if numbers is None:
            return
        first = numbers[0] if numbers else None
        screen = 1 if self.alternate else 0
        stack = self.keyboard[screen]
        if kind == b">":
            stack = (stack + ((first or 0) & 0x1F,))[-STACK:]
        elif kind == b"<":
            count = first or 1
            stack = stack[: max(0, len(stack) - count)]
        else:
            how = numbers[1] if len(numbers) > 1 and numbers[1] is not None else 1
            flags, top = (first or 0) & 0x1F, stack[-1] if stack else 0
            new = {1: flags, 2: top | flags, 3: top & ~flags}.get(how)
            if new is None:
                return
            stack = stack[:-1] + (new,)
        self.keyboard = ((stack, self.keyboard[1]) if screen == 0
                         else (self.keyboard[0], stack))

    def modifiers(self, params: bytes, final: bytes) -> None:
        """`CSI > 4 ; n m` (modifyOtherKeys n), `CSI > 4 m` and `CSI > m` (its default),
        `CSI > 4 n` (off)."""
        parts = params.split(b";") if params else []
        if parts and parts[0] != b"4":
            return  # another key modifier resource
        value = parts[1] if len(parts) > 1 else b""
        if final == b"n" or not value:
            self.modify_other_keys = 0
        elif len(value) <= 2 and 0 <= int(value) <= 3:
            self.modify_other_keys = int(value)

    def margins_set(self, params: bytes) -> None:
        """DECSTBM: `CSI t ; b r` (missing or 0: the screen's edge)."""
        margins = _margins(params)
        if margins != _IGNORED:  # (a terminal ignores a region it cannot have)
            self.margins = margins

    def style(self, params: bytes) -> None:
        """DECSCUSR: `CSI n SP q` (0 to 6)."""
        if len(params) <= 1 and (not params or params <= b"6"):
            self.cursor_style = int(params or b"0")

    def escape(self, final: bytes) -> None:
        """`ESC c` (RIS), `ESC =` (DECKPAM), `ESC >` (DECKPNM)."""
        if final == b"c":
            self.reset()
        else:
            self.keypad = final == b"="

    # --- what is stored (a state file's record) -------------------------------------------

    def stored(self) -> list[int]:
        """These modes as a record keeps them ([] for the defaults): see `from_stored`."""
        values = self._values()
        return [] if values == _DEFAULT_STORED else values

    def _values(self) -> list[int]:
        top, bottom = self.margins or (0, 0)
        flags = [self.cursor, self.cursor_keys, self.keypad, self.origin, self.autowrap,
                 self.focus_events, self.bracketed_paste]
        values = [1, self.alternate, sum(1 << i for i, f in enumerate(flags) if f),
                  self.mouse, self.encoding, top, bottom, self.modify_other_keys,
                  self.cursor_style]
        for stack in self.keyboard:
            values += [len(stack), *stack]
        return values

    @classmethod
    def from_stored(cls, values: list[int]) -> Modes | None:
        """The modes `stored` gave, or None if `values` is not something it gives (a record
        is not believed unchecked: every value is held to the set it comes from)."""
        modes = cls()
        if not values:
            return modes
        if len(values) < 11 or values[0] != 1 or len(values) > 11 + 2 * STACK:
            return None
        alternate, flags, mouse, encoding, top, bottom, keys, style = values[1:9]
        if (alternate not in (0, *ALTERNATE) or not 0 <= flags < 1 << 7
                or mouse not in (0, *TRACKING) or encoding not in (0, *ENCODINGS)
                or not 0 <= keys <= 3 or not 0 <= style <= 6
                or not _margins_valid(top, bottom)):
            return None
        at, stacks = 9, []
        for _ in range(2):
            depth = values[at] if at < len(values) else -1
            stack = tuple(values[at + 1 : at + 1 + depth]) if 0 <= depth <= STACK else None
            if stack is None or len(stack) != depth or any(not 0 <= f <= 0x1F for f in stack):
                return None
            stacks.append(stack)
            at += 1 + depth
        if at != len(values):
            return None
        (modes.cursor, modes.cursor_keys, modes.keypad, modes.origin, modes.autowrap,
         modes.focus_events, modes.bracketed_paste) = (bool(flags >> i & 1) for i in range(7))
        modes.alternate, modes.mouse, modes.encoding = alternate, mouse, encoding
        modes.margins = (top, bottom) if top else None
        modes.modify_other_keys, modes.cursor_style = keys, style
        modes.keyboard = (stacks[0], stacks[1])
        return modes

    # --- setting them again -----------------------------------------------------------------

    def preamble(self) -> tuple[bytes, list[str]]:
        """The bytes that put a terminal fresh from a reset into these modes, and the names
        of the modes they set (`MODE_NAMES`, in that order); empty for the defaults."""
        parts: list[tuple[str, bytes]] = []
        main, alternate = self.keyboard
        keyboard = b"".join(b"\x1b[>%du" % flags for flags in main)
        if self.alternate:
            keyboard_alt = b"".join(b"\x1b[>%du" % flags for flags in alternate)
            parts.append(("alternate_screen", keyboard + b"\x1b[?%dh" % self.alternate
                          + keyboard_alt))
            if main or alternate:
                parts.append(("kitty_keyboard", b""))
        elif main or alternate:
            # The alternate screen keeps a stack of its own, for the next program there.
            keyboard_alt = b"".join(b"\x1b[>%du" % flags for flags in alternate)
            parts.append(("kitty_keyboard", keyboard + (
                b"\x1b[?1047h" + keyboard_alt + b"\x1b[?1047l" if alternate else b"")))
        if self.margins is not None:
            top, bottom = self.margins
            parts.append(("scroll_region", b"\x1b[%d;%dr" % (top, bottom) if bottom
                          else b"\x1b[%dr" % top))
        if self.origin:
            parts.append(("origin_mode", b"\x1b[?6h"))
        if not self.autowrap:
            parts.append(("no_autowrap", b"\x1b[?7l"))
        if self.cursor_keys:
            parts.append(("cursor_keys", b"\x1b[?1h"))
        if self.keypad:
            parts.append(("keypad", b"\x1b="))
        if self.mouse:
            parts.append(("mouse", b"\x1b[?%dh" % self.mouse))
        if self.encoding:
            parts.append(("mouse_encoding", b"\x1b[?%dh" % self.encoding))
        if self.focus_events:
            parts.append(("focus_events", b"\x1b[?1004h"))
        if self.bracketed_paste:
            parts.append(("bracketed_paste", b"\x1b[?2004h"))
        if self.modify_other_keys:
            parts.append(("modify_other_keys", b"\x1b[>4;%dm" % self.modify_other_keys))
        if self.cursor_style:
            parts.append(("cursor_style", b"\x1b[%d q" % self.cursor_style))
        if not self.cursor:
            parts.append(("cursor_hidden", b"\x1b[?25l"))
        return b"".join(data for _, data in parts), [name for name, _ in parts]

    def names(self) -> list[str]:
        return self.preamble()[1]


_DEFAULT_STORED = Modes()._values()


# Full-screen programs send the same few sequences again and again (vim hides and shows the
# cursor at each redraw, htop sets its scroll region): what their parameters mean is kept.
@functools.lru_cache(maxsize=256)
def _private_modes(params: bytes) -> tuple[int, ...]:
    return tuple(int(param) for param in params.split(b";") if param and len(param) <= 5)


_IGNORED = (0, 0)


@functools.lru_cache(maxsize=256)
def _margins(params: bytes) -> tuple[int, int] | None:
    """The margins DECSTBM sets, None for the whole screen, `_IGNORED` for none at all."""
    numbers = _numbers(params, 2)
    if numbers is None:
        return _IGNORED
    top = (numbers[0] if numbers else None) or 0
    bottom = (numbers[1] if len(numbers) > 1 else None) or 0
    if top > MAX_ROW or bottom > MAX_ROW or (bottom and top >= bottom):
        return _IGNORED
    return None if top <= 1 and bottom == 0 else (max(1, top), bottom)


def _numbers(params: bytes, most: int) -> list[int | None] | None:
    """The parameters of a sequence (None where one is left out), or None if there are
    more than `most` or one is longer than any a terminal takes."""
    parts = params.split(b";") if params else []
    if len(parts) > most or any(len(part) > 5 for part in parts):
        return None
    return [int(part) if part else None for part in parts]


def _margins_valid(top: int, bottom: int) -> bool:
    if (top, bottom) == (0, 0):
        return True
    return (1 <= top <= MAX_ROW and 0 <= bottom <= MAX_ROW and (bottom == 0 or top < bottom)
            and (top, bottom) != (1, 0))
# Every name a preamble may list, in the order it sets them (PROTOCOL.md's `restored_modes`).
MODE_NAMES = ("alternate_screen", "kitty_keyboard", "scroll_region", "origin_mode",
              "no_autowrap", "cursor_keys", "keypad", "mouse", "mouse_encoding",
              "focus_events", "bracketed_paste", "modify_other_keys", "cursor_style",
              "cursor_hidden")


class Scanner:
    """Follows the modes of one stream fed to it in pieces (`feed`). `pending` is the start
    of a sequence the last piece ended in (at most `LONGEST` bytes), finished by the next."""

    __slots__ = ("modes", "pending")

    def __init__(self, modes: Modes | None = None, pending: bytes = b"") -> None:
        self.modes = modes if modes is not None else Modes()
        self.pending = pending

    def copy(self) -> Scanner:
        return Scanner(self.modes.copy(), self.pending)

    @staticmethod
    def valid_pending(pending: bytes) -> bool:
        """Whether `pending` is one a scanner can have kept (a stored one is checked)."""
        return not pending or (len(pending) < LONGEST
                               and _PARTIAL.fullmatch(pending) is not None)

    def lose(self) -> None:
        """Bytes are missing here: no sequence runs on across them."""
        self.pending = b""

    def feed(self, data: Buffer, start: int = 0, end: int | None = None) -> bool:
        """Follow `data[start:end]`, the next bytes of the stream. True if the modes or a
        pending start changed (then the caller may want to record them)."""
        if end is None:
            end = len(data)
        pos = start
        changed = False
        if self.pending:
            changed = True
            resumed = self._resume(data, start, end)
            if resumed is None:
                return changed
            pos = resumed
        first = data.find(_ESC, pos, end)
        if first < 0:
            return changed
        matched_to = first
        modes = self.modes
        for match in _SEQUENCE.finditer(data, first, end):
            _apply(modes, match)
            matched_to = match.end()
            changed = True
        tail = data.rfind(_ESC, max(matched_to, end - LONGEST), end)
        if tail >= 0 and _PARTIAL.fullmatch(data, tail, end):
            self.pending = bytes(data[tail:end])
            changed = True
        return changed

    def _resume(self, data: Buffer, start: int, end: int) -> int | None:
        """Finish the pending sequence with the head of this piece: where to go on from, or
        None if the whole piece went into it and it is pending still."""
        pending = self.pending
        head = bytes(data[start : min(end, start + LONGEST)])
        joined = pending + head
        self.pending = b""
        match = _SEQUENCE.match(joined)
        if match is not None:
            _apply(self.modes, match)
            return start + match.end() - len(pending)
        if start + len(head) == end and _PARTIAL.fullmatch(joined):
            self.pending = joined
            return None
        return start  # not a sequence after all: its bytes hold no ESC to start another


def _apply(modes: Modes, match: re.Match[bytes]) -> None:
    sequence = match[0]
    if len(sequence) == 2:
        modes.escape(sequence[1:])
        return
    kind, final = sequence[2:3], sequence[-1:]
    if kind == b"?":
        modes.private(sequence[3:-1], final == b"h")
    elif final == b"u":
        modes.kitty(kind, sequence[3:-1])
    elif kind == b">":
        modes.modifiers(sequence[3:-1], final)
    elif kind == b"!":
        modes.soft_reset()
    elif final == b"r":
        modes.margins_set(sequence[2:-1])
    else:
        modes.style(sequence[2:-2])
