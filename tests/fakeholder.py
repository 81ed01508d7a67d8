"""A fake holder for the client's failure paths: a real Unix socket server in a thread that
greets with the real encoder (`escrow_client.protocol`, `escrow_client.fdpass`) and then
misbehaves as the test says.

The test gives one *script* per connection it expects, in order: a function of the greeted
`Peer`. The server accepts a connection, answers its `hello` with a `welcome`, runs the next
script, and closes the connection when the script returns (with `repeat_last`, the last
script serves every further connection until `close()`). Connections are served one at a
time, or with `concurrent` each in a thread of its own from the moment it is accepted (a
custody connection stays open while its client opens others). Once every script has run it
closes its listener too, so a further connection is refused, as by a holder that is gone
(the socket file stays). Everything a client sent after its `hello` is recorded per connection in
`FakeHolder.received`, so a test can assert what never left the client (an `ack`, say).

Resource handling: `close()` (or the end of a `with` block) joins the threads, closes the
listener, and re-raises in the test's thread whatever a script raised. The fake holder owns
no fd it sends: the test keeps its own and closes them.

Also here: `fds_open_on(fd)`, every fd of this process that refers to the same pipe or the
same terminal master as `fd`, so a test can prove the client closed (or kept) its copy.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from escrow_client import EscrowClient, fdpass, protocol
from escrow_client.platform import pty_number

OWNER = "com.example.term"
SID = "tab-1"
# Budgets small enough for a 2 s client timeout (docs/design.md §4 step 2: timeout > budget + send).
WELCOME = protocol.Welcome(
    version=protocol.VERSION, holder_version="fake", pid=os.getpid(), drain_stop_budget=0.2,
    send_deadline=0.2, ack_deadline=2.0, limits={"max_request_bytes": protocol.MAX_REQUEST_BYTES},
)
CLIENT_TIMEOUT = 2.0

T = TypeVar("T", bound=protocol.Message)


class Peer:
    """One accepted, greeted connection, as the fake holder sees it."""

    def __init__(self, sock: socket.socket, received: list[protocol.Request]) -> None:
        self.sock = sock
        self.received = received

    def receive(self) -> protocol.Request:
        """The client's next message (recorded). EOFError when it hung up."""
        return self.receive_carrying()[0]

    def receive_carrying(self) -> tuple[protocol.Request, int | None]:
        """The client's next message (recorded), and the number of the terminal whose
        master came with it (None: no fd, or not a pty master)."""
        body, fds = fdpass.recv_frame(self.sock, protocol.MAX_REQUEST_BYTES)
        try:
            terminal = pty_number(fds[0]) if fds else None
        finally:
            fdpass.close_fds(fds)  # nothing here keeps what a client sends
        message = protocol.decode_request(body)
        self.received.append(message)
        return message, terminal

    def expect(self, kind: type[T]) -> T:
        message = self.receive()
        assert isinstance(message, kind), f"expected {kind.__name__}, got {message!r}"
        return message

    def send(self, message: protocol.Message, fd: int | None = None) -> None:
        fdpass.send_frame(self.sock, protocol.encode(message), fd)

    def until_eof(self) -> None:
        """Record whatever else the client sends, until it hangs up."""
        try:
            while True:
                self.receive()
        except (EOFError, ConnectionResetError):
            return


Script = Callable[[Peer], None]


class FakeHolder:
    def __init__(
        self,
        directory: Path,
        scripts: list[Script],
        welcome: protocol.Welcome = WELCOME,
        welcome_delay: float = 0.0,
        timeout: float = 10.0,
        repeat_last: bool = False,
        concurrent: bool = False,
    ) -> None:
        self.socket_path = str(directory / "fake.sock")
        self.received: list[list[protocol.Request]] = []
        self._scripts = scripts
        self._welcome = welcome
        self._welcome_delay = welcome_delay
        self._timeout = timeout
        self._repeat_last = repeat_last  # serve the last script until close()
        self._concurrent = concurrent
        self._connections: list[threading.Thread] = []  # with `concurrent`, one each
        self._closing = False
        self._errors: list[BaseException] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(8)
        self._listener.settimeout(timeout)  # a client that never comes fails the test
        self._thread = threading.Thread(target=self._serve, name="fake-holder", daemon=True)
        self._thread.start()

    def client(self, timeout: float = CLIENT_TIMEOUT) -> EscrowClient:
        return EscrowClient(OWNER, socket_path=self.socket_path, timeout=timeout)

    def _serve(self) -> None:
        scripts = iter(self._scripts)
        script = next(scripts, None)
        repeating = False
        try:
            while script is not None:
                sock, _ = self._listener.accept()
                if self._closing:  # close()'s own connection, to wake us
                    sock.close()
                    return
                received: list[protocol.Request] = []
                self.received.append(received)  # in the order of the connections
                if self._concurrent:
                    connection = threading.Thread(
                        target=self._serve_in_thread, args=(sock, script, received, repeating),
                        name="fake-holder-connection", daemon=True)
                    self._connections.append(connection)
                    connection.start()
                else:
                    self._serve_one(sock, script, received, repeating)
                following = next(scripts, None)
                if following is None and self._repeat_last:
                    repeating = True
                else:
                    script = following
        except BaseException as exc:  # handed to the test's thread by close()
            self._errors.append(exc)
        finally:
            self._listener.close()  # gone: the next connect is refused

    def _serve_in_thread(self, sock: socket.socket, script: Script,
                         received: list[protocol.Request], repeating: bool) -> None:
        try:
            self._serve_one(sock, script, received, repeating)
        except BaseException as exc:  # handed to the test's thread by close()
            self._errors.append(exc)

    def _serve_one(self, sock: socket.socket, script: Script, received: list[protocol.Request],
                   repeating: bool) -> None:
        with sock:
            sock.settimeout(self._timeout)
            peer = Peer(sock, received)
            try:
                peer.expect(protocol.Hello)
                received.clear()  # what follows the handshake is what tests look at
                if self._welcome_delay:
                    time.sleep(self._welcome_delay)  # the behaviour under test: a slow holder
                peer.send(self._welcome)
                script(peer)
            except (EOFError, BrokenPipeError, ConnectionResetError):
                if not repeating:
                    raise
                # Serving on until close(), a client may give up anywhere in a call (its
                # deadline ran out): that is not the test failing.

    def close(self) -> None:
        if self._repeat_last and self._thread.is_alive():
            self._closing = True
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.connect(self.socket_path)  # wakes accept(), which sees _closing
        self._thread.join(self._timeout + 5.0)
        assert not self._thread.is_alive(), "the fake holder did not finish its scripts"
        for connection in self._connections:
            connection.join(self._timeout + 5.0)
            assert not connection.is_alive(), "the fake holder did not finish a connection"
        if self._errors:
            raise self._errors[0]

    def __enter__(self) -> FakeHolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _identity(fd: int) -> tuple[int, int, int, int | None]:
    """What an fd refers to: its inode, its access mode (both ends of a pipe share one
    inode), and for a pty master its terminal (every master has the inode of /dev/ptmx)."""
    st = os.fstat(fd)
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    return (st.st_dev, st.st_ino, mode, pty_number(fd))


def fds_open_on(fd: int) -> set[int]:
    """Every fd of this process that refers to what `fd` refers to (`fd` included)."""
    want = _identity(fd)
    found = set()
    for name in os.listdir("/proc/self/fd"):
        other = int(name)
        try:
            if _identity(other) == want:
                found.add(other)
        except OSError:
            pass  # the listing's own fd, closed by now
    return found
