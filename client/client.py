"""`EscrowClient`: give PTY masters to escrowd, and take them back (DESIGN §8).

A blocking API with deadlines, for any app; an async app calls it from a thread. It never
imports an event loop.

The retrieve side follows DESIGN §4 step 8: the client acks only once it holds the fd and
has checked it is a terminal, never reads the fd before `done`, and if `done` never comes it
asks again on a fresh connection instead of guessing. No path loses a session, and no path
leaves two readers.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import autostart, breaker, errors, protocol
from .channel import Channel, Deadline
from .custody import Custody
from .fdpass import close_fds
from .liveness import process_alive
from .paths import resolve_socket_path

DEFAULT_TIMEOUT = 5.0
DEFAULT_RECLAIM_DEADLINE = 8.0
# How long reclaim_all retries custody_held before it believes another live instance holds
# the session (an old instance that is exiting lets go within this).
DEFAULT_CUSTODY_GRACE = 1.0
_RETRY_PAUSE = 0.05  # between tries at a holder that is restarting


@dataclass
class Retrieved:
    """A session taken back. The caller owns `fd` (close-on-exec) and should write `replay`
    to its screen before reading `fd`.

    `confirmed` is True when the holder answered `done`. False means the holder could not
    confirm it (it is gone, which took its copy with it, or it did not answer again): the
    fd is the caller's, and `EscrowClient.list()` tells what the holder thinks later.
    """

    fd: int
    session: protocol.SessionInfo
    replay: bytes
    dropped_bytes: int
    handoff_id: str
    confirmed: bool


@dataclass
class ReclaimReport:
    """What `reclaim_all` took back, what it could not, and who answered: an empty report
    from a holder that started with nothing (`adopted` 0) after restarts (`restarts`,
    `unclean_restarts` above 0) means the escrow was lost, not that there was none."""

    retrieved: dict[str, Retrieved] = field(default_factory=dict)
    failed: dict[str, errors.EscrowError] = field(default_factory=dict)
    holder_instance: str = ""
    adopted: int = 0
    restarts: int = 0
    unclean_restarts: int = 0


class EscrowClient:
    def __init__(
        self,
        owner: str,
        socket_path: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        autostart: bool = False,
        client_name: str = "",
        breaker_cooldown: float = breaker.DEFAULT_COOLDOWN,
        autostart_idle_exit: float = 600.0,
    ) -> None:
        if not _valid_name(owner):
            raise errors.EscrowConfigError(f"owner {owner!r} must match {protocol.NAME_PATTERN}")
        if timeout <= 0:
            raise errors.EscrowConfigError("timeout must be positive")
        self.owner = owner
        self.socket_path = resolve_socket_path(socket_path)
        self.timeout = timeout
        self.autostart = autostart
        self.autostart_idle_exit = autostart_idle_exit
        self.breaker_cooldown = breaker_cooldown
        self.client_name = client_name or f"python pid={os.getpid()}"

    # --- connections ----------------------------------------------------------------------

    def _connect(self, deadline: Deadline, use_breaker: bool = True) -> Channel:
        hello = protocol.Hello(
            version=protocol.VERSION, owner=self.owner, client=self.client_name,
            timeout=self.timeout,
        )
        try:
            return Channel(self.socket_path, hello, deadline, self.breaker_cooldown, use_breaker)
        except errors.HolderUnavailable:
            if not self.autostart:
                raise
        autostart.spawn_holder(self.socket_path, self.autostart_idle_exit)
        while True:  # wait, within the deadline, for whichever holder wins the lock
            try:
                return Channel(self.socket_path, hello, deadline, self.breaker_cooldown,
                               use_breaker)
            except errors.HolderUnavailable:
                if deadline.remaining() <= 0.02:
                    raise
                time.sleep(0.02)

    @contextmanager
    def _channel(
        self, deadline: Deadline | None = None, use_breaker: bool = True
    ) -> Iterator[Channel]:
        channel = self._connect(deadline or Deadline(self.timeout), use_breaker)
        try:
            yield channel
        finally:
            channel.close()

    def _check_invariant(
        self, welcome: protocol.Welcome, budget: float, what: str = "client timeout"
    ) -> None:
        """DESIGN §4 step 2: never start a retrieve we would give up on while the holder is
        still legitimately stopping the drain and sending."""
        holder_needs = welcome.drain_stop_budget + welcome.send_deadline
        if budget <= holder_needs:
            raise errors.EscrowConfigError(
                f"{what} {budget:.3g}s must exceed the holder's drain_stop_budget "
                f"({welcome.drain_stop_budget:.3g}s) + send_deadline "
                f"({welcome.send_deadline:.3g}s) = {holder_needs:.3g}s; raise the {what}"
            )

    # --- depositing -----------------------------------------------------------------------

    def custody(self) -> Custody:
        """A custody connection: sessions deposited through it stay `held` (the app is the
        reader) until it closes, by `close()`, the end of a `with` block, or the process
        dying. Then the holder starts draining them."""
        return Custody(self, self._connect(Deadline(self.timeout)))

    def hand_off(
        self,
        session_id: str,
        fd: int,
        child_pid: int | None = None,
        label: str = "",
        cols: int = 0,
        rows: int = 0,
        meta: dict[str, str] | None = None,
    ) -> None:
        """Deposit `fd` and end custody at once: when this returns, the holder has
        confirmed it is draining. `fd` stays open in the caller, which must not read it
        again and should close it. Raises if the holder did not confirm; then the caller
        still owns its terminal.

        A holder restarting under the call (an upgrade: `busy`, or a connection that
        dropped) is asked again within the timeout: a deposit the old holder had taken is
        resumed by the new one, never doubled."""
        deadline = Deadline(self.timeout)
        while True:
            try:
                with self.custody() as custody:
                    custody.deposit(session_id, fd, child_pid, label, cols, rows, meta)
                return
            except (errors.Busy, errors.HolderUnavailable) as exc:
                restarting = isinstance(exc, errors.Busy) or exc.dropped
                if not restarting or deadline.remaining() <= _RETRY_PAUSE:
                    raise
                time.sleep(_RETRY_PAUSE)

    # --- retrieving -----------------------------------------------------------------------

    def retrieve(self, session_id: str) -> Retrieved:
        """Take one session back. Raises CustodyHeld (no retry) if its app still holds it,
        SessionUnknown, HandedOff, Released or Expired as the holder answers."""
        deadline = Deadline(self.timeout)
        channel = self._connect(deadline)
        try:
            return self._retrieve_on(channel, session_id, deadline)
        finally:
            channel.close()

    def _retrieve_on(self, channel: Channel, sid: str, deadline: Deadline) -> Retrieved:
        self._check_invariant(channel.welcome, self.timeout)
        w = channel.welcome
        if deadline.remaining() <= w.drain_stop_budget + w.send_deadline:
            raise errors.HolderUnresponsive(
                f"not enough time left to retrieve {sid} (the holder may need "
                f"{w.drain_stop_budget + w.send_deadline:.3g}s)", sid,
            )
        reply, fds = channel.call(protocol.Retrieve(id=sid), deadline)
        if not isinstance(reply, protocol.Handoff):
            close_fds(fds)
            raise errors.ProtocolViolation(f"expected handoff, got {type(reply).__name__}")
        fd = fds[0]
        if not os.isatty(fd):
            # Do not ack: the holder keeps its copy and drains again when we hang up.
            os.close(fd)
            channel.close()
            raise errors.ProtocolViolation(f"the holder handed off {sid} as a non-terminal")
        result = Retrieved(fd, reply.session, reply.replay, reply.dropped_bytes,
                           reply.handoff_id, confirmed=False)
        ack_sent = False
        try:
            channel.send(protocol.Ack(id=sid, handoff_id=reply.handoff_id), deadline)
            ack_sent = True
            done, _ = channel.receive(deadline)
        except errors.AckLate:
            os.close(fd)  # the holder is draining it again: we must not become a second reader
            raise
        except (errors.HolderUnresponsive, errors.HolderUnavailable, errors.ProtocolViolation):
            channel.close()
            return self._resolve(result)
        except errors.EscrowError:
            os.close(fd)  # the holder refused our ack: it kept the session
            raise
        except BaseException as exc:
            if not ack_sent:
                os.close(fd)  # no ack left us: the holder drains it again when we hang up
                raise
            # Interrupted (Ctrl-C, SystemExit) after the ack: the holder may well have
            # handed it off, so closing our copy could hang up the terminal for good.
            # Keep it open and give it to whoever catches this.
            exc.retrieved = result  # type: ignore[attr-defined]
            raise
        if not isinstance(done, protocol.Done):
            channel.close()
            return self._resolve(result)
        result.confirmed = True
        return result

    def _resolve(self, result: Retrieved) -> Retrieved:
        """`done` never came: ask on a fresh connection who owns the fd (DESIGN §4 step 8).
        We still hold our copy, unread."""
        sid = result.session.id
        deadline = Deadline(self.timeout)
        while True:
            try:
                # Past the breaker: the timeout that brought us here has just opened it,
                # and this question must really be asked.
                with self._channel(deadline, use_breaker=False) as channel:
                    reply, _ = channel.call(protocol.List(), deadline)
            except errors.HolderUnavailable:
                return result  # the holder is gone and took its copy with it: ours
            except errors.EscrowError:
                return result  # cannot tell; the holder has our ack queued, if anything
            if not isinstance(reply, protocol.Sessions):
                return result
            info = next((s for s in reply.sessions if s.id == sid), None)
            state = info.state if info is not None else "unknown"
            if state == "handed_off" and info is not None:
                if info.handoff_id == result.handoff_id:
                    result.confirmed = True
                    return result
                os.close(result.fd)  # somebody else's handoff, not ours
                raise errors.HandedOff(f"session {sid} was handed off to another client", sid)
            if state == "handing_off" and info is not None and info.handoff_id not in (
                None, result.handoff_id
            ):
                os.close(result.fd)  # another client's handoff: ours was put back first
                raise errors.Busy(f"session {sid} is being handed off to another client", sid)
            if state == "handing_off":
                # Ours. A holder that restarted (and adopted it) completes it on an ack sent
                # here; one still acting on our hang-up answers `busy`, and we ask again.
                if self._ack_again(result, deadline):
                    return result
                if deadline.remaining() > 0.02:
                    time.sleep(0.02)
                    continue
                return result  # our ack is queued there, if anything: keep the fd
            if state in ("draining", "exited", "held") and info is not None and (
                info.deposited_at != result.session.deposited_at
            ):
                return result  # a new deposit reused the id: ours was handed off, keep it
            if state in ("draining", "exited", "held"):
                os.close(result.fd)  # the holder kept it and drains it: we must not read too
                raise errors.HolderUnresponsive(
                    f"handoff of {sid} was not confirmed; the session is still escrowed "
                    f"({state}): retrieve it again", sid,
                )
            # released, expired or unknown: the holder has no copy left; ours is the only one.
            return result

    def _ack_again(self, result: Retrieved, deadline: Deadline) -> bool:
        """Ack `result` on a fresh connection: True once the holder answered `done`.
        `ack_late` means the holder kept the session: our copy is closed and that raised.
        Anything else (`busy`: the first connection's handoff is still being wound up;
        no answer) is False, and the caller asks again."""
        sid = result.session.id
        try:
            with self._channel(deadline, use_breaker=False) as channel:
                reply, _ = channel.call(protocol.Ack(id=sid, handoff_id=result.handoff_id),
                                        deadline)
        except errors.AckLate:
            os.close(result.fd)  # the holder is draining it again: we must not read too
            raise
        except errors.EscrowError:
            return False
        if isinstance(reply, protocol.Done):
            result.confirmed = True
            return True
        return False

    def reclaim_all(
        self, deadline: float = DEFAULT_RECLAIM_DEADLINE, grace: float = DEFAULT_CUSTODY_GRACE
    ) -> ReclaimReport:
        """Retrieve every session of this owner under one shared deadline.

        `custody_held` is retried for `grace` seconds (the old instance may still be
        exiting); after that, a session whose custodian process is alive (or cannot be
        told dead) is reported as `CustodyHeld` at once: another live instance holds it.
        One whose custodian is positively dead is retried to the deadline (the holder is
        about to see the hang-up). No retrieve starts with less than the holder's
        drain-stop budget plus send deadline left, and a `deadline` too short for even one
        is an `EscrowConfigError` before any retrieve is sent. Sessions not retrieved stay
        escrowed and are in `failed`, each with the last real answer it got.
        If the holder cannot even list the sessions (nothing listening, or no answer), that
        error is raised: there is nothing to name in `failed`.
        """
        until = Deadline(deadline)
        report = ReclaimReport()
        channel: Channel | None = None
        try:
            call = Deadline(min(self.timeout, until.remaining()))
            channel = self._connect(call)
            w = channel.welcome
            self._check_invariant(w, self.timeout)
            self._check_invariant(w, deadline, "reclaim deadline")
            status, _ = channel.call(protocol.Status(), call)
            if isinstance(status, protocol.HolderStatus):
                report.holder_instance, report.adopted = status.instance, status.adopted
                report.restarts = status.restarts
                report.unclean_restarts = status.unclean_restarts
            reply, _ = channel.call(protocol.List(), call)
            assert isinstance(reply, protocol.Sessions)
            live = {s.id: s for s in reply.sessions if s.state in protocol.LIVE_STATES}
            if live:
                self._check_invariant(w, until.remaining(), "reclaim deadline left")
            pending = list(live)
            grace_ends = Deadline(grace)
            pause = 0.02
            while pending:
                retry: list[str] = []
                for sid in pending:
                    if until.remaining() <= w.drain_stop_budget + w.send_deadline:
                        # Out of time: keep the last real answer (custody_held, busy) if
                        # the session had one.
                        report.failed.setdefault(sid, errors.HolderUnresponsive(
                            f"not enough of the reclaim deadline left to retrieve {sid}", sid))
                        continue
                    call = Deadline(min(self.timeout, until.remaining()))
                    try:
                        if channel.sock.fileno() < 0:
                            channel = self._connect(call)
                        report.retrieved[sid] = self._retrieve_on(channel, sid, call)
                    except errors.CustodyHeld as exc:
                        report.failed[sid] = exc
                        if grace_ends.remaining() > 0 or _custodian_dead(live[sid]):
                            retry.append(sid)
                    except errors.Busy as exc:
                        retry.append(sid)  # another client's handoff may yet be put back
                        report.failed[sid] = exc
                    except errors.EscrowError as exc:
                        report.failed[sid] = exc
                        if isinstance(exc, errors.HolderUnresponsive | errors.HolderUnavailable):
                            channel.close()
                    else:
                        report.failed.pop(sid, None)
                pending = retry
                if pending:
                    time.sleep(min(pause, max(0.0, until.remaining())))
                    pause = min(pause * 2, 0.25)
        except BaseException as exc:
            # Whatever stops us, the fds already retrieved are the caller's: hand them over.
            exc.reclaim_report = report  # type: ignore[attr-defined]
            raise
        finally:
            if channel is not None:
                channel.close()
        return report

    # --- asking -----------------------------------------------------------------------------

    def list(self, all_owners: bool = False) -> list[protocol.SessionInfo]:
        with self._channel() as channel:
            reply, _ = channel.call(protocol.List(all_owners=all_owners), Deadline(self.timeout))
        assert isinstance(reply, protocol.Sessions)
        return reply.sessions

    def status(self) -> protocol.HolderStatus:
        with self._channel() as channel:
            reply, _ = channel.call(protocol.Status(), Deadline(self.timeout))
        assert isinstance(reply, protocol.HolderStatus)
        return reply

    def welcome(self) -> protocol.Welcome:
        """The holder's handshake answer: its version, budgets and limits."""
        with self._channel() as channel:
            return channel.welcome

    def release(self, session_id: str) -> None:
        """Tell the holder to drop its copy of a session (the user closed it)."""
        with self._channel() as channel:
            channel.call(protocol.Release(id=session_id), Deadline(self.timeout))


def _custodian_dead(info: protocol.SessionInfo) -> bool:
    """Positive proof only: the custodian's pid is gone, or a zombie."""
    return process_alive(info.custodian_pid, None) is False


def _valid_name(name: str) -> bool:
    return re.fullmatch(protocol.NAME_CHARS, name) is not None
