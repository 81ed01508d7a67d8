"""`escrowctl`: look at the holder, its sessions, and take a relaunch for a test drive.

Every subcommand is a thin layer over `EscrowClient`; nothing here speaks the protocol
itself. Exit status: 0 on success; 1 for an error (printed as `escrowctl: <message>
(<code>)`); 2 for bad arguments. `status` has its own codes (`STATUS_EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from . import __version__, demo, errors, paths, protocol
from .client import DEFAULT_TIMEOUT, EscrowClient
from .protocol import HolderStatus, SessionInfo

# The owner escrowctl names itself with when it only looks (status, list of every owner).
ADMIN_OWNER = "escrowctl"

# DESIGN §7: 0 only for running; the others follow the LSB status codes, plus 150 (from
# the LSB's application-specific range) for a holder that accepted but did not answer.
STATUS_EXIT_CODES: dict[str, int] = {
    "running": 0,
    "dead": 1,
    "not_running": 3,
    "indeterminate": 4,
    "unresponsive": 150,
}

_NAME_RE = re.compile(protocol.NAME_PATTERN)


# --- status -------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What `escrowctl status` concludes about the holder on one socket path."""

    state: str
    socket: str
    pid: int | None = None
    holder: HolderStatus | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def holder_verdict(socket_path: str, timeout: float) -> Verdict:
    """Ask the holder on `socket_path` for its status and judge from the answer.

    Read-only: it deletes nothing and takes no lock. For now the verdict is `running` when
    the socket answers `status`, else `not_running`; DESIGN §7's full table (lock, pidfile,
    leftovers) replaces this function without changing its callers.
    """
    evidence: dict[str, Any] = {"socket_exists": os.path.exists(socket_path)}
    try:
        status = EscrowClient(ADMIN_OWNER, socket_path=socket_path, timeout=timeout,
                              client_name=f"escrowctl pid={os.getpid()}").status()
    except errors.EscrowError as exc:
        evidence.update(answered_status=False, error=str(exc), error_code=exc.code)
        return Verdict("not_running", socket_path, evidence=evidence)
    evidence["answered_status"] = True
    return Verdict("running", socket_path, pid=status.pid, holder=status, evidence=evidence)


def cmd_status(args: argparse.Namespace) -> int:
    socket_path = paths.resolve_socket_path(args.socket)
    verdict = holder_verdict(socket_path, args.timeout)
    buffered: int | None = None
    if verdict.holder is not None:
        try:
            sessions = _admin(args).list(all_owners=True)
            buffered = sum(s.buffered_bytes for s in sessions)
        except errors.EscrowError:
            pass  # it answered `status` a moment ago; the summary just lacks this figure
    if args.json:
        _print_json({
            "state": verdict.state,
            "pid": verdict.pid,
            "socket": verdict.socket,
            "holder": _holder_dict(verdict.holder) if verdict.holder is not None else None,
            "evidence": verdict.evidence,
            "buffered_bytes": buffered,
        })
    else:
        print(_status_text(verdict, buffered))
    return STATUS_EXIT_CODES.get(verdict.state, 4)


def _holder_dict(status: HolderStatus) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.to_builtins(status)
    fields.pop("type", None)  # the message tag, not a field of the status
    return fields


def _status_text(verdict: Verdict, buffered: int | None) -> str:
    status = verdict.holder
    if status is None:
        why = verdict.evidence.get("error", "no answer")
        return (f"escrowd: {verdict.state.replace('_', ' ')} on {verdict.socket}\n"
                f"  {why}")
    by_state = ", ".join(f"{n} {state}" for state, n in sorted(status.sessions_by_state.items()))
    lines = [
        f"escrowd: {verdict.state} (pid {status.pid}, version {status.version})",
        f"  socket    {status.socket}",
        f"  uptime    {_duration(time.time() - status.started_at)}",
        f"  sessions  {by_state or 'none'}",
        f"  buffered  {_size(buffered) if buffered is not None else '?'} of replay",
        f"  open fds  {status.open_fds if status.open_fds is not None else '?'}",
        f"  rss       {_size(status.rss_bytes) if status.rss_bytes is not None else '?'}",
    ]
    return "\n".join(lines)


# --- list ---------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    if args.owner is None:
        sessions = _admin(args).list(all_owners=True)
    else:
        sessions = _client(args, args.owner).list()
    if args.json:
        _print_json([msgspec.to_builtins(s) for s in sessions])
    elif not sessions:
        where = f" of {args.owner}" if args.owner else ""
        print(f"no sessions{where}")
    else:
        print(_session_table(sessions, time.time()))
    return 0


_ALIVE = {True: "yes", False: "no", None: "?"}


def _session_table(sessions: Sequence[SessionInfo], now: float) -> str:
    header = ("SESSION", "STATE", "LABEL", "CHILD", "ALIVE", "BUFFERED", "DROPPED", "AGE")
    rows = [header] + [
        (
            f"{s.owner}/{s.id}",
            s.state,
            s.label or "-",
            str(s.child_pid) if s.child_pid is not None else "-",
            _ALIVE[s.child_alive],
            _size(s.buffered_bytes),
            _size(s.dropped_bytes),
            _duration(now - s.state_since),
        )
        for s in sessions
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {5, 6, 7}  # numbers line up on the right
    return "\n".join(
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
        for row in rows
    )


# --- release ------------------------------------------------------------------------------


def cmd_release(args: argparse.Namespace) -> int:
    owner, sid = args.session
    _client(args, owner).release(sid)
    print(f"released {owner}/{sid}: escrowd closed its copy of the terminal")
    return 0


def _session_ref(text: str) -> tuple[str, str]:
    """`OWNER/ID` for argparse: split on the first '/' and check both names."""
    owner, slash, sid = text.partition("/")
    if not slash:
        raise argparse.ArgumentTypeError(f"{text!r} is not OWNER/ID (e.g. com.example.term/tab-1)")
    for what, name in (("owner", owner), ("session id", sid)):
        if not _NAME_RE.fullmatch(name):
            raise argparse.ArgumentTypeError(
                f"{what} {name!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -")
    return owner, sid


# --- demo ---------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """DESIGN §9: a shell printing a counter survives its app's relaunch, shown live.

    Two separate processes play the app before and after its relaunch (escrow_client.demo
    `app` and `reclaim`); this one only sets the scene and cleans up if anything fails.
    """
    socket_path = paths.resolve_socket_path(args.socket)
    client = EscrowClient(demo.OWNER, socket_path=socket_path, timeout=args.timeout)
    try:
        welcome = client.welcome()
    except errors.HolderUnavailable:
        print(
            f"escrowctl demo: no holder is running on {socket_path}.\n"
            "Start one in another terminal, then run the demo again:\n"
            "    scripts/holder      (from a clone of fd-escrow)\n"
            "    escrowd             (where fd-escrow is installed)",
            file=sys.stderr,
        )
        return 1
    needs = welcome.drain_stop_budget + welcome.send_deadline
    if args.timeout <= needs:
        raise errors.EscrowConfigError(
            f"--timeout {args.timeout:g} must exceed the holder's drain_stop_budget + "
            f"send_deadline ({needs:g}s) for the demo to take its session back")
    sid = f"demo-{uuid.uuid4().hex[:8]}"
    common = ["--socket", socket_path, "--id", sid, "--timeout", str(args.timeout)]
    say = demo.say
    say("escrowctl demo: a shell keeps running, and loses no output, while its app restarts.")
    say(f"escrowd (pid {welcome.pid}) holds sessions on {socket_path}")
    with tempfile.TemporaryDirectory(prefix="escrowctl-demo-") as tmp:
        report_path = os.path.join(tmp, "app.json")
        report: dict[str, Any] = {}
        try:
            say("")
            say("1. Start an app. It runs a shell in a new terminal (a PTY); the shell prints a "
                "counter.")
            if _run_demo_part("app", [*common, "--report", report_path]) != 0:
                return 1
            report = _read_report(report_path)
            if not isinstance(report.get("shell_pid"), int):
                print("escrowctl demo: the app did not say which shell it started",
                      file=sys.stderr)
                return 1
            say("")
            say("3. The app is gone; escrowd is draining the shell's output...")
            time.sleep(demo.PAUSE)
            _show_escrowed(client, sid)
            say("")
            say("4. Start a fresh app process. It takes the terminal back from escrowd.")
            return _run_demo_part("reclaim", [
                *common, "--shell-pid", str(report["shell_pid"]),
                "--last-tick", str(report.get("last_tick", 0)),
            ])
        finally:
            report = report or _read_report(report_path)  # the app may have failed
            _demo_cleanup(client, sid, report)


def _read_report(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            report: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {}
    return report


def _run_demo_part(role: str, argv: list[str]) -> int:
    sys.stdout.flush()
    try:
        proc = subprocess.run([sys.executable, "-m", "escrow_client.demo", role, *argv],
                              stdin=subprocess.DEVNULL, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"escrowctl demo: the {role} step took over 60 s; stopped it", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(f"escrowctl demo: the {role} step failed (exit status {proc.returncode})",
              file=sys.stderr)
    return proc.returncode


def _show_escrowed(client: EscrowClient, sid: str) -> None:
    info = next((s for s in client.list() if s.id == sid), None)
    if info is None:
        demo.say(f"   escrowd: {sid} is unknown (?)")
        return
    demo.say(f"   escrowd: {sid} is {info.state}, {_size(info.buffered_bytes)} of output "
             f"buffered, shell alive: {_ALIVE[info.child_alive]}")


def _demo_cleanup(client: EscrowClient, sid: str, report: dict[str, Any]) -> None:
    """Leave nothing behind even when a step failed: release the session if escrowd still
    holds it, and end the shell if it still runs (and is still the same process)."""
    try:
        left = [s for s in client.list() if s.id == sid and s.state in protocol.LIVE_STATES]
        if left:
            client.release(sid)
            print(f"escrowctl demo: released {demo.OWNER}/{sid}, left over", file=sys.stderr)
    except errors.EscrowError as exc:
        print(f"escrowctl demo: could not clean up {sid}: {exc} ({exc.code})", file=sys.stderr)
    pid, started = report.get("shell_pid"), report.get("shell_start_time")
    if isinstance(pid, int) and demo.end_shell(pid, started):
        print(f"escrowctl demo: ended the demo shell (pid {pid}), left over", file=sys.stderr)


# --- plumbing -----------------------------------------------------------------------------


def _client(args: argparse.Namespace, owner: str) -> EscrowClient:
    return EscrowClient(owner, socket_path=args.socket, timeout=args.timeout,
                        client_name=f"escrowctl pid={os.getpid()}")


def _admin(args: argparse.Namespace) -> EscrowClient:
    return _client(args, ADMIN_OWNER)


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="escrowctl",
        description="Look at escrowd, the holder that keeps terminal sessions alive while "
        "their app restarts, and at the sessions it holds.",
    )
    parser.add_argument("--version", action="version", version=f"escrowctl {__version__}")
    parser.add_argument(
        "--socket", metavar="PATH",
        help=f"the holder's socket (default: ${paths.SOCKET_ENV}, else "
        "$XDG_RUNTIME_DIR/escrowd/escrowd.sock, else a per-user directory in the temp dir; "
        f"here and now: {paths.default_socket_path()})",
    )
    parser.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"deadline for each call to the holder (default {DEFAULT_TIMEOUT:g})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "status", help="is a holder running?",
        description="Say whether a holder answers on the socket, and summarise it. Exit "
        "status: 0 running, 1 dead (leftovers found), 3 not running, 4 indeterminate, "
        "150 unresponsive.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("list", help="list escrowed sessions (every owner's by default)")
    p.add_argument("--owner", metavar="OWNER", help="only this owner's sessions")
    p.add_argument("--json", action="store_true", help="print a JSON list of sessions")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser(
        "release", help="make the holder drop its copy of a session",
        description="Make the holder close its copy of a session's terminal (as when the user "
        "closes the tab). If no app holds the terminal either, its programs get SIGHUP.",
    )
    p.add_argument("session", metavar="OWNER/ID", type=_session_ref,
                   help="the session, as `escrowctl list` shows it")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser(
        "demo", help="watch a shell survive its app's restart",
        description="Run a shell printing a counter under a throwaway app, hand it to the "
        "holder, end the app, and take the shell back from a fresh process.",
    )
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except errors.EscrowError as exc:
        print(f"escrowctl: {exc} ({exc.code})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
