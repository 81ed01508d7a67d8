"""The holder at its file descriptor limit: which errors say so, what it answers then, and
the one fd it keeps in reserve.

Every session costs the holder fds (its master, its state file, maybe a journal), so a
holder with many sessions can run out. Out of fds, it never drops a connection (and with
it a custody) nor a session: each request that needs an fd it cannot have is answered
`limit` with `OUT_OF_FDS`, and a connection it cannot even accept is accepted with the
reserve fd, long enough to be told `limit` (escrowd.server).
"""

from __future__ import annotations

import errno
import os
import resource

from escrow_client.platform import open_fd_count

# Out of file descriptors: for this process (EMFILE) or the whole system (ENFILE).
FD_EXHAUSTION = {errno.EMFILE, errno.ENFILE}
OUT_OF_FDS = "the holder is out of file descriptors"


def out_of_fds() -> bool:
    """True when this process is at (or within a couple of) its open-file limit, or the
    system is out of files. (Counting needs an fd of its own, so try to open one first.)"""
    try:
        probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno in FD_EXHAUSTION
    os.close(probe)
    count = open_fd_count()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return count is not None and soft != resource.RLIM_INFINITY and count >= soft - 2


def open_reserve() -> int | None:
    """An fd to keep in reserve (None if not even that one can be had now)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
