"""Frames with file descriptors over a Unix stream socket (SCM_RIGHTS).

The receive side is written once, without I/O (`FrameAssembler`), and driven by a blocking
loop here and by an async loop in the holder. Rules it enforces (PROTOCOL.md, "fd passing"):

- It asks for exactly the 4 header bytes, then exactly the body. Linux may merge earlier
  fd-less bytes into the recvmsg that returns fds, so reading ahead would attach an fd to the
  wrong frame.
- Every fd that arrives is close-on-exec (MSG_CMSG_CLOEXEC, or fcntl right after where the
  platform lacks it) and is closed again on any error, including MSG_CTRUNC. A control buffer
  of CMSG_SPACE(4) can deliver two fds through alignment padding, so the count is checked
  as well as the flag.
- Every send passes MSG_NOSIGNAL (SO_NOSIGPIPE is set on the socket where that exists
  instead), so a peer that hung up gives EPIPE, not a SIGPIPE that kills the process.

The stdlib's `socket.send_fds`/`recv_fds` ignore their flags argument in Python 3.11, which
is why sendmsg/recvmsg are called directly.
"""

from __future__ import annotations

import array
import os
import socket
import time
from collections.abc import Iterable, Sequence

from .platform import RECV_FLAGS, SEND_FLAGS, mark_cloexec
from .protocol import HEADER, FrameError, ProtocolError, parse_header

# Room for a few fds, so that a frame with too many is seen (and its fds closed) rather than
# silently truncated by the kernel.
MAX_FDS_SEEN = 8
ANCILLARY_SPACE = socket.CMSG_SPACE(MAX_FDS_SEEN * array.array("i").itemsize)

Ancillary = list[tuple[int, int, bytes]]
_CTRUNC = int(socket.MSG_CTRUNC)  # (an enum flag: `&` on it is a slow Python call)


def close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def fds_from_ancillary(ancdata: Ancillary, msg_flags: int) -> list[int]:
    """Return the fds installed by one recvmsg; on MSG_CTRUNC close them and raise
    TruncatedFds (the frame's bytes are still whole in the stream)."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints = array.array("i")
            ints.frombytes(data[: len(data) - len(data) % ints.itemsize])
            fds.extend(ints)
    mark_cloexec(fds)
    if msg_flags & _CTRUNC:
        close_fds(fds)
        raise TruncatedFds(
            "ancillary data was truncated (MSG_CTRUNC): too many fds, or the receiver is out "
            "of file descriptors"
        )
    return fds


class TruncatedFds(ProtocolError):
    """A frame's fds did not all arrive (MSG_CTRUNC). Every fd that did is closed. Raised
    only once the whole frame has been read, so the stream stays in step."""


def rights(fds: int | Sequence[int] | None) -> Ancillary:
    """The ancillary data that carries `fds` (one fd, or several in order), or none."""
    if fds is None:
        return []
    listed = [fds] if isinstance(fds, int) else list(fds)
    if not listed:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", listed).tobytes())]


class FrameAssembler:
    """Collects one frame, header then body, and every fd that came with it.

    Usage: while `feed(*recvmsg(assembler.wanted, ANCILLARY_SPACE, RECV_FLAGS)[:3])` returns
    None, keep reading. It returns `(body, fds)` once the frame is whole. The caller owns the
    returned fds. On EOF in the middle of a frame, or any error, the fds are closed before the
    exception leaves. A clean EOF between frames raises EOFError.
    """

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self._buf = bytearray()
        self._body_len: int | None = None
        self._truncated: TruncatedFds | None = None
        self.fds: list[int] = []

    @property
    def wanted(self) -> int:
        if self._body_len is None:
            return HEADER.size - len(self._buf)
        return self._body_len - len(self._buf)

    @property
    def started(self) -> bool:
        return bool(self._buf or self.fds or self._truncated or self._body_len is not None)

    def feed(
        self, data: bytes, ancdata: Ancillary, msg_flags: int
    ) -> tuple[bytes, list[int]] | None:
        try:
            try:
                self.fds.extend(fds_from_ancillary(ancdata, msg_flags))
            except TruncatedFds as exc:
                self._truncated = exc  # read the rest of the frame, then refuse it
            if not data:
                if self.started:
                    raise FrameError("connection closed in the middle of a frame")
                raise EOFError
            if self._body_len is None:
                self._buf += data
                if len(self._buf) < HEADER.size:
                    return None
                self._body_len = parse_header(bytes(self._buf), self.max_body)
                self._buf.clear()
                return None
            if not self._buf and len(data) == self._body_len:
                body = data  # the whole body in one read (the usual case): not copied
            else:
                self._buf += data
                if len(self._buf) < self._body_len:
                    return None
                body = bytes(self._buf)
            fds, truncated = self.fds, self._truncated
            self._buf, self._body_len, self.fds, self._truncated = bytearray(), None, [], None
            if truncated is not None:
                close_fds(fds)
                raise truncated
            return body, fds
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Close every fd collected so far (the frame will not be delivered)."""
        fds, self.fds = self.fds, []
        close_fds(fds)


def recv_frame(sock: socket.socket, max_body: int) -> tuple[bytes, list[int]]:
    """Blocking: read one whole frame. Raises EOFError at a clean end of stream, ProtocolError
    on a bad frame, OSError (including TimeoutError, from the socket's timeout) otherwise."""
    assembler = FrameAssembler(max_body)
    try:
        while True:
            data, ancdata, flags, _ = sock.recvmsg(assembler.wanted, ANCILLARY_SPACE, RECV_FLAGS)
            frame = assembler.feed(data, ancdata, flags)
            if frame is not None:
                return frame
    except BaseException:
        assembler.discard()
        raise


# A receive buffer kept for the next frame is at most this big (a bigger frame gets a
# buffer of its own): a handoff with a 64 KiB replay fits.
_KEPT_BUFFER = 1 << 20


class FrameReader:
    """Blocking: whole frames from one socket, read into one buffer that is used again for
    the next frame. Reading into fresh memory each time made the kernel fault in every page
    of it: with a thousand handoffs' replays to keep, that was as much work as the copies.

    Same rules as `recv_frame` (exactly the header, then exactly the body; every fd closed
    on any error)."""

    def __init__(self, sock: socket.socket, max_body: int) -> None:
        self.sock = sock
        self.max_body = max_body
        self._buffer = bytearray()

    def read(self, until: float | None = None) -> tuple[memoryview, list[int]]:
        """The next frame's body, valid until the next `read`, and its fds (the caller's).
        EOFError at a clean end of stream, ProtocolError on a bad frame, OSError (including
        TimeoutError) otherwise. With `until` (a `time.monotonic()` instant), TimeoutError
        once it passes, however the frame trickles in: a socket's own timeout starts
        again at every byte that comes."""
        fds: list[int] = []
        truncated: TruncatedFds | None = None

        def fill(view: memoryview, started: bool) -> None:
            nonlocal truncated
            got = 0
            while got < len(view):
                if until is not None:
                    left = until - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("the deadline passed in the middle of a frame")
                    self.sock.settimeout(left)
                n, ancdata, flags, _ = self.sock.recvmsg_into([view[got:]], ANCILLARY_SPACE,
                                                              RECV_FLAGS)
                try:
                    fds.extend(fds_from_ancillary(ancdata, flags))
                except TruncatedFds as exc:
                    truncated = exc  # read the rest of the frame, then refuse it
                if n == 0:
                    if started or got or fds or truncated:
                        raise FrameError("connection closed in the middle of a frame")
                    raise EOFError
                got += n

        try:
            header = bytearray(HEADER.size)
            fill(memoryview(header), started=False)
            length = parse_header(bytes(header), self.max_body)
            buffer = self._buffer
            if len(buffer) < length:
                buffer = bytearray(length)
                if length <= _KEPT_BUFFER:
                    self._buffer = buffer
            body = memoryview(buffer)[:length]
            fill(body, started=True)
            if truncated is not None:
                raise truncated
            return body, fds
        except BaseException:
            close_fds(fds)
            raise


def send_frame(
    sock: socket.socket, frame: bytes, fd: int | Sequence[int] | None = None
) -> None:
    """Blocking: send one whole frame, `fd` (or several) riding on its first byte."""
    view = memoryview(frame)
    ancdata = rights(fd)
    while view:
        sent = sock.sendmsg([view], ancdata, SEND_FLAGS)
        ancdata = []
        view = view[sent:]
