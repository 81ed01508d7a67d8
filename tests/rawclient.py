"""A raw protocol client for tests: one real AF_UNIX connection, one frame at a time.

Built only on `escrow_client.protocol` (messages, framing) and `escrow_client.fdpass`
(sendmsg/recvmsg with SCM_RIGHTS), so a test can stop anywhere in an exchange: after
`hello`, after sending `retrieve`, after receiving a `handoff` but before the `ack`, and so
on. It never turns an `error` answer into an exception: the test looks at the message.

Resource handling: owns its socket and every fd it receives (kept in `fds`); `close()`
closes them all, and closing an fd early through `close_fd()` keeps the list honest.
"""

from __future__ import annotations

import os
import socket

from escrow_client import fdpass, protocol

OWNER = "com.example.term"
MAX_RESPONSE_BYTES = 256 << 20


class RawClient:
    def __init__(
        self, socket_path: str, timeout: float = 10.0, rcvbuf: int | None = None
    ) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.fds: list[int] = []
        try:
            if rcvbuf is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.settimeout(timeout)
            self.sock.connect(socket_path)
        except BaseException:
            self.sock.close()
            raise

    # --- one step at a time -----------------------------------------------------------------

    def send(self, message: protocol.Message, fd: int | None = None) -> None:
        fdpass.send_frame(self.sock, protocol.encode(message), fd)

    def send_bytes(self, data: bytes) -> None:
        """Anything at all, framed or not (MSG_NOSIGNAL, like every real send)."""
        view = memoryview(data)
        while view:
            view = view[self.sock.send(view, socket.MSG_NOSIGNAL) :]

    def receive(self) -> tuple[protocol.Response, int | None]:
        """The next message and the fd it carried (owned by this client until closed)."""
        body, fds = fdpass.recv_frame(self.sock, MAX_RESPONSE_BYTES)
        self.fds.extend(fds)
        message = protocol.decode_response(body)
        protocol.check_fds(message, len(fds))
        return message, (fds[0] if fds else None)

    def hello(self, owner: str = OWNER, timeout: float | None = None) -> protocol.Welcome:
        """Handshake. `timeout` is what the hello announces (the holder waits for an ack at
        least that long); None announces none, so the holder's own ack deadline rules."""
        self.send(protocol.Hello(version=protocol.VERSION, owner=owner, client="rawclient",
                                 timeout=timeout))
        welcome, _ = self.receive()
        assert isinstance(welcome, protocol.Welcome), welcome
        return welcome

    def retrieve_handoff(self, sid: str) -> tuple[protocol.Handoff, int]:
        """Send `retrieve` and read the `handoff` with its fd; do not ack."""
        self.send(protocol.Retrieve(id=sid))
        reply, fd = self.receive()
        assert isinstance(reply, protocol.Handoff), reply
        assert fd is not None
        return reply, fd

    # --- cleanup -------------------------------------------------------------------------------

    def close_fd(self, fd: int) -> None:
        self.fds.remove(fd)
        os.close(fd)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        fdpass.close_fds(fds)
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
