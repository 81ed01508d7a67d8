"""The fd store: where a session's two fds (its PTY master and its state file) wait while
no holder runs (docs/design.md §11).

Under systemd it is the service manager's own (`FDSTORE=1` on $NOTIFY_SOCKET); everywhere
else it is the keeper's, which speaks the same protocol. Either way a restarted holder gets
the fds back through `LISTEN_FDS`/`LISTEN_FDNAMES`, named as they were stored:

    session-<token>   a session's two fds, stored together: its PTY master (a character
                      device) and its state file (a regular file, escrowd.statefile),
                      whose record carries the same token
    journal-<token>   while an app journals that session, its journal file
                      (escrowd.journal)
    holder            the holder's own state file (its restart counters)

Every master is stored with `FDPOLL=0`: systemd would otherwise drop a master that hangs
up, and with it the exit tail still readable from it.

Under the keeper the channel is a socketpair the holder inherits ($ESCROWD_NOTIFY_FD), and
the keeper answers every store (`ESCROWD_STORED=<n>` or `ESCROWD_STORE_FAILED=<n>`, for the
`ESCROWD_STORE_ID=<n>` the holder numbered it with): a store counts as done only once it is
answered. systemd answers nothing; there the datagram's send is all that can be checked, and
the holder refuses to start with a session cap the store cannot hold ($FDSTORE).

Without either there is no store: the holder works as before, and its sessions do not
survive its own death (`enabled` is False, and `status` says so).
"""

from __future__ import annotations

import contextlib
import errno
import socket

import trio

from escrow_client.platform import SEND_FLAGS

from .log import log

# Named here too, where the store is: the holder's modules import them from here.
from .names import FDS_PER_SESSION as FDS_PER_SESSION
from .names import HOLDER_NAME as HOLDER_NAME
from .names import JOURNAL_PREFIX as JOURNAL_PREFIX
from .names import NOTIFY_FD_ENV as NOTIFY_FD_ENV
from .names import SESSION_PREFIX as SESSION_PREFIX
from .names import STORE_FAILED as STORE_FAILED
from .names import STORE_ID as STORE_ID
from .names import STORED as STORED
from .names import is_store_name as is_store_name
from .names import journal_name as journal_name
from .names import rights_for as rights_for
from .names import session_name as session_name

# How long a store message may wait for room in the manager's queue (and, with the keeper,
# for its answer) before the deposit is refused: it must not be answered before its fds
# are safe.
STORE_DEADLINE = 2.0


class StoreError(Exception):
    """The fds could not be handed to the store."""


class FdStore:
    """A connected datagram socket to $NOTIFY_SOCKET, or the keeper's channel (`channel`,
    whose stores are answered). Resource handling: owns the socket; `close()` closes it.
    Never blocks the event loop, never raises SIGPIPE."""

    def __init__(self, address: str | None, channel: socket.socket | None = None) -> None:
        self.sock: socket.socket | None = None
        self._pending: list[str] = []  # removals the manager's queue had no room for yet
        self._more = trio.Event()
        self.answers = channel is not None  # the keeper answers each store
        self._next_id = 0
        self._waiting: dict[int, trio.Event] = {}
        self._answered: dict[int, str | None] = {}  # None: stored; else why it was not
        # One task at a time may wait for room to send (trio allows one waiter per fd).
        self._room = trio.Lock()
        if channel is not None:
            channel.setblocking(False)
            self.sock = channel
            return
        if not address or not address.startswith(("/", "@")):
            return
        target = "\0" + address[1:] if address.startswith("@") else address
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.connect(target)
        except OSError as exc:
            sock.close()
            log("fd_store", state="unavailable", reason=f"cannot reach {address}: {exc}")
            return
        self.sock = sock

    @property
    def enabled(self) -> bool:
        return self.sock is not None

    async def store(self, name: str, fds: list[int]) -> None:
        """Hand copies of `fds` to the store under `name` (they stay ours too). Raises
        StoreError if the store would not take them within STORE_DEADLINE (with the keeper:
        if it did not answer that it has them). `read_answers` must be running then."""
        if self.sock is None:
            return
        message = f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0"
        if not self.answers:
            await self._send(message.encode(), fds)
            return
        self._next_id += 1
        number = self._next_id
        answered = self._waiting[number] = trio.Event()
        try:
            with trio.move_on_after(STORE_DEADLINE):
                await self._send(f"{message}\n{STORE_ID}={number}".encode(), fds)
                await answered.wait()
            if not answered.is_set():
                raise StoreError("the keeper did not say it has the fds in time")
            why = self._answered.pop(number)
            if why is not None:
                raise StoreError(why)
        finally:
            self._waiting.pop(number, None)
            self._answered.pop(number, None)

    def store_nowait(self, name: str, fds: list[int]) -> bool:
        """Hand copies of `fds` to the store under `name` if that can be done at once, with
        no answer waited for (for what the holder can do without: a lost one is logged).
        Sent in order with removals, so that a removal never overtakes it."""
        if self.sock is None:
            return False
        if self._pending:
            # A removal waits for room: this would overtake it (and a removal of the same
            # name, sent after, would drop it). Not stored, then; logged.
            log("fd_store", action="store", name=name, reason="not stored: removals wait")
            return False
        try:
            self.sock.sendmsg([f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0".encode()],
                              rights_for(fds), SEND_FLAGS)
        except OSError as exc:
            log("fd_store", action="store", name=name, error=errno.errorcode.get(
                exc.errno or 0, str(exc)), reason="not stored: the store has no room now")
            return False
        return True

    async def read_answers(self) -> None:
        """Take the keeper's answers to stores (a task for the holder's life; with no
        keeper it returns at once)."""
        while self.answers and self.sock is not None:
            try:
                await trio.lowlevel.wait_readable(self.sock)
            except trio.ClosedResourceError:
                return  # closed: the keeper is gone, and this holder serves on alone
            while self.sock is not None:
                try:
                    data = self.sock.recv(4096)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    log("fd_store", error=exc.strerror or repr(exc), reason="reading answers")
                    break
                self._take_answer(data)

    def _take_answer(self, data: bytes) -> None:
        fields: dict[str, str] = {}
        for line in data.decode("utf-8", "replace").split("\n"):
            key, _, value = line.partition("=")
            fields[key] = value
        for key, why in ((STORED, None), (STORE_FAILED, fields.get("REASON") or "refused")):
            number = fields.get(key, "")
            event = self._waiting.get(int(number)) if number.isdigit() else None
            if event is not None:
                self._answered[int(number)] = why
                event.set()

    def remove(self, name: str) -> None:
        """Drop every fd stored under `name` (the session ended). Sent now if the manager's
        queue has room (a Unix datagram queue holds as few as 10), else queued and sent by
        `keep_removing` as soon as it does: a removal is never dropped while this holder
        runs. (If it dies first, its state file says the session ended, and the next
        holder closes what it finds.)"""
        if self.sock is None:
            return
        self._pending.append(name)
        self._send_pending()
        if self._pending:
            self._more.set()

    async def keep_removing(self) -> None:
        """Send queued removals as the manager takes them (a task for the holder's life)."""
        assert self.sock is not None or not self._pending
        while True:
            await self._more.wait()
            self._more = trio.Event()
            while self._pending and self.sock is not None:
                async with self._room:
                    if self.sock is not None:
                        with contextlib.suppress(trio.ClosedResourceError):
                            await trio.lowlevel.wait_writable(self.sock)
                self._send_pending()

    def _send_pending(self) -> None:
        while self._pending and self.sock is not None:
            name = self._pending[0]
            try:
                self.sock.sendmsg([f"FDSTOREREMOVE=1\nFDNAME={name}".encode()], [],
                                  SEND_FLAGS)
            except BlockingIOError:
                return
            except OSError as exc:
                log("fd_store", action="remove", name=name, error=errno.errorcode.get(
                    exc.errno or 0, str(exc)), reason="could not send FDSTOREREMOVE")
            self._pending.pop(0)

    @property
    def removals_pending(self) -> int:
        return len(self._pending)

    async def _send(self, message: bytes, fds: list[int]) -> None:
        with trio.move_on_after(STORE_DEADLINE):
            while self.sock is not None:
                try:
                    self.sock.sendmsg([message], rights_for(fds), SEND_FLAGS)
                    return
                except BlockingIOError:
                    async with self._room:
                        if self.sock is not None:
                            with contextlib.suppress(trio.ClosedResourceError):
                                await trio.lowlevel.wait_writable(self.sock)
                except OSError as exc:
                    raise StoreError(f"the fd store refused: {exc.strerror or exc}") from None
            raise StoreError("the fd store is gone")
        raise StoreError("the fd store did not take the fds in time")

    def close(self) -> None:
        if self.sock is not None:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
            self.sock = None
