"""Undoing `escrowctl install-service`: the systemd user units or the LaunchAgent it wrote,
disabled and removed; never a file it did not write, never a holder stopped unannounced.

A file is install-service's own only when its text is, to the byte, what
`service_files` renders for the words it names (the escrowd command, the socket, escrowd's
arguments, read back from the file): a unit the user edited, or someone else's file by the
same name, is left where it is, and said so. Removing the files stops nothing: systemd runs
a loaded unit on after its file is gone, and a LaunchAgent's holder runs until it is booted
out. Stopping the holder hangs up every terminal no app holds, so it is never done here
without a word: a holder that runs is named, with its sessions, and `escrowctl stop` is
the way to stop it (which refuses while sessions are escrowed). On macOS the agent is
booted out only while its holder holds nothing (bootout stops it).

Nor are the files removed while the service's holder holds sessions, unless forced: with the
units gone, a crash of that holder has no `Restart=` and no fd store to come back to (a
LaunchAgent's, no KeepAlive). "Holds none" needs positive proof (`service_holder`): the
holder answered with no live session, or none runs (systemd runs no holder of the service,
or `holder_verdict` says `not_running`/`dead`). A lock file that is missing or free proves
nothing (anyone can remove it); anything that cannot be told is "cannot tell", never 0.

Order, systemd: `systemctl --user disable` (the links that would start it at login), the
files removed, `daemon-reload`. launchd: `launchctl bootout` (if nothing is held), the
plist removed.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import service_files
from .liveness import STATUS_TIMEOUT, Verdict, holder_verdict, read_lock
from .protocol import LIVE_STATES
from .service_files import LAUNCHD_LABEL, SYSTEMD_SOCKET, install_plan

UNITS = ("escrowd.socket", "escrowd.service")
_COMMAND_TIMEOUT = 30.0


@dataclass
class Removal:
    """What uninstall found and did. `ours`: the files install-service wrote (removed,
    unless `dry`); `foreign`: files by those names whose text is not what it writes (left);
    `socket_path`: the socket the files named (None if none could be read); `done`: the
    commands run, and `failed` those that did not succeed, with their output."""

    kind: str
    ours: list[Path] = field(default_factory=list)
    foreign: list[Path] = field(default_factory=list)
    socket_path: str | None = None
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def find(kind: str) -> Removal:
    """The files install-service would write for `kind` ("systemd" or "launchd"), sorted
    into its own and others'. Reads only."""
    removal = Removal(kind)
    for path in install_plan(kind, None, None, []).files:
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError):
            removal.foreign.append(path)  # cannot be read: cannot be proved ours
            continue
        socket_path = _rendered_socket(kind, path.name, text)
        if socket_path is None:
            removal.foreign.append(path)
        else:
            removal.ours.append(path)
            removal.socket_path = removal.socket_path or socket_path
    return removal


def _rendered_socket(kind: str, name: str, text: str) -> str | None:
    """The socket path `text` names, if `text` is exactly what install-service renders for
    the words it holds; else None."""
    try:
        if kind == "launchd":
            argv = plistlib.loads(text.encode())["ProgramArguments"]
            at = argv.index("--socket")
            command, socket_path, extra = argv[:at], argv[at + 1], argv[at + 2:]
            log = str(Path.home() / "Library" / "Logs" / "escrowd.log")
            rendered = service_files.launchd_plist(command, socket_path, log, extra)
        elif name == "escrowd.socket":
            [listen] = [line for line in text.splitlines() if line.startswith("ListenStream=")]
            socket_path = _literal(listen.partition("=")[2])
            rendered = service_files.systemd_socket(socket_path)
        else:
            [start] = [line for line in text.splitlines() if line.startswith("ExecStart=")]
            words = [_literal(w) for w in shlex.split(start.partition("=")[2])]
            at = words.index("--bare")
            if words[at + 1] != "--socket":
                return None
            command, socket_path, extra = words[:at], words[at + 2], words[at + 3:]
            rendered = service_files.systemd_service(command, socket_path, extra)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError,
            plistlib.InvalidFileException, service_files.ServiceFileError):
        return None
    return socket_path if rendered == text else None


def _literal(word: str) -> str:
    """A unit file's word as install-service was given it (`service_files._unit_word`
    backwards); a wrong guess only makes the comparison fail, which keeps the file."""
    if word in (service_files.SHIPPED_SYSTEMD_ESCROWD, SYSTEMD_SOCKET):
        return word
    return word.replace("$$", "$").replace("%%", "%")


def socket_of(removal: Removal) -> str | None:
    """The socket the removed files served, as a client names it (`%t` resolved)."""
    path = removal.socket_path
    if path is None or not path.startswith("%t/"):
        return path
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, path[3:]) if runtime else None


def service_holder(kind: str, socket: str | None) -> tuple[Verdict | None, int | None]:
    """The verdict on the holder of the service's `socket` (None if none was asked for),
    and the live sessions it holds: 0 only on positive proof, None when it cannot be told.

    Under systemd the socket is connected to only while systemd says the service runs (or
    a process holds the lock): a connection to a socket unit that only listens would start
    a holder (socket activation) just to be told it is there."""
    if socket is None:
        return None, None
    if kind == "systemd":
        state = _service_state()
        if state is None:
            return None, None
        if state in ("inactive", "failed") and read_lock(socket).state != "held":
            return None, 0  # systemd runs no holder of the service
    verdict = holder_verdict(socket, STATUS_TIMEOUT, list_sessions=True)
    if verdict.state in ("not_running", "dead"):
        return verdict, 0
    if verdict.state != "running" or verdict.sessions is None:
        return verdict, None
    return verdict, sum(s.state in LIVE_STATES for s in verdict.sessions)


def _service_state() -> str | None:
    """systemd's ActiveState of escrowd.service, None if systemctl cannot say."""
    argv = ["systemctl", "--user", "show", "--property=ActiveState", "--value",
            "escrowd.service"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT,
                                stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = result.stdout.strip()
    return state if result.returncode == 0 and state else None


def remove(removal: Removal, holds_sessions: bool | None) -> None:
    """Disable, remove `removal.ours`, reload. `holds_sessions`: whether a holder on the
    socket holds sessions (None: cannot tell); on macOS only a holder holding none (known)
    is booted out."""
    if not removal.ours:
        return
    if removal.kind == "launchd":
        if holds_sessions is False:
            _run(removal, ["launchctl", "bootout", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"])
    else:
        units = [p.name for p in removal.ours]
        _run(removal, ["systemctl", "--user", "disable", *units])
    for path in removal.ours:
        path.unlink(missing_ok=True)
    if removal.kind == "systemd":
        _run(removal, ["systemctl", "--user", "daemon-reload"])


def _run(removal: Removal, argv: list[str]) -> None:
    line = shlex.join(argv)
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT,
                                stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        removal.failed.append(f"{line}: {exc}")
        return
    if result.returncode == 0:
        removal.done.append(line)
    else:
        removal.failed.append(f"{line}: {(result.stderr or result.stdout).strip()}")
