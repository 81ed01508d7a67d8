"""Taking a session over from another `escrowctl attach`: `escrowctl attach -d` (docs/design.md
§13, docs/escrowctl.md). Custody is never taken from anyone (PROTOCOL.md §10.2): the
attachment that holds the session is asked to let go, lets go as on the detach key, and the
new one attaches once the session drains again.

    consent  the attachment says, in its session's `meta` (`KEY`: its pid, start time and,
             where the platform tells it, its session's terminal), that it can be taken
             over; only once its handler for the request is installed, and it takes the
             entry back before it lets go (`Consent.given`). Only escrowctl consents
             (`attach(takeover=True)`): it handles SIGUSR1 for its whole life, so that a
             request that comes as the attachment ends cannot kill it; a library caller
             never does. An app never says so, nor an attach whose session's meta has no
             room for the entry: their sessions are refused, and the custodian named. A
             consent is believed only while the session is `held` by that very pid
             (`custodian_pid`), that pid is the process that started then, and it runs
             as this user (`consented`): a stale entry (an attach SIGKILLed), or one an
             app copied with the meta, is none.
    request  a note in the holder's socket directory (the user's own, 0700: the client
             checked it before it connected), `takeover-<pid>` for the attachment asked,
             created 0600 and exclusively, naming the session, who asks (pid, start time,
             terminals) and until when (the requester's own deadline); written whole
             and linked into place, so that nobody reads half a note; then SIGUSR1 to
             that pid, through a pidfd where there is one, so that a pid reused
             meanwhile is not signalled. The attachment acts on SIGUSR1 only if such a
             note is there, a regular file of this user's open to nobody else, for its
             session and its own pid, from a requester that still runs, not expired,
             and not typed inside the session itself (`Consent.asked`): a stray SIGUSR1
             changes nothing. It lets go even while blocked writing to a frozen terminal
             (client/attach_signals.py). escrowctl catches SIGUSR1 for its whole life
             (`catch_stray`), so that a stray one never kills it either.
    itself   an `attach -d` typed inside the session it names would take the session over
             into itself: refused before anything is sent, when one of its stdin, stdout
             and stderr is the terminal the consent names (and refused by the attachment
             too, from the note).
    wait     the new attach watches the session (under the call's timeout, `--timeout`,
             5 s by default; saying so after a second) until it leaves `held`, and
             retrieves it then as any attach does. If the old one does not let go in
             time, the note goes and the session is looked at once more (it may have let
             go just then: it is retrieved); if still held, the error says nothing was
             changed. Two
             `attach -d` at once: one of them creates the note, and the other is told
             who is taking the session over.

The note itself, written whole and removed only by its writer or once stale:
client/takeover_note.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from . import errors, liveness, platform, processes, protocol, takeover_note
from .custody import Custody
from .retrieved import Retrieved
from .takeover_note import Note, note_path

TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from .client import EscrowClient

KEY = "escrowctl.attach"  # in a session's meta: "PID START_TIME [DEV RDEV]", the consent
SIGNAL = signal.SIGUSR1
SAY_AFTER = 1.0
_POLL = 0.05
_MAX_META = 32  # entries in a meta (PROTOCOL.md §7)

Terminal = tuple[int, int]  # a terminal's device: (st_dev, st_rdev) of its pts


def catch_stray() -> None:
    """For escrowctl's whole life: a SIGUSR1 outside an attachment does nothing. A handler,
    not SIG_IGN, so that the program `run` starts does not inherit it ignored (exec puts a
    handled signal back to its default)."""
    signal.signal(SIGNAL, _nothing)


def _nothing(signum: int, frame: FrameType | None) -> None:
    pass


def why(by_pid: int, by_tty: str) -> str:
    return f"taken over by escrowctl attach -d (pid {by_pid}, {by_tty})"


def _taken_meanwhile(ref: str, session_id: str, by: int | None) -> errors.CustodyHeld:
    by_whom = f" by pid {by}" if by else ""
    return errors.CustodyHeld(f"{ref} was taken{by_whom} meanwhile; nothing was changed",
                              session_id)


def my_terminals() -> list[Terminal]:
    """The terminals this process's stdin, stdout and stderr are."""
    found: list[Terminal] = []
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                st = os.fstat(fd)
                if (st.st_dev, st.st_rdev) not in found:
                    found.append((st.st_dev, st.st_rdev))
        except OSError:
            pass
    return found


class Consent:
    """One attachment's consent to be taken over: the old side. `meta` is the session's,
    as it was when the attachment began, and what it is given back when the consent is
    withdrawn."""

    def __init__(self, custody: Custody, client: EscrowClient, session_id: str,
                 meta: dict[str, str], master: int) -> None:
        self.custody, self.session_id = custody, session_id
        self._owner, self._note = client.owner, note_path(client.socket_path, os.getpid())
        self._meta = {k: v for k, v in meta.items() if k != KEY}
        self._start: float | None = None
        try:
            self._terminal = platform.terminal_identity(master)
        except OSError:
            self._terminal = None

    @contextmanager
    def given(self) -> Iterator[None]:
        """Give consent for as long as the block lasts. Enter it with the handler for
        SIGNAL installed; it is taken back before the handler is (the holder told first,
        so that nobody who reads it after signals a process that no longer handles it)."""
        self._give()
        try:
            yield
        finally:
            self._withdraw()

    def _give(self) -> None:
        start = liveness.process_start_time(os.getpid())
        said = f"{os.getpid()} {start!r}"
        if self._terminal is not None:
            said += " {} {}".format(*self._terminal)
        meta = {**self._meta, KEY: said}
        if start is None or len(meta) > _MAX_META:
            return  # cannot be proven to be this process, or no room: no consent
        try:
            self.custody.update(self.session_id, meta=meta)
        except errors.EscrowError:
            return  # the holder is away: this attachment cannot be taken over
        self._start = start

    def _withdraw(self) -> None:
        if self._start is None or not self.custody.protected:
            return
        try:
            self.custody.update(self.session_id, meta=self._meta)
        except errors.EscrowError:
            pass  # a consent left behind is believed of this process only, while it holds
        self._start = None

    def asked(self) -> str | None:
        """After a SIGNAL: why this attachment is to let go (a takeover it can believe),
        or None (a stray signal, or none that can be believed)."""
        if self._start is None or not self.custody.protected:
            return None  # letting go now could leave nobody with the terminal
        note = takeover_note.read(self._note)
        if note is None or (note.owner, note.id, note.for_pid) != (
                self._owner, self.session_id, os.getpid()) \
                or abs(note.for_start - self._start) >= 1e-3 or note.expires <= time.time() \
                or liveness.process_alive(note.by_pid, note.by_start) is not True \
                or (self._terminal is not None and list(self._terminal) in note.by_terminals):
            return None  # (the last: asked from inside its own session)
        return why(note.by_pid, note.by_tty)


def consented(info: protocol.SessionInfo) -> tuple[int, float] | None:
    """The custodian's pid and start time, if it consented to be taken over and that
    consent can be believed now."""
    pid = info.custodian_pid
    try:
        said_pid, said_start = info.meta.get(KEY, "").split()[:2]
        start = float(said_start)
        if info.state != "held" or pid is None or int(said_pid) != pid:
            return None
    except ValueError:
        return None
    if liveness.process_alive(pid, start) is not True:
        return None
    try:
        if processes.process_uids(pid) != (os.getuid(), os.getuid()):
            return None
    except (processes.NoSuchProcess, OSError, ValueError):
        return None
    return pid, start


def consent_terminal(info: protocol.SessionInfo) -> Terminal | None:
    """The session's terminal, as its consenting custodian says it (None: not said)."""
    try:
        dev, rdev = info.meta.get(KEY, "").split()[2:4]
        return int(dev), int(rdev)
    except ValueError:
        return None


def held_by(client: EscrowClient, session_id: str, exc: errors.CustodyHeld,
            steal: bool) -> errors.CustodyHeld:
    """The answer to an attach of a held session, naming who holds it."""
    info = _session(client, session_id)
    if info is None or info.custodian_pid is None:
        return exc
    pid = info.custodian_pid
    name = liveness.process_name(pid)
    who = f"{client.owner}/{session_id} is held by pid {pid}{f' ({name})' if name else ''}"
    if consented(info) is not None:
        return errors.CustodyHeld(f"{who}: it is attached elsewhere, and `escrowctl attach "
                                  "-d` takes it over; nothing was changed", session_id)
    if steal:
        return errors.CustodyHeld(f"{who}: it did not agree to be taken over (an app, or an "
                                  "attach whose session meta had no room); it must let go; "
                                  "nothing was changed", session_id)
    return errors.CustodyHeld(f"{who}: an app shows it, or it is attached elsewhere; "
                              "nothing was changed", session_id)


def take_over(client: EscrowClient, custody: Custody, session_id: str,
              held: errors.CustodyHeld, asked: float,
              on_wait: Callable[[str], None] | None = None) -> Retrieved:
    """Ask the attachment that holds `session_id` to let go, wait for it, and retrieve the
    session into `custody` (with its journal), as `Custody.retrieve` does. `asked`: when
    the retrieve that got `held` was sent (Unix time); a custody taken since is not the
    one this takeover is for. `on_wait` is told, once, when the wait has lasted a second.

    Error handling: a custodian that did not consent (an app) raises CustodyHeld naming
    it, and nothing is sent to it; so does a session whose terminal is this process's
    own; another takeover of it under way raises Busy; one that does not let go within
    the client's timeout, or another process that takes the session first (another
    `attach -d` at the same time), raises CustodyHeld. In each case nothing was
    changed."""
    started, started_at, deadline = time.monotonic(), time.time(), client.timeout
    ref = f"{client.owner}/{session_id}"
    info = _session(client, session_id)
    if info is None or info.state != "held":
        return _retrieve(client, custody, session_id)  # it let go meanwhile
    if info.state_since >= asked:  # the same clock: the holder's is this host's
        # Taken since this attach asked (another `attach -d` at the same time): it keeps it.
        raise _taken_meanwhile(ref, session_id, info.custodian_pid)
    custodian = consented(info)
    # Held for under a second: perhaps by an attach that has just taken it and is about
    # to consent (it does once its handler is installed). Both clocks: the wall clock
    # may step.
    while custodian is None and time.time() - info.state_since < SAY_AFTER \
            and time.monotonic() - started < SAY_AFTER:
        time.sleep(_POLL)
        now = _session(client, session_id)
        if now is None or now.state != "held" or now.custodian_pid != info.custodian_pid:
            return _retrieve(client, custody, session_id)
        info, custodian = now, consented(now)
    if custodian is None:
        raise held_by(client, session_id, held, steal=True)
    terminals = my_terminals()
    if consent_terminal(info) in terminals:
        raise errors.CustodyHeld(f"this terminal is {ref}'s own: escrowctl attach -d "
                                 "inside the session would take it over into itself; "
                                 "nothing was changed", session_id)
    pid, start = custodian
    path = note_path(client.socket_path, pid)
    try:
        tty = os.ttyname(0)
    except OSError:
        tty = "no terminal"
    note = Note(client.owner, session_id, pid, start, os.getpid(),
                liveness.process_start_time(os.getpid()), tty, started_at + deadline,
                [list(t) for t in terminals])
    mine = takeover_note.write(path, ref, note)
    try:
        if not processes.signal_if(pid, SIGNAL, lambda: _still_consenting(client, session_id,
                                                                        custodian)):
            return _retrieve(client, custody, session_id)  # it let go meanwhile
        said = False
        while True:
            info = _session(client, session_id)
            if info is None or info.state != "held":
                try:
                    return custody.retrieve(session_id, journal=True)
                except (errors.CustodyHeld, errors.Busy):
                    info = _session(client, session_id)  # a third came first: whose now?
            if info is not None and info.state == "held" and info.custodian_pid != pid:
                raise _taken_meanwhile(ref, session_id, info.custodian_pid)
            waited = time.monotonic() - started
            if waited >= deadline:
                break
            if not said and waited >= SAY_AFTER and on_wait is not None:
                on_wait(f"escrowctl: waiting for pid {pid} to let go of {ref} (up to "
                        f"{deadline:g} s)")
                said = True
            time.sleep(_POLL)
    finally:
        takeover_note.remove(path, mine)
    # The note is gone and expired: whatever read it in time may just have let go.
    info = _session(client, session_id)
    if info is not None and info.state == "held" and info.custodian_pid == pid:
        raise errors.CustodyHeld(f"pid {pid}, attached to {ref}, did not let go within "
                                 f"{deadline:g} s; nothing was changed", session_id)
    return _retrieve(client, custody, session_id)


def _retrieve(client: EscrowClient, custody: Custody, session_id: str) -> Retrieved:
    """Retrieve a session that is no longer held by the attachment asked; another that took
    it first is named."""
    try:
        return custody.retrieve(session_id, journal=True)
    except (errors.CustodyHeld, errors.Busy):
        info = _session(client, session_id)
        raise _taken_meanwhile(f"{client.owner}/{session_id}", session_id,
                               info.custodian_pid if info else None) from None


def _still_consenting(client: EscrowClient, session_id: str,
                      custodian: tuple[int, float]) -> bool:
    info = _session(client, session_id)
    return info is not None and consented(info) == custodian


def _session(client: EscrowClient, session_id: str) -> protocol.SessionInfo | None:
    try:
        return next((s for s in client.list() if s.id == session_id), None)
    except errors.EscrowError:
        return None
