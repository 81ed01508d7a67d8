"""Kill: end an escrowed session's program and release the session, signalling only the
processes the kernel names as that terminal's (`escrowctl kill`, docs/escrowctl.md).

Why not the session's `child_pid`: it is what the depositing app said, and a pid outlives
nothing; signalling it could hit another terminal's program, or a process that took the
number since. So the question goes to the kernel, through the terminal itself:

1. The session is retrieved into custody, as `attach` does (docs/design.md §12): the holder
   keeps its copy, held by this process, and hands over the master. A session an app or
   another attach holds is refused (`Refused`, naming the holder of it), and nothing
   changes.
2. On the master, TIOCGSID names the slave's session (its leader's pid) and TIOCGPGRP its
   foreground process group (`platform.terminal_processes`). Each named process is pinned
   with a pidfd, then the kernel is asked again: a pidfd whose pid it still names is that
   process, never a later owner of the number. Where the kernel cannot say (macOS, or a
   terminal something holds open with no session on it), nothing is signalled: `Refused`
   with code `indeterminate`.
3. SIGHUP, then SIGCONT (what a hangup sends, so a stopped job sees it), to the leader's
   process group and to the foreground group, each right after the kernel named it afresh.
   Then the end is awaited, up to the grace: the terminal hung up (every slave fd closed),
   or the kernel naming no session any more and every pinned process ended. Meanwhile what
   the program prints is read and recorded in the session's journal, so that a kill that
   fails loses none of its output.
4. No end within the grace: the kernel is asked again, and SIGKILL goes to the groups it
   names now and to every pinned process still running (a pidfd cannot hit another).
5. Ended: the session is released (the holder closes its copy; the program's last bytes go
   with it, as `release` does) and this process closes its own. Not ended (`NotEnded`, a
   process of another user among them, say): custody ends, and the holder drains the
   session again, as it was.

A session whose terminal has already hung up (its program ended) is only released.
`child_pid` is checked against what the kernel said, and a mismatch reported; it is never
signalled for what the app said.

Resource handling: the custody connection, the master and every pidfd are closed on every
path out.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import errors, platform
from .client import EscrowClient
from .liveness import process_name

DEFAULT_GRACE = 3.0  # seconds between SIGHUP and SIGKILL
# How long a SIGKILLed program has to let go of its terminal before the kill is a failure.
KILL_WAIT = 2.0
_READS_AT_ONCE = 16


class Refused(Exception):
    """Nothing was signalled and the session is as it was. `code`: `custody_held` (an app
    or another attach holds it) or `indeterminate` (the kernel cannot say whose the
    terminal is)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class NotEnded(Exception):
    """Signals were sent but the program did not end (or could not be signalled): the
    session is escrowed again, draining."""


@dataclass
class Killed:
    """What a kill did. `signalled`: (signal name, pid, process name) in order;
    `ended_after`: seconds from the first signal to the end, None if the program had ended
    before (then it was only released); `steps`: each thing done, said in order;
    `notes`: what else is worth saying."""

    signalled: list[tuple[str, int, str | None]] = field(default_factory=list)
    ended_after: float | None = None
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def kill(client: EscrowClient, session_id: str, grace: float = DEFAULT_GRACE) -> Killed:
    """End the program of `client.owner`'s session `session_id` and release it (see the
    module's docstring). Raises Refused, NotEnded, or the holder's answer to the retrieve
    (SessionUnknown, Released...)."""
    custody = client.custody()
    try:
        try:
            got = custody.retrieve(session_id, journal=True)
        except errors.CustodyHeld as exc:
            raise Refused(_held_by_whom(client, session_id, exc), "custody_held") from None
        try:
            ending = _Ending(custody.read, session_id, got.fd)
            try:
                killed = ending.run(got.session.child_pid, grace)
            finally:
                ending.close()
            custody.release(session_id)
            return killed
        finally:
            os.close(got.fd)
    finally:
        custody.close()


class _Ending:
    """One terminal's program being ended: its master, the pidfds pinned, the waiting."""

    def __init__(self, read: Callable[[str], bytes], session_id: str, master: int) -> None:
        self._read = read
        self.session_id = session_id
        self.master = master
        self.hung_up = False
        self.pinned: dict[int, int] = {}  # pid -> pidfd, for processes the kernel named

    def close(self) -> None:
        for pidfd in self.pinned.values():
            os.close(pidfd)
        self.pinned.clear()

    def run(self, child_pid: int | None, grace: float) -> Killed:
        killed = Killed()
        self._drain()
        if self.hung_up:
            return killed  # its program has ended: releasing is all there is to do
        leader, foreground = self._ask()
        if leader is None:
            raise Refused("the kernel names no session on its terminal, yet something holds "
                          "it open: nothing was signalled (escrowctl release hangs it up)",
                          "indeterminate")
        self._pin(leader, foreground)
        if child_pid is not None:
            killed.notes += _cross_check(child_pid, leader)
        started = time.monotonic()
        self._signal(signal.SIGHUP, killed, True)
        if not self._wait(started + grace):
            killed.steps.append(f"not ended after {time.monotonic() - started:.1f} s")
            self._signal(signal.SIGKILL, killed, False)
            if not self._wait(time.monotonic() + KILL_WAIT):
                raise NotEnded(f"{'; '.join(killed.steps)}; its terminal is still in use "
                               f"{time.monotonic() - started:.1f} s after: the session is "
                               "escrowed again")
        killed.ended_after = time.monotonic() - started
        return killed

    def _ask(self) -> tuple[int | None, int | None]:
        named = platform.terminal_processes(self.master)
        if named is None:
            raise Refused("this platform cannot tell which processes a terminal's are: "
                          "nothing was signalled", "indeterminate")
        return named

    def _pin(self, leader: int, foreground: int | None) -> None:
        """Pidfds for the leader and the foreground group's leader, kept only if the
        kernel still names them after they were taken (then they are those processes)."""
        for pid in dict.fromkeys((leader, foreground)):
            if pid is None:
                continue
            try:
                pidfd = platform.pin_process(pid)
            except ProcessLookupError:
                continue  # a group whose leader has gone: the group is signalled still
            if pidfd is None:
                continue
            try:
                named = pid in self._ask()
            except BaseException:
                os.close(pidfd)
                raise
            if named:
                self.pinned[pid] = pidfd
            else:
                os.close(pidfd)

    def _signal(self, signum: int, killed: Killed, cont: bool) -> None:
        """`signum` to every group the kernel names now and every pinned process still
        running."""
        name = signal.Signals(signum).name
        groups = [g for g in dict.fromkeys(self._ask()) if g is not None]
        done: set[int] = set()
        for group in groups:
            described = process_name(group)
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                continue
            except PermissionError:
                raise NotEnded(f"not permitted to signal process group {group}"
                               f"{_named(described)}: it is another user's; the session is "
                               "escrowed again") from None
            done.add(group)
            killed.signalled.append((name, group, described))
            killed.steps.append(f"{name} to pid {group}{_named(described)}")
            if cont:
                try:
                    os.killpg(group, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # the hangup has ended it already
        for pid, pidfd in self.pinned.items():
            if pid in done or _ended(pidfd):
                continue
            described = process_name(pid)
            try:
                platform.signal_pinned(pidfd, signum)
            except ProcessLookupError:
                continue
            except PermissionError:
                raise NotEnded(f"not permitted to signal pid {pid}{_named(described)}: it is "
                               "another user's; the session is escrowed again") from None
            killed.signalled.append((name, pid, described))
            killed.steps.append(f"{name} to pid {pid}{_named(described)}")

    def _wait(self, deadline: float) -> bool:
        """Wait for the program's end, reading what it prints; False at `deadline`."""
        poller = select.poll()
        poller.register(self.master, select.POLLIN)
        for pidfd in self.pinned.values():
            poller.register(pidfd, select.POLLIN)
        while not self._ended():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for fd, _ in poller.poll(left * 1000):
                if fd == self.master:
                    self._drain()
                else:
                    poller.unregister(fd)  # that process has ended
        return True

    def _ended(self) -> bool:
        if self.hung_up:
            return True
        if any(not _ended(pidfd) for pidfd in self.pinned.values()):
            return False
        return self._ask()[0] is None

    def _drain(self) -> None:
        """Read (into the session's journal) what the terminal has for us now, a bounded
        amount (a program that writes without end must not keep the deadline from being
        seen); note its hang-up."""
        for _ in range(_READS_AT_ONCE):
            if self.hung_up or not select.select([self.master], [], [], 0)[0]:
                return
            try:
                data = self._read(self.session_id)
            except BlockingIOError:
                return
            except OSError:
                self.hung_up = True  # EIO: the last slave fd is closed
                return
            if not data:
                self.hung_up = True


def _ended(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def _cross_check(child_pid: int, leader: int) -> list[str]:
    """What to say if the app's `child_pid` is not in the terminal's session."""
    try:
        if os.getsid(child_pid) == leader:
            return []
    except ProcessLookupError:
        return []  # it has ended: nothing to tell apart
    except OSError:
        pass
    return [f"the app said its program is pid {child_pid}{_named(process_name(child_pid))}, "
            f"which is not in this terminal's session (led by pid {leader}): it was not "
            "signalled"]


def _named(name: str | None) -> str:
    return f" ({name})" if name else ""


def describe(killed: Killed) -> str:
    """What was done, as `escrowctl kill` says it (after `killed OWNER/ID: `)."""
    if killed.ended_after is None:
        return "its program had already ended; released"
    parts = [*(killed.steps or ["nothing needed signalling"]),
             f"ended after {killed.ended_after:.1f} s", "released", *killed.notes]
    return "; ".join(parts)


def _held_by_whom(client: EscrowClient, session_id: str, exc: errors.CustodyHeld) -> str:
    try:
        info = next((s for s in client.list() if s.id == session_id), None)
    except errors.EscrowError:
        info = None
    who = ""
    if info is not None and info.custodian_pid is not None:
        who = f" by pid {info.custodian_pid}{_named(process_name(info.custodian_pid))}"
    return (f"it is held{who}: an app shows it, or it is attached elsewhere (escrowctl "
            "attach -d takes it from an attach); nothing was changed")
