"""`escrowctl demo`: a shell printing a counter survives its app's relaunch, shown live
(DESIGN §9).

Two separate processes play the app before and after its relaunch (`escrow_client.demo`'s
`app` and `reclaim` halves, which tell steps 2 and 5); this verb tells steps 1, 3 and 4,
runs the halves between them, shows what escrowd holds while no app runs, and cleans up if
anything fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from .. import demo as halves
from .. import errors, paths, protocol
from ..client import EscrowClient
from ..interpreter import CHILD_CWD, python_command
from .text import ALIVE, size


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo", help="watch a shell survive its app's restart",
        description="Run a shell printing a counter under a throwaway app, hand it to the "
        "holder, end the app, and take the shell back from a fresh process.",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    socket_path = paths.resolve_socket_path(args.socket)
    client = EscrowClient(halves.OWNER, socket_path=socket_path, timeout=args.timeout)
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
    say = halves.say
    say("escrowctl demo: a shell keeps running, and loses no output, while its app restarts.")
    say(f"escrowd (pid {welcome.pid}) holds sessions on {socket_path}")
    with tempfile.TemporaryDirectory(prefix="escrowctl-demo-") as tmp:
        report_path = os.path.join(tmp, "app.json")
        report: dict[str, Any] = {}
        try:
            say("")
            say("1. Start an app. It runs a shell in a new terminal (a PTY); the shell prints a "
                "counter.")
            if _run_half("app", [*common, "--report", report_path]) != 0:
                return 1
            report = _read_report(report_path)
            if not isinstance(report.get("shell_pid"), int):
                print("escrowctl demo: the app did not say which shell it started",
                      file=sys.stderr)
                return 1
            say("")
            say("3. The app is gone; escrowd is draining the shell's output...")
            time.sleep(halves.PAUSE)
            _show_escrowed(client, sid)
            say("")
            say("4. Start a fresh app process. It takes the terminal back from escrowd.")
            return _run_half("reclaim", [
                *common, "--shell-pid", str(report["shell_pid"]),
                "--last-tick", str(report.get("last_tick", 0)),
            ])
        finally:
            report = report or _read_report(report_path)  # the app may have failed
            _cleanup(client, sid, report)


def _show_escrowed(client: EscrowClient, sid: str) -> None:
    info = next((s for s in client.list() if s.id == sid), None)
    if info is None:
        halves.say(f"   escrowd: {sid} is unknown (?)")
        return
    halves.say(f"   escrowd: {sid} is {info.state}, {size(info.buffered_bytes)} of output "
               f"buffered, shell alive: {ALIVE[info.child_alive]}")


def _read_report(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            report: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {}
    return report


def _run_half(role: str, argv: list[str]) -> int:
    sys.stdout.flush()
    try:
        proc = subprocess.run(python_command("escrow_client.demo", role, *argv),
                              stdin=subprocess.DEVNULL, cwd=CHILD_CWD, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"escrowctl demo: the {role} step took over 60 s; stopped it", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(f"escrowctl demo: the {role} step failed (exit status {proc.returncode})",
              file=sys.stderr)
    return proc.returncode


def _cleanup(client: EscrowClient, sid: str, report: dict[str, Any]) -> None:
    """Leave nothing behind even when a step failed: release the session if escrowd still
    holds it, and end the shell if it still runs (and is still the same process)."""
    try:
        left = [s for s in client.list() if s.id == sid and s.state in protocol.LIVE_STATES]
        if left:
            client.release(sid)
            print(f"escrowctl demo: released {halves.OWNER}/{sid}, left over", file=sys.stderr)
    except errors.EscrowError as exc:
        print(f"escrowctl demo: could not clean up {sid}: {exc} ({exc.code})", file=sys.stderr)
    pid, started = report.get("shell_pid"), report.get("shell_start_time")
    if isinstance(pid, int) and halves.end_shell(pid, started):
        print(f"escrowctl demo: ended the demo shell (pid {pid}), left over", file=sys.stderr)
