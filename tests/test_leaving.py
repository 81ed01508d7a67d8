"""Leaving an attached session gives the terminal back whole, and the detach key never
misfires (docs/design.md §13).

On a real screen (a tmux pane, as in tests/test_attach.py): the program in the session
(tests/keys_app.py) switches on every mode a full-screen program may; on each way out the
pane's modes are the ones it had before: tmux's mode flags, what a paste sends (bracketed or
not), what Ctrl-Enter sends (modifyOtherKeys or not), `stty -g`. The detach key pressed twice
or held down never kills escrowctl (it did: `^\\Quit`, exit 131), and in the encodings of
kitty's keyboard protocol and modifyOtherKeys, sent as a terminal sends them, it detaches.

tmux 3.3 knows neither kitty's keyboard protocol nor synchronized updates, and reports no
focus or margin modes: for those, what escrowctl writes to a PTY the test holds is played
through a model of a terminal's modes (tests/terminal_model.py), which must end as it began.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import test_attach
from keys_app import MODES
from terminal_model import Terminal
from test_attach import ESCROWCTL, RUN_OWNER, TIMEOUT, Pane, Screens, session, state

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client.detach_key import DOUBLE_PRESS
from escrow_client.leaving import LEAVE

screens = test_attach.screens  # the fixture: tmux servers, ended at teardown

KEYS_APP = str(Path(__file__).with_name("keys_app.py"))
KEYS = shlex.join([sys.executable, KEYS_APP])
# tmux's flags of a pane's modes (FORMATS in tmux(1)).
FLAGS = ("alternate_on", "cursor_flag", "insert_flag", "keypad_cursor_flag", "keypad_flag",
         "mouse_all_flag", "mouse_any_flag", "mouse_button_flag", "mouse_sgr_flag",
         "mouse_standard_flag", "mouse_utf8_flag", "wrap_flag")


def observe(pane: Pane, name: str) -> tuple[str, str]:
    """The pane's modes, while `keys_app.py NAME` runs in it: tmux's flags, and what the
    program gets for a paste (bracketed or not) and for Ctrl-Enter (a CSI u sequence under
    modifyOtherKeys; nothing, from tmux, without)."""
    pane.wait_text(f"{name} ready")
    flags = pane.value(" ".join(f"{f}=#{{{f}}}" for f in FLAGS))
    pane.server.tmux("set-buffer", "-b", "probe", "pasted")
    pane.server.tmux("paste-buffer", "-p", "-b", "probe", "-t", pane.name)
    pane.keys("C-Enter")
    pane.keys("q")
    return flags, pane.wait_line(rf"^{name} got (.*)$")[1]


WAYS_OUT = {
    # name: (what the program does, what ends the attachment, escrowctl's exit status)
    "detach-key": ("--modes", "key", 0),
    "sigterm": ("--modes", signal.SIGTERM, 0),
    "sighup": ("--modes", signal.SIGHUP, 0),
    "program-exits": ("--modes --exit 7", None, 7),
    "error": ("--modes", "holder-dies", 1),
}


@pytest.mark.parametrize("way", WAYS_OUT)
def test_every_way_out_gives_the_terminal_back_whole(
    screens: Screens, make_holder: Callable[..., HolderProcess], holder: HolderProcess,
    way: str
) -> None:
    program, how, status = WAYS_OUT[way]
    target = make_holder(name="doomed") if how == "holder-dies" else holder
    a = screens.pane("a")
    before, after = screens.dir / "before", screens.dir / "after"
    # A 1 s timeout: a custody whose holder died gives up on it after that.
    a.line(f"stty -g >{before}; {KEYS} before; escrowctl --socket {target.socket} --timeout 1 "
           f"run --id m1 -- {KEYS} program {program}; echo \"rc=$?\"; stty -g >{after}; "
           f"{KEYS} after")
    theirs = observe(a, "before")
    if how is not None:
        a.wait_text("program ready")
        if how == "key":
            a.keys("C-\\")
        elif how == "holder-dies":
            target.proc.kill()
            target.proc.wait()
            a.keys("C-\\")  # refused: escrowctl has the last copy of the terminal
            a.wait_text("the holder is not reachable right now")
            (escrowctl,) = [p for p in psutil.process_iter(["cmdline"])
                            if target.socket in (p.info["cmdline"] or [])]
            escrowctl.send_signal(signal.SIGTERM)
        else:
            assert isinstance(how, signal.Signals)
            info = session(target, "m1")
            assert info is not None and info.custodian_pid is not None
            os.kill(info.custodian_pid, how)
    assert int(a.wait_line(r"^rc=(\d+)$")[1]) == status, a.capture()
    # The user's screen as it was, what escrowctl said below it (the program left it on the
    # alternate screen: leaving that, the cursor went back to where it was before).
    shown = a.capture()
    assert shown.startswith("outer$ stty -g") and f"\nbefore got {theirs[1]}\n" in shown, shown
    assert observe(a, "after") == theirs
    assert after.read_text() == before.read_text()


def test_the_detach_key_is_found_in_the_encodings_of_keyboard_protocols(
    screens: Screens, holder: HolderProcess
) -> None:
    """A terminal under kitty's keyboard protocol or modifyOtherKeys sends Ctrl-\\ as an
    escape sequence (here sent to the pane by tmux as the terminal would, byte by byte):
    pressed twice, it reaches the program as it came; pressed once, it detaches."""
    a = screens.pane("a")
    encodings = {
        "kitty": b"\x1b[92;5u",
        "kitty, with its press and release": b"\x1b[92;5:1u\x1b[92;5:3u",
        "modifyOtherKeys": b"\x1b[27;5;92~",
    }
    for n, (what, key) in enumerate(encodings.items()):
        got = screens.dir / f"got{n}"
        sid = f"e{n}"
        a.line(f"escrowctl run --id {sid} -- {KEYS} program{n} --modes --log {got}; "
               f"echo \"rc{n}=$?\"")
        a.wait_text(f"program{n} ready")
        # Twice (in one write of the terminal's, as a quick double press often comes).
        a.keys("-H", *(f"{b:02x}" for b in key * 2))
        wait_for(lambda: got.exists() and got.read_bytes() == key, TIMEOUT,  # noqa: B023
                 f"the program to get the key, {what}, once")
        a.keys("-H", *(f"{b:02x}" for b in key))
        a.wait_text(f"detached from {RUN_OWNER}/{sid}")
        assert int(a.wait_line(rf"^rc{n}=(\d+)$")[1]) == 0
        assert state(holder, sid) == "draining" and got.read_bytes() == key, what


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


# --- on a PTY the test holds: the bytes escrowctl writes on the way out -----------------


def read_to_the_status(child: PtyChild) -> tuple[bytes, int]:
    """What was written to the PTY until the shell there says `rc=N`, and N. (escrowctl
    runs under a shell that outlives it: were it the session's leader, its exit would hang
    the terminal up, and the kernel may drop the last bytes it wrote.)"""
    out = b""
    while not (m := re.search(rb"rc=(\d+)\r?\n", out)):
        chunk = child.read_available(timeout=TIMEOUT, until=b"\n")
        assert chunk, f"the shell to say how escrowctl exited; it wrote: {out!r}"
        out += chunk
    return out[: m.start()], int(m[1])


def under_a_shell(*argv: str) -> list[str]:
    return ["sh", "-c", '"$@"; echo "rc=$?"; exec cat', "sh", *argv]


PTY_WAYS_OUT = {
    # name: (what the program does, what ends the attachment, escrowctl's exit status)
    "detach-key, kitty": ([], b"\x1b[92;5u", 0),
    "detach-key, modifyOtherKeys": ([], b"\x1b[27;5;92~", 0),
    "sigterm": ([], signal.SIGTERM, 0),
    "sighup": ([], signal.SIGHUP, 0),
    "program-exits": (["--exit", "7"], None, 7),
}


@pytest.mark.parametrize("way", PTY_WAYS_OUT)
def test_what_is_written_on_the_way_out_turns_off_what_the_program_turned_on(
    holder: HolderProcess, pty_children: Callable[..., PtyChild], way: str
) -> None:
    program, how, status = PTY_WAYS_OUT[way]
    local = pty_children(under_a_shell(ESCROWCTL, "--socket", holder.socket, "run", "--id",
                                       "w1", "--", sys.executable, KEYS_APP, "program",
                                       "--modes", *program))
    terminal = Terminal()
    fresh = terminal.modes()
    if how is not None:
        shown = local.read_available(timeout=TIMEOUT, until=b"program ready")
        terminal.feed(shown)
        assert terminal.modes() != fresh  # every mode is on: see keys_app.MODES
        if isinstance(how, bytes):
            os.write(local.master, how)
        else:
            info = session(holder, "w1")
            assert info is not None and info.custodian_pid is not None
            os.kill(info.custodian_pid, how)
    rest, rc = read_to_the_status(local)
    assert rc == status, rest
    terminal.feed(rest)
    assert terminal.modes() == fresh, rest
    if status == 0:
        assert b"detached from" in rest


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


def test_kittys_flags_on_the_alternate_screen_are_popped_from_the_main_one() -> None:
    """A program that left the alternate screen with flags pushed there (kitty keeps them
    for the next program on it): what escrowctl writes on the way out pops them too."""
    terminal = Terminal()
    fresh = terminal.modes()
    terminal.feed(MODES + b"\x1b[?1049l")
    assert terminal.modes()["kitty flags, alternate screen"] == 27
    terminal.feed(LEAVE)
    assert terminal.modes() == fresh


def test_ctrl_c_ends_the_wait_for_a_program_that_left_its_terminal(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """`escrowctl run -- nohup sleep 60` (here: a shell that ignores SIGHUP and moves its
    output off the terminal, then sleeps): the attachment ends ("the program closed its
    terminal") and escrowctl waits for the program to exit, which may be never. Ctrl-C must
    end that wait (exit 130), as it did before the keys that signal were kept quiet around
    a detach."""
    local = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "w2", "--",
                          "sh", "-c", "trap '' HUP; exec </dev/null >/dev/null 2>&1; "
                          "exec sleep 60"])
    wait_for(lambda: state(holder, "w2") == "released", TIMEOUT,
             "the attachment to end with the program's terminal")
    released = session(holder, "w2")
    assert released is not None and released.child_pid is not None
    program = psutil.Process(released.child_pid)  # the holder's child, waited for
    wait_for(lambda: not ignores(local.pid, signal.SIGINT), TIMEOUT,
             "escrowctl to take Ctrl-C again, as it waits for the program")
    try:
        os.write(local.master, b"\x03")
        wait_for(lambda: local.proc.poll() is not None, TIMEOUT, "Ctrl-C to end escrowctl")
        assert local.proc.returncode == 130, local.read_available()
    finally:
        program.kill()


def ignores(pid: int, signum: int) -> bool:
    """Whether process `pid` ignores `signum` (its SigIgn mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigIgn:")).split()[1]
    return bool(int(mask, 16) >> (signum - 1) & 1)
