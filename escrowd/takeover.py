"""A keeper's standby, from its own side: the next holder, started ahead of need, that waits
with every module loaded until its keeper tells it to serve (docs/design.md §11; the
keeper's side is escrowd.standby).

A standby is `escrowd --bare` started by the keeper as a holder is (escrowd.spawn), with
nothing passed but its end of a stream socket to the keeper, at 3 ($ESCROWD_STANDBY_FD). It
loads what a holder loads (escrowd.__main__ imports escrowd.serving before it gets here),
says `R` (ready), and blocks reading. It holds no session fd, no listening socket and no
channel to the store, writes no pidfile and logs nothing: until it is told to serve, it can
touch no session and no client can reach it.

Told to serve, it is sent an order and then the fds in batches (at most SCM_MAX_FD, 253, a
message), exactly as a holder started by exec gets them: the listening socket, every stored
fd in the store's order, and its end of a new notify channel last. The order names them
(`LISTEN_FDNAMES`), and says the store's room (`FDSTORE`) and the watchdog's interval. The
standby closes its socket to the keeper, puts the fds at 3, 4, ... (every one it received
that sits in the way moved first), and sets the environment escrowd.spawn gives a holder;
from there on it is that holder: `passed_fds` finds its fds as an exec'd holder finds them.
Its working directory is `/` and its signals are a fresh holder's: it was started as one.

What it does with anything it does not expect, it does by exiting, so that the keeper starts
a holder by exec instead (a standby that fails costs nothing but that):
- EOF before an order: the keeper closed its end (it stops, or wants a standby of newer
  code). It exits 0.
- An order it cannot read, fewer or more fds than it says, a batch the kernel cut short
  (MSG_CTRUNC: the standby is out of fds), or an fd of its own where a passed one must go:
  every fd it received is closed (the keeper keeps its own copies) and it exits 1.

Except when the keeper died: then its copies died with it, and what the standby was sent
may be the only copy of some sessions. A keeper that lives never closes a standby's socket
mid-takeover without killing it first (escrowd.standby), so a takeover cut short (EOF
before every batch came, or no one to say TAKEN to) is the keeper's death once the
standby's parent changes: it serves what arrived, as a holder exec'd by a keeper that died
would have had it all: the listener and the stored fds that came, their names trimmed to
match, and no channel to a store (the holder serves on alone, escrowd.serving).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
import time

from escrow_client.fdpass import close_fds
from escrow_client.platform import RECV_FLAGS, SEND_FLAGS

from .names import NOTIFY_FD_ENV, STANDBY_FD_ENV
from .spawn import holder_environment
from .standby import BATCH, MAX_FDS_PER_MESSAGE, READY, TAKEN

ORDER_HEADER = struct.Struct("!I")
MAX_ORDER_BYTES = 16 << 20  # names for far more fds than any store holds
# How long an EOF mid-takeover may come before the standby sees its parent change, if that
# EOF was the keeper's death: its fds are closed just before its children are reparented.
_ORPHANED_WITHIN = 2.0


class TakeoverFailed(Exception):
    """What the keeper sent cannot be served as it is."""


class Waiting:
    """A standby before it is loaded: its socket to the keeper, the fds it inherited, and
    its keeper's pid."""

    def __init__(self, sock: socket.socket, inherited: set[int]) -> None:
        self.sock = sock
        self.inherited = inherited
        self.keeper = os.getppid()


def standby() -> Waiting | None:
    """This process as a standby ($ESCROWD_STANDBY_FD), or None for a holder started by
    exec. Call it before loading the holder's modules: what is open then was inherited."""
    value = os.environ.pop(STANDBY_FD_ENV, None)
    if value is None:
        return None
    if not value.isdigit():
        sys.exit(1)
    sock = socket.socket(fileno=int(value))
    sock.set_inheritable(False)
    return Waiting(sock, _open_fds())


def stand_by(waiting: Waiting) -> None:
    """Say ready, wait to be told to serve, and return as the holder an exec would have
    started (see the module's docstring); or exit."""
    sock, inherited = waiting.sock, waiting.inherited
    received: list[int] = []
    try:
        sock.sendall(READY, SEND_FLAGS)
        order = _read_order(sock)
        if order is None:
            sys.exit(0)  # told to go, not to serve
        count = int(order.pop("FDS"))
        names = order["LISTEN_FDNAMES"].split(":") if order["LISTEN_FDNAMES"] else []
        if len(names) != count - 1:
            raise TakeoverFailed(f"{len(names)} names for {count} fds")
        received = _receive(sock, count)
        whole = len(received) == count
        if whole:
            try:
                sock.sendall(TAKEN, SEND_FLAGS)  # the keeper waits for it: now the holder
            except OSError:
                if not _orphaned(waiting.keeper):
                    raise
        elif not received or not _orphaned(waiting.keeper):
            raise TakeoverFailed("the keeper's socket closed before every fd came")
        sock.close()
        placed = _place(received, inherited)
        received = []
        env = dict(os.environ, FDSTORE=order["FDSTORE"])
        if whole:
            holder_environment(env, names, float(order["WATCHDOG_SECONDS"]), os.getpid())
        else:  # cut short by the keeper's death: the last batch, the channel's, never came
            holder_environment(env, names[:placed], float(order["WATCHDOG_SECONDS"]),
                               os.getpid())
            env.pop(NOTIFY_FD_ENV)
            print(f"escrowd: the keeper died during the takeover: serving the {placed} of "
                  f"{count} fds that came", file=sys.stderr)
        os.environ.clear()
        os.environ.update(env)
    except (OSError, KeyError, ValueError, TakeoverFailed) as exc:
        close_fds(received)
        print(f"escrowd: the standby could not take over: {exc!r}", file=sys.stderr)
        sys.exit(1)


def _read_order(sock: socket.socket) -> dict[str, str] | None:
    head = _exactly(sock, ORDER_HEADER.size)
    if head is None:
        return None
    (size,) = ORDER_HEADER.unpack(head)
    if size > MAX_ORDER_BYTES:
        raise TakeoverFailed(f"an order of {size} bytes")
    body = _exactly(sock, size)
    if body is None:
        raise TakeoverFailed("the order was cut short")
    order: dict[str, str] = {}
    for line in body.decode().split("\n"):
        key, sep, text = line.partition("=")
        if sep:
            order[key] = text
    return order


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes, or None at EOF before the first; TakeoverFailed at EOF after it."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            if data:
                raise TakeoverFailed("the order was cut short")
            return None
        data += chunk
    return bytes(data)


def _receive(sock: socket.socket, count: int) -> list[int]:
    """`count` fds, in order, from batches of one byte each (reading exactly that byte, so
    that no batch's fds are taken with another's); fewer if the keeper's socket closed
    first."""
    fds: list[int] = []
    space = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * 4)
    try:
        while len(fds) < count:
            data, ancdata, flags, _ = sock.recvmsg(1, space, RECV_FLAGS)
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % 4
                    fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
            if flags & socket.MSG_CTRUNC:
                raise TakeoverFailed("a batch of fds was cut short (MSG_CTRUNC)")
            if not data and not ancdata:
                return fds  # EOF: the caller judges it
            if data != BATCH:
                raise TakeoverFailed(f"{data!r} where a batch of fds must be")
        if len(fds) != count:
            raise TakeoverFailed(f"{len(fds)} fds where the order says {count}")
    except BaseException:
        close_fds(fds)
        raise
    return fds


def _orphaned(keeper: int) -> bool:
    """Whether `keeper`, this standby's parent, died (its children are reparented as it
    exits, a moment after its fds are closed)."""
    deadline = time.monotonic() + _ORPHANED_WITHIN
    while os.getppid() == keeper:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _open_fds() -> set[int]:
    """This process's open fds (one of them, the listing's own, closed again)."""
    try:
        return {int(name) for name in os.listdir("/dev/fd")}
    except OSError:
        return set()


def _place(fds: list[int], inherited: set[int]) -> int:
    """Put `fds` at 3, 4, ... (inheritable, as an exec leaves them) and close where they
    came in; returns how many. What sits there was inherited at exec (`inherited`: open
    before the holder's modules were loaded), as an exec'd holder's passed fds go over it
    too; an fd this process opened since raises TakeoverFailed before anything is moved."""
    end = 3 + len(fds)
    mine = set(fds)
    for fd in range(3, end):
        if fd in mine or fd in inherited:
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue
        close_fds(fds)
        raise TakeoverFailed(f"fd {fd} of the standby's own is where a passed fd must go")
    # Those in the way (or below 3: a keeper may run with a standard fd closed) move past
    # the targets first, so that no dup2 overwrites one still to be placed.
    moved: list[int] = []
    for i, fd in enumerate(fds):
        if fd != 3 + i and fd < end:
            try:
                moved.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, end))
            except OSError:
                close_fds(moved + fds[i:])
                raise
            os.close(fd)
        else:
            moved.append(fd)
    for target, fd in enumerate(moved, start=3):
        if fd == target:
            os.set_inheritable(fd, True)
        else:
            os.dup2(fd, target)  # inheritable
            os.close(fd)
    return len(fds)
