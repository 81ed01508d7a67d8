"""The service files that start `escrowd`: systemd user units and a LaunchAgent, written for
where escrowd really is (`escrowctl install-service`).

One source for each text: the files shipped in `systemd/` and `launchd/` are these
functions' output for a `pipx install` (a test keeps them equal), and `install-service`
writes the same text with the paths of the running installation (`install_plan`: which
files, where, and what to run after writing them).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from . import paths
from .interpreter import python_command

LAUNCHD_LABEL = "com.fd-escrow.escrowd"
# Where `pipx install` (and `pip install --user`) put console scripts: the shipped files
# assume it, as the systemd specifier and as the macOS home of the placeholder user.
SHIPPED_SYSTEMD_ESCROWD = "%h/.local/bin/escrowd"
SHIPPED_LAUNCHD_HOME = "/Users/USERNAME"
# The systemd socket: the default path under $XDG_RUNTIME_DIR (%t), as clients compute it.
SYSTEMD_SOCKET = "%t/escrowd/escrowd.sock"


def escrowd_command() -> list[str]:
    """How to run this installation's escrowd: its console script beside the running
    interpreter (a venv's or pipx's bin/), else `python -m escrowd` with that interpreter."""
    script = Path(sys.executable).parent / "escrowd"
    if os.access(script, os.X_OK):
        return [str(script)]
    return python_command("escrowd")


class ServiceFileError(ValueError):
    """A path or argument that a unit file or plist could not carry as it is."""


# escrowd's default --max-sessions, and the fds a session may have in the store at once
# (escrowd.config and escrowd.fdstore say the same; a test holds them equal).
DEFAULT_MAX_SESSIONS = 2048
FDS_PER_SESSION = 3


def store_size(extra_args: list[str] | None) -> int:
    """The FileDescriptorStoreMax= that holds every session escrowd's arguments allow, and
    the holder's own state file (a holder refuses to start with a cap its store cannot
    hold)."""
    sessions = DEFAULT_MAX_SESSIONS
    args = extra_args or []
    for i, arg in enumerate(args):
        value = (arg.partition("=")[2] if arg.startswith("--max-sessions=")
                 else args[i + 1] if arg == "--max-sessions" and i + 1 < len(args) else None)
        if value is not None:
            try:
                sessions = int(value)
            except ValueError:
                raise ServiceFileError(f"--max-sessions {value!r} is not a number") from None
    return sessions * FDS_PER_SESSION + 1


def systemd_service(command: list[str], socket_path: str = SYSTEMD_SOCKET,
                    extra_args: list[str] | None = None) -> str:
    store_max = store_size(extra_args)
    words = [*command, "--bare", "--socket", socket_path, *(extra_args or [])]
    exec_start = shlex.join(
        [_unit_word(words[0], variables=False)] + [_unit_word(w) for w in words[1:]])
    return f"""\
# fd-escrow: the per-user holder of PTY masters. Install: `escrowctl install-service`
# writes this file with the path of your escrowd (see docs/operations.md, "Running under systemd").
[Unit]
Description=fd-escrow holder (escrowd): keeps terminal sessions alive while apps restart
Requires=escrowd.socket
After=escrowd.socket
# No start limit: a unit that hits one fails, and a failed unit's fd store is released with
# every session in it. The default (5 starts in 10 s) did that to the fifth restart in a
# row, and to an upgrade whose holder cannot start (measured on systemd 252). Without it,
# systemd keeps the fds and tries again every RestartSec= until a holder starts.
StartLimitIntervalSec=0

[Service]
# escrowd writes READY=1 on $NOTIFY_SOCKET once it serves, STATUS= lines (how many sessions
# it holds), WATCHDOG=1 every WatchdogSec/2 and STOPPING=1 when it stops. Only escrowd
# itself (the main process) writes there.
Type=notify
NotifyAccess=main
# The socket comes from escrowd.socket (LISTEN_FDS); --socket must name the same path, so
# that the lock, the pidfile and `escrowctl status` all refer to the socket clients use.
# --bare: systemd itself keeps the sessions' fds while no holder runs (no keeper needed).
ExecStart={exec_start}
# The pings come from the holder's event loop: a wedged holder stops pinging and is
# restarted.
WatchdogSec=30
# Only escrowd itself is ever signalled: the children of escrowed sessions belong to their
# apps (and to the apps' cgroups), and nothing in this unit may kill them by accident.
KillMode=process
# The escrow outlives the holder: every session's PTY master and state file (and an app's
# journal) wait in systemd's fd store (the holder stores them with FDSTORE=1, FDPOLL=0)
# while no holder runs, and the next holder adopts them. Three fds per session at most:
# room for every session --max-sessions allows and the holder's own state (a holder
# refuses to start with a cap its store cannot hold).
FileDescriptorStoreMax={store_max}
# systemd 254 and later keep the store across a stop too; 252 keeps it across a restart
# (systemctl restart, Restart=, the watchdog) but drops it on a stop.
FileDescriptorStorePreserve=yes
# Any exit restarts the holder, which adopts every stored session: a crash, a watchdog
# timeout, an upgrade (`systemctl --user restart escrowd`).
Restart=always
RestartSec=0.2
# Give the holder time to finish the handoffs under way and flush its state.
TimeoutStopSec=20

[Install]
WantedBy=default.target
Also=escrowd.socket
"""


def systemd_socket(socket_path: str = SYSTEMD_SOCKET) -> str:
    return f"""\
# fd-escrow: the holder's socket, owned by the user's systemd so the holder can start on
# first connection. Install: `escrowctl install-service` (see docs/operations.md).
[Unit]
Description=fd-escrow holder socket (escrowd)

[Socket]
# The default socket path is $XDG_RUNTIME_DIR/escrowd/escrowd.sock (%t/escrowd/escrowd.sock).
ListenStream={_unit_word(socket_path, variables=False)}
SocketMode=0600
DirectoryMode=0700
# Keep the socket file when stopping, so clients see "refused" (a holder may come back).
RemoveOnStop=no

[Install]
WantedBy=sockets.target
"""


# What a word of ExecStart= or ListenStream= may hold here: anything else (quotes,
# backslashes, control characters) systemd would read differently, or refuse.
_UNIT_SAFE = re.compile(r"[A-Za-z0-9 ._/@+=,:~%$-]*")


def _unit_word(word: str, variables: bool = True) -> str:
    """`word` as a literal in a unit file: % starts a specifier everywhere, and $ a variable
    in the arguments of ExecStart= (not in its executable, nor in ListenStream=). The two
    specifiers this module means (%h, %t) are kept."""
    if word in (SHIPPED_SYSTEMD_ESCROWD, SYSTEMD_SOCKET):
        return word
    if not _UNIT_SAFE.fullmatch(word):
        raise ServiceFileError(
            f"{word!r} holds characters a systemd unit cannot carry as they are (quotes, "
            "backslashes, control characters): install where the path is plain")
    word = word.replace("%", "%%")
    return word.replace("$", "$$") if variables else word


def launchd_plist(command: list[str], socket_path: str, log_path: str,
                  extra_args: list[str] | None = None) -> str:
    """The LaunchAgent. It pins the socket path: launchd gives an agent a $TMPDIR of its
    own, and the agent, the apps and a shell must all agree on one path."""
    argv = [*command, "--socket", socket_path, *(extra_args or [])]
    arguments = "\n".join(f"        <string>{escape(a)}</string>" for a in argv)
    log = escape(log_path)
    return f"""\
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<!-- fd-escrow: the per-user holder as a LaunchAgent. Install: `escrowctl install-service`
     writes this file with the path of your escrowd and your socket (see docs/operations.md,
     "Running under launchd"). -->
<plist version="1.0">
<dict>
    <key>Label</key>
    <string>{LAUNCHD_LABEL}</string>
    <key>ProgramArguments</key>
    <array>
{arguments}
    </array>
    <key>RunAtLoad</key>
    <true/>
    <!-- Restart after a crash, not after a clean stop. -->
    <key>KeepAlive</key>
    <dict>
        <key>SuccessfulExit</key>
        <false/>
    </dict>
    <!-- Not Background: launchd throttles the CPU and I/O of Background jobs, and the holder
         must keep draining terminals and answer an app's handoff within its deadlines. -->
    <key>ProcessType</key>
    <string>Standard</string>
    <key>StandardOutPath</key>
    <string>{log}</string>
    <key>StandardErrorPath</key>
    <string>{log}</string>
</dict>
</plist>
"""


def shipped_files() -> dict[str, str]:
    """The texts of the files in the source tree, by path relative to its root."""
    home = SHIPPED_LAUNCHD_HOME
    return {
        "systemd/escrowd.service": systemd_service([SHIPPED_SYSTEMD_ESCROWD]),
        "systemd/escrowd.socket": systemd_socket(),
        f"launchd/{LAUNCHD_LABEL}.plist": launchd_plist(
            [f"{home}/.local/bin/escrowd"], "/tmp/escrowd-UID/escrowd.sock",
            f"{home}/Library/Logs/escrowd.log"),
    }


# --- what install-service writes -----------------------------------------------------------


@dataclass(frozen=True)
class InstallPlan:
    """The files that start `command` serving `socket_path`, by where they go, and what the
    user runs next to start it."""

    command: list[str]
    socket_path: str
    files: dict[Path, str]
    next_steps: list[str]


def install_plan(kind: str, escrowd: str | None, socket: str | None,
                 extra_args: list[str]) -> InstallPlan:
    """The LaunchAgent (`kind` "launchd") or the systemd user units ("systemd") for
    `escrowd` (default: this installation's, `escrowd_command`) on `socket` (default: the
    path an app computes for the service manager's holder), with escrowd's `extra_args`."""
    command = [escrowd] if escrowd else escrowd_command()
    home = Path.home()
    if kind == "launchd":
        # Pinned to what an app computes: a GUI app sees neither $ESCROW_SOCKET nor
        # $XDG_RUNTIME_DIR from this shell.
        socket_path = os.path.abspath(socket) if socket else os.path.join(
            paths.SHARED_TMP, f"escrowd-{os.getuid()}", "escrowd.sock")
        plist = home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        files = {plist: launchd_plist(command, socket_path,
                                      str(home / "Library" / "Logs" / "escrowd.log"),
                                      extra_args)}
        agent = f"gui/{os.getuid()}/{LAUNCHD_LABEL}"
        next_steps = [f"launchctl bootout {agent} 2>/dev/null; "
                      f"launchctl bootstrap gui/{os.getuid()} {shlex.quote(str(plist))}",
                      f"launchctl print {agent}"]
    else:
        socket_path = os.path.abspath(socket) if socket else SYSTEMD_SOCKET
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        unit_dir = config / "systemd" / "user"
        files = {unit_dir / "escrowd.service": systemd_service(command, socket_path, extra_args),
                 unit_dir / "escrowd.socket": systemd_socket(socket_path)}
        next_steps = ["systemctl --user daemon-reload",
                      "systemctl --user enable --now escrowd.socket",
                      "escrowctl status"]
    return InstallPlan(command, socket_path, files, next_steps)
