"""Liveness, from positive proof only.

A process: is it alive, and is it still the same process? Three answers: True, False,
None. False needs positive proof (no such pid, a zombie, or a different start time);
anything that cannot be told is None, never rounded to False.

The holder on a socket path: `holder_verdict` judges it by docs/design.md §7's table from what it
observes itself (the lock, read with F_GETLK; one connection to the socket; the pidfile and
any leftovers), and changes nothing.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import advice, deadlines, errors, paths, processes, protocol, trust
from .channel import MAX_RESPONSE_BYTES
from .fdpass import close_fds, recv_frame, send_frame
from .platform import harden_socket, lock_holder_pid
from .waiting import waiting

# processes.py reads a Linux process from /proc itself: psutil would be a quarter of
# `escrowctl status`'s start. psutil's start times are boot time plus clock ticks: the same
# process always gives the same figure, a different one differs by at least a tick.
_SAME_START = 1e-3
# What a process that cannot be told gives (OSError: out of fds, /proc hidden or absent).
_CANNOT_TELL = (OSError, ValueError, OverflowError)


def process_start_time(pid: int) -> float | None:
    try:
        return processes.process_state(pid)[1]
    except (processes.NoSuchProcess, *_CANNOT_TELL):
        return None


def process_alive(pid: int | None, start_time: float | None) -> bool | None:
    """True if `pid` runs, is not a zombie and (where `start_time` is known) started then."""
    if pid is None or not 0 < pid < 1 << 31:
        return None  # not a pid at all (a record gone wrong): nothing can be told of it
    try:
        zombie, created = processes.process_state(pid)
    except processes.NoSuchProcess:
        return False
    except _CANNOT_TELL:
        return None
    if zombie:
        return False
    if start_time is None:
        return None
    return bool(abs(created - start_time) < _SAME_START)


def started_otherwise(pid: int, start_time: float | None) -> bool:
    """Positive proof that `pid` is not the process that started at `start_time`: the one
    with that pid now started at another time. False if that cannot be told."""
    if start_time is None:
        return False
    created = process_start_time(pid)
    return created is not None and abs(created - start_time) >= _SAME_START


def process_name(pid: int) -> str | None:
    """The name of process `pid` (`escrowctl`, `python3`...), or None if it cannot be told."""
    try:
        return processes.process_name(pid) or None
    except (processes.NoSuchProcess, *_CANNOT_TELL):
        return None


# --- the holder on a socket path (docs/design.md §7) ----------------------------------------------

# How long `escrowctl status` waits for an answer by default (deadlines.py says why).
STATUS_TIMEOUT = deadlines.STATUS_TIMEOUT

# The owner `escrowctl status` names itself with in its hello.
ADMIN_OWNER = "escrowctl"

# How the socket responded to one connection attempt (`SocketProbe.answer`).
ANSWERED = "answered"  # hello and status were answered within the timeout
ACCEPTED_NO_ANSWER = "accepted_no_answer"  # connected (or the backlog is full); no answer
CLOSED = "closed"  # connected, then the holder hung up without answering
ERROR_ANSWER = "error_answer"  # the holder answered with an `error` (limit, forbidden, ...)
REFUSED = "refused"  # ECONNREFUSED: nothing listens on that file
MISSING = "missing"  # ENOENT: no socket file
ERROR = "error"  # anything else (EACCES, a bad frame, ...)
UNTRUSTED = "untrusted"  # the listener is another user's: nothing was sent to it

_NO_ANSWER = (ACCEPTED_NO_ANSWER,)
_NOT_SERVING = (MISSING, REFUSED)


@dataclass(frozen=True)
class LockState:
    """What F_GETLK says about `<socket>.lock`. `state` is `held` (by `pid`, None where the
    kernel cannot name it, e.g. another pid namespace), `free`, `missing` (no lock file, so
    nobody holds it) or `unreadable` (`error` says why)."""

    state: str
    pid: int | None = None
    error: str | None = None


def read_lock(socket_path: str) -> LockState:
    """Ask who holds the holder's lock, taking nothing and creating nothing.

    The lock file is opened read-only (F_GETLK needs no write access) and closed again
    before this returns. Never call this from the holder process itself: its own lock never
    conflicts with itself, and closing any fd on the file would drop that lock.
    """
    path = paths.lock_path(socket_path)
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the check.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
                     | os.O_NOFOLLOW)
    except FileNotFoundError:
        return LockState("missing")
    except OSError as exc:
        return LockState("unreadable", error=f"cannot open {path}: {exc.strerror}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            # F_GETLK on a directory answers "unlocked" without meaning it, and escrowd
            # could not lock it either.
            return LockState("unreadable", error=f"{path} is not a regular file")
        pid = lock_holder_pid(fd)
    except OSError as exc:
        return LockState("unreadable", error=f"cannot query the lock on {path}: {exc.strerror}")
    finally:
        os.close(fd)
    if pid is None:
        return LockState("free")
    return LockState("held", pid if pid > 0 else None)


@dataclass
class SocketProbe:
    """One connection attempt on the holder's socket, and what it showed."""

    answer: str
    error: str | None = None
    peer_pid: int | None = None  # SO_PEERCRED: the process that made the socket listen
    welcome: protocol.Welcome | None = None
    status: protocol.HolderStatus | None = None
    sessions: list[protocol.SessionInfo] | None = None


def probe_socket(socket_path: str, timeout: float, list_sessions: bool = False) -> SocketProbe:
    """Connect to `socket_path` and ask `hello` then `status` (then `list` of every owner,
    if asked), all within `timeout`.

    This speaks the protocol on its own socket rather than through `EscrowClient`, so that
    what it reports is what it saw: whether the connection was accepted is known before any
    answer is awaited, and the client's circuit breaker is neither consulted nor tripped.
    """
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        harden_socket(sock)
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except FileNotFoundError:
            return SocketProbe(MISSING)
        except ConnectionRefusedError:
            return SocketProbe(REFUSED)
        except (TimeoutError, BlockingIOError):
            # A listener whose backlog is full: it exists and is not accepting.
            return SocketProbe(ACCEPTED_NO_ANSWER, error="the listen backlog is full")
        except OSError as exc:
            return SocketProbe(ERROR, error=f"connect: {exc.strerror or exc}")
        probe = SocketProbe(ACCEPTED_NO_ANSWER)
        try:
            # A listener that cannot be told is refused.
            probe.peer_pid = trust.check_peer(sock, socket_path)
        except errors.Forbidden as exc:
            return SocketProbe(UNTRUSTED, error=str(exc))
        with waiting(socket_path, lambda: probe.peer_pid, deadline - time.monotonic()):
            return _greet(sock, probe, timeout, deadline, list_sessions)
    finally:
        sock.close()


def _greet(sock: socket.socket, probe: SocketProbe, timeout: float, deadline: float,
           list_sessions: bool) -> SocketProbe:
    """`probe_socket`'s questions, on the connected and trusted `sock`."""
    try:
        hello = protocol.Hello(version=protocol.VERSION, owner=ADMIN_OWNER,
                               client=f"escrowctl status pid={os.getpid()}",
                               timeout=timeout)
        probe.welcome = _call(sock, hello, protocol.Welcome, deadline)
        probe.status = _call(sock, protocol.Status(), protocol.HolderStatus, deadline)
    except TimeoutError:
        return probe  # accepted, and no answer within the timeout
    except (EOFError, ConnectionError) as exc:
        probe.answer = CLOSED
        probe.error = "the holder closed the connection" + (
            f" ({exc.strerror})" if isinstance(exc, OSError) and exc.strerror else "")
        return probe
    except _ErrorAnswer as exc:
        probe.answer, probe.error = ERROR_ANSWER, str(exc)
        return probe
    except (OSError, protocol.ProtocolError) as exc:
        probe.answer, probe.error = ERROR, str(exc)
        return probe
    probe.answer = ANSWERED
    if list_sessions:
        try:
            probe.sessions = _call(sock, protocol.List(all_owners=True), protocol.Sessions,
                                   deadline).sessions
        except (OSError, EOFError, protocol.ProtocolError, _ErrorAnswer):
            pass  # it answered `status`; only the session list is missing
    return probe


class _ErrorAnswer(Exception):
    """The holder answered `error`, or with a message of the wrong type."""


_T = TypeVar("_T", bound=protocol.Message)


def _call(sock: socket.socket, message: protocol.Message, expected: type[_T],
          deadline: float) -> _T:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)
    send_frame(sock, protocol.encode(message))
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)
    body, fds = recv_frame(sock, MAX_RESPONSE_BYTES)
    close_fds(fds)  # none of these answers carries an fd
    reply = protocol.decode_response(body)
    if isinstance(reply, protocol.Error):
        raise _ErrorAnswer(f"{reply.code}: {reply.message}")
    if not isinstance(reply, expected):
        raise _ErrorAnswer(f"expected {expected.__name__}, got {type(reply).__name__}")
    return reply


def _socket_file(socket_path: str) -> str:
    """`socket`, `missing`, `other` (something that is not a socket) or `error`."""
    try:
        mode = os.lstat(socket_path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "error"
    return "socket" if stat.S_ISSOCK(mode) else "other"


def _holder_files(socket_path: str) -> list[str]:
    """The files a holder leaves behind if it dies: its socket and its pidfile. (The lock
    file is not one: a holder that stops cleanly leaves it, and it proves nothing.)"""
    found = []
    if _socket_file(socket_path) == "socket":
        found.append(socket_path)
    if os.path.lexists(paths.pid_path(socket_path)):
        found.append(paths.pid_path(socket_path))
    return found


@dataclass
class Verdict:
    """What `escrowctl status` concludes about the holder on one socket path.

    `pid` is the live holder's pid (from its answer, or from the lock), None when there is
    none or it cannot be named. `holder` is its `status` answer when it gave one; `sessions`
    every owner's sessions when they were asked for and listed. `reason` says, in a
    sentence, why this verdict; `evidence` is everything observed (JSON-ready).
    """

    state: str
    socket: str
    pid: int | None = None
    holder: protocol.HolderStatus | None = None
    sessions: list[protocol.SessionInfo] | None = None
    reason: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)


def holder_verdict(socket_path: str, timeout: float = STATUS_TIMEOUT,
                   list_sessions: bool = False) -> Verdict:
    """Judge the holder on `socket_path` by docs/design.md §7's table (the first matching row wins):

    | evidence                                                         | verdict         |
    |------------------------------------------------------------------|-----------------|
    | the socket answers `status` within `timeout`                     | `running`       |
    | a process holds the lock; the socket accepted, did not answer    | `unresponsive`  |
    | a process holds the lock; the socket is missing or refuses       | `indeterminate` |
    | nobody holds the lock; the socket refuses or is missing; a       | `dead`          |
    |   leftover pidfile exists (and maybe the socket file)            |                 |
    | nobody holds the lock, and no pidfile exists (the socket file    | `not_running`   |
    |   alone is what a stopped systemd socket unit keeps, on purpose) |                 |
    | anything else (the lock cannot be read, say)                     | `indeterminate` |

    Trust first (docs/design.md §8): a socket directory that is not this user's own (or a listener
    of another uid) is `indeterminate`, with `evidence["trust"]` saying why, and nothing
    there is read or sent to.

    Read-only: it deletes nothing, creates nothing and takes no lock (F_GETLK only asks),
    so it never stops a holder from starting. Positive proof only: the lock is read before
    and after the socket is tried, and `dead` or `not_running` need it free both times and
    the leftovers seen both times (a holder starting or stopping meanwhile makes the answer
    `indeterminate`, never `dead`); a pidfile that names a live process with the recorded
    start time also rules out `dead`. A pidfile that is missing, empty or half-written is
    no evidence either way. A kernel-held lock is itself proof that its holder is alive.
    """
    try:
        trust.check_socket_dir(socket_path)
    except errors.HolderUnavailable:
        # No directory: no lock file, no socket, nothing. Nothing else is looked at (a
        # directory made there meanwhile would be someone else's to fill).
        return Verdict("not_running", socket_path,
                       reason=f"the directory of {socket_path} does not exist: nothing "
                       "exists there",
                       evidence={"trust": None, "timeout": timeout})
    except errors.EscrowError as exc:
        # Another user's directory: its files and its listener prove nothing about our
        # holder, and nothing in it is touched.
        return Verdict("indeterminate", socket_path, reason=str(exc),
                       evidence={"trust": str(exc), "timeout": timeout})
    lock_before = read_lock(socket_path)
    files_before = _holder_files(socket_path)
    probe = probe_socket(socket_path, timeout, list_sessions)
    lock = read_lock(socket_path)
    files_after = _holder_files(socket_path)
    socket_file = _socket_file(socket_path)
    pid_record = paths.read_pidfile(socket_path)
    pid_alive = (process_alive(pid_record.pid, pid_record.start_time)
                 if pid_record is not None else None)

    held = lock_before.state == "held" and lock.state == "held"
    free = lock_before.state in ("free", "missing") and lock.state in ("free", "missing")
    leftovers = [f for f in files_after if f in files_before] if free else []
    lock_pid = lock.pid if lock.state == "held" else None
    evidence: dict[str, Any] = {
        "trust": probe.error if probe.answer == UNTRUSTED else None,
        "answered_status": probe.answer == ANSWERED,
        "timeout": timeout,
        "socket_exists": socket_file != "missing",
        "socket_file": socket_file,
        "socket_answer": probe.answer,
        "socket_error": probe.error,
        "socket_peer_pid": probe.peer_pid,
        "lock_file": paths.lock_path(socket_path),
        "lock": lock.state,
        "lock_before": lock_before.state,
        "lock_holder_pid": lock_pid,
        "lock_error": lock.error or lock_before.error,
        "pidfile": {
            "path": paths.pid_path(socket_path),
            "exists": os.path.lexists(paths.pid_path(socket_path)),
            "pid": pid_record.pid if pid_record is not None else None,
            "start_time": pid_record.start_time if pid_record is not None else None,
            "alive": pid_alive,
        },
        "leftovers": leftovers,
    }
    verdict = Verdict("indeterminate", socket_path, evidence=evidence)
    who = f"pid {lock_pid}" if lock_pid is not None else "a process"
    if probe.answer == UNTRUSTED:
        verdict.reason = probe.error or "the listener is not this user's holder"
    elif probe.answer == ANSWERED and probe.status is not None:
        verdict.state, verdict.pid = "running", probe.status.pid
        verdict.holder, verdict.sessions = probe.status, probe.sessions
        verdict.reason = f"pid {probe.status.pid} answered status"
    elif held and probe.answer in _NO_ANSWER:
        verdict.state, verdict.pid = "unresponsive", lock_pid
        verdict.reason = (f"{who} holds the lock, and the socket accepted a connection but "
                          f"did not answer within {timeout:g}s"
                          + (f" ({probe.error})" if probe.error and "backlog" in probe.error
                             else ""))
    elif held and probe.answer in _NOT_SERVING:
        verdict.pid = lock_pid
        what = "is missing" if probe.answer == MISSING else "refuses connections"
        verdict.reason = (f"{who} holds the lock, but the socket {what}: a holder starting "
                          "or stopping, or one whose socket file was removed")
    elif (free and probe.answer in _NOT_SERVING and paths.pid_path(socket_path) in leftovers
          and pid_alive is not True):
        verdict.state = "dead"
        what = "is missing" if probe.answer == MISSING else "refuses connections"
        names = " and ".join("its socket file" if f == socket_path else "its pidfile"
                             for f in leftovers)
        verdict.reason = (f"nobody holds the lock and the socket {what}, but {names} "
                          f"{'is' if len(leftovers) == 1 else 'are'} left over (the next "
                          "escrowd on this path removes them)")
    elif free and probe.answer in _NOT_SERVING and not files_after and socket_file == "missing":
        verdict.state = "not_running"
        verdict.reason = "nobody holds the lock, and no socket file or pidfile exists"
    elif (free and probe.answer == REFUSED and leftovers == [socket_path]
          and files_after == [socket_path]):
        # A holder that stopped cleanly removes its pidfile; the socket file it leaves is
        # one a service manager keeps (systemd's escrowd.socket, RemoveOnStop=no) so that
        # clients see "refused" until a holder comes back.
        verdict.state = "not_running"
        verdict.reason = ("nobody holds the lock and no pidfile is left (a clean stop); the "
                          "socket file is kept by its service manager and refuses connections")
    else:
        verdict.pid = lock_pid
        verdict.reason = _why_indeterminate(lock_before, lock, probe, socket_file, pid_record,
                                            pid_alive, socket_path)
    return verdict


def _why_indeterminate(before: LockState, after: LockState, probe: SocketProbe,
                       socket_file: str, record: paths.PidRecord | None,
                       record_alive: bool | None, socket_path: str) -> str:
    for lock in (after, before):
        if lock.state == "unreadable":
            return f"cannot tell who holds the lock: {lock.error}"
    if before.state != after.state or before.pid != after.pid:
        return (f"the lock changed while status looked ({before.state} -> {after.state}): "
                "a holder is starting or stopping")
    if probe.answer in _NO_ANSWER:
        return ("nobody holds the lock, yet the socket accepted a connection and did not "
                "answer")
    if record is not None and record_alive is True:
        return (f"nobody holds the lock and the socket does not answer, but the pidfile "
                f"names pid {record.pid}, which is alive and started when it recorded")
    if socket_file == "other":
        return advice.not_a_socket(socket_path) or f"{socket_path} exists and is not a socket"
    if probe.answer in _NOT_SERVING:
        return "holder files appeared or vanished while status looked"
    detail = f": {probe.error}" if probe.error else ""
    return f"the socket {probe.answer.replace('_', ' ')}{detail}"
