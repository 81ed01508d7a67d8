"""A safe replay: what a session printed, with nothing in it that makes a terminal answer
(docs/design.md §12, "A replay on a real terminal").

A replay is the program's raw output, queries and all: vim asked where the cursor was
(`CSI 6 n`) and what the terminal is (`CSI > c`), a shell theme asked for the background
colour (`OSC 11 ; ?`). Those questions were answered once, when they were asked. Written
again to a real terminal they are asked again, and the terminal answers into its input,
which is where the user's keys come from: the answers reach the program as if typed
(`2RRR` before the next command, `^[[2;2R` in `cat -v`). `safe_replay` takes them out.

What counts as a question is whatever makes a terminal send something back (from xterm's
ctlseqs, and the common extensions of kitty and iTerm2):

- ENQ (answerback), DECID (`ESC Z`), device attributes (`CSI c`, `CSI > c`, `CSI = c`,
  each with or without a 0), DECREQTPARM (`CSI x`), XTVERSION (`CSI > q`);
- status and position reports, `CSI Ps n` and `CSI ? Ps n` (not `CSI > Ps n`, which sets
  a key modifier); mode requests (DECRQM, `CSI ? Ps $ p`, `CSI Ps $ p`);
- xterm's state queries (XTQMODKEYS `CSI ? Pp m`, XTQFMTKEYS `CSI ? Pp g`, XTSMGRAPHICS
  with a read action, XTREPORTCOLORS `CSI # R`, XTTITLEPOS `CSI # S`, XTREPORTSGR), DEC's
  (DECRQPSR `$ w`, DECRQTSR `$ u`, DECRQUPSS `& u`, DECRQDE `" v`, DECRQLP `' |`, DECRQCRA
  `* y`) and kitty's keyboard query (`CSI ? u`);
- window reports and window operations: every XTWINOPS (`CSI Ps ; ... t`) but the title
  stack (22, 23). The reports (11, 13-21) answer; the rest iconify, move, raise, lower,
  resize or maximise the window of whoever attaches now, on behalf of a program that asked
  for it long ago: the screen is fitted to the terminal it is shown on, never the other way
  round. The title stack stays, paired with the titles the replay sets;
- strings that ask: DECRQSS (`DCS $ q`), XTGETTCAP (`DCS + q`), XTGETXRES (`DCS + Q`);
  OSC 4, 5, 10-19, 22, 50 and 52 with a field that is `?` (colours, the pointer, the font,
  the clipboard: an OSC that both sets and asks is taken out whole), OSC 60-62 (xterm's
  feature queries), kitty's OSC 21 `key=?`, OSC 99 `p=?`, OSC 5522 reads and graphics
  queries (`APC G a=q`), iTerm2's `OSC 1337 ; Report...`.

Kept although a terminal may answer it: a kitty graphics command that gives an image id
(`i=`) and no `q=` (kitty answers `ESC _ G i=31 ; OK ESC \\`). It draws or places the
image, and taking it out would change the picture. escrowctl attach drops the answer with
the other replies that come while it waits for its own (client/replies.py); an app that
writes a replay to its terminal itself gets it in its input, as any reply.

Everything else passes byte for byte, and each question is replaced by an ST (`ESC \\`),
which does nothing on its own but end whatever the question's own ESC would have ended in
the middle of a sequence: so the bytes around it mean what they meant (taking `CSI 6 n` out
of `ESC ] 0 ; tit` `CSI 6 n` `le BEL` would make a title of the text after it).

The edges. A replay whose ring wrapped starts clean (escrowd/trim.py); one that starts in
the middle of a sequence shows its tail as text, and a tail is no question. A question cut
at the end is taken out when it is a string (`OSC 11 ; ?` without its BEL), because tmux
answers a string when whatever comes next ends it (an ESC, CAN or SUB), and kept when it
is a control sequence (`ESC [ 6`), which no terminal acts on before its final byte: the
next ESC discards it. A C0 control inside a control sequence, which a terminal executes in
passing, is not looked through (no program writes one there), but ENQ is taken out
wherever it is.

8-bit controls (0x90 DCS, 0x9a DECID, 0x9b CSI, 0x9c ST, 0x9d OSC, 0x9f APC). In UTF-8,
which a replay almost always is, 0x80-0xBF are continuation bytes: the 0x9c of a check mark
(E2 9C 93) in a title is no ST. So a C1 byte counts as a control only where it cannot be a
continuation byte: after an ASCII byte (or first). UTF-8-encoded C1 controls (C2 9B for
U+009B) count everywhere: no text is made of them, and a terminal that takes them for
controls would answer them (xterm ignores them; not every terminal does).

Cost: a few passes of regular expressions over the replay (the 8-bit ones only over a
replay that has such bytes), with Python work only per question, or per control sequence
whose final byte a question's could be; a MiB of htop's output took 5 to 6 ms on a
2-vCPU VM (docs/performance.md).
"""

from __future__ import annotations

TYPE_CHECKING = False  # (not typing's: escrowctl imports this module with the package)
if TYPE_CHECKING:
    import re

ST = b"\x1b\\"
ENQ = b"\x05"

# The raw 0x9c too: in a question's string it follows ASCII, so it is no continuation byte.
_ST = rb"(?:\x1b\\|\xc2\x9c|\x9c)"
# A question in a string ends at its terminator, or where something else ends the string
# (ESC, CAN, SUB), or at the end of the replay.
_CUT = rb"(?=[\x1b\x18\x1a])|\Z"
_STRING_END = rb"(?:" + _ST + rb"|" + _CUT + rb")"
_OSC_END = rb"(?:\x07|" + _ST + rb"|" + _CUT + rb")"  # and BEL, xterm's end of an OSC

_FIELD = rb"[ -:<-~]*+"  # printable ASCII but `;`
_CSI_QUESTIONS = rb"|".join([
    rb"[>=]?0*c",  # DA1, DA2, DA3
    rb"\??[0-9;]*+n",  # DSR, DEC DSR
    rb"\??[0-9;]*+\$p",  # DECRQM
    rb"\?[0-9;]*+[mgu]",  # XTQMODKEYS, XTQFMTKEYS, kitty's keyboard flags
    rb"\?[0-9]*+;[14](?:;[0-9;]*+)?S",  # XTSMGRAPHICS, read or read the maximum
    rb"[01]?x",  # DECREQTPARM
    rb">0?q",  # XTVERSION
    rb"[0-9;]*+(?:\#[RS|]|\$[wu]|'\||\*y)",  # XTREPORTCOLORS and the like (above)
    rb"&u|\"v",  # DECRQUPSS, DECRQDE
    rb"(?!0*2[23](?![0-9]))0*[1-9][0-9]*+(?:;[0-9]*+)*+t",  # XTWINOPS but the title stack
])
# A string's question is looked for up to its first sign (a `?` field, `=?`) inside an atomic
# group, then the rest taken possessively: the rest reaches the same end from any sign, so
# one that does not end there is given up at once. Without the group each later sign was
# tried, every try running to the end again: a string of 64 KiB of `;?` took 10 s.
_OSC_QUESTIONS = rb"|".join([
    rb"1337;Report[ -~]*+",
    rb"(?:[45]|1[0-9]|22|5[02])(?>(?:;" + _FIELD + rb")*?;\?)" + _FIELD + rb"(?:;" + _FIELD
    + rb")*+",
    rb"6[0-2](?:;[ -~]*+)?",
    rb"21;(?>[ -~]*?=\?)[ -~]*+",
    rb"99;(?>[ -~]*?p=\?)[ -~]*+",
    rb"5522;(?>[ -~]*?type=read)[ -~]*+",
])


def _questions(csi: bytes, osc: bytes, dcs: bytes, apc: bytes, decid: bytes) -> bytes:
    """Every question, after the introducers given (each a pattern; `csi` with what may
    follow it)."""
    return rb"|".join([
        csi,
        osc + rb"(?:" + _OSC_QUESTIONS + rb")" + _OSC_END,
        dcs + rb"(?:\$q|\+[qQ])[ -~]*+" + _STRING_END,
        apc + rb"G(?>(?:[ -+\--:<-~]*+,)*?a=q)[ -~]*+" + _STRING_END,  # as an OSC's
        decid,
    ])


def _raw(c1: bytes) -> bytes:
    """A raw C1 byte where it cannot be a continuation byte: first, or after ASCII."""
    return c1 + rb"(?<![\x80-\xff]" + c1 + rb")"


# The passes, each as cheap as its kind of sequence allows, because a replay may hold an ESC
# every few bytes (htop's: one in seven). 7-bit control sequences: a cheap pattern picks out
# those whose final byte a question could have (not `m` or `H`, which most output is made
# of: XTQMODKEYS, `CSI ? Pp m`, is looked for with the strings), then each is checked whole.
_CSI_CANDIDATE = rb"\x1b\[[ -?]*+[cgnpqtuvwxyRS|]"
_OTHER_QUESTION = rb"\x1b(?:" + _questions(rb"\[\?[0-9;]*+m", rb"\]", b"P", b"_", b"Z") + rb")"
# 8-bit introducers, each pass run only on a replay that has such a byte at all: encoded in
# UTF-8 (C2 and the C1 byte: U+0080-U+009F), and raw.
_ENCODED_C1_QUESTION = rb"\xc2(?:" + _questions(
    rb"\x9b(?:" + _CSI_QUESTIONS + rb")", rb"\x9d", rb"\x90", rb"\x9f", rb"\x9a") + rb")"
_RAW_C1_QUESTION = _questions(
    _raw(rb"\x9b") + rb"(?:" + _CSI_QUESTIONS + rb")", _raw(rb"\x9d"), _raw(rb"\x90"),
    _raw(rb"\x9f"), _raw(rb"\x9a"))
_C1_BYTES = (b"\x90", b"\x9a", b"\x9b", b"\x9d", b"\x9f")


_COMPILED: dict[bytes, re.Pattern[bytes]] = {}


def _compiled(pattern: bytes) -> re.Pattern[bytes]:
    # When first used, not at import: every app imports the library, and the holder, and
    # most of them never write a replay to a terminal (compiling these takes milliseconds;
    # importing re, for `escrowctl --version`, a few more).
    compiled = _COMPILED.get(pattern)
    if compiled is None:
        import re

        compiled = _COMPILED[pattern] = re.compile(pattern)
    return compiled


def _instead(question: re.Match[bytes]) -> bytes:
    # An ST that ends in a byte of the kind the question ended in (ASCII, or not): the byte
    # after it then follows the same kind of byte as before (the C1 rule above), so that
    # what was no control is not made one, and taking questions out twice is taking them
    # out once. An 8-bit ending is an ST or DECID, raw or UTF-8-encoded: so is the ST.
    found = question.group()
    if found[-1] < 0x80:
        return ST
    return b"\xc2\x9c" if found[-2:-1] == b"\xc2" else b"\x9c"


def _csi(candidate: re.Match[bytes]) -> bytes:
    return ST if _compiled(_CSI_QUESTIONS).fullmatch(candidate.group(), 2) else candidate.group()


def safe_replay(replay: bytes | bytearray | memoryview) -> bytes:
    """`replay` with every terminal question taken out (each replaced by an ST), so that
    writing it to a real terminal makes the terminal answer nothing. Everything else comes
    back as it was; a replay with no ESC, ENQ or C1 control comes back equal."""
    data = bytes(replay)
    if ENQ in data:  # first: a terminal executes ENQ even inside a sequence, then goes on
        data = data.replace(ENQ, b"")
    data = _compiled(_CSI_CANDIDATE).sub(_csi, data)
    data = _compiled(_OTHER_QUESTION).sub(_instead, data)
    if any(c1 in data for c1 in _C1_BYTES):
        if b"\xc2" in data:
            data = _compiled(_ENCODED_C1_QUESTION).sub(_instead, data)
        if not _utf8(data):  # in UTF-8, no byte of those values follows an ASCII one
            data = _compiled(_RAW_C1_QUESTION).sub(_instead, data)
    return data


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
