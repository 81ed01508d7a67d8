"""One client connection, as the holder sees it: framed messages with fds, async.

The framing rules live in `escrow_client.fdpass` (shared with the client); this is only the
trio loop around them.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

import trio

from escrow_client import protocol
from escrow_client.fdpass import ANCILLARY_SPACE, FrameAssembler, close_fds, rights
from escrow_client.liveness import process_start_time
from escrow_client.platform import RECV_FLAGS, SEND_FLAGS, harden_socket, peer_credentials

_WIDE_SEND_BUFFER = 4 << 20


class SendTimeout(OSError):
    pass


class Connection:
    """A connected client socket.

    Resource handling: owns `sock` and closes it in `close()`. Received fds belong to the
    caller of `receive()`.
    """

    def __init__(
        self, sock: trio.socket.SocketType, number: int, send_deadline: float = 1.0
    ) -> None:
        self.sock = sock
        # trio's own (non-blocking) socket, for a send that can complete at once: trio's
        # methods yield to the scheduler on every call, a round per message when a
        # handoff of many sessions sends a thousand.
        self._now: socket.socket | None = getattr(sock, "_sock", None)
        self.number = number
        self.send_deadline = send_deadline
        harden_socket(sock)  # type: ignore[arg-type]
        self.peer_pid, self.peer_uid = peer_credentials(sock)  # type: ignore[arg-type]
        self.owner = ""
        self.client = ""
        self.client_timeout = 0.0
        self.custodian = False  # deposited at least once: never idle-timed-out
        self._peer_start_time: float | None = None

    def peer_start_time(self) -> float | None:
        """When the peer process started (asked once: a custodian's identity with its pid)."""
        if self._peer_start_time is None and self.peer_pid:
            self._peer_start_time = process_start_time(self.peer_pid)
        return self._peer_start_time

    async def receive_frame(self, max_body: int) -> tuple[bytes, list[int]]:
        """Read exactly one frame. EOFError at a clean end; ProtocolError on a bad frame
        (every fd that came with it closed)."""
        assembler = FrameAssembler(max_body)
        try:
            while True:
                data, ancdata, flags, _ = await self.sock.recvmsg(
                    assembler.wanted, ANCILLARY_SPACE, RECV_FLAGS
                )
                frame = assembler.feed(data, ancdata, flags)
                if frame is not None:
                    return frame
        except BaseException:
            assembler.discard()
            raise

    async def receive(self, max_body: int) -> tuple[protocol.Request, int | None]:
        """Read and decode one request; returns it with its fd, if it must carry one."""
        body, fds = await self.receive_frame(max_body)
        try:
            message = protocol.decode_request(body)
            protocol.check_fds(message, len(fds))
        except BaseException:
            close_fds(fds)
            raise
        return message, (fds[0] if fds else None)

    async def send(
        self, message: protocol.Message, fd: int | Sequence[int] | None = None
    ) -> None:
        """Send one whole frame; `fd` (or several) rides on its first byte. MSG_NOSIGNAL on
        every send.

        Bounded by `send_deadline`: a peer that does not read gets SendTimeout (an OSError),
        never a connection task stuck forever. After it the stream is out of step."""
        view = memoryview(protocol.encode(message))
        ancdata = rights(fd)
        if self._now is not None:
            try:
                sent = self._now.sendmsg([view], ancdata, SEND_FLAGS)
            except BlockingIOError:
                pass  # full: wait below
            else:
                ancdata = []
                view = view[sent:]
                if not view:
                    return
        with trio.move_on_after(self.send_deadline):
            while view:
                sent = await self.sock.sendmsg([view], ancdata, SEND_FLAGS)
                ancdata = []
                view = view[sent:]
            return
        raise SendTimeout(errno.ETIMEDOUT, "send deadline passed: the peer is not reading")

    def widen_send_buffer(self) -> None:
        """Let the kernel queue a few MiB for this peer (as far as net.core.wmem_max allows;
        often it does not): the handoffs of a `retrieve_many` then go out while the holder
        stops the next drains, instead of each waiting for the app to read the one before."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _WIDE_SEND_BUFFER)
        except OSError:
            pass  # a narrower buffer is only slower

    async def send_error(
        self, code: str, message: str, sid: str | None = None, versions: list[int] | None = None
    ) -> None:
        await self.send(protocol.Error(code=code, message=message, id=sid, versions=versions))

    def close(self) -> None:
        self.sock.close()
