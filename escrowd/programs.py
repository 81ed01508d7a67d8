"""Programs the holder starts itself (`start`, PROTOCOL.md section 12.9): the fork and exec
on a new PTY, the reaping, and the exit status a session keeps (docs/design.md §16).

Starting: the program is the session leader of a new PTY, which is its controlling
terminal; it runs from the `cwd` asked for, with exactly the environment asked for, the
default signal dispositions (the holder ignores SIGINT and SIGPIPE) and no fd of the
holder's. subprocess reports a failed chdir or exec over its close-on-exec pipe, so a
program that cannot run is an answer (`cwd_gone`, `exec_failed`), never a session that
silently exits 127.

Reaping: the holder waits only for its own programs, each by its pid (never waitpid(-1):
whatever else runs in this process may have children of its own), polling with WNOHANG
a few times a second while any runs. A status is kept in the session's record at once (so
it survives a restart, escrowd.statefile), or in its tombstone if the session has ended.

A program a stopped holder started is no child of this one: it is never waited for (its
pid, once gone, may be one of this holder's own programs). It is watched until its pid is
gone (a zombie is not gone: its parent has yet to reap it, and a pid now another process's
start time is), then the status the keeper kept when it reaped the orphan
(escrowd.orphans) is believed if it names that pid and start time; if there is none,
nobody can know, and the status is "unknown", never a guess.

`wait` answers once a session's program has ended (`ending`), or at once if it has.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import termios
import threading
from dataclasses import dataclass
from typing import Any

import trio

from escrow_client import processes, protocol

from . import orphans
from .fdlimit import FD_EXHAUSTION, OUT_OF_FDS
from .log import log
from .registry import Registry, RegistryError
from .session import Session

Key = tuple[str, str]
_POLL = 0.05  # seconds between looks at running programs
_SAME_START = 0.05  # as escrow_client.liveness: start times this close are the same process
_DEFAULTS = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD,
             signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGPIPE)


@dataclass
class _Watched:
    key: Key
    pid: int
    start_time: float | None
    child: subprocess.Popen[bytes] | None  # None: adopted, not this holder's child


def spawn(request: protocol.Start) -> tuple[int, subprocess.Popen[bytes]]:
    """Start `request.argv` on a new PTY as described above: the master and the process.
    RegistryError with the code to answer if it cannot be started (nothing left open)."""
    _check_strings(request)
    if not os.path.isabs(request.cwd):
        raise RegistryError("bad_request", f"cwd {request.cwd!r} is not an absolute path")
    try:
        if not stat.S_ISDIR(os.stat(request.cwd).st_mode):
            raise RegistryError("cwd_gone", f"cwd {request.cwd} is not a directory")
    except OSError as exc:
        raise RegistryError("cwd_gone", f"cwd {request.cwd}: {exc.strerror or exc}") from None
    try:
        master, slave = os.openpty()
    except OSError as exc:
        if exc.errno in FD_EXHAUSTION:
            raise RegistryError("limit", OUT_OF_FDS) from None
        raise RegistryError("limit", f"no PTY to be had: {exc.strerror or exc}") from None
    try:
        if request.cols and request.rows:
            termios.tcsetwinsize(slave, (request.rows, request.cols))
        if request.modes is not None:
            _set_modes(slave, request.modes)
        if threading.active_count() != 1:  # preexec_fn is fork-safe in one thread only
            log("internal_error", where="programs", threads=threading.active_count(),
                error="a program is forked with preexec_fn while other threads run")
        child = subprocess.Popen(
            request.argv, stdin=slave, stdout=slave, stderr=slave, cwd=request.cwd,
            env=request.env, close_fds=True, start_new_session=True,
            preexec_fn=_in_child)
    except ValueError as exc:  # a NUL in an argument, a "=" in a variable's name
        os.close(master)
        raise RegistryError("bad_request", f"cannot run that: {exc}") from None
    except OSError as exc:
        os.close(master)
        if exc.errno in FD_EXHAUSTION:
            raise RegistryError("limit", OUT_OF_FDS) from None
        if exc.filename == request.cwd and exc.filename != request.argv[0]:
            raise RegistryError("cwd_gone", f"cwd {request.cwd}: {exc.strerror}") from None
        raise RegistryError("exec_failed", f"cannot run {request.argv[0]}: "
                            f"{exc.strerror or exc}") from None
    except subprocess.SubprocessError as exc:  # _in_child failed: nothing was exec'd
        os.close(master)
        raise RegistryError("exec_failed", f"cannot run {request.argv[0]}: {exc}") from None
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return master, child


def _check_strings(request: protocol.Start) -> None:
    """bad_request for what no exec can take: a NUL in cwd, argv or env, a "=" or nothing
    as a variable's name (os.stat and subprocess would raise ValueError, not OSError)."""
    if "\0" in request.cwd:
        raise RegistryError("bad_request", "cwd has a NUL in it")
    if any("\0" in arg for arg in request.argv):
        raise RegistryError("bad_request", "an argument has a NUL in it")
    for name, value in request.env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise RegistryError("bad_request", f"environment variable {name!r} cannot be "
                                "passed on (a NUL, or a name empty or with a \"=\")")


def _set_modes(fd: int, modes: protocol.Modes) -> None:
    """The termios attributes asked for, where this terminal takes them (else its own)."""
    try:
        cc: list[int | bytes] = list(termios.tcgetattr(fd)[6])
        for i, c in enumerate(modes.cc[:len(cc)]):
            cc[i] = c if isinstance(cc[i], int) else bytes([c])
        attrs: list[Any] = [modes.iflag, modes.oflag, modes.cflag, modes.lflag, modes.ispeed,
                            modes.ospeed, cc]
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
    except (termios.error, OverflowError, TypeError, ValueError):
        pass


def _in_child() -> None:
    """Between fork and exec: the PTY (stdin) becomes the controlling terminal, and the
    holder's signal dispositions and mask are not passed on."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    for signum in _DEFAULTS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


class Programs:
    """The programs of this holder's sessions that it watches, until each has ended."""

    def __init__(self, registry: Registry, exits_dir: str | None) -> None:
        self.registry = registry
        self.exits_dir = exits_dir  # where the keeper keeps orphans' statuses
        # A list, not a map by pid: an adopted program's pid, once gone, may be reused by a
        # program this holder starts, and each is watched until its own end.
        self._watched: list[_Watched] = []
        self._ended: dict[Key, trio.Event] = {}
        self._more = trio.Event()

    def track(self, session: Session, child: subprocess.Popen[bytes]) -> None:
        """Watch the program this holder just started for `session` (recorded as started,
        with its start time, from its first record)."""
        self._watched.append(_Watched(session.key, child.pid, session.child_start_time,
                                      child))
        if self.exits_dir is not None and session.child_start_time is not None:
            try:
                orphans.mark(self.exits_dir, child.pid, session.child_start_time)
            except OSError as exc:  # its status is lost only if the holder dies first
                log("program_unmarked", session=session.name, pid=child.pid, error=repr(exc))
        self._more.set()

    def adopt(self, sessions: list[Session]) -> None:
        """Watch the programs of adopted sessions that had not ended."""
        for session in sessions:
            if session.started and session.exit_status is None and session.child_pid:
                self._watched.append(_Watched(session.key, session.child_pid,
                                              session.child_start_time, None))
        self._more.set()

    async def run(self) -> None:
        """Look at the watched programs until cancelled."""
        while True:
            if not self._watched:
                await self._more.wait()
                self._more = trio.Event()
                continue
            for watched in list(self._watched):
                try:
                    ending = self._ending(watched)
                except Exception as exc:  # one program's trouble is its own
                    log("internal_error", where="programs", pid=watched.pid, error=repr(exc))
                    continue
                if ending is not None:
                    self._watched.remove(watched)
                    orphans.unmark(self.exits_dir, watched.pid, watched.start_time)
                    self._record(watched, ending)
            await trio.sleep(_POLL)

    async def ending(self, owner: str, sid: str) -> protocol.ExitStatus | str:
        """How the program of session owner/sid ended, once it has. RegistryError
        `unknown` (no such session), `not_a_program` (the holder did not start it)."""
        while True:
            session = self.registry.get(owner, sid)
            tomb = self.registry.tombstone(owner, sid) if session is None else None
            if session is None and tomb is None:
                raise RegistryError("unknown", f"no session {owner}/{sid} is known")
            started, ending = ((session.started, session.exit_status) if session is not None
                               else (tomb.started, tomb.exit_status) if tomb is not None
                               else (False, None))
            if not started:
                raise RegistryError("not_a_program", f"the holder did not start the program "
                                    f"of {owner}/{sid}: its app knows how it ended")
            if ending is not None:
                return ending
            event = self._ended.setdefault((owner, sid), trio.Event())
            await event.wait()

    def _ending(self, watched: _Watched) -> protocol.ExitStatus | str | None:
        """How a watched program ended, or None while it runs (or it cannot be told)."""
        if watched.child is not None:
            code = watched.child.poll()
            return None if code is None else _status(code)
        # Adopted: never waited for (no child of this process; its pid may be one now, of
        # another program), only looked at by pid and start time.
        try:
            _, created = processes.process_state(watched.pid)
        except processes.NoSuchProcess:
            pass  # gone, reaped by whoever was its parent
        except (OSError, ValueError):
            return None  # cannot be told now: looked at again
        else:
            if watched.start_time is None or abs(created - watched.start_time) < _SAME_START:
                return None  # it runs, or is a zombie its parent has yet to reap
        kept = orphans.take(self.exits_dir, watched.pid, watched.start_time)
        return kept if kept is not None else "unknown"

    def _record(self, watched: _Watched, ending: protocol.ExitStatus | str) -> None:
        owner, sid = watched.key
        session = self.registry.get(owner, sid)
        if session is not None and session.child_pid == watched.pid and session.started:
            session.exit_status = ending  # type: ignore[assignment]
            session.persist()
            session.log("program_ended", pid=watched.pid, status=_said(ending))
        else:
            tomb = self.registry.tombstones.get(watched.key)
            if tomb is not None and tomb[0].child_pid == watched.pid:
                tomb[0].exit_status = ending  # type: ignore[assignment]
            log("program_ended", session=f"{owner}/{sid}", pid=watched.pid,
                status=_said(ending))
        event = self._ended.pop(watched.key, None)
        if event is not None:
            event.set()


def _status(code: int) -> protocol.ExitStatus:
    """subprocess's returncode (-N: killed by signal N) as an ExitStatus."""
    return protocol.ExitStatus(signal=-code) if code < 0 else protocol.ExitStatus(code=code)


def _said(ending: protocol.ExitStatus | str) -> str:
    if isinstance(ending, protocol.ExitStatus):
        return f"code {ending.code}" if ending.code is not None else f"signal {ending.signal}"
    return ending

