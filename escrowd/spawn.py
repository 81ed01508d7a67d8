"""Starting a holder from the keeper: fork, put the fds where systemd would put them, exec.

The child gets the listening socket and every stored fd at 3, 4, ... (`LISTEN_FDS`, their
names in `LISTEN_FDNAMES`, as systemd passes a unit's sockets and fd store), its end of the
keeper's channel just after them (`ESCROWD_NOTIFY_FD`), the watchdog interval
(`WATCHDOG_USEC`), its soft fd limit raised to the hard one, and `/` as its working
directory. Nothing in the child ever returns to the keeper's loop: if the exec fails, it
says so and exits 127.
"""

from __future__ import annotations

import fcntl
import os
import resource
import socket

from escrow_client.interpreter import CHILD_CWD

from .fdstore import NOTIFY_FD_ENV
from .log import log


def fork_holder(argv: list[str], env: dict[str, str], fds: list[int], names: list[str],
                watchdog: float, keepers_end: socket.socket) -> int:
    """A new process that execs the holder `argv` with `env` and `fds` (the channel's end
    last), named `names`, and pinging every `watchdog` seconds; it closes the keeper's end
    of the channel first. Returns its pid; OSError if no process could be forked."""
    pid = os.fork()
    if pid == 0:  # the child: nothing here may return to the keeper's loop
        try:
            keepers_end.close()
            _exec_holder(argv, fds, names, env, watchdog)
        except BaseException as exc:
            log("keeper_exec_failed", error=repr(exc), reason="the holder did not start")
        finally:
            os._exit(127)
    return pid


def _exec_holder(argv: list[str], fds: list[int], names: list[str],
                 env: dict[str, str], watchdog: float) -> None:
    """In the forked child: put `fds` at 3, 4, ... as systemd would (the last one, the
    channel, just after the LISTEN_FDS ones), and exec the holder from `/`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:  # a holder with many sessions needs many fds; so does this shuffle
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # Out of the way first, the few that sit where the targets are (so that no dup2
    # overwrites one still needed); the rest are put in place from where they are.
    end = 3 + len(fds)
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, end) if fd < end else fd for fd in fds]
    for target, fd in enumerate(fds, start=3):
        os.dup2(fd, target)  # inheritable
    listen = len(fds) - 1
    env.update(LISTEN_FDS=str(listen), LISTEN_PID=str(os.getpid()),
               LISTEN_FDNAMES=":".join(names), WATCHDOG_USEC=str(int(watchdog * 1e6)),
               WATCHDOG_PID=str(os.getpid()))
    env[NOTIFY_FD_ENV] = str(3 + listen)
    env.pop("NOTIFY_SOCKET", None)  # a variable meant for the keeper's own manager
    os.chdir(CHILD_CWD)
    os.execve(argv[0], argv, env)
