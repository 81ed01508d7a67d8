"""The keeper's side of the notify protocol, on its channel to the holder it runs: the
notifications it reads, what they do to the fd store it keeps, and its answers (the
holder's side is escrowd.fdstore and escrowd.service; escrowd.keeper has why a channel).

A notification is one datagram of `KEY=value` lines, as systemd's sd_notify sends them,
with the fds it stores attached and, where the platform can, the sender's credentials.
Only the holder the keeper started may store fds here: another sender's are closed.
`FDSTORE=1` keeps the fds under its `FDNAME` (a name the holder stores: escrowd.fdstore),
`FDSTOREREMOVE=1` closes those kept under it, and `READY=1` and `WATCHDOG=1` are the
holder's pings. Every store the holder numbered (`ESCROWD_STORE_ID`) is answered:
`ESCROWD_STORED=<n>` once its fds are kept, `ESCROWD_STORE_FAILED=<n>` with a `REASON`
when they are not (a name the holder does not store, no fds, or a message the kernel cut
short because the keeper is at its fd limit: MSG_CTRUNC).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from escrow_client.fdpass import close_fds
from escrow_client.platform import PASSCRED, RECV_FLAGS, SEND_FLAGS, mark_cloexec

from .log import log
from .names import STORE_FAILED, STORE_ID, STORED, is_store_name

_MAX_FDS_PER_MESSAGE = 253  # SCM_MAX_FD


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """The keeper's end and the holder's end of a new channel. The keeper's end is told
    the sender's credentials with each datagram where the platform can, and has room for a
    burst of deposits (one store message each)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        if PASSCRED is not None:
            mine.setsockopt(socket.SOL_SOCKET, PASSCRED, 1)
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        mine.setblocking(False)
    except OSError:
        mine.close()
        theirs.close()
        raise
    return mine, theirs


def read_notifications(channel: socket.socket, store: dict[str, list[int]],
                       holder: int | None, pinged: Callable[[], None]) -> None:
    """Act on every notification waiting on the keeper's end of `channel` (never blocks)
    with `store`, the fds kept by name; `holder` is the pid of the holder the keeper
    started, and `pinged` is called for each of its pings."""
    space = socket.CMSG_SPACE(_MAX_FDS_PER_MESSAGE * 4) + socket.CMSG_SPACE(12)
    while True:
        try:
            data, ancdata, flags, _ = channel.recvmsg(4096, space, RECV_FLAGS)
        except (BlockingIOError, InterruptedError):
            return
        fds, sender = _unpack(ancdata)
        mark_cloexec(fds)  # macOS cannot at receipt: a stored fd inherited by a standby's exec
        fields = _fields(data)
        if sender is not None and sender != holder:
            close_fds(fds)  # only the holder we started may store fds here
            log("keeper_refused", sender_pid=sender, reason="not from the holder")
            continue
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            # At the fd limit the kernel drops the fds it cannot install: what came is
            # not the whole message, and the holder must not answer `deposited`.
            close_fds(fds)
            log("keeper_refused", name=fields.get("FDNAME"),
                reason="a truncated notification (the keeper is out of fds?)")
            _answer(channel, fields, False, "the keeper could not take the fds: it is at "
                    "its file descriptor limit")
            continue
        if _handle(channel, store, holder, fields, fds):
            pinged()


def _handle(channel: socket.socket, store: dict[str, list[int]], holder: int | None,
            fields: dict[str, str], fds: list[int]) -> bool:
    """One notification from the holder. True if it is a ping."""
    if fields.get("FDSTORE") == "1":
        name = fields.get("FDNAME", "stored")
        if fds and is_store_name(name):
            store.setdefault(name, []).extend(fds)
            fds = []
            _answer(channel, fields, True)
        else:
            log("keeper_refused", name=name, reason="not a name the holder stores")
            _answer(channel, fields, False, "not a name the holder stores, or no fds")
    close_fds(fds)  # fds that came without a valid FDSTORE are not kept
    if fields.get("FDSTOREREMOVE") == "1":
        close_fds(store.pop(fields.get("FDNAME", ""), []))
    if fields.get("READY") == "1":
        log("keeper_holder_ready", holder_pid=holder, stored=len(store))
    return fields.get("READY") == "1" or fields.get("WATCHDOG") == "1"


def _answer(channel: socket.socket, fields: dict[str, str], stored: bool,
            reason: str = "") -> None:
    """Tell the holder whether a store it numbered (ESCROWD_STORE_ID) was kept. A
    holder that gets no answer in time refuses the deposit itself."""
    number = fields.get(STORE_ID)
    if number is None:
        return
    text = f"{STORED}={number}" if stored else f"{STORE_FAILED}={number}\nREASON={reason}"
    try:
        channel.send(text.encode(), SEND_FLAGS)
    except OSError as exc:  # its queue is full, or it died: it times out, or is gone
        log("keeper_answer_lost", store_id=number, error=exc.strerror or repr(exc))


def _unpack(ancdata: list[tuple[int, int, bytes]]) -> tuple[list[int], int | None]:
    fds: list[int] = []
    sender: int | None = None
    for level, kind, data in ancdata:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
        elif kind == getattr(socket, "SCM_CREDENTIALS", None) and len(data) >= 12:
            sender = struct.unpack("3i", data[:12])[0]
    return fds, sender


def _fields(data: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").split("\n"):
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields
