"""The shipped systemd units under a real `systemd --user` (tests/usermanager.py): socket
activation, Type=notify, the fd store across a SIGKILL, a restart of the service or of its
socket, and the watchdog (docs/design.md §11).

The units are installed as a user installs them: `escrowctl install-service --systemd` with
this virtualenv's escrowd, `systemctl --user daemon-reload`, `enable --now escrowd.socket`.
The holder starts on the first connection. Each test has a manager of its own.

What systemd 252 does (measured here; the journal lines are asserted below):
- `systemctl --user kill -s KILL escrowd.service`, a watchdog timeout, `restart
  escrowd.service` and `restart escrowd.socket` all keep the fd store: the socket's restart
  is propagated to the service (Requires=) as a restart, not as a stop.
- `daemon-reload` and `daemon-reexec` keep it too.
- `stop escrowd.service` (or `stop escrowd.socket`, which stops the service through
  Requires=) releases the store: every draining terminal hangs up. 254 and later keep it
  (FileDescriptorStorePreserve=yes).
- A unit that hits its start limit fails, and a failed unit releases its store: with the
  default limit (5 starts in 10 s), the fifth `systemctl --user restart` in a row, or a
  holder that cannot start (a broken upgrade) restarted five times, dropped every session.
  The service sets StartLimitIntervalSec=0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import usermanager
from survival import (
    assert_all_survived,
    assert_still_there,
    start_three_sessions,
    states,
)
from usermanager import UserManager

from conftest import OWNER, PtyChild, wait_for
from escrow_client import EscrowClient, EscrowError, protocol

VENV_BIN = Path(sys.executable).parent
ESCROWD = str(VENV_BIN / "escrowd")
ESCROWCTL = str(VENV_BIN / "escrowctl")
SERVICE = "escrowd.service"
TICKER = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"]


@pytest.fixture
def manager() -> Iterator[UserManager]:
    with usermanager.started() as m:
        yield m


@dataclass
class Installed:
    """escrowd's units, installed and enabled in `manager`."""

    manager: UserManager
    socket: str

    def client(self, owner: str = OWNER, timeout: float = 10.0) -> EscrowClient:
        return EscrowClient(owner, socket_path=self.socket, timeout=timeout)

    def status(self) -> protocol.HolderStatus:
        return self.client("escrowctl").status()

    def show(self, *properties: str) -> dict[str, str]:
        return self.manager.show(SERVICE, *properties)

    def stored_fds(self) -> int:
        return int(self.show("NFileDescriptorStore")["NFileDescriptorStore"])

    def next_holder(self, before: protocol.HolderStatus,
                    timeout: float = 15.0) -> protocol.HolderStatus:
        """Wait for a holder other than `before` to answer `status`."""
        def answered() -> protocol.HolderStatus | None:
            try:
                status = self.client("escrowctl", timeout=2.0).status()
            except EscrowError:
                return None
            return status if status.instance != before.instance else None

        return wait_for(answered, timeout, f"a holder other than pid {before.pid} to answer")

    def journal(self) -> str:
        return self.manager.unit_journal(SERVICE)

    def journal_lines(self, text: str) -> list[str]:
        return [line for line in self.journal().splitlines() if text in line]

    def releases(self) -> int:
        """How many times systemd said it released the unit's fd store. (A daemon-reload
        says it too, freeing the unit once its state and fds are serialized: compare
        counts across an action without one.)"""
        return len(self.journal_lines("Releasing all stored fds"))


def install(manager: UserManager, edit: Callable[[str], str] | None = None) -> Installed:
    """Install and enable the units as a user does; `edit` changes the written service
    file first (a shorter WatchdogSec=, say)."""
    manager.run(ESCROWCTL, "install-service", "--systemd", "--escrowd", ESCROWD)
    if edit is not None:
        unit = manager.unit_dir / SERVICE
        text = unit.read_text()
        unit.write_text(edit(text))
        assert unit.read_text() != text, "the edit changed nothing"
    manager.systemctl("daemon-reload")
    manager.systemctl("enable", "--now", "escrowd.socket")
    return Installed(manager, str(manager.runtime_dir / "escrowd" / "escrowd.sock"))


def started(installed: Installed) -> protocol.HolderStatus:
    """Connect, which starts the holder (socket activation), and return its status."""
    status = installed.status()
    assert status.fd_store == "systemd" and status.keeper_pid is None, status
    return status


def test_socket_activation_and_notify(manager: UserManager,
                                      pty_children: Callable[..., PtyChild]) -> None:
    """Nothing runs until the first connection, which starts the holder; systemd and
    `escrowctl status` agree on who serves, and the fd store holds what the holder said."""
    installed = install(manager)
    assert manager.show("escrowd.socket", "ActiveState", "SubState") == {
        "ActiveState": "active", "SubState": "listening"}
    assert installed.show("ActiveState", "MainPID") == {"ActiveState": "inactive",
                                                        "MainPID": "0"}

    status = started(installed)  # the first connection: it waits in the socket's backlog
    shown = json.loads(manager.run(ESCROWCTL, "status", "--json").stdout)  # default socket
    unit = installed.show("MainPID", "ActiveState", "SubState", "StatusText", "NRestarts")
    assert unit == {"MainPID": str(status.pid), "ActiveState": "active", "SubState": "running",
                    "StatusText": f"serving {installed.socket}: no sessions", "NRestarts": "0"}
    assert shown["state"] == "running" and shown["socket"] == installed.socket
    assert shown["pid"] == shown["holder"]["pid"] == status.pid
    assert shown["holder"]["fd_store"] == "systemd" and shown["keeper"] is None
    assert shown["holder"]["instance"] == status.instance
    assert shown["evidence"]["lock_holder_pid"] == status.pid
    assert installed.stored_fds() == 1  # the holder's own state

    # `deposited` comes after the store message: systemd handles its notify socket before
    # any later request on its bus, so the two fds are there when `show` answers.
    ticker = pty_children(TICKER)
    installed.client().hand_off("s", ticker.master, child_pid=ticker.pid)
    assert installed.stored_fds() == 3
    stored = installed.journal_lines("to fd store")
    assert len(stored) == 3 and all("session-" in line for line in stored[1:]), stored
    got = installed.client().retrieve("s")
    os.close(got.fd)
    wait_for(lambda: installed.stored_fds() == 1, 5.0, "the retrieved session's fds removed")


def assert_adopted(installed: Installed, before: protocol.HolderStatus,
                   after: protocol.HolderStatus, sessions: int, clean: bool) -> None:
    assert after.pid != before.pid and installed.show("MainPID") == {"MainPID": str(after.pid)}
    assert after.fd_store == "systemd"
    assert after.adopted == sessions, after
    assert after.restarts == before.restarts + 1, (before, after)
    assert after.unclean_restarts == before.unclean_restarts + (0 if clean else 1), after
    assert installed.stored_fds() == 1 + 2 * sessions


def test_every_kind_of_session_survives_the_holders_sigkill(
    manager: UserManager, pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    """The issue's Done-when under the shipped units: `systemctl --user kill -s KILL` in the
    middle of three sessions; systemd keeps their fds, starts a new holder (Restart=always),
    and the new holder adopts all three."""
    installed = install(manager)
    started(installed)
    three = start_three_sessions(installed.client(), pty_children, apps, tmp_path)
    before = installed.status()
    assert installed.stored_fds() == 7
    released = installed.releases()

    t0 = time.monotonic()
    manager.systemctl("kill", "-s", "KILL", SERVICE)
    after = installed.next_holder(before)
    took = time.monotonic() - t0
    assert_adopted(installed, before, after, 3, clean=False)
    assert installed.show("NRestarts") == {"NRestarts": "1"}
    assert installed.journal_lines("Main process exited, code=killed, status=9/KILL")
    assert installed.releases() == released
    print(f"SIGKILL: MainPID {before.pid} -> {after.pid}, adopted {after.adopted}, "
          f"{after.unclean_restarts} unclean restart(s), answering after {took:.2f}s")

    assert_still_there(three)
    assert_all_survived(three, clean=False)
    assert installed.stored_fds() == 1  # every session taken back, its fds removed


def test_restarts_of_the_service_and_of_its_socket_are_clean(
    manager: UserManager, pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    """An upgrade (`systemctl --user restart escrowd.service`, and `escrowctl upgrade`,
    which runs it) and a restart of the socket (what a package upgrade may do) each replace
    the holder in order: every session adopted, no restart counted unclean, no gap."""
    installed = install(manager)
    first = started(installed)
    three = start_three_sessions(installed.client(), pty_children, apps, tmp_path)
    released = installed.releases()

    restarts: list[tuple[str, Callable[[], object]]] = [
        ("systemctl --user restart escrowd.service",
         lambda: manager.systemctl("restart", SERVICE)),
        ("systemctl --user restart escrowd.socket",
         lambda: manager.systemctl("restart", "escrowd.socket")),
        ("escrowctl upgrade", lambda: manager.run(ESCROWCTL, "upgrade")),
    ]
    for what, restart in restarts:
        before = installed.status()
        t0 = time.monotonic()
        restart()
        after = installed.next_holder(before)
        took = time.monotonic() - t0
        assert_adopted(installed, before, after, 3, clean=True)
        assert after.sessions_by_state == {"held": 1, "draining": 1, "exited": 1}, what
        assert installed.show("StatusText") == {"StatusText": (
            f"serving {installed.socket}: 3 sessions (1 held, 1 draining, 1 exited)")}
        assert_still_there(three)
        print(f"{what}: MainPID {before.pid} -> {after.pid}, adopted {after.adopted}, "
              f"answering after {took:.2f}s")
    # The socket's restart reached the service as a restart (Requires=), never as a stop:
    # the store was never released.
    journal = installed.journal()
    assert installed.releases() == released
    assert journal.count("Installed new job escrowd.service/restart") >= 2, journal[-3000:]
    # The holder's own state (its restart counts) stays in the store all along: stored once,
    # by the first holder, and never taken out, not even for a moment while a new holder
    # adopts (one killed then would leave the store without it).
    assert [line.split(f"{SERVICE}: ", 1)[1] for line in installed.journal_lines(
        "FDNAME=holder")] == [
        f"Got notification message from PID {first.pid} (FDSTORE=1, FDNAME=holder, FDPOLL=0)"]
    assert_all_survived(three, clean=True)


def test_restarts_in_a_row_and_a_holder_that_cannot_start_keep_the_store(
    manager: UserManager, pty_children: Callable[..., PtyChild],
) -> None:
    """A unit that hits its start limit fails, and a failed unit's store is released. The
    default limit (5 starts in 10 s) dropped every session on the fifth restart in a row,
    and when an upgrade installed a holder that cannot start. With StartLimitIntervalSec=0
    systemd keeps trying, with the fds, until a holder starts."""
    installed = install(manager)
    first = started(installed)
    ticker = pty_children(TICKER)
    installed.client().hand_off("s", ticker.master, child_pid=ticker.pid)
    os.close(ticker.master)
    ticker.master = -1

    for _ in range(6):
        manager.systemctl("restart", SERVICE)
    assert installed.show("ActiveState", "NFileDescriptorStore") == {
        "ActiveState": "active", "NFileDescriptorStore": "3"}

    # A broken upgrade: the installed holder exits at once, over and over.
    dropin = manager.unit_dir / f"{SERVICE}.d" / "broken.conf"
    dropin.parent.mkdir()
    dropin.write_text("[Service]\nExecStart=\nExecStart=/bin/false\n")
    manager.systemctl("daemon-reload")
    manager.systemctl("restart", "--no-block", SERVICE)

    def restarted_past_the_default_limit() -> bool:
        unit = installed.show("NRestarts", "ActiveState", "Result")
        assert unit["ActiveState"] != "failed", unit
        return int(unit["NRestarts"]) >= 8

    wait_for(restarted_past_the_default_limit, 15.0,
             "systemd restarting the broken holder past the default start limit")
    assert installed.show("NFileDescriptorStore") == {"NFileDescriptorStore": "3"}
    assert ticker.proc.poll() is None, "the terminal hung up"

    # The fixed upgrade: the next automatic restart runs it, and it adopts the session.
    dropin.unlink()
    manager.systemctl("daemon-reload")
    after = installed.next_holder(first)
    assert after.adopted == 1 and states(installed.client()) == {"s": "draining"}
    assert after.unclean_restarts == first.unclean_restarts
    got = installed.client().retrieve("s")
    os.close(got.fd)


def test_a_reload_or_reexec_of_the_manager_keeps_the_store(
    manager: UserManager, pty_children: Callable[..., PtyChild],
) -> None:
    """`daemon-reload` (any package that installs units) and `daemon-reexec` (an upgrade of
    systemd itself) serialize the store and take it back; the running holder's store
    messages still reach the manager after it re-executed."""
    installed = install(manager)
    first = started(installed)
    tickers = [pty_children(TICKER) for _ in range(2)]

    def hand_off(sid: str, ticker: PtyChild) -> None:
        installed.client().hand_off(sid, ticker.master, child_pid=ticker.pid)
        os.close(ticker.master)  # the holder's (and the store's) copies are the only ones
        ticker.master = -1

    hand_off("a", tickers[0])

    manager.systemctl("daemon-reload")
    manager.systemctl("daemon-reexec")
    assert installed.show("MainPID", "NFileDescriptorStore") == {
        "MainPID": str(first.pid), "NFileDescriptorStore": "3"}
    hand_off("b", tickers[1])
    assert installed.stored_fds() == 5

    manager.systemctl("restart", SERVICE)
    after = installed.next_holder(first)
    assert_adopted(installed, first, after, 2, clean=True)
    assert states(installed.client()) == {"a": "draining", "b": "draining"}
    for ticker in tickers:
        assert ticker.proc.poll() is None, "a terminal hung up"
    for sid in ("a", "b"):
        os.close(installed.client().retrieve(sid).fd)


def test_a_stop_of_the_service_on_this_systemd(
    manager: UserManager, pty_children: Callable[..., PtyChild],
) -> None:
    """What `systemctl --user stop escrowd.service` does to the store, measured: systemd
    before 254 releases it (every terminal the holder drains hangs up, and the next holder
    starts afresh); 254 and later keep it (FileDescriptorStorePreserve=yes). Stopping the
    socket stops the service too (Requires=)."""
    installed = install(manager)
    first = started(installed)
    ticker = pty_children(TICKER)
    installed.client().hand_off("s", ticker.master, child_pid=ticker.pid)
    os.close(ticker.master)
    ticker.master = -1
    released = installed.releases()

    manager.systemctl("stop", SERVICE)
    assert installed.show("ActiveState") == {"ActiveState": "inactive"}
    kept = usermanager.systemd_version() >= 254
    after = installed.next_holder(first)  # the socket starts a new one
    if kept:
        assert installed.stored_fds() == 3 and after.adopted == 1
        assert ticker.proc.poll() is None
    else:
        assert installed.releases() == released + 1
        assert after.adopted == 0 and after.restarts == 0 and installed.stored_fds() == 1
        assert ticker.proc.wait(5) == -signal.SIGHUP  # the terminal hung up
        assert states(installed.client()) == {}

    manager.systemctl("stop", "escrowd.socket")
    assert installed.show("ActiveState") == {"ActiveState": "inactive"}
    # A clean stop: the socket unit keeps its socket file on purpose (RemoveOnStop=no), and
    # that alone is no sign of a holder that died.
    shown = manager.run(ESCROWCTL, "status", "--json", check=False)
    assert (shown.returncode, json.loads(shown.stdout)["state"]) == (3, "not_running"), (
        shown.stdout)


def test_the_watchdog_replaces_a_stopped_holder(
    manager: UserManager, pty_children: Callable[..., PtyChild],
    apps: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    """A holder that stops answering (SIGSTOP: its event loop no longer pings) is killed by
    systemd once WatchdogSec= passes (2 s here, for a short test) and replaced by one that
    adopts every session."""
    installed = install(manager, lambda text: text.replace("WatchdogSec=30", "WatchdogSec=2"))
    started(installed)
    three = start_three_sessions(installed.client(), pty_children, apps, tmp_path)
    before = installed.status()
    assert not installed.journal_lines("Watchdog timeout")  # it pings while it runs

    t0 = time.monotonic()
    os.kill(before.pid, signal.SIGSTOP)
    after = installed.next_holder(before)
    took = time.monotonic() - t0
    assert_adopted(installed, before, after, 3, clean=False)
    assert installed.journal_lines("Watchdog timeout (limit 2s)!")
    assert installed.journal_lines(f"Killing process {before.pid} (escrowd) with signal "
                                   "SIGABRT")
    print(f"watchdog: MainPID {before.pid} -> {after.pid}, adopted {after.adopted}, "
          f"answering {took:.2f}s after the SIGSTOP")
    assert_still_there(three)
    assert_all_survived(three, clean=False)

