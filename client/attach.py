"""Attach: pick up an escrowed session from any terminal, with the holder out of the data
path (DESIGN §13). `escrowctl attach` and `escrowctl run` are thin over this module.

An attachment holds the session in custody (DESIGN §12): the session stays escrowed, and
the terminal escrowctl runs in (the *local terminal*) reads the real PTY master, so every
byte goes from the program to the local terminal without passing through the holder. What
escrowctl reads it records in the session's journal, so the ring keeps everything the
session printed, attached or not, and the next attach replays it without a gap.

    attach   retrieve into custody, reset the local terminal, write the replay, repaint
    run      start a command in a new PTY the size of the local terminal, deposit it
    then     raw mode, copy bytes both ways, forward SIGWINCH, until one of the endings

Endings, and what becomes of the session:

- *Detached* (the session goes on, drained by the holder again): the detach key, the local
  terminal going away (EOF or EIO on stdin or stdout, SIGHUP), SIGTERM, SIGINT.
- *Ended*: the program closed its terminal (EIO on the master, after its last bytes), or,
  for `run`, the program escrowctl started exited. Its last bytes go to the local terminal
  first; then the session is released and, for `run`, its exit status is taken.

Resource handling: on every ending, an error included, the local terminal gets its modes
back (termios, and the modes a program may have switched on with escape sequences), the
master its file status flags, and custody is ended (the holder drains) or the session
released. The master is read only while this process holds custody.

Signals: handlers for SIGWINCH, SIGTERM, SIGHUP, SIGINT (and SIGCHLD for `run`) only note
the signal; a wake-up fd (`signal.set_wakeup_fd`) makes the loop see it, so none is missed
between a check and the wait. Call from the main thread.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import subprocess
import termios
import threading
import time
import tty
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from . import errors
from .client import EscrowClient
from .custody import Custody
from .liveness import process_name
from .protocol import LIVE_STATES
from .repaint import repaint

DEFAULT_DETACH_KEY = "^\\"
# A second press of the detach key within this many seconds sends the key itself to the
# program; a single press detaches once this has passed (or at once, when another key
# follows it).
DOUBLE_PRESS = 0.3
READ_SIZE = 65536

# Written to the local terminal before the replay: RIS, a full reset (a fresh screen,
# default modes), since the replay begins somewhere in the middle of the session's life.
RESET = b"\x1bc"
# Written when the local terminal is handed back: the modes a full-screen program may have
# switched on, off again (a full reset would also wipe the screen the user comes back to).
LEAVE = (
    b"\x1b[?1047l"  # the main screen (1047: without moving the cursor, as 1049 would)
    b"\x1b7\x1b[r\x1b8"  # no scroll region (it homes the cursor: saved around it)
    b"\x1b[?1l\x1b>"  # normal cursor keys and keypad
    b"\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1005l\x1b[?1006l\x1b[?1015l"  # no mouse reports
    b"\x1b[?1004l\x1b[?2004l"  # no focus reports, no bracketed paste
    b"\x1b[?7h\x1b(B\x1b[0m\x1b[?25h"  # autowrap, ASCII, plain text, a visible cursor
)

_KEY_RE = re.compile(r"(?:\^|c-|ctrl[-+])(.)", re.IGNORECASE)


# --- the detach key -------------------------------------------------------------------


def parse_key(text: str) -> int | None:
    """A detach key as given on the command line: a control key in caret notation (`^\\`,
    `^]`, `^A`, `^?`) or as `C-x` / `Ctrl-x` (any case), or `none` for no detach key.
    Returns its byte, or None for `none`. Raises ValueError for anything else, and for
    Escape (`^[`), which begins the sequences of arrow and function keys."""
    if text.lower() == "none":
        return None
    m = _KEY_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a control key: give it as ^X or C-x "
                         f"(e.g. {DEFAULT_DETACH_KEY}), or none")
    char = m[1].upper()
    if char == "?":
        return 0x7F
    if not "@" <= char <= "_":
        raise ValueError(f"{text!r} is not a control key (^@, ^A-^Z, ^[, ^\\, ^], ^^, ^_, ^?)")
    if char == "[":
        raise ValueError(f"{text!r} is Escape, which begins the arrow and function keys; "
                         "choose another key")
    return ord(char) - 0x40


def key_name(key: int | None) -> str:
    """How `parse_key` spells `key` (`^\\`), or `none`."""
    if key is None:
        return "none"
    return "^?" if key == 0x7F else "^" + chr(key + 0x40)


class DetachKey:
    """Finds the detach key in what the user types. One press detaches: once `double_press`
    seconds pass with nothing after it, or at once when another key follows. Two presses
    in a row send the key itself to the program. With `key` None, everything goes through."""

    def __init__(self, key: int | None, double_press: float = DOUBLE_PRESS) -> None:
        self.key = key
        self.double_press = double_press
        self._pressed_at: float | None = None

    def feed(self, data: bytes, now: float) -> tuple[bytes, bool]:
        """What of `data` (typed at `now`) goes to the program, and whether to detach now.
        Whatever follows the press that detaches is not for the session: it is dropped."""
        if self.key is None:
            return data, False
        out = bytearray()
        i = 0
        while i < len(data):
            if self._pressed_at is not None:
                if data[i] != self.key:
                    return bytes(out), True
                out.append(self.key)  # pressed twice: the key itself
                self._pressed_at = None
                i += 1
                continue
            press = data.find(self.key, i)
            if press < 0:
                out += data[i:]
                break
            out += data[i:press]
            self._pressed_at = now
            i = press + 1
        return bytes(out), False

    def cancel(self) -> None:
        """Forget a press that was waiting (its detach was refused)."""
        self._pressed_at = None

    def wait(self, now: float) -> float | None:
        """Seconds until a press waiting for a second one detaches (0 once it does); None
        when no press is waiting."""
        if self._pressed_at is None:
            return None
        return max(0.0, self._pressed_at + self.double_press - now)


# --- exit status ----------------------------------------------------------------------


def exit_status(returncode: int) -> int:
    """A program's ending as a shell reports it: its exit code, or 128+N for signal N
    (`subprocess` gives -N)."""
    return returncode if returncode >= 0 else 128 - returncode


# --- the local terminal ---------------------------------------------------------------


class _Interrupted(Exception):
    """A detaching signal came while a write to the local terminal was blocked."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class TerminalGone(Exception):
    """The local terminal went away (EOF or EIO on it): the attachment detaches."""


class LocalTerminal:
    """The terminal escrowctl runs in: keys come from `in_fd`, output goes to `out_fd`.

    Resource handling: `raw()` puts it in raw mode and gives it back on leaving, with the
    termios it had and the modes a program may have set through escape sequences (`LEAVE`);
    a terminal that has gone away is not an error there. Nothing here changes the file
    status flags of either fd: the shell that started escrowctl shares them."""

    def __init__(self, in_fd: int = 0, out_fd: int = 1) -> None:
        for fd, what in ((in_fd, "input"), (out_fd, "output")):
            if not os.isatty(fd):
                raise errors.NotATerminal(f"escrowctl needs a terminal to attach to: its "
                                          f"{what} (fd {fd}) is not one")
        if os.tcgetpgrp(in_fd) != os.getpgrp():
            # In the background the first change of its modes would stop this process
            # (SIGTTOU) while it holds the session: nobody would read it.
            raise errors.EscrowConfigError("escrowctl needs to run in the foreground of its "
                                           "terminal to attach (not with &)")
        self.in_fd, self.out_fd = in_fd, out_fd
        self.stalled = False  # it stopped taking output: nothing more is written to it

    def size(self) -> tuple[int, int]:
        """(rows, cols)."""
        rows, cols = termios.tcgetwinsize(self.in_fd)
        return rows, cols

    @contextmanager
    def raw(self) -> Iterator[None]:
        saved = termios.tcgetattr(self.in_fd)
        tty.setraw(self.in_fd, termios.TCSADRAIN)
        try:
            yield
        finally:
            # A terminal that is gone has nothing left to give back; one that stopped
            # taking output would block us for ever (TCSANOW: what was written already
            # went through output processing as it was written).
            try:
                if not self.stalled:
                    self.write(LEAVE)
            except TerminalGone:
                pass
            try:
                termios.tcsetattr(self.in_fd, termios.TCSANOW, saved)
            except (OSError, termios.error):
                pass

    def read(self) -> bytes:
        """What the user typed (b"" if nothing was there after all)."""
        try:
            data = os.read(self.in_fd, READ_SIZE)
        except BlockingIOError:
            return b""  # O_NONBLOCK, set by someone sharing the terminal
        except OSError as exc:
            raise TerminalGone(str(exc)) from None
        if not data:
            raise TerminalGone("end of input")
        return data

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view) :]
            except BlockingIOError:
                select.select([], [self.out_fd], [])
            except OSError as exc:
                raise TerminalGone(str(exc)) from None


# --- an attachment --------------------------------------------------------------------


@dataclass(frozen=True)
class Ending:
    """How an attachment ended. `detached`: custody ended, and the holder drains the
    session again; `why` says what detached it. Otherwise the program ended and the
    session was released: `status` is its exit status for `run` (None for `attach`, which
    cannot know it)."""

    detached: bool
    why: str
    status: int | None = None
    stalled: bool = False  # the terminal stopped taking output: write nothing more to it


_DETACHING: dict[int, str] = {signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP",
                              signal.SIGINT: "SIGINT"}


class Attachment:
    """One session, attached to the local terminal. `custody` holds the session; `master`
    is this process's copy of its PTY master; `child` is the program's process when this
    process started it (`run`)."""

    def __init__(self, custody: Custody, session_id: str, master: int, terminal: LocalTerminal,
                 keys: DetachKey, child: subprocess.Popen[bytes] | None = None) -> None:
        self.custody = custody
        self.session_id = session_id
        self.master = master
        self.terminal = terminal
        self.keys = keys
        self.child = child
        self._signals: list[int] = []
        self._wake_r = self._wake_w = -1
        self._size = (0, 0)  # the session's, as last set
        self._writing = False  # in a write to the local terminal (see _note)

    def run(self, replay: bytes | None = None) -> Ending:
        """Attach until one of the endings, and see to the session as it says (custody
        ended, or the session released). With `replay` (a retrieved session), the local
        terminal is reset, the replay written and the program made to redraw first.
        Closes `master` on return, and ends custody whatever happens: on an error, as on
        a detach, the holder drains the session again."""
        try:
            self._size = termios.tcgetwinsize(self.master)
            try:
                with self._signal_handlers(), self.terminal.raw():
                    if replay is not None:
                        self._write_local(RESET + replay)
                        if not self._resize():  # a new size makes the program redraw
                            repaint(self.master)
                    else:
                        self._resize()  # the terminal may have changed size while we started
                    ending = self._copy()
            except TerminalGone as exc:
                ending = Ending(True, f"the terminal went away: {exc}")
            except _Interrupted as exc:
                ending = Ending(True, f"{_DETACHING[exc.signum]}, while the terminal was "
                                "not taking output", stalled=True)
            if not ending.detached:
                self.custody.release(self.session_id)
        finally:
            os.close(self.master)
            self.master = -1
            self.custody.close()
        if not ending.detached and self.child is not None:
            return Ending(False, ending.why, exit_status(self.child.wait()))
        return ending

    # --- the copy loop ----------------------------------------------------------------

    def _copy(self) -> Ending:
        master, keys_fd, wake = self.master, self.terminal.in_fd, self._wake_r
        typed = bytearray()  # for the program, not yet taken by its terminal
        while True:
            wait = self.keys.wait(time.monotonic())
            readable, writable, _ = select.select(
                [wake, keys_fd, master], [master] if typed else [], [], wait)
            if wake in readable:
                ending = self._on_signals()
                if ending is not None:
                    return ending
            if master in readable and self._from_program():
                return Ending(False, "the program closed its terminal")
            if keys_fd in readable:
                data, detach = self.keys.feed(self.terminal.read(), time.monotonic())
                typed += data
                self._to_program(typed)
                if detach and (ending := self._detach_key()) is not None:
                    return ending
            elif master in writable:
                self._to_program(typed)
            if self.keys.wait(time.monotonic()) == 0 and (
                    ending := self._detach_key()) is not None:
                return ending

    def _detach_key(self) -> Ending | None:
        if not self.custody.protected:
            # The holder is away (restarting, or gone): detaching now could leave this
            # process with the last copy of the terminal. Stay, and say so.
            self.keys.cancel()
            self._write_local(b"\r\n[escrowctl: the holder is not reachable right now, so "
                              b"this stays attached; press the detach key again later]\r\n")
            return None
        return Ending(True, f"the detach key {key_name(self.keys.key)}")

    def _from_program(self) -> bool:
        """Copy what the program wrote to the local terminal; True once its terminal hung
        up (EIO, after every byte it wrote was read)."""
        try:
            data = self.custody.read(self.session_id, READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            return True  # EIO: the last slave fd is closed
        if not data:
            return True
        self._write_local(data)
        return False

    def _to_program(self, typed: bytearray) -> None:
        """Give the program what the user typed, as much as its terminal takes now.

        O_NONBLOCK is set for this write only, so that a program that does not read its
        input cannot stop its output from being copied; it is the open file description's,
        shared with the holder, which takes the flags it finds for the app's own when it
        drains: set for the whole attachment, an escrowctl SIGKILLed would leave it set
        for good. (Reads need none: they follow select.)"""
        flags = fcntl.fcntl(self.master, fcntl.F_GETFL)
        fcntl.fcntl(self.master, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        try:
            n = os.write(self.master, typed)
        except BlockingIOError:
            return
        except OSError:  # EIO: the program is gone; its ending is read from the master
            n = len(typed)
        finally:
            fcntl.fcntl(self.master, fcntl.F_SETFL, flags)
        del typed[:n]

    def _tail(self) -> None:
        """The program exited: copy what it wrote before that and nobody read yet (select
        flushes the terminal's pending input first, so all of it shows as readable)."""
        while select.select([self.master], [], [], 0)[0]:
            if self._from_program():
                return

    # --- signals ------------------------------------------------------------------------

    def _on_signals(self) -> Ending | None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass
        pending, self._signals = self._signals, []
        for signum in pending:
            if signum in _DETACHING:
                return Ending(True, _DETACHING[signum])
            if signum == signal.SIGCHLD and self.child is not None \
                    and self.child.poll() is not None:
                self._tail()
                return Ending(False, "the program exited")
        if signal.SIGWINCH in pending:
            self._resize()
        return None

    def _resize(self) -> bool:
        """Give the session the local terminal's size, if it changed: the kernel signals
        the program (SIGWINCH), and `escrowctl list` shows the new size. True if it did."""
        size = self.terminal.size()
        if size == self._size:
            return False
        termios.tcsetwinsize(self.master, size)
        self._size = size
        rows, cols = size
        # Off the copy loop: a holder that is slow to answer must not stop the bytes.
        threading.Thread(target=self._report_size, args=(cols, rows), daemon=True).start()
        return True

    def _report_size(self, cols: int, rows: int) -> None:
        try:
            self.custody.update(self.session_id, cols=cols, rows=rows)
        except errors.EscrowError:
            pass  # the holder is away: the size shows late, the program has it already

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)
        if self._writing and signum in _DETACHING:
            # Blocked writing to a terminal that does not read (a dropped ssh link, a
            # frozen emulator): leave the write, or nothing but SIGKILL would end this.
            self.terminal.stalled = True
            raise _Interrupted(signum)

    def _write_local(self, data: bytes) -> None:
        self._writing = True
        try:
            self.terminal.write(data)
        finally:
            self._writing = False

    @contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        wanted = [signal.SIGWINCH, *_DETACHING]
        if self.child is not None:
            wanted.append(signal.SIGCHLD)
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        old_wake = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old = {signum: signal.signal(signum, self._note) for signum in wanted}
        try:
            yield
        finally:
            for signum, handler in old.items():
                signal.signal(signum, handler)
            signal.set_wakeup_fd(old_wake)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

# --- the two ways in --------------------------------------------------------------------


def attach(client: EscrowClient, session_id: str, detach_key: int | None) -> Ending:
    """`escrowctl attach`: retrieve `session_id` into custody (with its journal) and
    attach it to this process's terminal until it detaches or ends.

    Error handling: a session held by a custodian (an app, another attach) raises
    CustodyHeld naming the custodian's pid, and changes nothing; the holder's answers
    (SessionUnknown, Released...) are raised as they come. A stdin or stdout that is not a
    terminal raises NotATerminal before the holder is asked anything."""
    terminal = LocalTerminal()
    custody = client.custody()
    try:
        got = custody.retrieve(session_id, journal=True)
    except errors.CustodyHeld as exc:
        custody.close()
        raise _held_by_whom(client, session_id, exc) from None
    except BaseException:
        custody.close()
        raise
    return Attachment(custody, session_id, got.fd, terminal, DetachKey(detach_key)).run(
        got.replay)


def _held_by_whom(client: EscrowClient, session_id: str,
                  exc: errors.CustodyHeld) -> errors.CustodyHeld:
    try:
        info = next((s for s in client.list() if s.id == session_id), None)
    except errors.EscrowError:
        info = None
    if info is None or info.custodian_pid is None:
        return exc
    name = process_name(info.custodian_pid)
    return errors.CustodyHeld(
        f"{client.owner}/{session_id} is held by pid {info.custodian_pid}"
        f"{f' ({name})' if name else ''}: an app shows it, or it is attached elsewhere; "
        "nothing was changed", session_id)


class CannotRun(Exception):
    """The command could not be started; `status` is what a shell would exit with (127
    not found, 126 found but not executable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def run(client: EscrowClient, argv: Sequence[str], session_id: str, label: str,
        detach_key: int | None) -> Ending:
    """`escrowctl run`: start `argv` in a new PTY the size of this process's terminal,
    deposit it in custody (with a journal) as `session_id`, and attach it.

    The program is started before custody exists, with every fd but its terminal closed:
    it never holds the custody socket. If the deposit fails (the id exists, say), the
    program's terminal is closed and the program ended before the error is raised."""
    terminal = LocalTerminal()
    if any(s.id == session_id and s.state in LIVE_STATES for s in client.list()):
        raise errors.SessionExists(f"session {client.owner}/{session_id} exists; attach it "
                                   "with escrowctl attach, or choose another id", session_id)
    rows, cols = terminal.size()
    master, child = _spawn(argv, rows, cols, terminal.in_fd)
    try:
        custody = client.custody()
        try:
            custody.deposit(session_id, master, child_pid=child.pid, label=label, cols=cols,
                            rows=rows, journal=True)
        except BaseException:
            custody.close()
            raise
    except BaseException:
        os.close(master)
        _end(child)
        raise
    return Attachment(custody, session_id, master, terminal, DetachKey(detach_key),
                      child).run()


def _spawn(argv: Sequence[str], rows: int, cols: int,
           like: int | None = None) -> tuple[int, subprocess.Popen[bytes]]:
    """`argv` as the session leader of a new PTY of that size, which is its controlling
    terminal: the master and the process. The PTY's modes are those of terminal `like`
    (its erase character, iutf8...), as a terminal app gives a new tab the user's."""
    master, slave = os.openpty()
    try:
        if like is not None:
            try:
                termios.tcsetattr(slave, termios.TCSANOW, termios.tcgetattr(like))
            except termios.error:
                pass  # the PTY's own defaults, then
        termios.tcsetwinsize(slave, (rows, cols))
        child = subprocess.Popen(
            list(argv), stdin=slave, stdout=slave, stderr=slave, close_fds=True,
            start_new_session=True, preexec_fn=_take_controlling_terminal)
    except OSError as exc:
        os.close(master)
        status = 127 if isinstance(exc, FileNotFoundError) else 126
        raise CannotRun(f"cannot run {argv[0]}: {exc.strerror or exc}", status) from None
    finally:
        os.close(slave)
    return master, child


def _take_controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _end(child: subprocess.Popen[bytes]) -> None:
    """End a program whose terminal was just closed: the hang-up ends most (SIGHUP)."""
    try:
        child.wait(2.0)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
