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
from .repaint import repaint

DEFAULT_TIMEOUT = 5.0
DEFAULT_RECLAIM_DEADLINE = 8.0
# How long reclaim_all retries custody_held before it believes another live instance holds
# the session (an old instance that is exiting lets go within this).
DEFAULT_CUSTODY_GRACE = 1.0
_RETRY_PAUSE = 0.05  # between tries at a holder that is restarting


@dataclass
class Retrieved:
    """A session taken back. The caller owns `fd` (close-on-exec). To restore the screen:
    reset the emulator, write `replay` to it, then `repaint()`, then read `fd`.

    `confirmed` is True when the holder answered `done`. False means the holder could not
    confirm it (it is gone, which took its copy with it, or it did not answer again): the
    fd is the caller's, and `EscrowClient.list()` tells what the holder thinks later.
    `dropped_bytes` were lost to a full ring before `replay`; `replay_trimmed` more were
    cut so that it starts on a clean boundary (DESIGN §12); `replay_journaled` of its
    bytes were recorded by the app before (a journal), the rest drained by the holder.
    """

    fd: int
    session: protocol.SessionInfo
    replay: bytes
    dropped_bytes: int
    handoff_id: str
    confirmed: bool
    replay_trimmed: int = 0
    replay_journaled: int = 0
    # A retrieve into custody with a journal: where the app goes on recording (the
    # custody takes these over).
    journal: protocol.Journal | None = None
    journal_fd: int | None = None
    # A retrieve into custody that ended with the holder holding no copy (it restarted
    # meanwhile): the custody deposits it again.
    deposit_again: bool = field(default=False, repr=False)

    def repaint(self) -> None:
        """Make the program on the terminal redraw its screen (see `escrow_client.repaint`)."""
        repaint(self.fd)

    def close(self) -> None:
        """Close what was received: the master and any state file (an abandoned result)."""
        for fd in (self.fd, self.journal_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.journal_fd = -1, None


@dataclass
class ReclaimReport:
    """What `reclaim_all` took back, what it could not, and who answered: an empty report
    from a holder that started with nothing (`adopted` 0) after restarts (`restarts`,
    `unclean_restarts` above 0, or None: unknown) means the escrow was lost, not that there
    was none."""

    retrieved: dict[str, Retrieved] = field(default_factory=dict)
    failed: dict[str, errors.EscrowError] = field(default_factory=dict)
    holder_instance: str = ""
    adopted: int = 0
    restarts: int | None = 0  # None: unknown (the holder lost its count)
    unclean_restarts: int | None = 0


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
        got, failed = self._retrieve_many_on(channel, [sid], deadline)
        if sid in failed:
            raise failed[sid]
        return got[sid]

    def _retrieve_many_on(
        self, channel: Channel, ids: list[str], deadline: Deadline, keep: bool = False,
        journal: bool = False,
    ) -> tuple[dict[str, Retrieved], dict[str, errors.EscrowError]]:
        """Retrieve `ids` over `channel` in one request (DESIGN §4, §12): every handoff
        comes first, then every ack goes out, then every `done` comes back. Returns what
        was taken back and, per id, what was not. With `keep` the sessions stay escrowed,
        held by `channel` (a custody connection).

        A `done` that does not come is resolved on a fresh connection (`_resolve`); with
        `keep`, a session is ours only if the holder has it held for this process (a
        custody that reconnects resumes it), else our copy is closed and it stays escrowed.
        Raises (after closing every fd it received) only for what spoils the whole call."""
        self._check_invariant(channel.welcome, self.timeout)
        w = channel.welcome
        if deadline.remaining() <= w.drain_stop_budget + w.send_deadline:
            raise errors.HolderUnresponsive(
                f"not enough time left to retrieve {', '.join(ids[:3])} (the holder may need "
                f"{w.drain_stop_budget + w.send_deadline:.3g}s)", ids[0],
            )
        wanted = set(ids)
        request: protocol.Message = (
            protocol.Retrieve(id=ids[0], keep=keep, journal=journal) if len(ids) == 1
            else protocol.RetrieveMany(ids=ids, keep=keep, journal=journal))
        got: dict[str, Retrieved] = {}
        failed: dict[str, errors.EscrowError] = {}
        acked: list[Retrieved] = []
        try:
            channel.send(request, deadline)
            while len(got) + len(failed) < len(wanted):
                try:
                    reply, fds = channel.receive(deadline)
                except errors.EscrowError as exc:
                    sid = exc.session_id
                    if sid not in wanted or sid in got or sid in failed:
                        raise
                    failed[sid] = exc  # refused: it stays escrowed
                    continue
                if not isinstance(reply, protocol.Handoff):
                    close_fds(fds)
                    raise errors.ProtocolViolation(
                        f"expected handoff, got {type(reply).__name__}")
                sid = reply.session.id
                if sid not in wanted or sid in got or sid in failed or not os.isatty(fds[0]):
                    # Do not ack: the holder keeps its copies and drains them again when we
                    # hang up.
                    close_fds(fds)
                    if not keep:  # (a custody's connection ends custody when it closes)
                        channel.close()
                    raise errors.ProtocolViolation(
                        f"the holder handed off {sid} unasked, twice, or as a non-terminal")
                got[sid] = Retrieved(
                    fds[0], reply.session, reply.replay, reply.dropped_bytes, reply.handoff_id,
                    confirmed=False, replay_trimmed=reply.replay_trimmed,
                    replay_journaled=reply.replay_journaled, journal=reply.journal,
                    journal_fd=fds[1] if len(fds) > 1 else None)
            # One ack for all (the holder's answers never pile up unread meanwhile).
            if len(got) == 1:
                (result,) = got.values()
                ack: protocol.Message = protocol.Ack(
                    id=result.session.id, handoff_id=result.handoff_id, keep=keep)
            elif got:
                ack = protocol.AckMany(acks={sid: r.handoff_id for sid, r in got.items()},
                                       keep=keep)
            if got:
                acked.extend(got.values())
                channel.send(ack, deadline)
                self._receive_done(channel, set(got), got, failed, deadline)
        except (errors.HolderUnresponsive, errors.HolderUnavailable,
                errors.ProtocolViolation) as exc:
            if not keep:
                channel.close()
            for result in list(got.values()):
                if result.confirmed:
                    continue
                if result not in acked:
                    got.pop(result.session.id).close()  # never acked: still the holder's
                    failed[result.session.id] = exc
                    continue
                try:
                    got[result.session.id] = (self._resolve_kept(result) if keep
                                              else self._resolve(result))
                except errors.EscrowError as unresolved:
                    got.pop(result.session.id)
                    failed[result.session.id] = unresolved
            for sid in wanted - set(got) - set(failed):
                failed[sid] = exc
        except BaseException as exc:
            for result in list(got.values()):
                if result not in acked:
                    got.pop(result.session.id).close()  # no ack left us: the holder's
            if not acked:
                raise
            # Interrupted (Ctrl-C, SystemExit) after acks: the holder may well have handed
            # them off, so closing our copies could hang the terminals up for good. Keep
            # them open and give them to whoever catches this.
            exc.retrieved = next(iter(got.values()), None)  # type: ignore[attr-defined]
            exc.retrieved_all = got  # type: ignore[attr-defined]
            raise
        return got, failed

    def _receive_done(self, channel: Channel, waiting: set[str], got: dict[str, Retrieved],
                      failed: dict[str, errors.EscrowError], deadline: Deadline) -> None:
        """Read the answer to the ack of `waiting`: `done` (or `done_many`) confirms them;
        a refusal (`ack_late`, `bad_request`) means the holder kept them and drains them
        again, so our copies are closed: we must not become a second reader."""
        try:
            done, _ = channel.receive(deadline)
        except (errors.HolderUnresponsive, errors.HolderUnavailable,
                errors.ProtocolViolation):
            raise
        except errors.EscrowError as exc:
            for sid in waiting:
                got.pop(sid).close()
                failed[sid] = exc
            return
        ids = ([done.id] if isinstance(done, protocol.Done)
               else done.ids if isinstance(done, protocol.DoneMany) else [])
        if set(ids) != waiting:
            raise errors.ProtocolViolation(f"expected done, got {done!r:.80}")
        for sid in ids:
            got[sid].confirmed = True

    def _resolve_kept(self, result: Retrieved) -> Retrieved:
        """`done` never came for a retrieve into custody. Ask the holder (again and again,
        within the timeout) who has the session:
        - held for this process: ours (a custody that reconnects resumes it);
        - our handoff, still under way: acked again on a fresh connection (a holder that
          restarted completes it; the session is then ours alone, and the custody deposits
          it again, with a journal of its own if one was asked);
        - unknown to it, released or expired: the holder has no copy; ours is the only
          one, kept (the custody deposits it again);
        - anything else (draining again, another's): our copy is closed.
        If it cannot be asked at all, our copy is closed: the session may be draining."""
        sid = result.session.id
        deadline = Deadline(self.timeout)
        asked, info = False, None
        while True:
            try:
                with self._channel(deadline, use_breaker=False) as channel:
                    reply, _ = channel.call(protocol.List(), deadline)
                assert isinstance(reply, protocol.Sessions)
                asked = True
                info = next((s for s in reply.sessions if s.id == sid), None)
            except errors.EscrowError:
                asked, info = False, None
            ours_under_way = (info is not None and info.state == "handing_off"
                              and info.handoff_id == result.handoff_id)
            if (asked and not ours_under_way) or deadline.remaining() < 0.05:
                break
            if ours_under_way and self._ack_again(result, deadline):
                return self._alone(result)
            time.sleep(0.05)
        if asked and (info is None or info.state in ("released", "expired")):
            return self._alone(result)
        if info is not None and info.state == "held" and info.custodian_pid == os.getpid():
            result.confirmed = True
            return result
        result.close()
        raise errors.HolderUnresponsive(
            f"retrieving {sid} into custody was not confirmed; it is still escrowed "
            f"({info.state if info else 'state unknown'}): retrieve it again", sid)

    @staticmethod
    def _alone(result: Retrieved) -> Retrieved:
        """The holder has no copy left: the session is ours alone, out of escrow (and of
        any journal the handoff offered)."""
        if result.journal_fd is not None:
            os.close(result.journal_fd)
        result.journal, result.journal_fd = None, None
        result.confirmed = result.deposit_again = True
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
                result.close()  # somebody else's handoff, not ours
                raise errors.HandedOff(f"session {sid} was handed off to another client", sid)
            if state == "handing_off" and info is not None and info.handoff_id not in (
                None, result.handoff_id
            ):
                result.close()  # another client's handoff: ours was put back first
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
                result.close()  # the holder kept it and drains it: we must not read too
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
            result.close()  # the holder is draining it again: we must not read too
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
        """Retrieve every session of this owner under one shared deadline, over one
        connection (`retrieve_many`). The sessions are the caller's, no longer escrowed:
        `Custody.reclaim_all` takes them back into custody instead, which an app that
        wants to survive its next crash too should use.

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
        channel = self._connect(Deadline(min(self.timeout, until.remaining())))
        try:
            return self._reclaim(channel, until, deadline, grace)
        finally:
            channel.close()

    def _reclaim(
        self, channel: Channel, until: Deadline, deadline: float, grace: float,
        keep: bool = False, journal: bool = False,
    ) -> ReclaimReport:
        """`reclaim_all` on `channel` (a custody's, with `keep`). Without `keep`, a
        connection that failed is replaced for the next round; with it, it is not (custody
        is the caller's to take back), and what is left fails."""
        report = ReclaimReport()
        try:
            call = Deadline(min(self.timeout, until.remaining()))
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
                if until.remaining() <= w.drain_stop_budget + w.send_deadline:
                    for sid in pending:
                        # Out of time: keep the last real answer (custody_held, busy) if
                        # the session had one.
                        report.failed.setdefault(sid, errors.HolderUnresponsive(
                            f"not enough of the reclaim deadline left to retrieve {sid}", sid))
                    break
                call = Deadline(min(self.timeout, until.remaining()))
                try:
                    if channel.sock.fileno() < 0:
                        if keep:
                            raise errors.HolderUnavailable(
                                "the custody connection closed during the reclaim")
                        channel = self._connect(call)
                    got, failed = {}, {}
                    # One request for them all, where the holder has retrieve_many.
                    size = (protocol.MAX_BATCH if "retrieve_many" in w.features else 1)
                    for start in range(0, len(pending), size):
                        batch = pending[start : start + size]
                        more, less = self._retrieve_many_on(channel, batch, call, keep, journal)
                        got.update(more)
                        failed.update(less)
                except errors.EscrowError as exc:
                    got, failed = {}, dict.fromkeys(pending, exc)
                    if not keep and isinstance(
                        exc, errors.HolderUnresponsive | errors.HolderUnavailable
                    ):
                        channel.close()
                except BaseException as exc:
                    report.retrieved.update(getattr(exc, "retrieved_all", {}))
                    raise
                report.retrieved.update(got)
                retry: list[str] = []
                for sid in pending:
                    why = failed.get(sid)
                    if why is None:
                        report.failed.pop(sid, None)
                        continue
                    report.failed[sid] = why
                    if isinstance(why, errors.CustodyHeld):
                        if grace_ends.remaining() > 0 or _custodian_dead(live[sid]):
                            retry.append(sid)
                    elif isinstance(why, errors.Busy):
                        retry.append(sid)  # another client's handoff may yet be put back
                pending = retry
                if pending:
                    time.sleep(min(pause, max(0.0, until.remaining())))
                    pause = min(pause * 2, 0.25)
        except BaseException as exc:
            # Whatever stops us, the fds already retrieved are the caller's: hand them over.
            exc.reclaim_report = report  # type: ignore[attr-defined]
            raise
        finally:
            if not keep:
                channel.close()  # (a replacement made here; the first is the caller's too)
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
