"""What a terminal keeps of the modes the bytes written to it switch on, for the modes tmux
cannot report (tests/test_leaving.py): kitty's keyboard protocol (a stack of flags for each
screen, as kitty keeps it: 8 deep, popped empty is no flags, RIS clears both), xterm's
modifyOtherKeys, the DEC private modes, insert mode, the keypad, SGR, the margins, the
cursor's shape, the charsets. Their meaning is kitty's keyboard protocol page and xterm's
ctlseqs (DECSC saves, and DECRC restores, the text's attributes and the charsets); everything
else written is text, and ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SEQUENCE = re.compile(
    rb"\x1b\[([<=>?]?)([0-9;:]*)([ -/]*)([@-~])"  # CSI
    rb"|\x1b([()*+])(.)"  # designate a charset
    rb"|\x1b([=>c78])"  # keypad, RIS, DECSC, DECRC
    rb"|([\x0e\x0f])",  # shift out, shift in
    re.DOTALL)
_STACK_DEPTH = 8
_ON_AT_START = frozenset({7, 25})  # autowrap, a visible cursor
_ALTERNATE = (47, 1047, 1049)


@dataclass
class Terminal:
    alternate: bool = False
    kitty: dict[bool, list[int]] = field(default_factory=lambda: {False: [], True: []})
    modify_other_keys: int = 0
    dec_modes: set[int] = field(default_factory=lambda: set(_ON_AT_START))
    insert: bool = False
    application_keypad: bool = False
    sgr_plain: bool = True
    margins: bool = False  # top and bottom, or left and right, set
    cursor_shape: int = 0
    charsets: dict[str, str] = field(default_factory=lambda: dict.fromkeys("()*+", "B"))
    shifted_out: bool = False
    saved: tuple[bool, dict[str, str], bool] | None = None  # by DECSC, for DECRC

    def kitty_flags(self, alternate: bool) -> int:
        stack = self.kitty[alternate]
        return stack[-1] if stack else 0

    def modes(self) -> dict[str, object]:
        """Every mode, by name (the screen's contents and the cursor's place aside)."""
        return {
            "alternate screen": self.alternate,
            "kitty flags, main screen": self.kitty_flags(False),
            "kitty flags, alternate screen": self.kitty_flags(True),
            "modifyOtherKeys": self.modify_other_keys,
            "DEC modes on": sorted(self.dec_modes),
            "insert mode": self.insert, "application keypad": self.application_keypad,
            "plain text": self.sgr_plain, "margins": self.margins,
            "cursor shape": self.cursor_shape,
            "charset text is shown in": self.charsets[")" if self.shifted_out else "("],
        }

    def feed(self, data: bytes) -> None:
        for m in _SEQUENCE.finditer(data):
            if m[4] is not None:
                self._csi(m[1].decode(), m[2].decode(), m[3].decode(), m[4].decode())
            elif m[5] is not None:
                self.charsets[m[5].decode()] = m[6].decode()
            elif m[7] is not None:
                self._escape(m[7])
            else:
                self.shifted_out = m[8] == b"\x0e"

    def _escape(self, final: bytes) -> None:
        if final in b"=>":
            self.application_keypad = final == b"="
        elif final == b"c":
            self.__dict__.update(Terminal().__dict__)  # RIS: everything as at power-on
        elif final == b"7":
            self.saved = (self.sgr_plain, dict(self.charsets), self.shifted_out)
        elif final in (b"8", b""):  # DECRC: what DECSC saved (of what is modelled), or defaults
            fresh = Terminal()
            self.sgr_plain, charsets, self.shifted_out = self.saved or (
                fresh.sgr_plain, fresh.charsets, fresh.shifted_out)
            self.charsets = dict(charsets)

    def _csi(self, private: str, params: str, intermediate: str, final: str) -> None:
        numbers = [int(p) if p.isdigit() else 0 for p in params.split(";")] if params else []
        first = numbers[0] if numbers else 0
        if final == "u" and private in "<=>" and private and not intermediate:
            self._kitty(private, numbers)
        elif private == ">" and final == "m" and first == 4:
            self.modify_other_keys = numbers[1] if len(numbers) > 1 else 0
        elif private == "?" and final in "hl":
            for mode in numbers:
                if mode == 1049:  # DECSC on the way in, DECRC on the way out
                    self._escape(b"7" if final == "h" else b"")
                if mode in _ALTERNATE:
                    self.alternate = final == "h"
                elif final == "h":
                    self.dec_modes.add(mode)
                else:
                    self.dec_modes.discard(mode)
                if mode == 69 and final == "l":
                    self.margins = False
        elif not private and final in "hl" and 4 in numbers:
            self.insert = final == "h"
        elif not private and final == "m" and not intermediate:
            self.sgr_plain = all(n == 0 for n in numbers)
        elif not private and final == "r" and not intermediate:
            self.margins = bool(numbers)
        elif not private and final == "s" and numbers and 69 in self.dec_modes:
            self.margins = True  # DECSLRM
        elif not private and final == "q" and intermediate == " ":
            self.cursor_shape = first

    def _kitty(self, op: str, numbers: list[int]) -> None:
        stack = self.kitty[self.alternate]
        if op == ">":
            stack.append(numbers[0] if numbers else 0)
            del stack[:-_STACK_DEPTH]  # full: the oldest goes
        elif op == "<":
            del stack[max(0, len(stack) - (numbers[0] if numbers else 1)):]
        else:
            flags = numbers[0] if numbers else 0
            how = numbers[1] if len(numbers) > 1 else 1
            current = stack[-1] if stack else 0
            new = {1: flags, 2: current | flags, 3: current & ~flags}.get(how, current)
            if stack:
                stack[-1] = new
            else:
                stack.append(new)
