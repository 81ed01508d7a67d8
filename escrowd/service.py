"""Service-manager glue: systemd's notify socket and socket activation, without libsystemd."""

from __future__ import annotations

import os
import socket
import stat

SD_LISTEN_FDS_START = 3


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to $NOTIFY_SOCKET; False if there is none or it fails."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False


def activated_listener() -> socket.socket | None:
    """The listening socket systemd passed (LISTEN_FDS/LISTEN_PID), or None.

    The variables are removed so that children never mistake them for their own. A passed
    fd that is not a listening Unix stream socket is refused with ValueError.
    """
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    os.environ.pop("LISTEN_PID", None)
    os.environ.pop("LISTEN_FDS", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid is None or count is None or pid != str(os.getpid()) or int(count) < 1:
        return None
    fd = SD_LISTEN_FDS_START
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        raise ValueError(f"fd {fd} passed by the service manager is not a socket")
    sock = socket.socket(fileno=fd)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ValueError(f"fd {fd} passed by the service manager is not a Unix stream socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise ValueError(f"fd {fd} passed by the service manager is not listening")
    sock.set_inheritable(False)
    return sock
