"""`escrowctl uninstall-service` under a real `systemd --user` (tests/usermanager.py): it
disables and removes the units install-service wrote, leaves a unit the user edited, and
stops no holder: the one that runs is named with its sessions, and they go on."""

from __future__ import annotations

import os
from collections.abc import Callable

from test_under_systemd import ESCROWCTL, TICKER, install, manager, started
from usermanager import UserManager

from conftest import PtyChild

__all__ = ["manager"]  # the fixture, from test_under_systemd


def test_uninstall_removes_its_own_units_leaves_an_edited_one_and_stops_nothing(
    manager: UserManager, pty_children: Callable[..., PtyChild],
) -> None:
    installed = install(manager, edit=lambda text: text + "# the user's own line\n")
    status = started(installed)
    ticker = pty_children(TICKER)
    installed.client().hand_off("s", ticker.master, child_pid=ticker.pid)
    assert manager.systemctl("is-enabled", "escrowd.socket").stdout.strip() == "enabled"

    result = manager.run(ESCROWCTL, "uninstall-service", check=False)
    out = result.stdout
    socket_unit, service_unit = (manager.unit_dir / n for n in ("escrowd.socket",
                                                                 "escrowd.service"))
    assert result.returncode == 1, (out, result.stderr)  # a file was left
    assert f"removed {socket_unit}" in out and not socket_unit.exists()
    assert f"left {service_unit}: not what install-service writes" in out
    assert service_unit.read_text().endswith("# the user's own line\n")  # untouched
    assert "ran systemctl --user disable escrowd.socket" in out
    assert "ran systemctl --user daemon-reload" in out
    enabled = manager.systemctl("is-enabled", "escrowd.socket", check=False).stdout.strip()
    assert enabled != "enabled", enabled
    assert (f"the holder (pid {status.pid}) on {installed.socket} still runs, holding 1 "
            "session(s): removing the service stopped nothing. `systemctl --user stop "
            "escrowd.socket escrowd.service` stops it, and hangs up every terminal no app "
            "holds") \
        in out, out

    # Nothing was stopped: the same holder serves, and the session is there.
    assert installed.status().pid == status.pid
    got = installed.client().retrieve("s")
    os.close(got.fd)

    # Run again: nothing of its own is left, and the edited unit still is not its own.
    again = manager.run(ESCROWCTL, "uninstall-service", check=False)
    assert again.returncode == 1 and f"left {service_unit}" in again.stdout
    assert "removed" not in again.stdout


def test_uninstall_of_units_as_written_removes_both_and_starts_no_holder(
    manager: UserManager,
) -> None:
    """No holder runs (the socket unit only listens): none is started by looking."""
    installed = install(manager)
    result = manager.run(ESCROWCTL, "uninstall-service")
    out = result.stdout
    assert "ran systemctl --user disable escrowd.service escrowd.socket" in out, out
    for name in ("escrowd.service", "escrowd.socket"):
        assert f"removed {manager.unit_dir / name}" in out
        assert not (manager.unit_dir / name).exists()
    assert "still runs" not in out and "cannot tell" not in out, out
    assert installed.show("ActiveState", "MainPID") == {"ActiveState": "inactive",
                                                        "MainPID": "0"}
