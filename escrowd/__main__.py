"""`escrowd`: run the holder in the foreground, under its keeper (escrowd.keeper), or alone
with `--bare` (as systemd's unit does: systemd keeps the fds then).

Exit status: 0 after a clean stop (SIGTERM, SIGINT, or --idle-exit), 1 when it cannot start
(the message says why, e.g. another holder already serves the socket), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys

from escrow_client import paths

from . import __version__, keeper
from . import log as log_file
from .config import Config, MiB
from .lifecycle import StartupError
from .log import log
from .names import STANDBY_FD_ENV


def _parser() -> argparse.ArgumentParser:
    d = Config(socket_path="")
    p = argparse.ArgumentParser(
        prog="escrowd",
        description="Hold PTY masters for terminal apps while they restart, draining their "
        "output so nothing is lost.",
        epilog="Exit status: 0 after a clean stop (SIGTERM, SIGINT, or --idle-exit); 1 when "
        "it cannot start (the message says why, e.g. another holder already serves the "
        "socket); 2 for bad arguments.",
    )
    p.add_argument("--version", action="version", version=f"escrowd {__version__}")
    p.add_argument("--check", action="store_true",
                   help="check that this installation can run a holder (every module loads, "
                   "a state file can be made, written and read back), then exit: the trial "
                   "an upgrade runs before it replaces a working holder")
    p.add_argument("--bare", action="store_true",
                   help="run the holder alone, without its keeper: for a service manager "
                   "that keeps the fds itself (systemd's unit), and for tests. Without a "
                   "fd store ($NOTIFY_SOCKET), its sessions die with it")
    p.add_argument("--socket", metavar="PATH",
                   help="socket path (default: $ESCROW_SOCKET, else "
                   "$XDG_RUNTIME_DIR/escrowd/escrowd.sock, else /tmp/escrowd-<uid>/escrowd.sock)")
    p.add_argument("--drain-stop-budget", type=float, default=d.drain_stop_budget,
                   metavar="SECONDS", help="time to stop a drain and sweep before a handoff "
                   f"(default {d.drain_stop_budget:g}; a client waits longer)")
    p.add_argument("--send-deadline", type=float, default=d.send_deadline, metavar="SECONDS",
                   help=f"time to send a handoff (default {d.send_deadline:g})")
    p.add_argument("--ack-deadline", type=float, default=d.ack_deadline, metavar="SECONDS",
                   help="time to wait for the app's ack after a handoff is sent (default "
                   f"{d.ack_deadline:g})")
    p.add_argument("--max-sessions", type=int, metavar="N",
                   help=f"sessions held at once (default {d.max_sessions}, or fewer if the fd "
                   "store cannot hold that many: given, a cap the store cannot hold is refused)")
    p.add_argument("--ring-bytes", type=int, default=d.ring_bytes, metavar="BYTES",
                   help="replay kept per session (default 1 MiB)")
    p.add_argument("--total-ring-bytes", type=int, default=d.total_ring_bytes, metavar="BYTES",
                   help=f"replay kept in all (default {d.total_ring_bytes // MiB} MiB)")
    p.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help=f"connections open at once (default {d.max_connections})")
    p.add_argument("--max-sessions-per-owner", type=int, default=d.max_sessions_per_owner,
                   metavar="N", help="sessions one owner (app) may hold at once (default "
                   f"{d.max_sessions_per_owner}): no app takes every slot")
    p.add_argument("--owner-ring-bytes", type=int, default=d.owner_ring_bytes,
                   metavar="BYTES", help="replay the sessions of one owner may keep in all "
                   f"(default {d.owner_ring_bytes // MiB} MiB): no app takes the whole budget")
    p.add_argument("--max-connections-per-owner", type=int,
                   default=d.max_connections_per_owner, metavar="N",
                   help="connections one owner may have open at once (default "
                   f"{d.max_connections_per_owner}; custody connections never time out)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   metavar="BYTES", help="the largest request a connection may send; a "
                   f"larger one closes it (default {d.max_request_bytes // MiB} MiB)")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout, metavar="SECONDS",
                   help="close a connection that holds no custody after this long idle "
                   f"(default {d.idle_timeout:g})")
    p.add_argument("--unclaimed-ttl", type=float, default=d.unclaimed_ttl, metavar="SECONDS",
                   help="release sessions nobody reclaimed after this long (0: never; "
                   f"default {d.unclaimed_ttl:g}, a day)")
    p.add_argument("--idle-exit", type=float, default=d.idle_exit, metavar="SECONDS",
                   help="exit after this long with no sessions and no connections (0: never; "
                   f"default {d.idle_exit:g})")
    p.add_argument("--ready-deadline", type=float, default=d.ready_deadline, metavar="SECONDS",
                   help="the keeper kills a holder it started that is not ready after this "
                   f"long, as frozen, and starts another (default {d.ready_deadline:g})")
    return p


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config:
    d = Config(socket_path="")
    config = Config(
        socket_path=paths.resolve_socket_path(args.socket),
        drain_stop_budget=args.drain_stop_budget,
        send_deadline=args.send_deadline,
        ack_deadline=args.ack_deadline,
        max_sessions=d.max_sessions if args.max_sessions is None else args.max_sessions,
        ring_bytes=args.ring_bytes,
        total_ring_bytes=args.total_ring_bytes,
        max_connections=args.max_connections,
        max_sessions_per_owner=args.max_sessions_per_owner,
        owner_ring_bytes=args.owner_ring_bytes,
        max_connections_per_owner=args.max_connections_per_owner,
        max_request_bytes=args.max_request_bytes,
        idle_timeout=args.idle_timeout,
        unclaimed_ttl=args.unclaimed_ttl,
        idle_exit=args.idle_exit,
        ready_deadline=args.ready_deadline,
    )
    for name in ("drain_stop_budget", "send_deadline", "ack_deadline", "idle_timeout",
                 "ready_deadline"):
        if getattr(config, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("max_sessions", "max_connections", "max_request_bytes",
                 "max_sessions_per_owner", "max_connections_per_owner"):
        if getattr(config, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if config.ring_bytes < 0 or config.total_ring_bytes < 0 or config.owner_ring_bytes < 0:
        parser.error("ring sizes cannot be negative")
    return config


def _raise_fd_limit() -> None:
    """Every session costs the holder one fd: take the soft limit up to the hard one (the
    usual soft 1024 would refuse deposits long before --max-sessions)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    # macOS refuses a soft limit above kern.maxfilesperproc even under an unlimited hard one:
    # ask for less until it is granted (or keep what we have: deposits past it get `limit`).
    while soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            return
        except (ValueError, OSError):
            wanted //= 2


def _check() -> int:
    """`escrowd --check`: what a holder needs to start, tried without serving anything."""
    from . import adoption, handoff, registry  # noqa: F401  (every module a holder loads)
    from .statefile import HolderRecord, Record, StateFile

    state = StateFile.create(Record, MiB, "check")
    try:
        state.write(Record(token="check", owner="check", id="check"))
        again = StateFile(os.dup(state.fd), Record)
        ok = again.record() == state.record()
        again.close()
        StateFile.create(HolderRecord, 0, "check").close()
    finally:
        state.close()
    print(f"escrowd {__version__}: {'ok' if ok else 'state files do not read back'}")
    return 0 if ok else 1


def _keeper_pid() -> int | None:
    """The keeper that started this holder (its parent), if one did."""
    value = os.environ.pop(keeper.KEEPER_ENV, None)
    if value is None or not value.isdigit() or int(value) != os.getppid():
        return None
    return int(value)


def main(argv: list[str] | None = None) -> int:
    # First, before any socket exists: a peer that hangs up must never kill the holder and
    # every session in it. Sends also use MSG_NOSIGNAL; this covers anything that does not.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.umask(0o077)
    _raise_fd_limit()
    parser = _parser()
    args = parser.parse_args(argv)
    config = _config(args, parser)
    if args.check:
        return _check()
    log_file.falls_back_to(config.socket_path + ".log")  # once the terminal is gone
    if not args.bare:
        return keeper.main(config, sys.argv[1:] if argv is None else argv)
    keeper_pid = _keeper_pid()
    if keeper_pid is None and STANDBY_FD_ENV in os.environ:
        # A standby whose keeper died while it started: as a holder it would take the lock
        # and the socket path from a holder that still serves every session, with nothing.
        print("escrowd: a standby whose keeper is gone: exiting", file=sys.stderr)
        return 1
    if keeper_pid is not None:
        # The keeper's to judge (see _watch_signals): Ctrl-C, and the hangup a shell passes
        # on to its jobs when its terminal closes, reach the holder too.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from . import takeover

    waiting = takeover.standby() if keeper_pid is not None else None
    # Only a holder loads the event loop and its own modules (the keeper above needs neither).
    from . import serving
    from .service import ActivationError, keeper_channel, passed_fds

    try:
        if waiting is not None:
            takeover.stand_by(waiting)  # a keeper's standby waits here until told to serve
        # Before trio.run: the event loop opens fds of its own, and fd 3 must still be the
        # one systemd passed (or nothing) when it is looked at.
        passed = passed_fds(config.socket_path)
        channel = keeper_channel(keeper_pid is not None)
        serving.serve(config, passed, keeper_pid, channel, args.max_sessions is not None)
    except (StartupError, paths.PathError, ActivationError) as exc:
        print(f"escrowd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    log("stopped", socket=config.socket_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
