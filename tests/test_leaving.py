"""The detach key never misfires, and what was typed for a session stays with it
(docs/design.md §13).

On a real screen (a tmux pane, as in tests/test_attach.py), the program in the session is
tests/keys_app.py. The detach key pressed twice or held down never kills escrowctl (it did:
`^\\Quit`, exit 131, when the second press came as the terminal got its modes back).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_attach import RUN_OWNER, TIMEOUT, Screens, state

from conftest import HolderProcess, PtyChild, require_program, wait_for
from escrow_client.detach_key import DOUBLE_PRESS

KEYS_APP = str(Path(__file__).with_name("keys_app.py"))
KEYS = shlex.join([sys.executable, KEYS_APP])


@pytest.fixture
def screens(holder: HolderProcess) -> Iterator[Screens]:
    for program in ("tmux", "bash"):
        require_program(program)
    s = Screens(holder)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("presses", ["twice, 0.1 s apart", "twice, 0.3 s apart",
                                     "twice, 0.5 s apart", "held down"])
def test_the_detach_key_pressed_twice_or_held_never_kills_escrowctl(
    screens: Screens, holder: HolderProcess, presses: str
) -> None:
    """Pressed twice, whatever the time between: escrowctl sends the key to the program
    and stays attached, or detaches, and nothing reaches escrowctl as a signal (the
    second press of a detach once killed it with SIGQUIT, once the terminal had its modes
    back). Held down: a press every 30 ms."""
    a = screens.pane("a")
    got = screens.dir / "got"
    a.line(f"escrowctl run --id p1 -- {KEYS} program --log {got}; echo \"rc=$?\"")
    a.wait_text("program ready")
    gaps = [0.03] * 20 if presses == "held down" else [float(presses.split()[1])]
    a.keys("C-\\")
    for gap in gaps:
        time.sleep(gap)  # the time between two presses (what is tested), not a wait
        a.keys("C-\\")
    last = time.monotonic()
    # A press that came while escrowctl was ending, its terminal cooked again, is echoed
    # there (`^\`), before what the shell says next.
    status = r"^(?:\^\\)*rc=(\d+)$"

    def ended_or_attached() -> str | None:
        if re.search(status, a.capture(), re.MULTILINE):
            return "ended"
        if time.monotonic() > last + DOUBLE_PRESS + 1.0 and state(holder, "p1") == "held":
            return "attached"
        return None

    if wait_for(ended_or_attached, TIMEOUT, "escrowctl to end, or to stay") == "attached":
        a.keys("C-\\")  # still attached, the key went to the program: now detach
    rc = int(a.wait_line(status)[1])
    shown = a.capture(history=True)
    assert rc == 0 and "Quit" not in shown, shown
    assert f"detached from {RUN_OWNER}/p1" in shown
    assert state(holder, "p1") == "draining"  # the program runs on
    assert set(got.read_bytes() if got.exists() else b"") <= {0x1C}  # only the key itself


# --- on a PTY the test holds ---------------------------------------------------------


# Leaves raw mode with bytes typed and not read, and says how many its terminal still has.
LEAVES_RAW = [sys.executable, "-c", """if True:
    import fcntl, os, struct, termios
    from escrow_client.local_terminal import LocalTerminal
    terminal = LocalTerminal()
    with terminal.raw():
        os.write(1, b"raw\\r\\n")
        os.read(0, 1)  # the first byte of what the test types: the rest waits, unread
    unread = struct.unpack("i", fcntl.ioctl(0, termios.FIONREAD, bytes(4)))[0]
    print(f"unread={unread}", flush=True)
    os.read(0, 1)  # until the test ends it: its exit would hang the terminal up
"""]


def test_what_was_typed_and_not_read_is_not_left_for_the_shell(
    pty_children: Callable[..., PtyChild]
) -> None:
    """Keys typed for the session and still unread when the terminal is given back (the
    detach key pressed again, or held down, in the program's keyboard protocol) are
    discarded: the shell the terminal goes back to would take them for its own."""
    local = pty_children(LEAVES_RAW)
    local.read_available(timeout=TIMEOUT, until=b"raw")
    os.write(local.master, b"x\x1c\x1b[92;5u")
    out = local.read_available(timeout=TIMEOUT, until=b"\n")
    assert re.search(rb"unread=0\r\n", out), out
