"""Start a holder when none answers (`EscrowClient(autostart=True)`).

The holder is spawned detached: its own session, stdio on /dev/null, no inherited fds, none
of the app's service-manager variables, and not a child of the app. Several apps racing to
start one is fine: every extra holder exits at once on the socket's lock, and every client
then finds the one that won.

Not a child: a short-lived launcher forks the holder and exits at once, so the holder is
reparented to init (or the user's service manager, if it is a subreaper). A holder that was
the app's child would stay a zombie in the app after it exits (--idle-exit, or losing the
lock race) until the app happened to reap it, and an app that reaps its terminals' children
with waitpid(-1) would collect the holder's status by surprise.
"""

from __future__ import annotations

import os
import subprocess
import sys

from . import advice, errors, paths, protocol
from .interpreter import CHILD_CWD, python_command

# Addressed to the app by its service manager, not to a holder the app happens to start: with
# NOTIFY_SOCKET the holder would send READY=1 and MAINPID=<its pid> to the app's unit.
_SERVICE_MANAGER_VARIABLES = (
    "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
    "LISTEN_FDNAMES",
)

# Run with `python -I -S`: a single-threaded process, so fork is safe; the holder becomes the
# leader of a new session, and the launcher's exit orphans it.
_LAUNCHER = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.setsid()\n"
    "    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n"  # the pipe is the launcher's alone
    "    os.execv(sys.argv[1], sys.argv[1:])\n"
    "os.write(1, b'%d' % pid)\n"
    "os._exit(0)\n"
)

# How long the launcher may take to fork and exit (it needs milliseconds).
_LAUNCH_TIMEOUT = 10.0

spawned = 0  # holders this process has launched (extra ones exit on the lock)
launched: list[int] = []  # their pids, as their launcher forked them


def spawn_holder(socket_path: str, idle_exit: float) -> None:
    """Start a holder for `socket_path` (see the module's docstring). A directory the
    holder would refuse (open to group or others) is refused here, with the holder's own
    reason, rather than left for the caller to wait on in vain; so is a missing one whose
    making would leave it at another user's mercy (`paths.creation_hazard`): they could
    rename it away from under the holder."""
    global spawned
    directory = os.path.dirname(socket_path)
    reason = paths.refusal(directory) or paths.creation_hazard(directory)
    if reason is not None:
        raise errors.EscrowConfigError(f"cannot start a holder there: {reason}; "
                                       f"{advice.own_directory(socket_path)}")
    env = {k: v for k, v in os.environ.items() if k not in _SERVICE_MANAGER_VARIABLES}
    holder = python_command("escrowd", "--socket", os.path.abspath(socket_path),
                            "--idle-exit", f"{idle_exit:g}")
    try:
        launcher = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, *holder],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
            cwd=CHILD_CWD,
            env=env,
            timeout=_LAUNCH_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return  # killed; the caller waits for a holder within its deadline and reports that
    if launcher.returncode == 0:
        spawned += 1
        if launcher.stdout.isdigit():
            launched.append(int(launcher.stdout))


def started_here(status: protocol.HolderStatus) -> int | None:
    """The pid this process launched, if the holder that gave `status` is that one (or
    runs under it, as the keeper's holder does); None if it is another, say the one that
    won the lock while ours exited on it. The status comes from a listener of this uid
    (`trust`), and the pid from our own launcher: nobody else can make this say yes."""
    for pid in (status.keeper_pid, status.pid):
        if pid is not None and pid in launched:
            return pid
    return None
