"""Replies: what the local terminal answers after an attach's replay, kept from the program
(docs/design.md §13).

`escrowctl attach` writes the replay with its questions taken out (client/safe_replay.py),
but a terminal may know a question that list does not, and what it answers would reach the
program as typed keys. So the attach ends what it writes before the repaint with a question
of its own, `ASK` (primary device attributes, `CSI c`, which every terminal answers), and
reads what the terminal sends through `Replies`:

- The terminal's first answer to `CSI c` is the answer to `ASK`, because a terminal answers
  in order and nothing of the program's reaches it before `ASK` does: that answer is
  dropped whenever it comes. (A terminal that never answers `CSI c` sends no such answer
  either, so nothing of anyone else's is taken for it.)
- Until that answer comes, or for `WAIT` after the replay was written and the program made
  to repaint (no key is read meanwhile), whichever is first,
  every other terminal reply is dropped too: answers to the replay's questions. Keys typed
  meanwhile cannot be told from replies by when they come, only by what they are, so only
  what parses as a reply is dropped (a cursor or status report, device attributes, a mode,
  window or keyboard report, any DCS, OSC or APC string) and everything else passes at
  once. A read that ends with what may be the start of a reply (ESC, `ESC [ 2 ;`) keeps it
  until the next read, or the end of `WAIT`, and then decides.
- After that, everything passes.
- An attach that ends before the answer came (the program had exited: it shows the last
  words and is done) waits for it, for what is left of `WAIT` (`awaited`), and reads it:
  left in the terminal, it would be typed at the prompt of the shell escrowctl returns to.

What can be lost: keys typed during that first second that are, byte for byte, a terminal
reply: F3 with any modifier (`CSI 1 ; N R`, a cursor report's shape); Alt with `]`, `P`,
`_` or `/` (the start of a string reply) and what is typed after it up to what ends such a
string; and keys typed while an attach that has ended waits for the answer. What can be
late: a read that ends with what may begin a reply (a lone ESC, Alt with one of those
keys), kept until the next read or the end of `WAIT`.
Replies in raw 8-bit form (S8C1T on a terminal not in UTF-8) are not recognised; their
UTF-8-encoded form (C2 9B for CSI) is.
"""

from __future__ import annotations

import re

ASK = b"\x1b[c"  # DA1
WAIT = 1.0  # seconds, after the replay is written and the repaint asked for

_CSI = rb"(?:\x1b\[|\xc2\x9b)"
_ST = rb"(?:\x1b\\|\xc2\x9c)"
_ANSWER = _CSI + rb"\?[0-9;]*+c"  # the answer to ASK
# A reply's string: no control in it, so that no key a user may have typed meanwhile (the
# detach key among them) is ever dropped or kept back with one. Nor a UTF-8-encoded C1
# control (C2 80 to C2 9F): so the string stops at its ST (C2 9C), and at the introducer
# of any other string, whose own try then starts there. With them in, 64 KiB of C2 9D made
# each introducer's try run to the end of the read, 3.6 s for that read.
_TEXT_BYTE = rb"[ -~\x80-\xc1\xc3-\xff]"
_TEXT = _TEXT_BYTE + rb"*+(?:\xc2(?![\x80-\x9f])" + _TEXT_BYTE + rb"*+)*+"
_REPLY = re.compile(rb"(?P<answer>" + _ANSWER + rb")|" + rb"|".join([
    _CSI + rb"(?:" + rb"|".join([
        rb">[0-9;]*+[cmf]",  # DA2; XTQMODKEYS, XTQFMTKEYS
        rb"\??[0-9;]*+[Rn]",  # cursor position (CPR, DECXCPR), status (DSR)
        rb"\??[0-9;]*+\$y",  # DECRPM
        rb"\?[0-9;]*+[uS]",  # kitty's keyboard flags, XTSMGRAPHICS
        rb"[0-9;:]*+[mtx]",  # XTREPORTSGR, window reports, DECREPTPARM
        rb"[0-9;]*+(?:\"w|&w|\*\{|\#[QS])",  # DECRPDE, DECLRP, DECMSR, XTREPORTCOLORS...
    ]) + rb")",
    rb"(?:\x1b[P_]|\xc2[\x90\x9f])" + _TEXT + _ST,  # DCS and APC: every one is a reply
    rb"(?:\x1b\]|\xc2\x9d)" + _TEXT + rb"(?:\x07|" + _ST + rb")",  # and every OSC
    rb"\x1b/Z",  # VT52's identify
]))
_ANSWER_ONLY = re.compile(_ANSWER)
# What may still become a reply, at the end of a read.
_BEGUN = re.compile(rb"(?:\x1b(?:\[[ -?]*+|[\]P_]" + _TEXT + rb"\x1b?|/)?"
                    rb"|\xc2(?:\x9b[ -?]*+|[\x90\x9d\x9f]" + _TEXT + rb"\x1b?)?)\Z")


class Replies:
    """The replies to drop from what the local terminal sends: `feed` each read through it.
    Made with `asked` None, it drops nothing (nothing was asked)."""

    def __init__(self, asked: float | None) -> None:
        self._answered = asked is None
        self._until = asked + WAIT if asked is not None else 0.0
        self._held = b""

    def feed(self, data: bytes, now: float) -> bytes:
        """What of `data`, just read from the terminal (b"" when nothing was, but `due`), is
        for the program, with what was kept back once it is decided."""
        data, self._held = self._held + data, b""
        if self._answered:
            return data
        if now >= self._until:
            return self._without_answer(data)
        kept, start = [], 0
        for reply in _REPLY.finditer(data):
            kept.append(data[start:reply.start()])
            start = reply.end()
            if reply.group("answer"):
                self._answered = True
                return b"".join(kept) + data[start:]
        begun = _BEGUN.search(data, start)
        end = begun.start() if begun is not None else len(data)
        self._held = data[end:]
        return b"".join(kept) + data[start:end]

    def awaited(self, now: float) -> float | None:
        """Seconds left to wait for the answer to `ASK` before leaving the terminal, or None:
        it came, or `WAIT` is over."""
        if self._answered or now >= self._until:
            return None
        return self._until - now

    def due(self, now: float) -> bool:
        """Whether what was kept back is to be decided now (`WAIT` is over): `feed` gives it."""
        return bool(self._held) and now >= self._until

    def wait(self, now: float, other: float | None) -> float | None:
        """Seconds until `due`, or `other` if that is sooner (either may be None: no time)."""
        if not self._held:
            return other
        mine = max(0.0, self._until - now)
        return mine if other is None else min(mine, other)

    def _without_answer(self, data: bytes) -> bytes:
        answer = _ANSWER_ONLY.search(data)
        if answer is None:
            return data
        self._answered = True
        return data[:answer.start()] + data[answer.end():]
