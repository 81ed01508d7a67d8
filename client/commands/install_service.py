"""`escrowctl install-service`: write the systemd user units (Linux) or the LaunchAgent
(macOS) for this installation's escrowd, and say what to run next. Starts nothing itself.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from .. import errors, paths, service_files


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "install-service", help="write the systemd units or the LaunchAgent for this escrowd",
        description="Write the service files that start escrowd at login and restart it if "
        "it crashes: systemd user units (escrowd.socket, escrowd.service) in "
        "~/.config/systemd/user on Linux, or a LaunchAgent in ~/Library/LaunchAgents on "
        "macOS, naming the escrowd of this installation and the socket that apps use. "
        "Arguments after -- go to escrowd (e.g. -- --unclaimed-ttl 0).",
    )
    p.add_argument("--systemd", dest="kind", action="store_const", const="systemd",
                   help="systemd user units (the default on Linux)")
    p.add_argument("--launchd", dest="kind", action="store_const", const="launchd",
                   help="a LaunchAgent (the default on macOS)")
    p.add_argument("--escrowd", metavar="PATH", help="the escrowd to run (default: "
                   f"{shlex.join(service_files.escrowd_command())})")
    p.add_argument("--print", action="store_true", help="print the files instead of writing them")
    p.add_argument("escrowd_args", nargs=argparse.REMAINDER, metavar="-- ESCROWD_ARGS",
                   help="arguments for escrowd")
    p.set_defaults(func=run, kind="launchd" if sys.platform == "darwin" else "systemd")


def run(args: argparse.Namespace) -> int:
    command = [args.escrowd] if args.escrowd else service_files.escrowd_command()
    extra = args.escrowd_args[1:] if args.escrowd_args[:1] == ["--"] else args.escrowd_args
    if any(a == "--socket" or a.startswith("--socket=") for a in extra):
        raise errors.EscrowConfigError("give the socket as `escrowctl --socket PATH "
                                       "install-service`, not among escrowd's arguments")
    home = Path.home()
    if args.kind == "launchd":
        # Pinned to what an app computes: a GUI app sees neither $ESCROW_SOCKET nor
        # $XDG_RUNTIME_DIR from this shell.
        socket_path = os.path.abspath(args.socket) if args.socket else os.path.join(
            paths.SHARED_TMP, f"escrowd-{os.getuid()}", "escrowd.sock")
        files = {home / "Library" / "LaunchAgents" / f"{service_files.LAUNCHD_LABEL}.plist":
                 service_files.launchd_plist(command, socket_path,
                                             str(home / "Library" / "Logs" / "escrowd.log"),
                                             extra)}
        agent = f"gui/{os.getuid()}/{service_files.LAUNCHD_LABEL}"
        plist = next(iter(files))
        next_steps = [f"launchctl bootout {agent} 2>/dev/null; "
                      f"launchctl bootstrap gui/{os.getuid()} {shlex.quote(str(plist))}",
                      f"launchctl print {agent}"]
    else:
        socket_path = (os.path.abspath(args.socket) if args.socket
                       else service_files.SYSTEMD_SOCKET)
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        unit_dir = config / "systemd" / "user"
        files = {unit_dir / "escrowd.service":
                 service_files.systemd_service(command, socket_path, extra),
                 unit_dir / "escrowd.socket": service_files.systemd_socket(socket_path)}
        next_steps = ["systemctl --user daemon-reload",
                      "systemctl --user enable --now escrowd.socket",
                      "escrowctl status"]
    for path, text in files.items():
        if args.print:
            print(f"# {path}\n{text}")
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as exc:
            raise errors.EscrowConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
        print(f"wrote {path}")
    if not args.print:
        print(f"escrowd: {shlex.join(command)}, serving {socket_path}\nnext:")
        for step in next_steps:
            print(f"  {step}")
    return 0
