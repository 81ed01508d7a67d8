"""Repaint (docs/design.md §12).

On a bare PTY: `repaint` signals the program twice, at the changed size and then at its own,
and leaves the size as it was, whatever it was.

On a real screen: an app shows a session in a tmux pane, is killed with SIGKILL, and is
relaunched in the same pane. The program in the session (vim, less, top, a bash prompt)
printed its screen before the crash and prints nothing after it, so the holder's replay does
not have it; after repaint the pane shows it again, as `tmux capture-pane` proves. Without
repaint the pane stays blank (`test_without_repaint...`). The app is tests/screenapp.py;
each test has its own tmux server and kills every process it started (the app, and the
program in the session, which outlives the app) at teardown.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import psutil
import pytest
from screens import gone, run_tmux, wait_for_screen

from conftest import HolderProcess, PtyChild, require_program, wait_for
from escrow_client import repaint

APP = str(Path(__file__).with_name("screenapp.py"))
COLS, ROWS = 100, 30
PROMPT = "escrow-ps1$ "
SCREEN_TIMEOUT = 10.0


# Prints the size each time it gets SIGWINCH.
SIZE_ON_WINCH = [sys.executable, "-c", """if True:
    import signal, termios
    def winch(*_):
        print("winch %d %d" % termios.tcgetwinsize(0), flush=True)
    signal.signal(signal.SIGWINCH, winch)
    print("ready", flush=True)
    while True:
        signal.pause()
"""]


@pytest.mark.parametrize("rows, cols, changed", [
    (24, 80, 23),  # shrinks by a row
    (1, 80, 2),  # grows: 0 rows would read as "size unknown"
    (0, 0, 1),  # an unset size cannot shrink
])
def test_repaint_signals_twice_and_leaves_the_size(
    pty_children: Callable[..., PtyChild], rows: int, cols: int, changed: int
) -> None:
    child = pty_children(SIZE_ON_WINCH, rows=rows, cols=cols)
    assert b"ready" in child.read_available(until=b"ready")
    repaint(child.master)
    last = f"winch {rows} {cols}".encode()
    seen = re.findall(rb"winch \d+ \d+", child.read_available(until=last))
    assert seen == [f"winch {changed} {cols}".encode(), last]
    assert termios.tcgetwinsize(child.master) == (rows, cols)


def test_repaint_waits_at_most_wait_for_a_program_that_does_not_answer(
    pty_children: Callable[..., PtyChild]
) -> None:
    child = pty_children(["sleep", "60"])  # SIGWINCH is ignored by default
    started = time.monotonic()
    repaint(child.master, wait=0.2)
    assert 0.2 <= time.monotonic() - started < 2.0
    assert termios.tcgetwinsize(child.master) == (24, 80)


# Answers SIGWINCH in two writes a moment apart, each with the size it sees then.
TWO_WRITES = [sys.executable, "-c", """if True:
    import signal, termios, time
    def winch(*_):
        print("first %d" % termios.tcgetwinsize(0)[0], flush=True)
        time.sleep(0.1)
        print("then %d" % termios.tcgetwinsize(0)[0], flush=True)
    signal.signal(signal.SIGWINCH, winch)
    print("ready", flush=True)
    while True:
        signal.pause()
"""]


def test_repaint_restores_the_size_only_once_the_output_stops(
    pty_children: Callable[..., PtyChild]
) -> None:
    """The program's answer is all written before the size goes back, not just begun: a
    program on its way back to waiting for input may not act on a signal until a key."""
    child = pty_children(TWO_WRITES)
    assert b"ready" in child.read_available(until=b"ready")
    started = time.monotonic()
    repaint(child.master, quiet=0.5)  # far longer than the gap, for a loaded machine
    took = time.monotonic() - started
    seen = re.findall(rb"(first|then) (\d+)", child.read_available(until=b"then 24"))
    assert seen == [(b"first", b"23"), (b"then", b"23"), (b"first", b"24"), (b"then", b"24")]
    assert 0.6 <= took < 5.0


def test_repaint_stops_waiting_at_its_limit_for_a_program_that_keeps_writing(
    pty_children: Callable[..., PtyChild]
) -> None:
    # A byte every 10 ms for 5 s: never quiet for `quiet`, and far from filling the terminal.
    child = pty_children([sys.executable, "-c", """if True:
        import sys, time
        for _ in range(500):
            sys.stdout.write("."); sys.stdout.flush(); time.sleep(0.01)
    """])
    assert child.read_available(until=b".")
    started = time.monotonic()
    repaint(child.master, quiet=0.2, limit=0.5)
    assert 0.5 <= time.monotonic() - started < 2.0
    assert termios.tcgetwinsize(child.master) == (24, 80)


def test_repaint_on_a_non_terminal_raises() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(OSError) as raised:
            repaint(r)
        assert raised.value.errno == errno.ENOTTY
    finally:
        os.close(r)
        os.close(w)


class Screen:
    """A private tmux server whose one pane runs screenapp.py, showing session `sid`."""

    def __init__(self, holder: HolderProcess, directory: Path) -> None:
        self.holder = holder
        self.dir = directory
        self.sid = ""
        self.socket = str(directory / "tmux.sock")
        self.env = {**os.environ, "HOME": str(directory), "LESS": "", "LESSHISTFILE": "-"}
        for name in ("LESSOPEN", "LESSCLOSE", "TMUX", "VIMINIT"):
            self.env.pop(name, None)
        self.processes: list[psutil.Process] = []  # the apps, and the program in the session
        self.app: psutil.Process | None = None  # the one running now
        self.launches = 0

    def tmux(self, *args: str) -> str:
        return run_tmux(self.socket, self.env, *args)

    def capture(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "app")

    def wait_screen(self, check: Callable[[str], bool], what: str) -> str:
        """The pane's text once `check` accepts it."""
        return wait_for_screen(self.capture, check, what, SCREEN_TIMEOUT)

    def wait_text(self, *texts: str) -> str:
        return self.wait_screen(lambda s: all(t in s for t in texts), f"the pane to show {texts}")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "app", *keys)

    def launch(self, *args: str) -> dict[str, int]:
        """Run screenapp.py with `args` in the pane (a new one, or the dead one again) and
        wait until it is ready: what it wrote in its ready file."""
        self.launches += 1
        ready = self.dir / f"ready{self.launches}"
        argv = [sys.executable, APP, args[0], self.holder.socket, self.sid, str(ready), *args[1:]]
        if self.launches == 1:
            # remain-on-exit: a killed app leaves its pane, to relaunch the next one in.
            # No status line: the pane is the whole COLS x ROWS window.
            self.tmux("set-option", "-g", "remain-on-exit", "on", ";",
                      "set-option", "-g", "status", "off", ";",
                      "new-session", "-d", "-s", "app", "-x", str(COLS), "-y", str(ROWS),
                      *argv)
            self.processes.append(psutil.Process(int(self.tmux("display-message", "-p",
                                                               "#{pid}"))))
        else:
            self.tmux("respawn-pane", "-t", "app", *argv)
        self.wait_screen(lambda _: ready.exists(), f"screenapp {args[0]} to be ready")
        info: dict[str, int] = json.loads(ready.read_text())
        self.app = psutil.Process(info["app"])
        self.processes.append(self.app)
        return info

    def start(self, sid: str, argv: list[str]) -> psutil.Process:
        """`argv` on a new session shown in the pane: its process."""
        self.sid = sid
        child = psutil.Process(self.launch("new", "--", *argv)["child"])
        self.processes.append(child)
        return child

    def crash_and_relaunch(self, child: psutil.Process, *options: str) -> None:
        """SIGKILL the app; once the holder drains the session (and its program lives on),
        relaunch the app in the same pane."""
        assert self.app is not None
        self.app.send_signal(signal.SIGKILL)
        wait_for(lambda: self.tmux("display-message", "-p", "-t", "app",
                                   "#{pane_dead}").strip() == "1", SCREEN_TIMEOUT, "pane dead")
        wait_for(lambda: {s.id: s.state for s in self.holder.client().list()}.get(self.sid)
                 == "draining", SCREEN_TIMEOUT, "the holder to drain the session")
        assert not gone(child), "the program died with its app"
        self.launch("relaunch", *options)

    def close(self) -> None:
        try:
            self.tmux("kill-server")
        except subprocess.CalledProcessError:
            pass  # no server left
        for proc in self.processes:
            try:
                proc.kill()  # psutil: never a pid that was reused meanwhile
            except psutil.NoSuchProcess:
                pass
        for proc in self.processes:
            wait_for(partial(gone, proc), 5.0, f"{proc} to die")


@pytest.fixture
def screen(holder: HolderProcess) -> Iterator[Screen]:
    for program in ("tmux", "vim", "less", "top", "bash"):
        require_program(program)
    directory = Path(tempfile.mkdtemp(prefix="esc-screen-"))  # short: tmux's socket is in it
    s = Screen(holder, directory)
    try:
        yield s
    finally:
        s.close()
        shutil.rmtree(directory, ignore_errors=True)


def vim_with_an_unsaved_edit(screen: Screen) -> tuple[psutil.Process, Path]:
    text = screen.dir / "notes.txt"
    text.write_text("first line\nsecond line\n")
    # No vimrc, viminfo or swap file; a short wait for the rest of an escape sequence, so
    # that Esc takes effect at once.
    vim = screen.start("vim", ["vim", "-N", "-u", "NONE", "-i", "NONE", "-n",
                               "--cmd", "set ttimeout ttimeoutlen=10", str(text)])
    screen.wait_text("first line", "second line")
    screen.keys("G", "o", "unsaved edit", "Escape")
    # Idle: the edit is on the screen and vim is back in normal mode.
    screen.wait_screen(lambda s: "unsaved edit" in s and "-- INSERT --" not in s,
                       "vim to show the edit, back in normal mode")
    return vim, text


def test_vim_repaints_with_its_unsaved_edit(screen: Screen) -> None:
    vim, text = vim_with_an_unsaved_edit(screen)
    screen.crash_and_relaunch(vim)
    screen.wait_text("first line", "second line", "unsaved edit")
    assert "unsaved edit" not in text.read_text()  # it was never saved: vim kept it

    screen.keys(":w", "Enter")
    wait_for(lambda: "unsaved edit" in text.read_text(), SCREEN_TIMEOUT, "vim to save")
    assert text.read_text() == "first line\nsecond line\nunsaved edit\n"
    screen.keys(":q", "Enter")
    wait_for(lambda: gone(vim), SCREEN_TIMEOUT, "vim to quit")


def test_without_repaint_vim_leaves_the_screen_blank(screen: Screen) -> None:
    """What repaint is for: the session's size did not change, so nothing tells vim to draw
    again; it answers a key, yet its buffer stays off the screen until it is asked to redraw
    (Ctrl-L here, a SIGWINCH from repaint)."""
    vim, _ = vim_with_an_unsaved_edit(screen)
    screen.crash_and_relaunch(vim, "--no-repaint")
    # ":" starts a command line: vim draws it on the last line, and only it.
    screen.keys(":")
    blank = screen.wait_screen(lambda s: s.rstrip("\n").endswith(":"), "vim's command line")
    assert "first line" not in blank and "unsaved edit" not in blank, blank
    screen.keys("Escape", "C-l")
    screen.wait_text("first line", "second line", "unsaved edit")
    screen.keys(":q!", "Enter")
    wait_for(lambda: gone(vim), SCREEN_TIMEOUT, "vim to quit")


def test_less_repaints_its_page(screen: Screen) -> None:
    text = screen.dir / "numbered.txt"
    text.write_text("".join(f"numbered line {i:04d}\n" for i in range(1, 501)))
    less = screen.start("less", ["less", str(text)])
    screen.wait_text("numbered line 0001")
    screen.keys("50g")  # a page of its own, not the file's first
    page = [f"numbered line {i:04d}" for i in range(50, 50 + ROWS - 1)]
    screen.wait_screen(lambda s: s.splitlines()[: ROWS - 1] == page, "less at line 50")

    screen.crash_and_relaunch(less)
    shown = screen.wait_screen(lambda s: s.splitlines()[: ROWS - 1] == page,
                               "less's page again")
    assert "numbered line 0049" not in shown and "numbered line 0079" not in shown
    screen.keys("q")
    wait_for(lambda: gone(less), SCREEN_TIMEOUT, "less to quit")


def test_top_repaints_its_header(screen: Screen) -> None:
    # A long delay: top draws nothing more by itself while the test runs, so what the
    # relaunched app shows is top's answer to repaint.
    top = screen.start("top", ["top", "-d", "100"])

    def header(s: str) -> bool:
        lines = s.splitlines()
        return bool(lines) and lines[0].startswith("top - ") and "load average" in lines[0] \
            and any(line.startswith("Tasks:") for line in lines)

    # Idle: top has drawn its whole first frame, down to the last row (it draws the next
    # one in 100 s).
    screen.wait_screen(lambda s: header(s) and len(s.splitlines()) == ROWS
                       and s.splitlines()[-1].strip() != "", "top's first frame")
    screen.crash_and_relaunch(top)
    screen.wait_screen(header, "top's header again")
    screen.keys("q")
    wait_for(lambda: gone(top), SCREEN_TIMEOUT, "top to quit")


def test_bash_repaints_its_prompt_and_the_half_typed_line(screen: Screen) -> None:
    bash = screen.start("bash", ["env", f"PS1={PROMPT}", "HISTFILE=/dev/null",
                                 "bash", "--norc", "--noprofile", "-i"])
    screen.wait_text(PROMPT.rstrip())  # capture-pane drops trailing spaces
    screen.keys("echo half-typ")
    screen.wait_text(PROMPT + "echo half-typ")

    screen.crash_and_relaunch(bash)
    screen.wait_text(PROMPT + "echo half-typ")
    # The line is still bash's to finish: it runs once it is entered.
    screen.keys("ed", "Enter")
    screen.wait_screen(lambda s: "\nhalf-typed\n" in s, "the finished line's output")
    screen.keys("exit", "Enter")
    wait_for(lambda: gone(bash), SCREEN_TIMEOUT, "bash to exit")
