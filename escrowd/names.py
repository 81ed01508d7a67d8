"""The names a holder and its keeper share, apart from the code of either: what the fd store
keeps fds under (escrowd.fdstore says what each is), the variables a keeper passes a holder,
and the answers on their channel.

They live here so that the keeper, which has no event loop and must start fast, can name
them without loading the holder's modules (escrowd.fdstore brings trio with it).
"""

from __future__ import annotations

import array
import socket

HOLDER_NAME = "holder"
SESSION_PREFIX = "session-"
JOURNAL_PREFIX = "journal-"
# The fds a session may have in the store at once: its master, its state file and, while an
# app journals, the journal (escrow_client.journal).
FDS_PER_SESSION = 3
# The keeper's channel and its answers (escrowd.fdstore, escrowd.notify).
NOTIFY_FD_ENV = "ESCROWD_NOTIFY_FD"
STORE_ID, STORED, STORE_FAILED = "ESCROWD_STORE_ID", "ESCROWD_STORED", "ESCROWD_STORE_FAILED"
# A standby's end of its socket to the keeper (escrowd.standby, escrowd.takeover).
STANDBY_FD_ENV = "ESCROWD_STANDBY_FD"


def session_name(token: str) -> str:
    return SESSION_PREFIX + token


def journal_name(token: str) -> str:
    return JOURNAL_PREFIX + token


def is_store_name(name: str) -> bool:
    """A name this holder stores fds under (anything else passed is the listening socket,
    or not ours)."""
    return name == HOLDER_NAME or name.startswith((SESSION_PREFIX, JOURNAL_PREFIX))


def rights_for(fds: list[int]) -> list[tuple[int, int, bytes]]:
    """SCM_RIGHTS for any number of fds (fdpass.rights carries at most one)."""
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
