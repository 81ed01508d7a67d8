"""A replay starts in the modes its program set (docs/design.md §12, escrowd.ring_modes).

Incident pinned: once a ring had wrapped past the bytes that set them, or a retrieve into
custody without a journal had delivered them, a relaunched app's emulator showed the cursor
the program hid and sat on the main screen instead of the alternate one (vim, less, htop),
and when the program exited there was no main screen to go back to.

Each test runs a real holder with small rings (`--ring-bytes 16384`) and a real program in
a real PTY: a script that sets every mode the holder follows, then less, vim and htop. The
app is the test: it retrieves the session and writes the replay, after a reset, to a real
terminal (a tmux pane whose program copies it there, raw), and tmux says which modes the
pane is in (`#{alternate_on}`, `#{cursor_flag}`, the keypad and mouse flags, the scroll
region); then the program's own exit is written there too. Last, `escrowctl attach` on a
tmux screen, and a holder SIGKILLed between the flood and the retrieve.
"""

from __future__ import annotations

import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from screens import run_tmux, wait_for_screen
from test_attach import OUTER, RUN_OWNER, Screens, detach, session

from conftest import OWNER, HolderProcess, PtyChild, require_program, wait_for
from escrow_client import Retrieved, SessionInfo

RING = 16 * 1024
TIMEOUT = 10.0
RESET = b"\x1bc"  # what an app writes before a replay (escrow_client.attach does)
LINE = 72  # bytes a flood line takes

# Sets the modes given in hex, prints "ready", floods (after a byte on the FIFO, if one is
# named), prints "flooded", then prints "more" for each byte typed. Raw: what it writes is
# what the terminal gets, byte for byte.
PROGRAM = """if True:
    import os, sys, tty
    tty.setraw(0)
    setup, flood, fifo = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.write(1, setup + b"ready\\r\\n")
    if fifo != "-":
        with open(fifo, "rb") as trigger:
            trigger.read(1)
    line = 0
    while flood > 0:
        line += 1
        text = (b"line %05d " % line).ljust(%(LINE)d - 2, b".") + b"\\r\\n"
        flood -= os.write(1, text[:flood])
    os.write(1, b"flooded\\r\\n")
    while os.read(0, 1):
        os.write(1, b"more\\r\\n")
""".replace("%(LINE)d", str(LINE))

CSI = b"\x1b["
# Every mode the holder follows, as a program sets them.
ALL_MODES = (CSI + b"?1049h" + CSI + b"?25l" + CSI + b"?1h" + b"\x1b=" + CSI + b"?1002h"
             + CSI + b"?1006h" + CSI + b"?2004h" + CSI + b"?1004h" + CSI + b">1u"
             + CSI + b">4;2m" + CSI + b"5;20r" + CSI + b"?6h" + CSI + b"?7l" + CSI + b"3 q")
ALL_NAMES = ("alternate_screen", "kitty_keyboard", "scroll_region", "origin_mode",
             "no_autowrap", "cursor_keys", "keypad", "mouse", "mouse_encoding",
             "focus_events", "bracketed_paste", "modify_other_keys", "cursor_style",
             "cursor_hidden")


def program(setup: bytes, flood: int, fifo: str = "-") -> list[str]:
    return [sys.executable, "-c", PROGRAM, setup.hex(), str(flood), fifo]


def info(holder: HolderProcess, sid: str, owner: str = OWNER) -> SessionInfo:
    found = session(holder, sid, owner)
    assert found is not None, f"no session {sid}"
    return found


def drained(holder: HolderProcess, sid: str, at_least: int, owner: str = OWNER) -> SessionInfo:
    """Once the holder has taken `at_least` bytes of the session's output (held or
    dropped)."""
    return wait_for(lambda: (s := info(holder, sid, owner)).buffered_bytes + s.dropped_bytes
                    >= at_least and s, TIMEOUT, f"{at_least} bytes of {sid} drained")


def hand_off(holder: HolderProcess, sid: str, child: PtyChild) -> None:
    """Deposit the program's terminal and end custody: the holder drains it. The test keeps
    its copy of the master only to type into it (it never reads it again)."""
    holder.client().hand_off(sid, child.master, child_pid=child.pid)


def keys_until_wrapped(holder: HolderProcess, sid: str, child: PtyChild,
                       press: Callable[[], None], more: int = 3) -> SessionInfo:
    """Make the program draw again (`press`) until its ring has dropped bytes, and `more`
    times after: each time, until the holder has drained what it drew."""
    pressed_after = 0
    for _ in range(200):
        before = info(holder, sid)
        total = before.buffered_bytes + before.dropped_bytes
        press()
        now = drained(holder, sid, total + 1)
        if now.dropped_bytes:
            pressed_after += 1
            if pressed_after > more:
                return now
    raise AssertionError(f"{sid}'s ring never wrapped")


def read_to_end(fd: int) -> bytes:
    """Everything the program writes until its terminal hangs up."""
    out = bytearray()
    while True:
        ready, _, _ = select.select([fd], [], [], TIMEOUT)
        assert ready, "the program did not end"
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


class Terminal:
    """A real terminal to write a replay to, as an app writes it to its emulator: a tmux
    pane whose program copies what the test sends through a FIFO to the pane, raw."""

    def __init__(self, directory: Path, cols: int = 80, rows: int = 24) -> None:
        self.socket = str(directory / "tmux.sock")
        self.env = {**os.environ, "HOME": str(directory)}
        self.env.pop("TMUX", None)
        fifo = directory / "pane.fifo"
        os.mkfifo(fifo)
        command = f"stty raw -echo; exec cat {shlex.quote(str(fifo))}"
        self.tmux("start-server", ";", "set-option", "-g", "status", "off", ";",
                  "new-session", "-d", "-s", "t", "-x", str(cols), "-y", str(rows),
                  "sh", "-c", command)

        def opened() -> int | None:
            try:
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                return None  # (ENXIO: cat has not opened it yet)

        self.fd: int = wait_for(opened, TIMEOUT, "the pane's program to open its FIFO")
        os.set_blocking(self.fd, True)

    def tmux(self, *args: str) -> str:
        return run_tmux(self.socket, self.env, *args)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def value(self, fmt: str) -> str:
        return self.tmux("display-message", "-p", "-t", "t", fmt).strip()

    def capture(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def wait_screen(self, check: Callable[[str], object], what: str) -> str:
        return wait_for_screen(self.capture, check, what, TIMEOUT, "the terminal")

    def shows(self, text: str) -> str:
        return self.wait_screen(lambda s: text in s, f"the terminal to show {text!r}")

    def close(self) -> None:
        os.close(self.fd)
        try:
            self.tmux("kill-server")
        except subprocess.CalledProcessError:
            pass


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    require_program("tmux")
    directory = Path(tempfile.mkdtemp(prefix="esc-mode-"))
    term = Terminal(directory)
    try:
        yield term
    finally:
        term.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def small_rings(make_holder: Callable[..., HolderProcess]) -> HolderProcess:
    return make_holder("--ring-bytes", str(RING))


def shown(term: Terminal, got: Retrieved, last: str) -> None:
    """Write the replay to the terminal, reset first, then what the program writes after
    it, as an app does, until the terminal shows `last`."""
    term.write(RESET + got.replay)

    def capture() -> str:
        while select.select([got.fd], [], [], 0)[0]:
            term.write(os.read(got.fd, 65536))
        return term.capture()

    wait_for_screen(capture, lambda s: last in s, f"the terminal to show {last!r}", TIMEOUT,
                    "the terminal")


def flags(term: Terminal) -> dict[str, str]:
    names = ("alternate_on", "cursor_flag", "keypad_flag", "keypad_cursor_flag",
             "mouse_any_flag", "mouse_button_flag", "mouse_sgr_flag", "origin_flag",
             "wrap_flag", "scroll_region_upper", "scroll_region_lower")
    values = term.value(" ".join(f"#{{{name}}}" for name in names)).split()
    return dict(zip(names, values, strict=True))


# --- every mode, from a script ---------------------------------------------------------


def test_a_replay_whose_ring_wrapped_starts_in_every_mode_its_program_set(
    small_rings: HolderProcess, pty_children: Callable[..., PtyChild], terminal: Terminal
) -> None:
    flood = 4 * RING
    child = pty_children(program(ALL_MODES, flood))
    hand_off(small_rings, "s1", child)
    drained(small_rings, "s1", len(ALL_MODES + b"ready\r\n") + flood + len(b"flooded\r\n"))

    got = small_rings.client().retrieve("s1")
    assert got.dropped_bytes > 0 and b"ready" not in got.replay  # the start is gone
    assert got.restored_modes == ALL_NAMES
    assert got.replay[: got.replay_preamble] == (
        CSI + b"?1049h" + CSI + b">1u" + CSI + b"5;20r" + CSI + b"?6h" + CSI + b"?7l"
        + CSI + b"?1h" + b"\x1b=" + CSI + b"?1002h" + CSI + b"?1006h" + CSI + b"?1004h"
        + CSI + b"?2004h" + CSI + b">4;2m" + CSI + b"3 q" + CSI + b"?25l")
    assert got.session.buffered_bytes == (len(got.replay) - got.replay_preamble
                                          + got.replay_trimmed)
    shown(terminal, got, "flooded")
    assert flags(terminal) == {
        "alternate_on": "1", "cursor_flag": "0", "keypad_flag": "1",
        "keypad_cursor_flag": "1", "mouse_any_flag": "1", "mouse_button_flag": "1",
        "mouse_sgr_flag": "1", "origin_flag": "1", "wrap_flag": "0",
        "scroll_region_upper": "4", "scroll_region_lower": "19"}
    os.close(got.fd)


def test_a_replay_that_holds_the_modes_own_bytes_gets_no_preamble(
    small_rings: HolderProcess, pty_children: Callable[..., PtyChild], terminal: Terminal
) -> None:
    child = pty_children(program(ALL_MODES, 1000))
    hand_off(small_rings, "s2", child)
    drained(small_rings, "s2", len(ALL_MODES + b"ready\r\n") + 1000 + len(b"flooded\r\n"))
    got = small_rings.client().retrieve("s2")
    assert (got.restored_modes, got.replay_preamble, got.dropped_bytes) == ((), 0, 0)
    assert got.replay.startswith(ALL_MODES)
    shown(terminal, got, "flooded")
    assert flags(terminal)["alternate_on"] == "1" and flags(terminal)["cursor_flag"] == "0"
    os.close(got.fd)


# --- real programs ------------------------------------------------------------------------


def tui(argv: list[str]) -> list[str]:
    """`argv` run as on an xterm, with no rc files or histories of the user's, and the size
    its terminal says (pytest sets LINES and COLUMNS, which curses would take instead)."""
    return ["env", "-u", "LINES", "-u", "COLUMNS", "TERM=xterm-256color", "LESS=",
            "LESSHISTFILE=-", "VIMINIT=", "HOME=/nonexistent", *argv]


def long_file(tmp_path: Path, lines: int = 3000) -> Path:
    path = tmp_path / "long.txt"
    path.write_text("".join(f"row {i:05d} {'-' * 60}\n" for i in range(1, lines + 1)))
    return path


def test_less_scrolled_past_its_ring_comes_back_on_the_alternate_screen_and_leaves_it(
    small_rings: HolderProcess, pty_children: Callable[..., PtyChild], terminal: Terminal,
    tmp_path: Path,
) -> None:
    """less pages through a long file while nobody reads it, until its ring has dropped
    the bytes that set its modes. The replay puts the terminal back on the alternate screen
    with less's keys; when less exits, the main screen comes back, without its pages."""
    require_program("less")
    child = pty_children(tui(["less", str(long_file(tmp_path))]))
    hand_off(small_rings, "l1", child)
    drained(small_rings, "l1", 1000)
    keys_until_wrapped(small_rings, "l1", child, lambda: os.write(child.master, b" "))

    got = small_rings.client().retrieve("l1")
    assert {"alternate_screen", "cursor_keys", "keypad"} <= set(got.restored_modes)
    last = got.replay.rsplit(b"row ", 1)[1][:5].decode()
    shown(terminal, got, f"row {last}")
    assert flags(terminal)["alternate_on"] == "1"
    assert flags(terminal)["keypad_flag"] == flags(terminal)["keypad_cursor_flag"] == "1"

    os.write(got.fd, b"q")
    terminal.write(read_to_end(got.fd))
    terminal.wait_screen(lambda s: "row " not in s, "less's pages to go with its screen")
    assert flags(terminal)["alternate_on"] == "0"
    os.close(got.fd)


def test_vim_retrieved_without_a_journal_before_comes_back_on_the_alternate_screen(
    small_rings: HolderProcess, pty_children: Callable[..., PtyChild], terminal: Terminal,
    tmp_path: Path,
) -> None:
    """An app that journals nothing took vim back into custody (the replay, vim's start
    and all, delivered to it), then crashed; vim drew a little since. The next app's
    replay is that little, after a preamble with vim's modes."""
    require_program("vim")
    notes = tmp_path / "notes.txt"
    notes.write_text("first line\nsecond line\n")
    child = pty_children(tui(["vim", "-N", "-u", "NONE", "-i", "NONE", "-n",
                              "--cmd", "set ttimeout ttimeoutlen=10", str(notes)]))
    hand_off(small_rings, "v1", child)
    drained(small_rings, "v1", 500)
    custody = small_rings.client().custody()
    first = custody.retrieve("v1")
    assert CSI + b"?1049h" in first.replay and first.restored_modes == ()
    custody.close()  # the app is gone: the holder drains again
    os.close(first.fd)

    os.write(child.master, b"Goadded line\x1b")
    drained(small_rings, "v1", 1)
    got = small_rings.client().retrieve("v1")
    assert b"?1049h" not in got.replay[got.replay_preamble :] and got.dropped_bytes == 0
    assert {"alternate_screen", "cursor_keys", "keypad"} <= set(got.restored_modes)
    shown(terminal, got, "added line")
    assert flags(terminal)["alternate_on"] == "1"

    os.write(got.fd, b":q!\r")
    terminal.write(read_to_end(got.fd))
    terminal.wait_screen(lambda s: "added line" not in s, "vim's screen to go with it")
    assert flags(terminal)["alternate_on"] == "0"
    os.close(got.fd)


def test_htop_redrawn_past_its_ring_comes_back_with_its_cursor_hidden(
    small_rings: HolderProcess, pty_children: Callable[..., PtyChild], terminal: Terminal,
) -> None:
    """htop hides the cursor and asks for mouse reports once, at its start; it redraws
    whole at each resize, past its ring."""
    require_program("htop")
    child = pty_children(tui(["htop", "-d", "600"]))
    hand_off(small_rings, "h1", child)
    drained(small_rings, "h1", 2000)
    sizes = iter([(23, 79), (24, 80)] * 100)
    keys_until_wrapped(small_rings, "h1", child,
                       lambda: termios.tcsetwinsize(child.master, next(sizes)))

    got = small_rings.client().retrieve("h1")
    assert {"alternate_screen", "cursor_hidden", "mouse"} <= set(got.restored_modes)
    shown(terminal, got, "F10")
    assert flags(terminal)["alternate_on"] == "1"
    assert flags(terminal)["cursor_flag"] == "0"
    assert flags(terminal)["mouse_any_flag"] == "1"
    os.close(got.fd)


# --- escrowctl attach, and a holder that restarts ------------------------------------------


def test_attach_after_the_ring_wrapped_shows_the_program_on_its_alternate_screen(
    small_rings: HolderProcess, tmp_path: Path,
) -> None:
    """`escrowctl run` a program that sets its modes; detach; it floods past its ring
    while nobody is attached; `escrowctl attach` elsewhere: the screen is in its modes."""
    for name in ("tmux", "bash"):
        require_program(name)
    screens = Screens(small_rings)
    try:
        fifo = tmp_path / "flood.fifo"
        os.mkfifo(fifo)
        setup = CSI + b"?1049h" + CSI + b"?25l" + CSI + b"?1h" + b"\x1b="
        a = screens.pane("a")
        a.line(f"escrowctl run --id m1 -- {shlex.join(program(setup, 4 * RING, str(fifo)))}")
        wait_for(lambda: a.value("#{alternate_on}") == "1", TIMEOUT, "the program's screen")
        assert a.value("#{cursor_flag}") == "0"
        detach(a, "m1", small_rings)
        with open(fifo, "wb") as trigger:
            trigger.write(b"go")
        drained(small_rings, "m1", len(setup + b"ready\r\n") + 4 * RING, RUN_OWNER)
        wait_for(lambda: info(small_rings, "m1", RUN_OWNER).dropped_bytes > 0, TIMEOUT,
                 "the ring to wrap")

        b = screens.pane("b")
        b.line("escrowctl attach escrowctl/m1")
        b.wait_text("flooded")
        assert b.value("#{alternate_on}") == "1"
        assert b.value("#{cursor_flag}") == "0"
        assert b.value("#{keypad_flag}") == b.value("#{keypad_cursor_flag}") == "1"
        detach(b, "m1", small_rings)
        assert b.value("#{alternate_on}") == "0"
        b.wait_prompt(OUTER)
    finally:
        screens.close()


def test_the_modes_are_restored_by_the_holder_that_adopts_the_session(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """The modes at the ring's oldest byte are in the session's record: the holder the
    keeper starts after a SIGKILL restores the same ones."""
    holder = make_holder("--ring-bytes", str(RING), keeper=True)
    flood = 4 * RING
    child = pty_children(program(ALL_MODES, flood))
    hand_off(holder, "k1", child)
    drained(holder, "k1", len(ALL_MODES + b"ready\r\n") + flood + len(b"flooded\r\n"))
    before = holder.client("escrowctl").status()
    os.kill(before.pid, signal.SIGKILL)

    def restarted() -> bool:
        try:
            return holder.client("escrowctl", timeout=1.0).status().instance != before.instance
        except Exception:
            return False

    wait_for(restarted, 15.0, "the keeper's next holder to answer")
    got = holder.client().retrieve("k1")
    assert got.restored_modes == ALL_NAMES
    os.close(got.fd)
