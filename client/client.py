"""`EscrowClient`: give PTY masters to escrowd, and take them back (docs/design.md §8).

A blocking API with deadlines, for any app; an async app calls it from a thread. It never
imports an event loop.

An `EscrowClient` holds what every call needs (the owner, the socket, the timeout, whether
to start a holder) and says what each call means; the work is in a module per concern:
`channel` connects and greets the holder, `custody` keeps deposited sessions escrowed for as
long as the app runs, `retrieve` (with `resolve`, for a `done` that never came) takes
sessions back, and `reclaim` takes back all of an owner's at launch.
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Any

from . import breaker, errors, protocol
from .channel import Channel, Deadline, connect
from .deadlines import DEFAULT_CUSTODY_GRACE, DEFAULT_RECLAIM_DEADLINE, DEFAULT_TIMEOUT
from .paths import resolve_socket_path

# What a call needs beyond the connection is imported by that call: `escrowctl list` and
# `status` make an `EscrowClient`, and must not pay for custody, retrieve and reclaim.
if TYPE_CHECKING:
    from .custody import Custody
    from .reclaim import ReclaimReport
    from .retrieved import Retrieved

__all__ = [
    "DEFAULT_CUSTODY_GRACE",
    "DEFAULT_RECLAIM_DEADLINE",
    "DEFAULT_TIMEOUT",
    "EscrowClient",
    "ReclaimReport",
    "Retrieved",
]

_RETRY_PAUSE = 0.05  # between tries at a holder that is restarting
_ELSEWHERE = {"ReclaimReport": "reclaim", "Retrieved": "retrieved"}


def __getattr__(name: str) -> Any:
    """`ReclaimReport` and `Retrieved`, which this module has always exported, from their
    own modules when asked for."""
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(f".{_ELSEWHERE[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class EscrowClient:
    """The blocking client of one owner's sessions. Each call opens a connection of its
    own within `timeout` and closes it before it returns; only `custody()` hands one
    over, open for as long as the custody lasts."""

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
        return connect(self.socket_path, hello, deadline, self.breaker_cooldown, use_breaker,
                       self.autostart_idle_exit if self.autostart else None)

    # --- depositing -----------------------------------------------------------------------

    def custody(self) -> Custody:
        """A custody connection: sessions deposited through it stay `held` (the app is the
        reader) until it closes, by `close()`, the end of a `with` block, or the process
        dying. Then the holder starts draining them."""
        from .custody import Custody

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
        resumed by the new one, never doubled. A deposit that got no answer
        (DepositIndeterminate) is settled by the custody as it ends: deposited again (or
        resumed) on the next holder, and that custody ended, confirmed."""
        deadline = Deadline(self.timeout)
        while True:
            try:
                with self.custody() as custody:
                    try:
                        custody.deposit(session_id, fd, child_pid, label, cols, rows, meta)
                    except errors.DepositIndeterminate:
                        pass  # custody keeps its copy; its close() settles and ends it
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
            got, failed = self._retrieve_many_on(channel, [session_id], deadline)
        finally:
            channel.close()
        if session_id in failed:
            raise failed[session_id]
        return got[session_id]

    def _retrieve_many_on(
        self, channel: Channel, ids: list[str], deadline: Deadline, keep: bool = False,
        journal: bool = False, replay_file: bool = False,
    ) -> tuple[dict[str, Retrieved], dict[str, errors.EscrowError]]:
        """`retrieve.retrieve_many_on`, with this client's timeout and connections."""
        from .retrieve import retrieve_many_on

        return retrieve_many_on(channel, ids, deadline, keep, journal, replay_file,
                                timeout=self.timeout, connect=self._connect)

    def _resolve(self, result: Retrieved) -> Retrieved:
        """`resolve.resolve`: ask on a fresh connection who owns a handoff never confirmed."""
        from .resolve import resolve

        return resolve(result, self._connect, self.timeout)

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
        from .reclaim import reclaim

        until = Deadline(deadline)
        channel = self._connect(Deadline(min(self.timeout, until.remaining())))
        try:
            return reclaim(channel, until, deadline, grace, timeout=self.timeout,
                           connect=self._connect, retrieve_many=self._retrieve_many_on)
        finally:
            channel.close()

    # --- asking -----------------------------------------------------------------------------

    def list(self, all_owners: bool = False) -> list[protocol.SessionInfo]:
        with self._connect(Deadline(self.timeout)) as channel:
            reply, _ = channel.call(protocol.List(all_owners=all_owners), Deadline(self.timeout))
        assert isinstance(reply, protocol.Sessions)
        return reply.sessions

    def status(self) -> protocol.HolderStatus:
        with self._connect(Deadline(self.timeout)) as channel:
            reply, _ = channel.call(protocol.Status(), Deadline(self.timeout))
        assert isinstance(reply, protocol.HolderStatus)
        return reply

    def welcome(self) -> protocol.Welcome:
        """The holder's handshake answer: its version, budgets and limits."""
        with self._connect(Deadline(self.timeout)) as channel:
            return channel.welcome

    def release(self, session_id: str) -> None:
        """Tell the holder to drop its copy of a session (the user closed it)."""
        with self._connect(Deadline(self.timeout)) as channel:
            channel.call(protocol.Release(id=session_id), Deadline(self.timeout))


def _valid_name(name: str) -> bool:
    return re.fullmatch(protocol.NAME_CHARS, name) is not None
