"""One blocking connection to the holder: connect, hello/welcome, framed calls.

Before a single byte is sent, the socket's directory and the listener's uid are checked
(`trust`): a holder of another user is `Forbidden`, never a peer.

Everything a call can fail with is mapped to the client's exceptions here, once:
nothing listening is `HolderUnavailable`; a deadline that passes is `HolderUnresponsive`;
an `error` answer is the exception for its code (also when a send failed because the
holder answered and closed); anything that is not the protocol is `ProtocolViolation`.

`connect` is the one way in, for every part of the client: with autostart, a holder is
started when none listens, and whichever holder wins the socket's lock is waited for
within the deadline.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from typing import Protocol, TypeVar

from . import breaker, errors, paths, protocol, trust
from .fdpass import FrameReader, close_fds, recv_frame, send_frame
from .platform import harden_socket
from .waiting import waiting

# A response may carry a whole replay ring; requests stay under the holder's 1 MiB.
MAX_RESPONSE_BYTES = 256 << 20
# How long a failed send waits for an answer the holder sent before it closed (it is
# already in our receive queue when the send fails, so this is only a bound).
_ANSWER_WAIT = 0.1

_R = TypeVar("_R", bound=protocol.Message)


class Deadline:
    """A point in time that several calls share."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.at - time.monotonic()


class Channel:
    """A connected, greeted socket. Resource handling: owns its socket (close-on-exec, as
    every Python socket is) and closes it in `close()`; fds received belong to the caller."""

    def __init__(
        self,
        socket_path: str,
        hello: protocol.Hello,
        deadline: Deadline,
        breaker_cooldown: float = breaker.DEFAULT_COOLDOWN,
        use_breaker: bool = True,
    ) -> None:
        self.socket_path = socket_path
        self.breaker_cooldown = breaker_cooldown
        self._request_limit: int | None = None  # known once the holder's welcome is in
        self.keep_open = False  # a timeout leaves it open, to be put back in step
        self._out_of_step = False
        left = breaker.open_for(socket_path) if use_breaker else None
        if left is not None:
            raise errors.HolderUnresponsive(
                f"the holder on {socket_path} timed out recently; failing fast for another "
                f"{left:.0f}s (circuit breaker)"
            )
        if deadline.remaining() <= 0:
            # Nothing was asked of the holder, so nothing timed out: the breaker stays shut.
            raise errors.HolderUnresponsive(f"no time left to call the holder on {socket_path}")
        try:
            paths.check_socket_path(socket_path)
        except paths.PathError as exc:
            raise errors.EscrowConfigError(str(exc)) from None
        # Trust before any byte (docs/design.md §8): the directory now, the listener's uid below.
        trust.check_socket_dir(socket_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._reader = FrameReader(self.sock, MAX_RESPONSE_BYTES)
        self.peer_pid: int | None = None  # the listener's, once connected
        try:
            harden_socket(self.sock)
            self._arm(deadline)
            with waiting(socket_path, lambda: self.peer_pid, deadline.remaining()):
                try:
                    self.sock.connect(socket_path)
                except TimeoutError:
                    raise self._timed_out("did not accept the connection") from None
                except OSError as exc:
                    raise trust.connect_error(exc, socket_path) from None
                self.peer_pid = trust.check_peer(self.sock, socket_path)
                reply, _ = self.call(hello, deadline)
            if not isinstance(reply, protocol.Welcome):
                raise errors.ProtocolViolation(f"expected welcome, got {type(reply).__name__}")
            self.welcome = reply
            self._request_limit = reply.limits.get("max_request_bytes")
        except BaseException:
            self.close()
            raise

    def _arm(self, deadline: Deadline) -> None:
        if self.sock.fileno() < 0:
            raise errors.HolderUnresponsive(
                f"the connection to {self.socket_path} was closed after a timeout")
        left = deadline.remaining()
        if left <= 0:
            raise self._timed_out("did not finish")
        self.sock.settimeout(left)

    def _timed_out(self, what: str) -> errors.HolderUnresponsive:
        """A deadline passed: the only thing that opens the circuit breaker. The stream is
        out of step now (a late answer would be taken for the next one's): closed, or, on
        a connection that must stay open (`keep_open`: custody ends when it closes), put
        back in step before its next call (`_resync`)."""
        breaker.trip(self.socket_path, self.breaker_cooldown)
        if self.keep_open:
            self._out_of_step = True
        else:
            self.close()
        return errors.HolderUnresponsive(
            f"the holder on {self.socket_path} {what} in time (stopped or stuck? "
            f"`escrowctl --socket {self.socket_path} status` names it)", timed_out=True
        )

    def _resync(self, deadline: Deadline) -> None:
        """Ask `status`, and skip every late answer until it comes: then the next answer
        is the next call's."""
        self.send(protocol.Status(), deadline)
        while True:
            try:
                reply, fds = self.receive(deadline)
            except (errors.HolderUnavailable, errors.HolderUnresponsive,
                    errors.ProtocolViolation):
                raise
            except errors.EscrowError:
                continue  # a late refusal of the call that timed out
            close_fds(fds)
            if isinstance(reply, protocol.HolderStatus):
                self._out_of_step = False
                return

    def send(self, message: protocol.Message, deadline: Deadline, fd: int | None = None) -> None:
        frame = protocol.encode(message)
        limit = self._request_limit
        if limit is not None and len(frame) - protocol.HEADER.size > limit:
            # The holder would end the connection, and with it any custody it carries.
            raise errors.BadRequest(
                f"{type(message).__name__} of {len(frame)} bytes is over the holder's "
                f"request limit of {limit} bytes; nothing was sent"
            )
        self._arm(deadline)
        try:
            send_frame(self.sock, frame, fd)
        except TimeoutError:
            raise self._timed_out("did not take a request") from None
        except OSError as exc:
            answer = None
            if exc.errno in (errno.EPIPE, errno.ECONNRESET):
                answer = self._answer_waiting(deadline, getattr(message, "id", None))
            raise answer or self._gone(exc) from None

    def receive(self, deadline: Deadline) -> tuple[protocol.Response, list[int]]:
        """The next message, with the fds it carried. An `error` answer is raised."""
        self._arm(deadline)
        try:
            body, fds = self._reader.read(deadline.at)
        except TimeoutError:
            raise self._timed_out("did not answer") from None
        except EOFError:
            raise errors.HolderUnavailable(
                f"the holder on {self.socket_path} closed the connection", dropped=True
            ) from None
        except protocol.ProtocolError as exc:
            raise errors.ProtocolViolation(f"bad frame from the holder: {exc}") from None
        except OSError as exc:
            raise self._gone(exc) from None
        try:
            message = protocol.decode_response(body)
            protocol.check_fds(message, len(fds))
        except protocol.ProtocolError as exc:
            close_fds(fds)
            raise errors.ProtocolViolation(f"bad message from the holder: {exc}") from None
        if isinstance(message, protocol.Error):
            raise errors.from_code(message.code, message.message, message.id)
        return message, fds

    def call(
        self, message: protocol.Message, deadline: Deadline, fd: int | None = None
    ) -> tuple[protocol.Response, list[int]]:
        with waiting(self.socket_path, lambda: self.peer_pid, deadline.remaining()):
            if self._out_of_step:
                self._resync(deadline)
            try:
                self.send(message, deadline, fd)
            except errors.EscrowError as exc:
                exc.request_sent = False  # not all of it left: the holder cannot act on it
                raise
            return self.receive(deadline)

    def call_for(
        self, message: protocol.Message, expected: type[_R], deadline: Deadline,
        fd: int | None = None,
    ) -> tuple[_R, list[int]]:
        """`call`, and the answer must be an `expected`: anything else is not the answer
        to this request, and the connection is `out_of_step`."""
        reply, fds = self.call(message, deadline, fd)
        if not isinstance(reply, expected):
            close_fds(fds)
            self.out_of_step()
            raise errors.ProtocolViolation(
                f"expected {expected.__name__} to {type(message).__name__}, got "
                f"{type(reply).__name__}")
        return reply, fds

    def out_of_step(self) -> None:
        """An answer that cannot be this request's (of the wrong type, or one too many):
        what the holder made of our requests is not known, and no later answer can be
        believed. Unlike after a timeout, no `_resync` can put that right. Shut down: the
        holder puts back whatever waited on us, and a custody's watcher sees the hang-up
        and takes custody back on a new connection, as when the holder goes away (it
        closes a `keep_open` connection itself); any other connection is closed."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed, or never connected: nothing more can be read either way
        if not self.keep_open:
            self.close()

    def finish(self, deadline: Deadline) -> None:
        """Close our side and wait (within `deadline`) for the holder to close its side:
        by then it has acted on our going away (custody ended, drains started)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(max(deadline.remaining(), 0.001))
            while self.sock.recv(4096):
                pass
        except OSError:
            pass  # the holder acts on our hang-up anyway; waiting was a courtesy
        finally:
            self.close()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _answer_waiting(self, deadline: Deadline, sid: str | None) -> errors.EscrowError | None:
        """A send failed because the holder closed: it may have answered first
        (`forbidden`, `limit`). That answer, not "broken pipe", is the truth, if it is
        about this request (no id, or the id of `sid`); else None."""
        try:
            self.sock.settimeout(max(0.001, min(_ANSWER_WAIT, deadline.remaining())))
            body, fds = recv_frame(self.sock, MAX_RESPONSE_BYTES)
        except (OSError, EOFError, protocol.ProtocolError):
            return None
        close_fds(fds)
        try:
            message = protocol.decode_response(body)
        except protocol.ProtocolError:
            return None
        if isinstance(message, protocol.Error) and message.id in (None, sid):
            return errors.from_code(message.code, message.message, message.id)
        return None

    def _gone(self, exc: OSError) -> errors.EscrowError:
        if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
            return errors.HolderUnavailable(
                f"the holder on {self.socket_path} closed the connection "
                f"({os.strerror(exc.errno)})", dropped=True)
        return errors.HolderUnavailable(f"talking to the holder on {self.socket_path}: {exc}",
                                        dropped=True)


class Connect(Protocol):
    """Opens a fresh connection for a part of the client (`EscrowClient._connect`): the
    caller owns the channel (`with connect(deadline) as channel:` closes it)."""

    def __call__(self, deadline: Deadline, use_breaker: bool = True) -> Channel: ...


def connect(
    socket_path: str,
    hello: protocol.Hello,
    deadline: Deadline,
    breaker_cooldown: float = breaker.DEFAULT_COOLDOWN,
    use_breaker: bool = True,
    autostart_idle_exit: float | None = None,
) -> Channel:
    """A greeted connection to the holder on `socket_path`. With `autostart_idle_exit`
    (autostart), a holder that is not there is started, to exit after that many idle
    seconds, and waited for."""
    try:
        return Channel(socket_path, hello, deadline, breaker_cooldown, use_breaker)
    except errors.HolderUnavailable:
        if autostart_idle_exit is None:
            raise
    from . import autostart  # only when none answers: it needs subprocess

    autostart.spawn_holder(socket_path, autostart_idle_exit)
    while True:  # wait, within the deadline, for whichever holder wins the lock
        try:
            return Channel(socket_path, hello, deadline, breaker_cooldown, use_breaker)
        except errors.HolderUnavailable:
            if deadline.remaining() <= 0.02:
                raise
            time.sleep(0.02)
