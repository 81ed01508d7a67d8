"""A program for the tests of what a terminal is given back (tests/test_leaving.py): it puts
its terminal in raw mode (so that no key signals it: Ctrl-\\ is a byte to it, as to vim),
optionally switches on every mode a full-screen program may, says NAME ready, and reads.

    keys_app.py NAME [--modes] [--exit STATUS] [--log FILE]

`--modes` switches on, before it says it is ready: kitty's keyboard protocol on both
screens (pushed on the main one, then pushed and set on the alternate one, where it stays),
xterm's modifyOtherKeys, mouse reports in every encoding, focus reports, bracketed paste,
application cursor keys and keypad, insert mode, no autowrap, a hidden bar cursor, scroll
margins (and left and right ones), bold red text, the line-drawing charset shifted in, and a
synchronized update it never ends (`MODES`). `--exit` exits with STATUS as soon as it is
ready, leaving all that on. Otherwise it reads until it reads `q`: each read is appended to
FILE as it came, and at the end it says `NAME got <what it read, as a Python bytes literal>`.
Its terminal's modes are put back when it exits (not the escape-sequence ones: that is the
point).
"""

from __future__ import annotations

import argparse
import os
import sys
import termios
import tty

MODES = (
    b"\x1b[>1u"  # kitty: disambiguate, pushed on the main screen
    b"\x1b[?1049h"  # the alternate screen
    b"\x1b[>31u\x1b[=27;1u"  # kitty: everything, pushed on the alternate screen; then set
    b"\x1b[>4;2m"  # modifyOtherKeys 2
    b"\x1b[?1h\x1b="  # application cursor keys and keypad
    b"\x1b[?9h\x1b[?1000h\x1b[?1001h\x1b[?1002h\x1b[?1003h"
    b"\x1b[?1005h\x1b[?1006h\x1b[?1015h\x1b[?1016h"
    b"\x1b[?1004h\x1b[?2004h"
    b"\x1b[4h\x1b[?7l\x1b[?25l\x1b[5 q"
    b"\x1b[?69h\x1b[2;70s\x1b[3;20r"
    b"\x1b[1;31m\x1b)0\x0e"
    b"\x1b[?2026h"
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--modes", action="store_true")
    parser.add_argument("--exit", type=int)
    parser.add_argument("--log")
    args = parser.parse_args()
    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        # Shifted out (SO) the text would be line drawing, which tmux shows as it is
        # only for the letters it has no line for: say it in SI, then shift out again.
        os.write(1, (MODES if args.modes else b"") + b"\x0f" + args.name.encode()
                 + b" ready\r\n" + (b"\x0e" if args.modes else b""))
        if args.exit is not None:
            return args.exit
        got = b""
        while not got.endswith(b"q"):
            data = os.read(0, 4096)
            if not data:
                break
            got += data
            if args.log:
                with open(args.log, "ab") as log:
                    log.write(data)
    finally:
        termios.tcsetattr(0, termios.TCSANOW, saved)
    print(f"{args.name} got {got!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
