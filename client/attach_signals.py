"""The signals an attachment acts on, seen by its copy loop without a race (docs/design.md §13).

SIGTERM, SIGHUP and SIGINT detach (`DETACHING`: the session goes on, drained by the holder
again); SIGWINCH gives the session the local terminal's new size; SIGCHLD, for `run`, may
mean the program exited; SIGUSR1 may be a takeover (client/takeover.py checks). Their
handlers only note the signal; a wake-up fd (`signal.set_wakeup_fd`) makes the loop's
select see it, so that none is missed between a check and the wait.

Once only does a handler do more: a write to a local terminal that does not read (a dropped
ssh link, a frozen emulator) would block for ever, and nothing but SIGKILL would end
escrowctl. A detaching signal during a write (`interruptible`) leaves it: the handler marks
the terminal stalled (nothing more is written to it) and raises `Interrupted`. So does a
takeover that can be believed (`taken()` says why, client/takeover.py): a frozen terminal
is what `escrowctl attach -d` is for.

SIGUSR1 is handled only by an attachment that can be taken over (`taken` given): a library
caller's attachment leaves it alone entirely, so that its own handler (faulthandler's,
say) is never replaced, not even for a moment.

The keys that signal (Ctrl-C, Ctrl-\\, Ctrl-Z: `KEYBOARD`) do so again from the moment the
terminal gets its modes back, before custody has ended and escrowctl has said how the
attachment ended; a key pressed then (the detach key's second press, or the key held down)
would kill escrowctl there (`^\\Quit`, exit 131), interrupt it or stop it. So SIGQUIT and
SIGTSTP are ignored from the start of an attachment, and all three from its end until the
attachment has said how it ended (`keyboard_back` puts back what they were before): for
escrowctl, which exits next, until it exits. Nothing is started meanwhile, to inherit them
ignored: the program `run` starts is started before. Waiting for that program's end is
not meanwhile: it can take as long as the program likes, and Ctrl-C must end the wait.

Call from the main thread.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from .local_terminal import LocalTerminal

DETACHING: dict[int, str] = {signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP",
                             signal.SIGINT: "SIGINT"}
KEYBOARD: tuple[int, ...] = (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP)


class Interrupted(Exception):
    """A detaching signal, or a takeover, came while a write to the local terminal was
    blocked; `why` says which."""

    def __init__(self, signum: int, why: str) -> None:
        super().__init__(signum, why)
        self.signum, self.why = signum, why


class Signals:
    """The signals of one attachment. Resource handling: `handled()` installs the handlers
    and the wake-up fd (`wake_fd`), and puts back what it found on leaving, but for the
    `KEYBOARD` signals, which it leaves ignored until `keyboard_back()`."""

    def __init__(self, terminal: LocalTerminal, child: bool,
                 taken: Callable[[], str | None] | None = None) -> None:
        self.terminal = terminal
        self._taken = taken
        self._wanted = [signal.SIGWINCH, *DETACHING]
        if taken is not None:  # SIGUSR1: a takeover, perhaps (`taken` checks it is one)
            self._wanted.append(signal.SIGUSR1)
        if child:
            self._wanted.append(signal.SIGCHLD)
        self._noted: list[int] = []
        self._keyboard: dict[int, signal._HANDLER] = {}  # the keys' handlers before handled()
        self.wake_fd = self._wake_w = -1
        self._writing = False  # in a write to the local terminal (see _note)

    @contextmanager
    def handled(self) -> Iterator[None]:
        self.wake_fd, self._wake_w = os.pipe()
        for fd in (self.wake_fd, self._wake_w):
            os.set_blocking(fd, False)
        old_wake = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._keyboard = {signum: signal.getsignal(signum) for signum in KEYBOARD}
        old = {signum: signal.signal(signum, self._note) for signum in self._wanted}
        for signum in KEYBOARD:
            if signum not in old:
                signal.signal(signum, signal.SIG_IGN)
        try:
            yield
        finally:
            for signum, handler in old.items():
                signal.signal(signum, signal.SIG_IGN if signum in KEYBOARD else handler)
            signal.set_wakeup_fd(old_wake)
            os.close(self.wake_fd)
            os.close(self._wake_w)
            self.wake_fd = self._wake_w = -1

    def keyboard_back(self) -> None:
        """Put back what the keys that signal did before `handled()` (see above)."""
        for signum, handler in self._keyboard.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._keyboard = {}

    def take(self) -> list[int]:
        """The signals noted since the last call, in order (the wake-up fd emptied)."""
        try:
            while os.read(self.wake_fd, 512):
                pass
        except BlockingIOError:
            pass
        pending, self._noted = self._noted, []
        return pending

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Around a write to the local terminal: a detaching signal, or a believed
        takeover, leaves it."""
        self._writing = True
        try:
            yield
        finally:
            self._writing = False

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._noted.append(signum)
        if not self._writing:
            return
        why = DETACHING.get(signum)
        if why is None and signum == signal.SIGUSR1 and self._taken is not None:
            why = self._taken()
        if why is not None:
            # Blocked writing to a terminal that does not read (a dropped ssh link, a
            # frozen emulator): leave the write, or nothing but SIGKILL would end this.
            self.terminal.stalled = True
            raise Interrupted(signum, why)
