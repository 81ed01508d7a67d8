"""What to do next, for an error that says what is wrong with a socket path.

An error that only says "refusing" or "unavailable" leaves a person guessing, and a
guess can be harmful: `chmod go-w /tmp` would break every other user of /tmp. So each
piece of advice here changes only what the user owns: start a holder, or pick a socket
path in a directory of their own (the default one, when that is not the path refused).
A directory is never advised a chmod unless this uid owns it and it is not a shared one
(sticky, like /tmp: open to everyone by intent).

Only words: nothing here decides whether a path is trusted (that is `trust`), and what it
looks at (lstat of the path) is used for nothing but the sentence.
"""

from __future__ import annotations

import os
import stat

from . import paths, platform


def start_holder(socket_path: str) -> str:
    """How to start a holder on `socket_path`; or, where no holder could start (a
    directory it would refuse, or one unsafe to create), where to put the socket instead.
    The service is named only for the default socket, the one install-service's units use
    (unless told otherwise)."""
    directory = os.path.dirname(socket_path)
    if paths.refusal(directory) is not None or paths.creation_hazard(directory) is not None:
        return f"no holder can start there: {own_directory(socket_path)}"
    service = ""
    if socket_path == paths.standard_socket_path():
        if platform.IS_MACOS:
            from .service_files import LAUNCHD_LABEL  # only for this sentence, only on macOS

            command = f"`launchctl kickstart gui/{os.getuid()}/{LAUNCHD_LABEL}`"
        else:
            command = "`systemctl --user start escrowd.socket`"
        service = f", or {command} if `escrowctl install-service` wrote its service"
    return (f"start one with `escrowd --socket {socket_path}` (`scripts/holder` in a "
            f"checkout){service}; `escrowctl run` starts one itself")


def own_directory(socket_path: str) -> str:
    """Where to put the socket instead of `socket_path`, whose directory is not usable."""
    standard = paths.standard_socket_path()
    if os.path.dirname(os.path.abspath(standard)) != os.path.dirname(socket_path):
        return (f"use a socket path in a directory you own, closed to others (mode 0700), "
                f"such as the default {standard} (drop --socket and ${paths.SOCKET_ENV})")
    return (f"use a socket path in another directory you own, closed to others (mode 0700), "
            f"with --socket or ${paths.SOCKET_ENV}")


def open_directory(socket_path: str, mode: int, owner: int) -> str:
    """What to do about the directory of `socket_path`, open to writes by group or others
    (`mode` and `owner` as lstat found them)."""
    directory = os.path.dirname(socket_path)
    if owner == os.getuid() and not mode & stat.S_ISVTX and not _shared(directory):
        return (f"if that directory is yours alone, `chmod go-w {directory}`; else "
                f"{own_directory(socket_path)}")
    return f"it is a shared directory: {own_directory(socket_path)}"


def _shared(directory: str) -> bool:
    """A directory whose mode others depend on: /tmp, one at the root (/run, /var), the
    home or one above it."""
    real = os.path.realpath(directory)
    home = os.path.realpath(os.path.expanduser("~"))
    return (real in (paths.SHARED_TMP, home) or os.path.dirname(real) == "/"
            or home.startswith(real.rstrip("/") + "/"))


def not_a_socket(socket_path: str) -> str | None:
    """What is wrong with what `socket_path` names, if it is something no holder can
    listen on (a directory, a regular file...), and what to give instead; else None."""
    try:
        mode = os.lstat(socket_path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISSOCK(mode):
        return None
    if stat.S_ISDIR(mode):
        inside = os.path.join(socket_path, "escrowd.sock")
        try:
            st = os.stat(socket_path)
            ours = st.st_uid == os.getuid() and not st.st_mode & 0o022
        except OSError:
            ours = False
        instead = (f"give the socket's own path, such as {inside}" if ours
                   else own_directory(inside))
        return f"{socket_path} is a directory, not a socket: {instead}"
    kind = "a regular file" if stat.S_ISREG(mode) else "not a socket"
    if stat.S_ISLNK(mode):
        kind = "a symlink"
    return (f"{socket_path} is {kind}, not the socket of a holder (nothing can listen "
            f"there): give the holder's socket path, such as {paths.standard_socket_path()}")
