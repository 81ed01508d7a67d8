"""Starting a holder from the keeper: fork, put the fds where systemd would put them, exec.

The child gets the listening socket and every stored fd at 3, 4, ... (`LISTEN_FDS`, their
names in `LISTEN_FDNAMES`, as systemd passes a unit's sockets and fd store), its end of the
keeper's channel just after them (`ESCROWD_NOTIFY_FD`), the watchdog interval
(`WATCHDOG_USEC`), its soft fd limit raised to the hard one, and `/` as its working
directory. Nothing in the child ever returns to the keeper's loop: if the exec fails, it
says so and exits 127.

A standby (escrowd.standby) is started the same way with nothing passed but its socket to
the keeper; told to serve, it puts what it is sent where this puts it, and its environment
says the same (`holder_environment`).
"""

from __future__ import annotations

import fcntl
import os
import resource
import socket

from escrow_client.interpreter import CHILD_CWD

from .log import log
from .names import NOTIFY_FD_ENV, STANDBY_FD_ENV


def fork_holder(argv: list[str], env: dict[str, str], fds: list[int], names: list[str],
                watchdog: float, keepers_end: socket.socket) -> int:
    """A new process that execs the holder `argv` with `env` and `fds` (the channel's end
    last), named `names`, and pinging every `watchdog` seconds; it closes the keeper's end
    of the channel first. Returns its pid; OSError if no process could be forked."""
    pid = os.fork()
    if pid == 0:  # the child: nothing here may return to the keeper's loop
        try:
            keepers_end.close()
            env.pop(STANDBY_FD_ENV, None)  # a holder, not a standby: whatever the keeper had
            holder_environment(env, names, watchdog, os.getpid())
            _exec(argv, fds, env)
        except BaseException as exc:
            log("keeper_exec_failed", error=repr(exc), reason="the holder did not start")
        finally:
            os._exit(127)
    return pid


def fork_standby(argv: list[str], env: dict[str, str], standbys_end: int,
                 keepers_end: socket.socket) -> int:
    """A new process that execs `argv` as a standby (escrowd.takeover): like a holder, with
    nothing passed but its end of the keeper's socket, at 3 ($ESCROWD_STANDBY_FD)."""
    pid = os.fork()
    if pid == 0:
        try:
            keepers_end.close()
            env[STANDBY_FD_ENV] = "3"
            env.pop("NOTIFY_SOCKET", None)
            _exec(argv, [standbys_end], env)
        except BaseException as exc:
            log("keeper_exec_failed", error=repr(exc), reason="the standby did not start")
        finally:
            os._exit(127)
    return pid


def holder_environment(env: dict[str, str], names: list[str], watchdog: float,
                       pid: int) -> None:
    """What a holder's environment says of the fds it was passed at 3, 4, ...: `names`
    (the LISTEN_FDS ones), the channel's end just after them, and its watchdog; `pid` is
    the holder's. The same for a holder started by exec and a standby told to serve."""
    listen = len(names)
    env.update(LISTEN_FDS=str(listen), LISTEN_PID=str(pid),
               LISTEN_FDNAMES=":".join(names), WATCHDOG_USEC=str(int(watchdog * 1e6)),
               WATCHDOG_PID=str(pid))
    env[NOTIFY_FD_ENV] = str(3 + listen)
    env.pop("NOTIFY_SOCKET", None)  # a variable meant for the keeper's own manager


def _exec(argv: list[str], fds: list[int], env: dict[str, str]) -> None:
    """In the forked child: put `fds` at 3, 4, ... as systemd would, and exec `argv` from
    `/`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:  # a holder with many sessions needs many fds; so does this shuffle
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # Out of the way first, the few that sit where the targets are (so that no dup2
    # overwrites one still needed); the rest are put in place from where they are.
    end = 3 + len(fds)
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, end) if fd < end else fd for fd in fds]
    for target, fd in enumerate(fds, start=3):
        os.dup2(fd, target)  # inheritable
    os.chdir(CHILD_CWD)
    os.execve(argv[0], argv, env)
