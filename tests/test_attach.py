"""`escrowctl attach` and `escrowctl run` (docs/design.md §13).

On a real screen: each test has its own tmux server (`-S` in a temporary directory, `-f
/dev/null`), whose panes run a plain bash; the test types into them with send-keys and reads
them with capture-pane, and kills every process it started at teardown (the tmux server, and
the programs in the sessions with everything they started, which outlive their panes).

Without a screen: the parts that are pure logic (the detach key, exit statuses), and the
answers `escrowctl attach` and `run` give before they touch a terminal, run in a bare PTY.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import psutil
import pytest
from screens import gone, run_tmux, wait_for_screen

from conftest import OWNER, HolderProcess, PtyChild, require_program, spawn_in_pty, wait_for
from escrow_client import SessionInfo, waiting
from escrow_client.attach import DetachKey, exit_status, key_name, parse_key

ESCROWCTL = str(Path(sys.executable).with_name("escrowctl"))
RUN_OWNER = "escrowctl"  # `escrowctl run`'s default owner
OUTER = "outer$ "
INNER = "inner$ "
TIMEOUT = 10.0
# A bash for a session: a prompt of its own, no rc files, no history file.
INNER_BASH = f"env PS1={shlex.quote(INNER)} HISTFILE=/dev/null bash --norc --noprofile -i"
# Typed into a session's bash: a background job printing numbered lines, 20 a second.
NUMBERED = "(i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.05; done) &"


def session(holder: HolderProcess, sid: str, owner: str = RUN_OWNER) -> SessionInfo | None:
    return next((s for s in holder.client(owner).list() if s.id == sid), None)


def state(holder: HolderProcess, sid: str, owner: str = RUN_OWNER) -> str:
    info = session(holder, sid, owner)
    return info.state if info is not None else "unknown"


def numbers(text: str) -> list[int]:
    """The numbered lines a screen shows, in order."""
    return [int(n) for n in re.findall(r"\bn=(\d+)\b", text)]


class Pane:
    """A tmux session with one window, running a plain bash: a terminal to type into."""

    def __init__(self, server: Tmux, name: str) -> None:
        self.server, self.name = server, name

    def keys(self, *keys: str) -> None:
        self.server.tmux("send-keys", "-t", self.name, *keys)

    def line(self, text: str) -> None:
        """Type `text` and Enter."""
        self.keys("-l", text)
        self.keys("Enter")

    def capture(self, history: bool = False, join: bool = True) -> str:
        """The screen (with `history`, everything scrolled off it too; with `join`,
        wrapped lines joined)."""
        return self.server.tmux("capture-pane", "-p", *(["-J"] if join else []), "-t",
                                self.name, *(["-S", "-"] if history else []))

    def wait_screen(self, check: Callable[[str], object], what: str,
                    history: bool = False, join: bool = True) -> str:
        return wait_for_screen(lambda: self.capture(history, join), check, what, TIMEOUT,
                               f"the pane {self.name}")

    def wait_text(self, *texts: str, history: bool = False) -> str:
        return self.wait_screen(lambda s: all(t in s for t in texts),
                                f"the pane to show {texts}", history)

    def wait_prompt(self, prompt: str) -> None:
        """Wait for the last line to be the (idle) prompt."""
        self.wait_screen(lambda s: s.rstrip().rsplit("\n", 1)[-1] == prompt.rstrip(),
                         f"the prompt {prompt!r}")

    def wait_line(self, pattern: str, history: bool = False) -> re.Match[str]:
        """The first line that matches `pattern` (a whole line), once there is one."""
        screen = self.wait_screen(lambda s: re.search(pattern, s, re.MULTILINE),
                                  f"a line matching {pattern!r}", history)
        match = re.search(pattern, screen, re.MULTILINE)
        assert match is not None
        return match

    def size(self) -> tuple[int, int]:
        cols, rows = self.server.tmux("display-message", "-p", "-t", self.name,
                                      "#{pane_width} #{pane_height}").split()
        return int(cols), int(rows)

    def value(self, fmt: str) -> str:
        return self.server.tmux("display-message", "-p", "-t", self.name, fmt).strip()


class Tmux:
    """A private tmux server. Its panes run bash with `escrowctl` on the PATH, talking to
    the test's holder."""

    def __init__(self, holder: HolderProcess, directory: Path, name: str = "tmux") -> None:
        self.dir = directory
        self.socket = str(directory / f"{name}.sock")
        self.env = {**os.environ, "HOME": str(directory)}
        for var in ("TMUX", "PROMPT_COMMAND", "VIMINIT"):
            self.env.pop(var, None)
        # What the panes' bash runs with (tmux gives a new pane the server's environment,
        # less what it sets itself: the prompt is given here).
        self.shell = shlex.join([
            "env", f"PATH={Path(ESCROWCTL).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            f"ESCROW_SOCKET={holder.socket}", f"PS1={OUTER}", "HISTFILE=/dev/null",
            "bash", "--norc", "--noprofile", "-i"])
        self.server: psutil.Process | None = None

    def tmux(self, *args: str) -> str:
        return run_tmux(self.socket, self.env, *args)

    def pane(self, name: str, cols: int = 80, rows: int = 24) -> Pane:
        """A new pane of `cols` x `rows` (no status line), at bash's prompt."""
        if self.server is None:
            self.tmux("start-server", ";", "set-option", "-g", "status", "off", ";",
                      "set-option", "-g", "history-limit", "10000", ";",
                      "new-session", "-d", "-s", name, "-x", str(cols), "-y", str(rows),
                      self.shell)
            self.server = psutil.Process(int(self.tmux("display-message", "-p", "#{pid}")))
        else:
            self.tmux("new-session", "-d", "-s", name, "-x", str(cols), "-y", str(rows),
                      self.shell)
        pane = Pane(self, name)
        assert pane.size() == (cols, rows)
        pane.wait_prompt(OUTER)
        return pane

    def processes(self) -> list[psutil.Process]:
        if self.server is None:
            return []
        try:
            return [self.server, *self.server.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        if self.server is not None:
            try:
                self.tmux("kill-server")
            except subprocess.CalledProcessError:
                pass  # no server left


class Screens:
    """Every tmux server of a test, and every program it ran in a session: all ended at
    teardown, whatever the test left running."""

    def __init__(self, holder: HolderProcess) -> None:
        self.holder = holder
        self.dir = Path(tempfile.mkdtemp(prefix="esc-att-"))  # short: tmux's sockets are here
        self.servers: list[Tmux] = []

    def tmux(self) -> Tmux:
        server = Tmux(self.holder, self.dir, f"tmux{len(self.servers)}")
        self.servers.append(server)
        return server

    def pane(self, name: str = "a", cols: int = 80, rows: int = 24) -> Pane:
        """A pane on the test's first tmux server."""
        if not self.servers:
            self.tmux()
        return self.servers[0].pane(name, cols, rows)

    def close(self) -> None:
        doomed = [p for server in self.servers for p in server.processes()]
        for info in self.holder.client("escrowctl").list(all_owners=True):
            if info.child_pid is not None and info.state in ("held", "draining", "exited"):
                try:
                    program = psutil.Process(info.child_pid)
                    doomed += [program, *program.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
        for server in self.servers:
            server.close()
        for proc in doomed:
            try:
                proc.kill()  # psutil: never a pid that was reused meanwhile
            except psutil.NoSuchProcess:
                pass
        for proc in doomed:
            wait_for(partial(gone, proc), 5.0, f"{proc} to die")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def screens(holder: HolderProcess) -> Iterator[Screens]:
    for program in ("tmux", "bash", "vim"):
        require_program(program)
    s = Screens(holder)
    try:
        yield s
    finally:
        s.close()


def detach(pane: Pane, sid: str, holder: HolderProcess) -> None:
    """Press the detach key; wait for escrowctl to say so and the holder to drain."""
    pane.keys("C-\\")
    pane.wait_text(f"detached from {RUN_OWNER}/{sid}")
    pane.wait_prompt(OUTER)
    wait_for(lambda: state(holder, sid) == "draining", TIMEOUT, "the holder to drain")


# --- on a real screen -----------------------------------------------------------------


def test_run_detach_and_attach_elsewhere_loses_nothing(
    screens: Screens, holder: HolderProcess
) -> None:
    a = screens.pane("a")
    a.line(f"escrowctl run --id a1 -- {INNER_BASH}")
    a.wait_prompt(INNER)
    info = session(holder, "a1")
    assert info is not None and info.state == "held" and info.child_pid is not None
    shell = info.child_pid
    a.line('echo "first:$$"')
    a.wait_line(rf"^first:{shell}$")
    a.line(NUMBERED)
    a.wait_screen(lambda s: len(numbers(s)) >= 5, "numbered lines")

    detach(a, "a1", holder)
    # The shell prints on, into the holder's ring.
    drained = session(holder, "a1")
    assert drained is not None
    wait_for(lambda: (s := session(holder, "a1")) is not None
             and s.buffered_bytes >= drained.buffered_bytes + 10 * len("n=99\r\n"),
             TIMEOUT, "ten lines printed while detached")
    shown_on_a = max(numbers(a.capture(history=True)))

    b = screens.pane("b", cols=100, rows=30)
    b.line("escrowctl attach escrowctl/a1")
    first = max(numbers(b.wait_screen(numbers, "the replay on b")))
    # Live: lines the shell printed after the attach, right behind the replay.
    b.wait_screen(lambda s: max(numbers(s), default=0) >= first + 10, "live lines on b")
    b.line('echo "again:$$"')
    b.wait_line(rf"^again:{shell}$", history=True)  # typed into the same shell

    # Everything, in order, once: what a showed, what was printed while detached, and
    # live lines after it.
    seen = numbers(b.capture(history=True))
    assert seen == list(range(1, len(seen) + 1)), seen
    assert len(seen) >= max(shown_on_a, first) + 10
    # The session took b's size.
    wait_for(lambda: (s := session(holder, "a1")) is not None and (s.cols, s.rows) == (100, 30),
             TIMEOUT, "the session to have b's size")
    assert psutil.Process(shell).children()  # the same shell, with its job

    # The shell ends while attached: escrowctl says so, and the session is released.
    b.line("kill %1; exit")
    b.wait_text(f"{RUN_OWNER}/a1 has ended")
    assert state(holder, "a1") == "released"


def test_a_wait_on_a_stopped_holder_is_not_told_into_the_attached_screen(
    screens: Screens, holder: HolderProcess
) -> None:
    """The holder stopped (SIGSTOP) while attached: the detach's hand-back waits on it,
    and no "waiting for the holder" line lands on the program's screen, which is the
    terminal's until escrowctl gives it back."""
    a = screens.pane("a")
    a.line(f"escrowctl run --id q1 -- {INNER_BASH}")
    a.wait_prompt(INNER)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        a.keys("C-\\")
        # A notice is due `waiting.AFTER` into the wait: only its absence by well after
        # then shows it was held off (it shows at once if it comes).
        due = time.monotonic() + waiting.AFTER + 1.5
        screen = wait_for_screen(lambda: a.capture(history=True),
                                 lambda s: "waiting for" in s or time.monotonic() > due,
                                 "the notice, or the time it is due", TIMEOUT, "the pane a")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert "waiting for the holder" not in screen, screen
    detached = a.wait_text(f"detached from {RUN_OWNER}/q1", history=True)
    assert "waiting for the holder" not in detached.split(f"detached from {RUN_OWNER}/q1")[0]
    wait_for(lambda: state(holder, "q1") == "draining", TIMEOUT, "the holder to drain")


WIDE = "w" * 100


def vim_drawn_at(cols: int, rows: int, *texts: str) -> Callable[[str], bool]:
    """Is vim, editing "first line" and WIDE, drawn on a screen of this size (showing
    `texts` too)? The long line fits on one row at 120 columns and wraps at 80; vim's `~`
    rows go down to the last row above its command line."""
    def check(screen: str) -> bool:
        lines = screen.split("\n")[:rows]
        return (lines[:2] == ["first line", WIDE[:cols]] and lines[rows - 2] == "~"
                and all(t in screen for t in texts))
    return check


def test_vim_redraws_at_the_size_of_the_terminal_it_is_attached_to(
    screens: Screens, holder: HolderProcess
) -> None:
    notes = screens.dir / "notes.txt"
    notes.write_text(f"first line\n{WIDE}\n")
    a = screens.pane("a", cols=80, rows=24)
    a.line(f"escrowctl run --id v1 -- vim -N -u NONE -i NONE -n "
           f"--cmd 'set ttimeout ttimeoutlen=10' {notes}")
    a.wait_screen(vim_drawn_at(80, 24), "vim at 80x24", join=False)
    a.keys("G", "o", "unsaved edit", "Escape")
    a.wait_screen(lambda s: "unsaved edit" in s and "-- INSERT --" not in s,
                  "vim to show the edit, back in normal mode")

    detach(a, "v1", holder)
    assert a.value("#{alternate_on}") == "0"  # escrowctl handed a back on its main screen

    b = screens.pane("b", cols=120, rows=40)
    b.line("escrowctl attach escrowctl/v1")
    b.wait_screen(vim_drawn_at(120, 40, "unsaved edit"), "vim drawn at 120x40", join=False)
    detach(b, "v1", holder)

    a.line("escrowctl attach escrowctl/v1")
    a.wait_screen(vim_drawn_at(80, 24, "unsaved edit"), "vim drawn at 80x24 again",
                  join=False)
    assert state(holder, "v1") == "held"
    a.keys(":q!", "Enter")
    a.wait_text(f"{RUN_OWNER}/v1 has ended")
    assert "unsaved edit" not in notes.read_text()  # only ever in vim, which kept it


def test_losing_the_terminal_detaches_and_nothing_is_lost(
    screens: Screens, holder: HolderProcess
) -> None:
    """The terminal escrowctl runs in disappears: the tmux server that holds the pane's
    PTY master is SIGKILLed, so the kernel hangs the pane up (SIGHUP, then EIO), as when
    a terminal window is closed or crashes. (A tmux client going away would not do: the
    pane, and escrowctl in it, live on in the server.)"""
    first_server = screens.tmux()
    a = first_server.pane("a")
    a.line(f"escrowctl run --id k1 -- {INNER_BASH}")
    a.wait_prompt(INNER)
    info = session(holder, "k1")
    assert info is not None and info.child_pid is not None and info.custodian_pid is not None
    shell, escrowctl = psutil.Process(info.child_pid), psutil.Process(info.custodian_pid)
    a.line(NUMBERED)
    a.wait_screen(lambda s: len(numbers(s)) >= 5, "numbered lines")

    # The local terminal disappears: its tmux server dies at once, closing the pane.
    assert first_server.server is not None
    first_server.server.kill()
    wait_for(partial(gone, escrowctl), TIMEOUT, "escrowctl to exit")
    wait_for(lambda: state(holder, "k1") == "draining", TIMEOUT, "the holder to drain")
    drained = session(holder, "k1")
    assert drained is not None and drained.child_alive
    wait_for(lambda: (s := session(holder, "k1")) is not None
             and s.buffered_bytes >= drained.buffered_bytes + 5 * len("n=99\r\n"),
             TIMEOUT, "lines printed while detached")

    b = screens.tmux().pane("b")
    b.line("escrowctl attach escrowctl/k1")
    first = max(numbers(b.wait_screen(numbers, "the replay on b")))
    b.wait_screen(lambda s: max(numbers(s), default=0) >= first + 5, "live lines on b")
    seen = numbers(b.capture(history=True))
    assert seen == list(range(1, len(seen) + 1)), seen
    b.line('echo "again:$$"')
    b.wait_line(rf"^again:{shell.pid}$", history=True)
    b.line("kill %1; exit")
    b.wait_text(f"{RUN_OWNER}/k1 has ended")


def _kill_escrowctl(holder: HolderProcess, sid: str, signum: int) -> None:
    info = session(holder, sid)
    assert info is not None and info.custodian_pid is not None
    os.kill(info.custodian_pid, signum)


EXIT_PATHS = {
    # name: (what escrowctl runs, what ends it, its exit status)
    "program-exits": ("sh -c 'exit 7'", None, 7),
    "program-killed": ("sh -c 'kill -TERM $$'", None, 128 + signal.SIGTERM),
    "detach-key": ("sh -c 'echo re\"\"ady; exec sleep 60'", "key", 0),
    "sigterm": ("sh -c 'echo re\"\"ady; exec sleep 60'", signal.SIGTERM, 0),
    "sighup": ("sh -c 'echo re\"\"ady; exec sleep 60'", signal.SIGHUP, 0),
    "error": ("sh -c 'echo re\"\"ady; exec sleep 60'", "holder-dies", 1),
}


@pytest.mark.parametrize("path", EXIT_PATHS)
def test_every_exit_path_gives_the_terminal_its_modes_back(
    screens: Screens, make_holder: Callable[..., HolderProcess], holder: HolderProcess,
    path: str
) -> None:
    command, how, status = EXIT_PATHS[path]
    target = holder
    if how == "holder-dies":
        target = make_holder(name="doomed")  # a holder of its own, to kill
    a = screens.pane("a")
    before, after = screens.dir / "before", screens.dir / "after"
    # A 1 s timeout: a custody whose holder died gives up on it after that.
    a.line(f"stty -g >{before}; escrowctl --socket {target.socket} --timeout 1 "
           f"run --id m1 -- {command}; echo \"rc=$?\"; stty -g >{after}")
    if how is not None:
        a.wait_line(r"^ready$")
        if how == "key":
            a.keys("C-\\")
        elif how == "holder-dies":
            target.proc.kill()
            target.proc.wait()
            # With the holder gone the detach key does not detach (escrowctl has the last
            # copy of the terminal): it says so and stays; a SIGTERM then ends it.
            a.keys("C-\\")
            a.wait_text("the holder is not reachable right now")
            (escrowctl,) = [p for p in psutil.process_iter(["cmdline"])
                            if target.socket in (p.info["cmdline"] or [])
                            and "run" in (p.info["cmdline"] or [])]
            escrowctl.send_signal(signal.SIGTERM)
        else:
            assert isinstance(how, signal.Signals)
            _kill_escrowctl(target, "m1", how)
    rc = int(a.wait_line(r"^rc=(\d+)$")[1])
    assert rc == status, a.capture()
    wait_for(after.exists, TIMEOUT, "stty -g after")
    wait_for(lambda: after.read_text().endswith("\n"), TIMEOUT, "stty -g after, whole")
    assert after.read_text() == before.read_text()
    if how == "holder-dies":
        a.wait_text("escrowctl: the holder did not confirm")
    elif status == 0:
        assert state(target, "m1") == "draining"  # detached: the session goes on
        a.wait_text("attach again with: escrowctl")
    else:
        assert state(target, "m1") == "released"


# --- the holder is out of the data path -------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of `pid` so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


FLOW = 64 << 20


def test_the_holder_spends_no_cpu_on_an_attached_session(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """64 MiB through an attached session cost the holder what the calls around them
    cost (the deposit, the release, the end of custody), nothing per byte: 0 to 10 ms in
    runs here. Draining the same 64 MiB cost it 0.34 to 0.5 s of CPU (measured on the
    same 2-core VM; 9.5 s/GiB in docs/performance.md's drain benchmark).

    The tolerance, 0.1 s, covers the holder's work on those calls (well under 10 ms each)
    and /proc's counting in clock ticks (10 ms each); it is a third or less of what the
    holder spends when it reads the flow itself. The local terminal here is a bare PTY that the
    test reads (tmux would take seconds to draw 64 MiB, and proves nothing more here)."""
    before = cpu_seconds(holder.pid)
    local = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "flow", "--",
                          "head", "-c", str(FLOW), "/dev/zero"])
    received = 0

    def read_everything() -> None:  # the local terminal: it reads what escrowctl writes
        nonlocal received
        while True:
            try:
                data = os.read(local.master, 1 << 16)
            except OSError:
                return
            if not data:
                return
            received += len(data)

    reader = threading.Thread(target=read_everything)
    started = time.monotonic()
    reader.start()
    assert local.proc.wait(60) == 0
    elapsed = time.monotonic() - started
    reader.join(10)
    spent = cpu_seconds(holder.pid) - before
    print(f"64 MiB attached in {elapsed:.2f}s: holder CPU {spent * 1000:.0f} ms")
    assert received >= FLOW
    assert state(holder, "flow") == "released"
    assert spent <= 0.1, f"the holder spent {spent:.3f}s of CPU while 64 MiB flowed past it"


# --- without a screen -------------------------------------------------------------------


def escrowctl_in_a_pty(pty_children: Callable[..., PtyChild], holder: HolderProcess,
                       *args: str) -> tuple[int, str]:
    """Run escrowctl in a PTY of its own: its exit status and what it printed there."""
    child = pty_children([ESCROWCTL, "--socket", holder.socket, *args])
    out = b""
    while True:
        chunk = child.read_available(timeout=TIMEOUT)
        if not chunk:
            break
        out += chunk
    return child.proc.wait(TIMEOUT), out.decode(errors="replace")


def test_exit_status_is_the_programs_or_128_plus_its_signal() -> None:
    assert [exit_status(rc) for rc in (0, 7, 255, -1, -9, -15)] == [0, 7, 255, 129, 137, 143]


@pytest.mark.parametrize("text, key", [
    ("^\\", 0x1C), ("^]", 0x1D), ("^a", 0x01), ("^A", 0x01), ("C-\\", 0x1C), ("c-q", 0x11),
    ("Ctrl-b", 0x02), ("ctrl+Z", 0x1A), ("^@", 0x00), ("^?", 0x7F), ("^_", 0x1F),
    ("none", None), ("NONE", None),
])
def test_detach_key_parser(text: str, key: int | None) -> None:
    assert parse_key(text) == key
    assert parse_key(key_name(key)) == key


@pytest.mark.parametrize("text", ["", "a", "^", "^ab", "C-", "ctrl", "^1", "^[", "C-[", "\\"])
def test_detach_key_parser_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_key(text)


def test_detach_key_one_press_detaches_two_send_it() -> None:
    k = DetachKey(0x1C, double_press=0.3)
    assert k.feed(b"ls\r", 10.0) == (b"ls\r", False)
    assert k.wait(10.0) is None
    # One press: what came before goes through; it detaches once nothing follows.
    assert k.feed(b"ab\x1c", 10.0) == (b"ab", False)
    assert k.wait(10.1) == pytest.approx(0.2)
    assert k.wait(10.3) == 0
    # Two presses: the key itself, and no detach.
    k = DetachKey(0x1C, double_press=0.3)
    assert k.feed(b"\x1c", 10.0) == (b"", False)
    assert k.feed(b"\x1cx", 10.1) == (b"\x1cx", False)
    assert k.wait(10.1) is None
    assert k.feed(b"a\x1c\x1cb\x1c\x1c", 11.0) == (b"a\x1cb\x1c", False)
    # A press and then another key: detach at once; what follows is not for the session.
    assert k.feed(b"x\x1cy z", 12.0) == (b"x", True)
    # No detach key: everything goes through.
    assert DetachKey(None).feed(b"\x1c\x1c", 0.0) == (b"\x1c\x1c", False)


def test_attach_of_a_held_session_names_its_custodian_and_changes_nothing(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    program = pty_children(["sh", "-c", "echo held-here; exec sleep 60"])
    with holder.client().custody() as custody:
        custody.deposit("t1", program.master, child_pid=program.pid, label="sh")
        before = session(holder, "t1", OWNER)
        rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", f"{OWNER}/t1")
        assert rc == 1
        assert re.search(rf"{OWNER}/t1 is held by pid {os.getpid()} \([^)]+\): .*"
                         r"nothing was changed \(custody_held\)", out), out
        assert session(holder, "t1", OWNER) == before  # held by us, nothing drained
        assert b"held-here" in program.read_available(until=b"held-here")  # still ours
        custody.release("t1")


def test_attach_of_an_unknown_session(holder: HolderProcess,
                                      pty_children: Callable[..., PtyChild]) -> None:
    rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", f"{OWNER}/nothing")
    assert (rc, out.strip()) == (1, f"escrowctl: no session {OWNER}/nothing is known (unknown)")


def test_attach_needs_a_terminal_and_asks_the_holder_nothing_without_one(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    program = pty_children(["sh", "-c", "exec sleep 60"])
    holder.client().hand_off("t1", program.master, child_pid=program.pid)
    for verb in (["attach", f"{OWNER}/t1"], ["run", "--", "true"]):
        done = subprocess.run([ESCROWCTL, "--socket", holder.socket, *verb], text=True,
                              capture_output=True, stdin=subprocess.DEVNULL, timeout=TIMEOUT)
        assert done.returncode == 1
        assert "needs a terminal" in done.stderr and "(not_a_terminal)" in done.stderr
    assert state(holder, "t1", OWNER) == "draining"
    assert [s.id for s in holder.client(RUN_OWNER).list()] == []  # run started nothing


def test_run_exits_with_the_programs_status_and_releases_it(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    rc, out = escrowctl_in_a_pty(pty_children, holder, "run", "--id", "r1", "--",
                                 "sh", "-c", "echo bye; kill -KILL $$")
    assert rc == 128 + signal.SIGKILL, out
    assert "bye" in out  # its last words, before the end
    assert state(holder, "r1") == "released"


def test_pressing_the_detach_key_twice_sends_it(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    # The program reads one byte in raw mode (where ^\ is a byte, not SIGQUIT).
    local = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "k2", "--",
                          "sh", "-c", "stty raw -echo; printf 'rea''dy'; "
                          "head -c 1 | od -An -tx1; stty sane"])
    assert b"ready" in local.read_available(until=b"ready")
    os.write(local.master, b"\x1c\x1c")
    out = local.read_available(until=b"1c")
    assert local.proc.wait(TIMEOUT) == 0
    assert re.search(rb"^ *1c\s*$", out, re.MULTILINE), out
    assert state(holder, "k2") == "released"


def test_attach_of_an_exited_session_shows_its_last_words_and_releases_it(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    program = pty_children(["sh", "-c", "echo last words"])
    holder.client().hand_off("t1", program.master, child_pid=program.pid)
    wait_for(lambda: state(holder, "t1", OWNER) == "exited", TIMEOUT, "the session to exit")
    rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", f"{OWNER}/t1")
    assert rc == 0, out
    assert "last words" in out
    assert f"escrowctl: {OWNER}/t1 has ended" in out
    assert state(holder, "t1", OWNER) == "released"


def test_a_program_run_holds_no_socket(holder: HolderProcess,
                                       pty_children: Callable[..., PtyChild]) -> None:
    """The program is not the custodian: it holds only its terminal (a child that kept
    the custody socket would keep the session held after escrowctl died)."""
    rc, out = escrowctl_in_a_pty(pty_children, holder, "run", "--id", "r2", "--",
                                 "sh", "-c", "ls -l /proc/$$/fd; exit 3")
    assert rc == 3, out
    fds = re.findall(r" (\d+) -> (\S+)", out)
    assert fds and all(target.startswith("/dev/pts/") for _, target in fds), out


def test_run_with_an_id_in_use_starts_nothing(
    holder: HolderProcess, pty_children: Callable[..., PtyChild], tmp_path: Path
) -> None:
    program = pty_children(["sh", "-c", "exec sleep 60"])
    holder.client(RUN_OWNER).hand_off("r3", program.master, child_pid=program.pid)
    marker = tmp_path / "ran"
    rc, out = escrowctl_in_a_pty(pty_children, holder, "run", "--id", "r3", "--",
                                 "touch", str(marker))
    assert rc == 1
    assert f"session {RUN_OWNER}/r3 exists" in out and "(exists)" in out
    assert not marker.exists()
    assert state(holder, "r3") == "draining"


def test_run_of_a_program_that_is_not_there(holder: HolderProcess,
                                            pty_children: Callable[..., PtyChild]) -> None:
    rc, out = escrowctl_in_a_pty(pty_children, holder, "run", "--", "/no/such/program")
    assert rc == 127
    assert "escrowctl: cannot run /no/such/program: No such file or directory" in out
    assert holder.client(RUN_OWNER).list() == []


def test_bad_detach_key_is_a_usage_error(holder: HolderProcess) -> None:
    done = subprocess.run([ESCROWCTL, "--socket", holder.socket, "attach", "--detach-key",
                           "^[", f"{OWNER}/t1"], capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert "Escape" in done.stderr and "Traceback" not in done.stderr


def test_a_sigkilled_attach_leaves_the_terminal_blocking(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """The master's flags belong to the open file description the holder shares, and the
    holder takes what it finds for the app's own: escrowctl sets O_NONBLOCK only around
    each write of what is typed, so even a SIGKILL leaves the terminal blocking for the
    next app."""
    local = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "nb", "--",
                          "sh", "-c", "echo re''ady; exec cat"])
    local.read_available(timeout=TIMEOUT, until=b"ready")
    os.write(local.master, b"typed\r")
    local.read_available(timeout=TIMEOUT, until=b"typed")
    info = session(holder, "nb")
    assert info is not None and info.custodian_pid is not None
    os.kill(info.custodian_pid, signal.SIGKILL)
    wait_for(lambda: state(holder, "nb") == "draining", TIMEOUT, "the session draining")
    got = holder.client(RUN_OWNER).retrieve("nb")
    try:
        assert os.get_blocking(got.fd)
    finally:
        os.close(got.fd)


def test_sigterm_ends_an_attach_whose_terminal_takes_no_output(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """A local terminal that stops reading (a dropped ssh link) blocks escrowctl in its
    write; SIGTERM still detaches it, and the holder drains the session again."""
    local = pty_children([ESCROWCTL, "--socket", holder.socket, "run", "--id", "st", "--",
                          "yes", "a line that fills the terminal"])
    wait_for(lambda: state(holder, "st") == "held", TIMEOUT, "the session held")
    info = session(holder, "st")
    assert info is not None and info.custodian_pid is not None
    pid = info.custodian_pid
    # Nobody reads the local terminal: escrowctl blocks writing to it.
    wait_for(lambda: Path(f"/proc/{pid}/wchan").read_text() in ("n_tty_write", "wait_woken"),
             TIMEOUT, "escrowctl blocked writing to its terminal")
    os.kill(pid, signal.SIGTERM)
    assert local.proc.wait(TIMEOUT) == 0
    wait_for(lambda: state(holder, "st") == "draining", TIMEOUT, "the session draining")
    holder.client(RUN_OWNER).release("st")


def test_losing_the_terminal_by_eof_or_eio_detaches_and_never_releases(
    holder: HolderProcess, pty_children: Callable[..., PtyChild], tmp_path: Path
) -> None:
    """The local terminal hangs up (its master is closed) and escrowctl is told by its
    reads and writes of it (EOF, EIO), not by SIGHUP: it detaches. The session drains
    again, its program alive and printing into the ring; released, its program would have
    been hung up and the user's work lost with a terminal that merely went away.

    escrowctl runs under a shell that leads the terminal's session and ignores SIGHUP,
    so that the hang-up signals nobody but that shell (the kernel signals the session
    leader only) and escrowctl learns of it by reading and writing alone."""
    program = pty_children(["sh", "-c", "while :; do echo tick; sleep 0.1; done"])
    holder.client().hand_off("t1", program.master, child_pid=program.pid)
    err, rc = tmp_path / "stderr", tmp_path / "rc"
    local = spawn_in_pty(["sh", "-c", f"trap '' HUP; {shlex.quote(ESCROWCTL)} --socket "
                          f"{shlex.quote(holder.socket)} attach {OWNER}/t1 2>{err}; "
                          f"echo $? >{rc}"])
    master_open = True
    escrowctl: psutil.Process | None = None
    try:
        info = wait_for(lambda: (s := session(holder, "t1", OWNER)) is not None
                        and s.state == "held" and s, TIMEOUT, "escrowctl to attach")
        assert info.custodian_pid is not None
        escrowctl = psutil.Process(info.custodian_pid)
        assert b"tick" in local.read_available(until=b"tick")  # it copies the program's output
        os.close(local.master)  # the local terminal goes away
        master_open = False
        wait_for(partial(gone, escrowctl), TIMEOUT, "escrowctl to exit")
        wait_for(lambda: rc.exists() and rc.read_text().endswith("\n"), TIMEOUT,
                 "the shell to write escrowctl's exit status")
        said = err.read_text()
        assert "the terminal went away" in said, said  # EOF or EIO, not a signal
        assert state(holder, "t1", OWNER) == "draining", \
            f"losing the terminal did not leave the session draining: {said}"
        assert rc.read_text() == "0\n"
        drained = session(holder, "t1", OWNER)
        assert drained is not None and drained.child_alive and program.proc.poll() is None
        wait_for(lambda: (s := session(holder, "t1", OWNER)) is not None
                 and s.buffered_bytes >= drained.buffered_bytes + 3 * len("tick\r\n"),
                 TIMEOUT, "the program's output drained into the ring after the detach")
    finally:
        if master_open:
            os.close(local.master)
        if escrowctl is not None and not gone(escrowctl):
            escrowctl.kill()
        local.kill()


def test_run_gives_the_program_the_modes_of_its_terminal(
    screens: Screens, holder: HolderProcess
) -> None:
    """A new session's PTY starts with the local terminal's modes (here iutf8, which a
    shell's line editing needs for UTF-8), as a terminal app's new tab would."""
    a = screens.pane("a")
    a.line(f"stty iutf8; escrowctl --socket {holder.socket} run --id modes -- "
           "sh -c 'stty -a | grep -o .iutf8'; echo \"rc=$?\"")
    assert int(a.wait_line(r"^rc=(\d+)$")[1]) == 0
    assert a.wait_line(r"^.iutf8$")[0] == " iutf8", a.capture()
