"""Which process serves a socket: the holder, told apart from its keeper.

Under the keeper (escrowd's default), the process that listens on the socket, whose pid
the peer credentials give, is the keeper: it binds the socket and passes it to the holder
it runs as its child. A wedged holder leaves its keeper answering for it, so "pid K does
not answer" would name a process that is fine. The holder that serves writes its pid and
start time to the pidfile (escrowd.lifecycle); that pid is believed only with proof that
it is the listener's own holder:

- the pidfile is read only in a socket directory `trust` accepted (this uid's, closed to
  others), without following a link or opening anything but a regular file;
- its process is alive and started when the pidfile says (not a reused pid);
- it is the listener itself (a holder without a keeper), or the listener's child.

Anything short of that is None: "not known", never a guess. (The standby holder a keeper
keeps loaded is its child too, but writes no pidfile until it serves.)
"""

from __future__ import annotations

from . import liveness, paths, processes


def serving_holder(socket_path: str, listener_pid: int | None) -> int | None:
    """The pid of the holder serving `socket_path`, whose listener (peer credentials) is
    `listener_pid`; None if it cannot be proved. Call only once the socket's directory
    passed `trust.check_socket_dir`."""
    if listener_pid is None:
        return None
    record = paths.read_pidfile(socket_path)
    if record is None or liveness.process_alive(record.pid, record.start_time) is not True:
        return None
    if record.pid == listener_pid:
        return record.pid
    try:
        parent = processes.process_parent(record.pid)
    except (processes.NoSuchProcess, OSError, ValueError, IndexError):
        return None
    return record.pid if parent == listener_pid else None
