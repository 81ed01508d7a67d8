"""Start a holder when none answers (`EscrowClient(autostart=True)`).

The holder is spawned detached: its own session, stdio on /dev/null, no inherited fds, and
never waited for by the app. Several apps racing to start one is fine: every extra holder
exits at once on the socket's lock, and every client then finds the one that won.
"""

from __future__ import annotations

import subprocess
import sys

# Spawned holders are never waited for; keep their Popen objects so that Python reaps the
# ones that exit (extra spawns that lost the lock race) instead of leaving zombies.
_spawned: list[subprocess.Popen[bytes]] = []


def spawn_holder(socket_path: str, idle_exit: float) -> None:
    _spawned[:] = [p for p in _spawned if p.poll() is None]
    _spawned.append(
        subprocess.Popen(
            [sys.executable, "-m", "escrowd", "--socket", socket_path,
             "--idle-exit", f"{idle_exit:g}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
        )
    )
