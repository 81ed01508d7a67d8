"""A custody believes only the answer its request can have (PROTOCOL.md 12.7): a `deposit`
answered by anything but `deposited` (a stale `handoff` or `done`, left on the stream by a
holder or a client out of step) is never taken for success. The app is told the deposit's
outcome is unknown, the connection is shut down as if the holder had gone away, and the
watcher takes custody back on a new one, depositing the session again.

A real holder does not answer out of turn on cue; a fake one (tests/fakeholder.py, a real
Unix socket server speaking the real protocol) does.
"""

from __future__ import annotations

import os
import tty
from pathlib import Path

import msgspec
import pytest
from fakeholder import OWNER, SID, WELCOME, FakeHolder, Peer, fds_open_on
from test_custody_failures import STATUS, fresh_breaker  # noqa: F401 (an autouse fixture)

from conftest import wait_for
from escrow_client import errors, protocol
from escrow_client.platform import pty_number

KEEPING = msgspec.structs.replace(WELCOME, features=["keep"], drain_stop_budget=0.05,
                                  send_deadline=0.05)


class OutOfTurn:
    """Every connection: the first deposit of all is answered `done` (what a holder out of
    step with its client sends); every other `deposited`; `list` says SID is draining.
    `deposits` has, per connection, the number of each terminal deposited on it, and
    `hung_up` the connections the client shut down."""

    def __init__(self) -> None:
        self.wrong_left = 1
        self.deposits: list[list[int | None]] = []
        self.hung_up = 0

    def __call__(self, peer: Peer) -> None:
        deposited: list[int | None] = []
        self.deposits.append(deposited)
        while True:
            try:
                message, terminal = peer.receive_carrying()
            except (EOFError, ConnectionResetError):
                self.hung_up += 1
                return
            if isinstance(message, protocol.List):
                peer.send(protocol.Sessions(sessions=[protocol.SessionInfo(
                    owner=OWNER, id=SID, state="draining", deposited_at=0.0)]))
            elif isinstance(message, protocol.Status):
                peer.send(STATUS)
            elif isinstance(message, protocol.Deposit):
                deposited.append(terminal)
                if self.wrong_left:
                    self.wrong_left -= 1
                    peer.send(protocol.Done(id=message.id))
                else:
                    peer.send(protocol.Deposited(id=message.id))
            else:
                raise AssertionError(f"not asked here: {message!r}")


def test_a_deposit_answered_out_of_turn_is_not_believed(socket_dir: Path) -> None:
    """A deposit answered `done`: DepositIndeterminate (never a silent success), the
    connection shut down, `protected` False then True again once the watcher has
    deposited the terminal again on a new connection; no copy of it left behind."""
    master, slave = os.openpty()
    tty.setraw(slave)
    holder = OutOfTurn()
    try:
        with FakeHolder(socket_dir, [holder], welcome=KEEPING, repeat_last=True,
                        concurrent=True) as fake:
            custody = fake.client().custody()
            changes: list[bool] = []
            custody.on_change(changes.append)
            try:
                with pytest.raises(errors.DepositIndeterminate) as unknown:
                    custody.deposit(SID, master)
                assert isinstance(unknown.value.cause, errors.ProtocolViolation)
                wait_for(lambda: holder.hung_up >= 1, what="the connection shut down")
                wait_for(lambda: custody.protected, what="custody taken back")
                assert changes == [False, True]  # lost, as when a holder goes away
                assert custody.pending() == set()
                assert holder.deposits[:2] == [[pty_number(master)]] * 2, holder.deposits
            finally:
                custody.close()
    finally:
        os.close(slave)
    assert fds_open_on(master) == {master}
    os.close(master)
