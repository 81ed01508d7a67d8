"""Service-manager glue: systemd's notify socket, its watchdog and socket activation, without
libsystemd.

Everything here is a no-op outside systemd: with no `NOTIFY_SOCKET` nothing is sent, with no
`WATCHDOG_USEC` nothing wakes up, and with no `LISTEN_FDS` the holder binds its own socket.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio

from .fdstore import NOTIFY_FD_ENV, is_store_name

SD_LISTEN_FDS_START = 3

# The states of a live session, in the order a STATUS= line names them.
_LIVE_STATES = ("held", "draining", "handing_off", "exited")


# The keeper's channel, when a keeper started this holder (see keeper_channel).
_channel: socket.socket | None = None


def keeper_channel(from_keeper: bool) -> socket.socket | None:
    """The datagram socket the keeper passed ($ESCROWD_NOTIFY_FD, just after the LISTEN_FDS
    ones), made close-on-exec; None if none was passed, or this holder's parent is not
    its keeper (`from_keeper`: the variable was inherited, not meant for us). Call it right
    after passed_fds. From then on `notify` writes there, as the fd store does."""
    global _channel
    value = os.environ.pop(NOTIFY_FD_ENV, None)
    if not from_keeper or value is None or not value.isdigit():
        return None
    fd = int(value)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_DGRAM:
        sock.detach()  # not the keeper's: never ours to close
        return None
    sock.set_inheritable(False)
    _channel = sock
    return sock


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1", several lines at once allowed) to the keeper's channel
    or $NOTIFY_SOCKET.

    One datagram (on $NOTIFY_SOCKET, from a fresh AF_UNIX SOCK_DGRAM socket; an address
    starting with "@" is in the abstract namespace). The send never blocks (a service
    manager that does not read its queue must not freeze the holder's event loop) and never
    raises SIGPIPE. Returns False if there is no notify socket or the datagram could not be
    sent.
    """
    if _channel is not None:
        try:
            _channel.send(state.encode(), getattr(socket, "MSG_NOSIGNAL", 0))
            return True
        except OSError:
            return False
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    elif not address.startswith("/"):
        return False  # e.g. vsock:..., which a per-user holder never gets
    try:
        # Close-on-exec: Python makes every socket non-inheritable (PEP 446).
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.connect(address)
            sock.sendmsg([state.encode()], [], getattr(socket, "MSG_NOSIGNAL", 0))
        return True
    except OSError:
        return False


def status_line(socket_path: str, counts: Mapping[str, int]) -> str:
    """The STATUS= text: where the holder serves and how many live sessions it holds."""
    socket_path = socket_path.replace("\n", "\\n")  # one line: a newline starts a new field
    total = sum(counts.get(state, 0) for state in _LIVE_STATES)
    if total == 0:
        return f"serving {socket_path}: no sessions"
    parts = ", ".join(f"{counts[s]} {s}" for s in _LIVE_STATES if counts.get(s))
    noun = "session" if total == 1 else "sessions"
    return f"serving {socket_path}: {total} {noun} ({parts})"


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when the service
    manager expects none: the variable is unset or invalid, or $WATCHDOG_PID names another
    process (the variable was inherited, not meant for us)."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


async def keep_watchdog(interval: float, status: Callable[[], str], last_status: str) -> None:
    """Ping the watchdog every `interval` seconds until cancelled. A ping comes from the event
    loop itself, so a wedged loop stops pinging and systemd restarts the holder. A STATUS=
    line rides on a ping when `status()` has changed since `last_status`; the holder never
    wakes up just to update it."""
    while True:
        await trio.sleep(interval)
        message = "WATCHDOG=1"
        text = status()
        if text != last_status:
            message += f"\nSTATUS={text}"
            last_status = text
        notify(message)


class ActivationError(ValueError):
    """The service manager passed something the holder cannot serve on."""


@dataclass
class Passed:
    """What the service manager (systemd, or the keeper) passed at start: the listening
    socket, if any, and the fd store's fds by name (see escrowd.fdstore), in the order
    passed. The holder owns them all (close-on-exec)."""

    listener: socket.socket | None = None
    stored: dict[str, list[int]] = field(default_factory=dict)


def passed_fds(expected_path: str | None = None) -> Passed:
    """The fds systemd (or the keeper) passed: LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES.

    Call it first thing, before anything (trio's event loop, say) opens an fd: only then
    are fds 3 and up known to be the passed ones rather than numbers that were free and got
    reused. The variables are removed so that children never mistake them for their own.
    Fds named as the fd store names them go to `stored`; of the others there must be at
    most one, a listening Unix stream socket (bound to `expected_path`, when given), or
    ActivationError says why not.
    """
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    names = os.environ.get("LISTEN_FDNAMES")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if pid is None or count is None or pid != str(os.getpid()):
        return Passed()  # not for us: an fd 3 we may have is someone else's business
    try:
        n = int(count)
    except ValueError:
        raise ActivationError(f"LISTEN_FDS={count!r} is not a number of fds") from None
    labels = names.split(":") if names else []
    labels += ["unknown"] * (n - len(labels))
    passed = Passed()
    listeners: list[int] = []
    for i in range(n):
        fd = SD_LISTEN_FDS_START + i
        if is_store_name(labels[i]):
            try:
                os.set_inheritable(fd, False)
            except OSError:
                continue  # not open: never ours to close later (its number may be reused)
            passed.stored.setdefault(labels[i], []).append(fd)
        else:
            listeners.append(fd)
    if len(listeners) > 1:
        raise ActivationError(
            f"the service manager passed {count} fds (LISTEN_FDS={count}"
            f"{f', LISTEN_FDNAMES={names}' if names else ''}); escrowd serves on exactly one "
            "listening socket: give its .socket unit a single ListenStream="
        )
    if listeners:
        passed.listener = _checked_listener(listeners[0], count, expected_path)
    return passed


def _checked_listener(fd: int, count: str, expected_path: str | None) -> socket.socket:
    what = f"fd {fd} passed by the service manager (LISTEN_FDS={count})"
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise ActivationError(
            f"{what} is not open: {os.strerror(exc.errno or errno.EBADF)}"
        ) from None
    if not stat.S_ISSOCK(mode):
        raise ActivationError(f"{what} is not a socket")
    sock = socket.socket(fileno=fd)
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise ActivationError(f"{what} is not a Unix stream socket (ListenStream=PATH)")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ActivationError(f"{what} is a socket that is not listening")
        if expected_path is not None:
            bound = sock.getsockname()
            if not _same_socket_file(bound, expected_path):
                raise ActivationError(
                    f"{what} is bound to {bound!r}, not to the holder's socket {expected_path}: "
                    "make ListenStream= in the .socket unit and --socket name the same path"
                )
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def _same_socket_file(bound: object, path: str) -> bool:
    if not isinstance(bound, str) or not bound or bound.startswith("\0"):
        return False  # unnamed or abstract: no path a client could connect to
    if os.path.abspath(bound) == os.path.abspath(path):
        return True
    try:
        return os.path.samefile(bound, path)
    except OSError:
        return False
