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
   foreground process group (`platform.terminal_processes`). Where the kernel cannot say
   (macOS, or a terminal something holds open with no session on it), nothing is
   signalled: `Refused` with code `indeterminate`.
3. Every process of that session is pinned with a pidfd: the leader, the foreground
   group's leader, and each process /proc lists with that session id
   (`platform.session_members`). A pidfd is kept only if, once it is held, the process
   answers getsid() with the terminal's session and the session is proved still the same
   (a pinned process of it still runs, so its number cannot have been taken by another, or
   the kernel names it still), and only then is the pidfd seen not to have ended: the
   answers were that process's, never a later owner of the number's. TIOCGPGRP goes on
   naming a foreground job's number after the job is reaped, until the leader takes the
   terminal back; a process of another session may have that number by then, and its
   getsid() tells it apart.
4. SIGHUP, then SIGCONT (what a hangup sends, so a stopped job sees it), to the leader's
   process group and to the foreground group. A group is signalled by its number only when
   its leader is pinned, and right before each killpg the kernel names it again, the leader
   is a group leader of the session still, and its pidfd has not ended (while it runs no
   other group can have its number). A group whose leader cannot be pinned and verified is
   never signalled by number; it is said so. Then the end is awaited, up to the grace:
   the terminal hung up, every slave fd closed (the only proof the program has let go of
   it; a background job that ignores SIGHUP keeps it). Meanwhile what the program prints
   is read and recorded in the session's journal, so that a kill that fails loses none of
   its output.
5. No hangup within the grace: SIGKILL to the groups the kernel names now, as above, and,
   each by its pidfd, to every process of the session still running (looked for again:
   one started meanwhile is pinned and verified as in 3).
6. Hung up: the session is released (the holder closes its copy; the program's last bytes
   go with it, as `release` does) and this process closes its own. Not hung up 2 s after
   SIGKILL (at once if no SIGKILL could be sent): `NotEnded`, `running` if a process of
   the session still runs (another user's, say), `held_open` if none does and something
   outside the session holds the terminal; custody ends, and the holder drains the session
   again, as it was. A signal not permitted (another user's process) is said among the
   steps, and the others go on; every step done is said in the `NotEnded` message too.

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
    """The terminal did not hang up: custody ends and the holder drains the session again.
    The message says every step done first. `code`: `running` (a process of the terminal's
    session still runs: another user's, say) or `held_open` (none of them runs, yet
    something outside the session holds the terminal open)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Killed:
    """What a kill did. `signalled`: (signal name, pid, process name) in order;
    `ended_after`: seconds from the first signal to the end, None if the program had ended
    before (then it was only released); `steps`: each thing done, or tried, said in order;
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
    """One terminal's program being ended: its master, its session, the pidfds pinned, the
    waiting."""

    def __init__(self, read: Callable[[str], bytes], session_id: str, master: int) -> None:
        self._read = read
        self.session_id = session_id
        self.master = master
        self.hung_up = False
        self.sid = 0  # the terminal's session, as the kernel first named it
        self.pinned: dict[int, int] = {}  # pid -> pidfd, each verified of that session
        self.not_permitted: set[int] = set()  # pids (or groups' leaders) another user's

    def close(self) -> None:
        for pidfd in self.pinned.values():
            os.close(pidfd)
        self.pinned.clear()

    def run(self, child_pid: int | None, grace: float) -> Killed:
        killed = Killed()
        self._drain()
        if self.hung_up:
            return killed  # its program has ended: releasing is all there is to do
        leader = self._ask()[0]
        if leader is None:
            raise Refused("the kernel names no session on its terminal, yet something holds "
                          "it open: nothing was signalled (escrowctl release hangs it up)",
                          "indeterminate")
        self.sid = leader
        self._pin_session()
        if child_pid is not None:
            killed.notes += _cross_check(child_pid, leader)
        started = time.monotonic()
        self._signal(signal.SIGHUP, killed, everyone=False)
        if not self._wait(started + grace):
            killed.steps.append(f"not ended after {time.monotonic() - started:.1f} s")
            sent = self._signal(signal.SIGKILL, killed, everyone=True)
            # Nothing sent (every one another user's, say): nothing to wait for.
            if not self._wait(time.monotonic() + (KILL_WAIT if sent else 0.0)):
                self._not_ended(killed, started)
        killed.ended_after = time.monotonic() - started
        for pid in sorted(self.not_permitted):
            if pid in self.pinned and not _ended(self.pinned[pid]):
                killed.notes.append(f"pid {pid}{_named(process_name(pid))}, another user's, "
                                    "still runs, no longer on the terminal")
        return killed

    def _not_ended(self, killed: Killed, started: float) -> None:
        self._pin_session()
        running = [pid for pid, pidfd in self.pinned.items() if not _ended(pidfd)]
        done = "; ".join(killed.steps + killed.notes)
        after = f"{time.monotonic() - started:.1f} s after the first signal"
        if running:
            who = ", ".join(f"pid {pid}{_named(process_name(pid))}" for pid in running)
            raise NotEnded(f"{done}; {who} still running {after}: the holder drains the "
                           "session again", "running")
        raise NotEnded(f"{done}; none of its terminal's processes runs, yet something "
                       f"outside its session holds the terminal open {after}: the holder "
                       "drains the session again (escrowctl release hangs it up)", "held_open")

    def _ask(self) -> tuple[int | None, int | None]:
        named = platform.terminal_processes(self.master)
        if named is None:
            raise Refused("this platform cannot tell which processes a terminal's are: "
                          "nothing was signalled", "indeterminate")
        return named

    def _pin_session(self) -> None:
        """Pin the leader, the foreground group's leader and every other process of the
        session that is not pinned yet."""
        members = platform.session_members(self.sid) or []
        for pid in dict.fromkeys((self.sid, *self._ask(), *members)):
            if pid is not None:
                self._pin(pid)

    def _pin(self, pid: int) -> int | None:
        """A pidfd for `pid`, kept if that process proves to be of the terminal's session,
        else None."""
        if pid in self.pinned:
            return self.pinned[pid]
        try:
            pidfd = platform.pin_process(pid)
        except ProcessLookupError:
            return None
        if pidfd is None:
            return None
        try:
            verified = self._verified(pid, pidfd)
        except BaseException:
            os.close(pidfd)
            raise
        if not verified:
            os.close(pidfd)
            return None
        self.pinned[pid] = pidfd
        return pidfd

    def _verified(self, pid: int, pidfd: int) -> bool:
        """Whether the process of `pidfd` (numbered `pid`) is of the terminal's session:
        asked once the pidfd is held, then the session proved the same (a pinned process of
        it still runs, so its number cannot have been taken, or the kernel names it still),
        then the pidfd proved not ended, so that the answer was that process's."""
        try:
            if os.getsid(pid) != self.sid:
                return False
        except OSError:
            return False
        witnessed = (any(not _ended(fd) for other, fd in self.pinned.items() if other != pid)
                     or self._ask()[0] == self.sid)
        return witnessed and not _ended(pidfd)

    def _leads_group(self, pid: int, pidfd: int) -> bool:
        """Whether the pinned (so verified) process `pid` leads a process group of the
        terminal's session now, asked before its pidfd is seen not to have ended: while it
        runs, no other group can have its number. (A process leaves its session only by
        setsid(), which would make its own pid the session's.)"""
        try:
            if os.getpgid(pid) != pid or os.getsid(pid) != self.sid:
                return False
        except OSError:
            return False
        return not _ended(pidfd)

    def _signal(self, signum: int, killed: Killed, everyone: bool) -> int:
        """`signum` to every process group the kernel names now whose leader is pinned and
        verified again right before; if `everyone`, to every process of the session still
        running, too (each by its pidfd). A process not permitted (another user's) is told
        and passed over. How many signals were sent."""
        name = signal.Signals(signum).name
        sent = 0
        done: set[int] = set()
        leader, foreground = self._ask()
        # The foreground group first: the leader's end takes the terminal from it (a shell
        # passing the hangup on may end it before it is proved, too).
        groups = [g for g in dict.fromkeys((foreground, leader)) if g is not None]
        proved: list[tuple[int, int]] = []
        for group in groups:
            pidfd = self._pin(group)
            if pidfd is None or not self._leads_group(group, pidfd):
                _note(killed, f"process group {group}, which its terminal names, was not "
                      "signalled: its leader has ended, or is not of the terminal's session")
            else:
                proved.append((group, pidfd))
        for group, pidfd in proved:
            described = process_name(group)  # (before the proof: nothing between it and killpg)
            if group not in self._ask() or not self._leads_group(group, pidfd):
                continue  # it has just ended, or the terminal been taken from it
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                continue
            except PermissionError:
                killed.steps.append(f"{name} to process group {group}{_named(described)} "
                                    "not permitted: it is another user's")
                self.not_permitted.add(group)
                continue
            sent += 1
            done.add(group)
            killed.signalled.append((name, group, described))
            killed.steps.append(f"{name} to pid {group}{_named(described)}")
            if signum == signal.SIGHUP:
                try:
                    os.killpg(group, signal.SIGCONT)  # as a hangup does: a stopped job sees it
                except OSError:
                    pass  # the hangup has ended it already
        if everyone:
            self._pin_session()
        for pid, pidfd in self.pinned.items():
            if (not (everyone or pid == self.sid) or _ended(pidfd)
                    or _group_of(pid) in done):  # (it got the group's signal)
                continue
            described = process_name(pid)
            try:
                platform.signal_pinned(pidfd, signum)
            except ProcessLookupError:
                continue
            except PermissionError:
                killed.steps.append(f"{name} to pid {pid}{_named(described)} not permitted: "
                                    "it is another user's")
                self.not_permitted.add(pid)
                continue
            sent += 1
            killed.signalled.append((name, pid, described))
            killed.steps.append(f"{name} to pid {pid}{_named(described)}")
        return sent

    def _wait(self, deadline: float) -> bool:
        """Wait for the terminal to hang up (every slave fd closed), reading what the
        program prints; False at `deadline`."""
        poller = select.poll()
        poller.register(self.master, select.POLLIN)
        self._drain()
        while not self.hung_up:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if poller.poll(left * 1000):
                self._drain()
        return True

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


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


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


def _note(killed: Killed, note: str) -> None:
    if note not in killed.notes:
        killed.notes.append(note)


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
