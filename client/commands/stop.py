"""`escrowctl stop`: stop the holder, unless it holds sessions (and --force was not given):
SIGTERM to its keeper (which stops the holder, then closes every stored fd), or to a bare
holder.

`escrow_client.control` does the work: it proves what to signal twice (the holder's own
`status` answer on a live connection, and the lock's holder, F_GETLK), says what refuses a
stop, signals and waits. Without an answer nothing is signalled. This verb says what
happened; every outcome has an exit status of its own (below, and in `--help`).
"""

from __future__ import annotations

import argparse

from .. import control, paths
from ..liveness import STATUS_TIMEOUT, holder_verdict
from . import Failed, describe
from .arguments import add_sub_timeout, positive

STOP_STOPPED = 0  # the holder was signalled and has exited
STOP_REFUSED = 1  # sessions are escrowed and --force was not given: nothing was signalled
STOP_NOT_RUNNING = 3  # no holder runs on the socket (not running, or dead): nothing to stop
STOP_CANNOT_TELL = 4  # the holder did not answer, or could not be told apart: nothing signalled
STOP_STILL_RUNNING = 5  # SIGTERM was sent, but the holder still ran after --wait seconds
STOP_NOT_PERMITTED = 6  # the holder's pid may not be signalled by this user: nothing signalled

DEFAULT_STOP_WAIT = 10.0

_EPILOG = f"""\
exit status:
  {STOP_STOPPED}  the holder exited (it removes its socket file and pidfile)
  {STOP_REFUSED}  sessions are escrowed and --force was not given: they are listed, and
     nothing was signalled
  {STOP_NOT_RUNNING}  no holder runs on the socket: nothing to stop
  {STOP_CANNOT_TELL}  the holder did not answer in time, or could not be told apart from
     another process: nothing was signalled
  {STOP_STILL_RUNNING}  SIGTERM was sent, but the holder still ran after --wait seconds
  {STOP_NOT_PERMITTED}  you may not signal the holder's pid: nothing was signalled
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Send SIGTERM to the holder and wait for it to exit. It refuses while "
        "sessions are\nescrowed (held, draining, handing_off or exited) and lists them: "
        "stopping the holder\ncloses its copies of their terminals, so those no app holds "
        "hang up and their programs\nget SIGHUP. The pid signalled is the one the holder "
        "gives in its answer, and must be\nthe lock's holder too; a holder that does not "
        "answer is never signalled.",
        epilog=_EPILOG,
    )
    p.add_argument("--force", action="store_true",
                   help="stop it even though sessions are escrowed (they hang up)")
    p.add_argument("--wait", type=positive, default=DEFAULT_STOP_WAIT, metavar="SECONDS",
                   help=f"how long to wait for it to exit (default {DEFAULT_STOP_WAIT:g})")
    add_sub_timeout(p, "how long the holder has to answer")
    p.set_defaults(func=run, default_timeout=STATUS_TIMEOUT)


def run(args: argparse.Namespace) -> int:
    socket_path = paths.resolve_socket_path(args.socket)
    verdict = holder_verdict(socket_path, args.timeout, list_sessions=True)
    if verdict.state in ("not_running", "dead"):
        raise Failed(f"no holder is running on {socket_path} "
                     f"({verdict.state.replace('_', ' ')}); nothing to stop", STOP_NOT_RUNNING)
    try:
        who = control.target(verdict)
    except control.NotProven as exc:
        raise Failed(f"not stopping the holder on {socket_path}: {exc}; nothing was "
                     "signalled", STOP_CANNOT_TELL) from None
    live = control.escrowed(verdict)
    refusal = control.stop_refusal(verdict, args.force)
    if refusal == control.UNDER_SYSTEMD:
        raise Failed(f"escrowd (pid {who.pid}) runs under systemd, which would start it "
                     "again: stop it with `systemctl --user stop escrowd.socket "
                     "escrowd.service`", STOP_REFUSED)
    if refusal == control.SESSIONS_UNKNOWN:
        raise Failed(f"not stopping escrowd (pid {who.holder_pid}): it did not list its "
                     "sessions in time, so it may hold some; use --force to stop it anyway",
                     STOP_CANNOT_TELL)
    if refusal == control.SESSIONS_ESCROWED:
        raise Failed(f"not stopping escrowd (pid {who.holder_pid}): {len(live)} session(s) "
                     "escrowed; stopping it would drop them (the terminals no app holds "
                     "would hang up). Reclaim or release them first, or use --force:"
                     + "".join(f"\n  {s.owner}/{s.id} {s.state}" for s in live),
                     STOP_REFUSED)
    try:
        gone = control.terminate(who, args.wait)
    except ProcessLookupError:
        print(f"escrowd (pid {who.pid}) on {socket_path} had already exited")
        return STOP_STOPPED
    except OSError as exc:  # EPERM: a process this user may not signal
        raise Failed(f"not stopping escrowd (pid {who.pid}) on {socket_path}: you may not "
                     f"signal it ({exc.strerror or exc}); nothing was signalled",
                     STOP_NOT_PERMITTED) from None
    if not gone:
        raise Failed(f"sent SIGTERM to escrowd (pid {who.pid}), but it still runs after "
                     f"{args.wait:g}s", STOP_STILL_RUNNING)
    dropped = f"; dropped {len(live)} escrowed session(s)" if live else ""
    pair = f" and its keeper (pid {who.pid})" if who.keeper else ""
    print(f"stopped escrowd (pid {who.holder_pid}){pair} on {socket_path}{dropped}")
    return STOP_STOPPED
