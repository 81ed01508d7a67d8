"""Attach: pick up an escrowed session from any terminal, with the holder out of the data
path (docs/design.md §13). `escrowctl attach` and `escrowctl run` are thin over this module.

An attachment holds the session in custody (docs/design.md §12): the session stays escrowed, and
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

Here are the endings, the copy loop and the two ways in; each part they use has a module
of its own: `local_terminal` (raw mode, and the modes given back: `leaving`), `detach_key`
(and the encodings of keyboard protocols: `key_events`), `attach_signals` (the signals, the
write to a stalled terminal they interrupt, and the keys' signals ignored to the end of the
process) and `spawn` (the program `run` starts).
"""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import signal
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

from . import errors, protocol, waiting
from . import takeover as takeovers
from .after_replay import after_replay
from .attach_signals import DETACHING, Interrupted, Signals
from .client import EscrowClient
from .custody import Custody
from .detach_key import DEFAULT_DETACH_KEY, DOUBLE_PRESS, DetachKey, key_name, parse_key
from .local_terminal import READ_SIZE, RESET, LocalTerminal, TerminalGone
from .protocol import LIVE_STATES
from .repaint import repaint
from .replies import ASK, Replies
from .safe_replay import safe_replay
from .spawn import CannotRun, end, exit_status, spawn

__all__ = [
    "DEFAULT_DETACH_KEY",
    "DOUBLE_PRESS",
    "Attachment",
    "CannotRun",
    "DetachKey",
    "Ending",
    "LocalTerminal",
    "TerminalGone",
    "attach",
    "exit_status",
    "key_name",
    "parse_key",
    "run",
]


@dataclass(frozen=True)
class Ending:
    """How an attachment ended. `detached`: custody ended, and the holder drains the
    session again; `why` says what detached it. Otherwise the program ended and the
    session was released: `status` is its exit status for `run` (None for `attach`, which
    cannot know it). For `run` with no status: `unknown` if nobody can know it (it was
    orphaned where no keeper could keep it), else `wait_failed` says why it was not had."""

    detached: bool
    why: str
    status: int | None = None
    unknown: bool = False
    wait_failed: str | None = None
    stalled: bool = False  # the terminal stopped taking output: write nothing more to it


class Attachment:
    """One session, attached to the local terminal. `custody` holds the session; `master`
    is this process's copy of its PTY master; `child` is the program's process when this
    process started it (`run`)."""

    def __init__(self, custody: Custody, session_id: str, master: int, terminal: LocalTerminal,
                 keys: DetachKey, child: subprocess.Popen[bytes] | None = None,
                 exiting: bool = False, consent: takeovers.Consent | None = None) -> None:
        self.custody = custody
        self.session_id = session_id
        self.master = master
        self.terminal = terminal
        self.keys = keys
        self.child = child
        # The process exits once this has said how it ended (escrowctl): the keys that
        # signal stay ignored until then (client/attach_signals.py says why).
        self.exiting = exiting
        self.consent = consent  # to be taken over by `escrowctl attach -d`
        self._signals = Signals(terminal, child is not None,
                                consent.asked if consent is not None else None)
        self._size = (0, 0)  # the session's, as last set
        self._replies = Replies(None)  # what the local terminal answers, kept from the program

    def run(self, replay: bytes | memoryview | None = None,
            first: bytes | memoryview = b"") -> Ending:
        """Attach until one of the endings, and see to the session as it says (custody
        ended, or the session released). With `replay` (a retrieved session), the local
        terminal is reset, the replay written and the program made to redraw first.
        Closes `master` on return, and ends custody whatever happens: on an error, as on
        a detach, the holder drains the session again."""
        try:
            self._size = termios.tcgetwinsize(self.master)
            try:
                with self._signals.handled(), self.terminal.raw(), waiting.quiet(), \
                        self.consent.given() if self.consent else nullcontext():
                    if replay is not None:
                        self._write_local(RESET + safe_replay(replay) + after_replay(replay)
                                          + ASK)
                        if not self._resize():  # a new size makes the program redraw
                            repaint(self.master)
                        # From now: the repaint (up to a second) reads no key, and what the
                        # terminal answered meanwhile is read, and told from keys, after it.
                        self._replies = Replies(time.monotonic())
                    else:
                        # What a program the holder started printed before it came here,
                        # as if read now.
                        self._write_local(bytes(first))
                        self._resize()  # the terminal may have changed size while we started
                    ending = self._copy()
                    self._last_answer()
            except TerminalGone as exc:
                ending = Ending(True, f"the terminal went away: {exc}")
            except Interrupted as exc:
                ending = Ending(True, f"{exc.why}, while the terminal was not taking output",
                                stalled=True)
            if not ending.detached:
                self.custody.release(self.session_id)
        finally:
            os.close(self.master)
            self.master = -1
            self.custody.close()
        if not ending.detached and self.child is not None:
            self._signals.keyboard_back()  # the program's end may take long: Ctrl-C ends the wait
            return Ending(False, ending.why, exit_status(self.child.wait()))
        if not self.exiting:
            self._signals.keyboard_back()
        return ending

    # --- the copy loop ----------------------------------------------------------------

    def _copy(self) -> Ending:
        master, keys_fd, wake = self.master, self.terminal.in_fd, self._signals.wake_fd
        typed = bytearray()  # for the program, not yet taken by its terminal
        while True:
            wait = self._replies.wait(time.monotonic(), self.keys.wait(time.monotonic()))
            readable, writable, _ = select.select(
                [wake, keys_fd, master], [master] if typed else [], [], wait)
            if wake in readable:
                ending = self._on_signals()
                if ending is not None:
                    return ending
            if master in readable and self._from_program():
                return Ending(False, "the program closed its terminal")
            if keys_fd in readable or self._replies.due(time.monotonic()):
                data = self.terminal.read() if keys_fd in readable else b""
                if (ending := self._keys(self._replies.feed(data, time.monotonic()),
                                         typed)) is not None:
                    return ending
            elif master in writable:
                self._to_program(typed)
            if self.keys.wait(time.monotonic()) == 0 and (
                    ending := self._keys(b"", typed)) is not None:
                return ending

    def _keys(self, data: bytes, typed: bytearray) -> Ending | None:
        """What the user typed (b"": what waited for its time) goes to the program, less
        the detach key; its ending if the key detaches."""
        given, detach = self.keys.feed(data, time.monotonic())
        typed += given
        self._to_program(typed)
        return self._detach_key() if detach else None

    def _last_answer(self) -> None:
        """Read the terminal's answer to ASK if it has not come yet (what else comes with it
        is not for the session any more)."""
        while (left := self._replies.awaited(time.monotonic())) is not None:
            if select.select([self.terminal.in_fd], [], [], left)[0]:
                try:
                    self._replies.feed(self.terminal.read(), time.monotonic())
                except TerminalGone:
                    return  # nobody is left to type it at

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
        pending = self._signals.take()
        for signum in pending:
            if signum in DETACHING:
                return Ending(True, DETACHING[signum])
            if signum == takeovers.SIGNAL and self.consent is not None \
                    and (why := self.consent.asked()) is not None:
                return Ending(True, why)
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

    def _write_local(self, data: bytes) -> None:
        with self._signals.interruptible():
            self.terminal.write(data)


# --- the two ways in --------------------------------------------------------------------


def attach(client: EscrowClient, session_id: str, detach_key: int | None,
           exiting: bool = False, steal: bool = False, takeover: bool = False,
           on_wait: Callable[[str], None] | None = None) -> Ending:
    """`escrowctl attach`: retrieve `session_id` into custody (with its journal) and
    attach it to this process's terminal until it detaches or ends. With `steal`
    (`attach -d`), an attach elsewhere that holds it is asked to let go first
    (client/takeover.py), and `on_wait` told, once, if that takes a while. With
    `takeover`, this attachment can be taken over likewise: only for a process that
    handles SIGUSR1 for its whole life (escrowctl: `takeover.catch_stray`), since a
    request may come just as the attachment ends; without, SIGUSR1 is left alone.

    Error handling: a session held by a custodian (an app, another attach not `steal`
    asked to let go) raises CustodyHeld naming the custodian's pid, and changes nothing;
    the holder's answers
    (SessionUnknown, Released...) are raised as they come. A stdin or stdout that is not a
    terminal raises NotATerminal before the holder is asked anything."""
    terminal = LocalTerminal()
    custody = client.custody()
    try:
        asked = time.time()
        try:
            got = custody.retrieve(session_id, journal=True)
        except errors.CustodyHeld as exc:
            if not steal:
                raise takeovers.held_by(client, session_id, exc, steal) from None
            got = takeovers.take_over(client, custody, session_id, exc, asked, on_wait)
    except BaseException:
        custody.close()
        raise
    consent = takeovers.Consent(custody, client, session_id, got.session.meta,
                                got.fd) if takeover else None
    ending = Attachment(custody, session_id, got.fd, terminal, DetachKey(detach_key),
                        exiting=exiting, consent=consent).run(got.replay)
    if ending.detached or not got.session.started:
        return ending
    return Ending(False, f"{ending.why}; {_how_it_ended(client, session_id)}")


def run(client: EscrowClient, argv: Sequence[str], session_id: str, label: str,
        detach_key: int | None, exiting: bool = False, takeover: bool = False) -> Ending:
    """`escrowctl run`: start `argv` in a new PTY the size of this process's terminal,
    escrowed in custody (with a journal) as `session_id`, and attach it; `takeover` as
    for `attach`.

    The holder starts the program (escrow_client.run_start), so that its exit status is
    known whenever it ends, attached or not; a holder too old for that gets today's way:
    the program is started here before custody exists, with every fd but its terminal
    closed (it never holds the custody socket), and deposited. If that deposit fails (the
    id exists, say), its terminal is closed and the program ended before the error is
    raised."""
    from . import run_start

    terminal = LocalTerminal()
    if any(s.id == session_id and s.state in LIVE_STATES for s in client.list()):
        raise errors.SessionExists(f"session {client.owner}/{session_id} exists; attach it "
                                   "with escrowctl attach, or choose another id", session_id)
    rows, cols = terminal.size()
    custody = client.custody()
    try:
        if not run_start.can_start(custody):
            custody.close()
            return _run_here(client, argv, session_id, label, detach_key, exiting, terminal,
                             takeover)
        got = run_start.start(custody, session_id, argv, label=label, cols=cols, rows=rows,
                              journal=True, modes_of=terminal.in_fd)
    except (errors.ExecFailed, errors.CwdGone) as exc:
        custody.close()
        # (As a shell says it: 127 for a program not found on the PATH it was given.)
        status = 126 if isinstance(exc, errors.ExecFailed) and shutil.which(argv[0]) else 127
        raise CannotRun(str(exc), status) from None
    except BaseException:
        custody.close()
        raise
    attachment = Attachment(custody, session_id, got.fd, terminal, DetachKey(detach_key),
                            exiting=exiting,
                            consent=takeovers.Consent(custody, client, session_id,
                                                      got.session.meta, got.fd)
                            if takeover else None)
    ending = attachment.run(first=got.replay)
    if ending.detached:
        return ending
    attachment._signals.keyboard_back()  # its end may take long: Ctrl-C ends the wait
    return _shell_status(client, session_id, ending.why)


def _shell_status(client: EscrowClient, session_id: str, why: str) -> Ending:
    """The end of a program the holder started, once it has ended, with its exit status as
    a shell says it, or why there is none ("unknown" is never a status)."""
    from .program_wait import wait

    try:
        ending = wait(client, session_id)
    except errors.EscrowError as exc:
        return Ending(False, why, wait_failed=str(exc))
    if not isinstance(ending, protocol.ExitStatus):
        return Ending(False, why, unknown=True)
    return Ending(False, why, ending.shell_status())


def _how_it_ended(client: EscrowClient, session_id: str) -> str:
    """How the program of a session the holder started ended, in words, for `attach`."""
    from .program_wait import wait

    try:
        ending = wait(client, session_id, 2.0)
    except errors.EscrowError:
        return "how its program ended cannot be told now (escrowctl wait tells, later)"
    if not isinstance(ending, protocol.ExitStatus):
        return "how its program ended is unknown"
    if ending.code is not None:
        return f"its program exited with status {ending.code}"
    return f"its program was killed by signal {ending.signal}"


def _run_here(client: EscrowClient, argv: Sequence[str], session_id: str, label: str,
              detach_key: int | None, exiting: bool, terminal: LocalTerminal,
              takeover: bool) -> Ending:
    """`run` for a holder that does not start programs: this process starts it."""
    rows, cols = terminal.size()
    master, child = spawn(argv, rows, cols, terminal.in_fd)
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
        end(child)
        raise
    return Attachment(custody, session_id, master, terminal, DetachKey(detach_key),
                      child, exiting=exiting,
                      consent=takeovers.Consent(custody, client, session_id, {}, master)
                      if takeover else None).run()

