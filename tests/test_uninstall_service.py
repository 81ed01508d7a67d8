"""`escrowctl uninstall-service` under a real `systemd --user` (tests/usermanager.py): it
disables and removes the units install-service wrote, leaves a unit the user edited, and
stops no holder: the one that runs is named with its sessions, and they go on. It removes
nothing while the service's holder holds sessions (unless --force), and a missing lock file
is no proof that it holds none: under launchd (a `launchctl` of the test's own, logging its
calls) no bootout follows."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from test_install_service import VENV_BIN, clean_env
from test_under_systemd import ESCROWCTL, TICKER, install, manager, started
from usermanager import UserManager

from conftest import HolderProcess, PtyChild
from escrow_client import paths

__all__ = ["manager"]  # the fixture, from test_under_systemd


def test_uninstall_removes_its_own_units_leaves_an_edited_one_and_stops_nothing(
    manager: UserManager, pty_children: Callable[..., PtyChild],
) -> None:
    installed = install(manager, edit=lambda text: text + "# the user's own line\n")
    status = started(installed)
    ticker = pty_children(TICKER)
    installed.client().hand_off("s", ticker.master, child_pid=ticker.pid)
    assert manager.systemctl("is-enabled", "escrowd.socket").stdout.strip() == "enabled"

    # Anyone can remove the lock file: that proves nothing about the sessions held.
    os.unlink(paths.lock_path(installed.socket))
    refused = manager.run(ESCROWCTL, "uninstall-service", check=False)
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert (f"refused: the service's holder (pid {status.pid}) on {installed.socket} holds 1 "
            "session(s)") in refused.stderr, refused.stderr
    assert "`--force` removes the files anyway" in refused.stderr
    assert "removed" not in refused.stdout and "ran " not in refused.stdout, refused.stdout
    assert all((manager.unit_dir / n).exists() for n in ("escrowd.socket", "escrowd.service"))
    assert manager.systemctl("is-enabled", "escrowd.socket").stdout.strip() == "enabled"

    result = manager.run(ESCROWCTL, "uninstall-service", "--force", check=False)
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
    again = manager.run(ESCROWCTL, "uninstall-service", "--force", check=False)
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


def test_launchd_agent_is_not_booted_out_while_its_holder_holds_a_session_sans_lock_file(
    tmp_path: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
) -> None:
    home, bin_dir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "launchctl.log"
    home.mkdir()
    bin_dir.mkdir()
    launchctl = bin_dir / "launchctl"
    launchctl.write_text(f'#!/bin/sh\necho "launchctl $*" >> {log}\n')
    launchctl.chmod(0o755)
    env = clean_env(HOME=str(home), PATH=f"{bin_dir}:{os.environ['PATH']}")
    escrowctl = [str(VENV_BIN / "escrowctl"), "--socket", holder.socket]

    def uninstall(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*escrowctl, "uninstall-service", "--launchd", *args],
                              capture_output=True, text=True, timeout=30, env=env)

    subprocess.run([*escrowctl, "install-service", "--launchd"], check=True,
                   capture_output=True, timeout=30, env=env)
    plist = home / "Library" / "LaunchAgents" / "com.fd-escrow.escrowd.plist"
    ticker = pty_children(TICKER)
    holder.client().hand_off("s", ticker.master, child_pid=ticker.pid)
    os.unlink(paths.lock_path(holder.socket))

    refused = uninstall()
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert f"refused: the service's holder (pid {holder.pid}) on {holder.socket} holds 1 " \
        "session(s)" in refused.stderr, refused.stderr
    assert plist.exists() and not log.exists()

    forced = uninstall("--force")
    assert f"removed {plist}" in forced.stdout and not plist.exists(), forced.stdout
    assert "holding 1 session(s)" in forced.stdout, forced.stdout
    assert "was not booted out" in forced.stdout
    assert not log.exists()  # launchctl never ran: bootout would have stopped the holder
    assert holder.alive()
