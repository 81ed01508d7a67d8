"""`escrowctl demo`: a shell printing a counter survives its app's relaunch, shown live
(docs/design.md §9).

Two separate processes play the app before and after its relaunch (`escrow_client.demo`'s
`app` and `reclaim` halves, which tell steps 2 and 5); this verb tells steps 1, 3 and 4,
runs the halves between them, shows what escrowd holds while no app runs, and cleans up if
anything fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from typing import Any

from .. import demo as halves
from .. import errors, paths
from ..client import EscrowClient
from . import describe
from .text import ALIVE, size


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
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
    halves.check_timeout(welcome, args.timeout)
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
            if halves.run_half("app", [*common, "--report", report_path]) != 0:
                return 1
            report = halves.read_report(report_path)
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
            return halves.run_half("reclaim", [
                *common, "--shell-pid", str(report["shell_pid"]),
                "--last-tick", str(report.get("last_tick", 0)),
            ])
        finally:
            report = report or halves.read_report(report_path)  # the app may have failed
            halves.leave_nothing(client, sid, report)


def _show_escrowed(client: EscrowClient, sid: str) -> None:
    info = next((s for s in client.list() if s.id == sid), None)
    if info is None:
        halves.say(f"   escrowd: {sid} is unknown (?)")
        return
    halves.say(f"   escrowd: {sid} is {info.state}, {size(info.buffered_bytes)} of output "
               f"buffered, shell alive: {ALIVE[info.child_alive]}")
