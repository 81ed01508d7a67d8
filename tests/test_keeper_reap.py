"""The keeper takes every notification a holder sent before it died, whenever it reaps it.

Incident pinned (found by reasoning over `bench/chaos.py --kill-holder`): the keeper drained
its notify socket, and only then reaped its holder; a holder that sent FDSTORE (a deposit it
then answered `deposited`) or FDSTOREREMOVE (a handoff it completed) and died between the
two had its message refused as one "not from the holder", since the keeper had already
forgotten that pid. The deposited session's fds were closed (the session lost), or the
handed-off session's fds stayed stored (adopted and drained by the next holder while the app
read it: two readers).

Here the order is forced: the holder (a forked process standing in for it) sends its
message and exits, and the keeper reaps it before it has looked at its notify socket.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from escrowd import keeper
from escrowd.fdstore import rights_for


def _holder_sends_and_dies(path: str, message: bytes, fds: list[int]) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendmsg([message], rights_for(fds), 0, path)
            code = 0
        finally:
            os._exit(code)
    # Dead, not yet reaped: the keeper reaps it.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    return pid


@pytest.fixture
def the_keeper(tmp_path: Path) -> Iterator[keeper.Keeper]:
    notify_path = str(tmp_path / "escrowd.sock.notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    notify = keeper._notify_socket(notify_path)
    k = keeper.Keeper(listener, notify, notify_path, [])
    yield k
    k._close_store()
    notify.close()
    listener.close()


def test_a_store_message_sent_just_before_dying_is_kept(the_keeper: keeper.Keeper) -> None:
    r, w = os.pipe()
    try:
        the_keeper.holder = _holder_sends_and_dies(
            the_keeper.notify_path, b"FDSTORE=1\nFDNAME=session-abc\nFDPOLL=0", [r])
        the_keeper._reap()
        assert the_keeper.holder is None
        the_keeper._messages()
        (stored,) = the_keeper.store["session-abc"]
        assert os.path.samestat(os.fstat(stored), os.fstat(r))
    finally:
        os.close(r)
        os.close(w)


def test_a_remove_message_sent_just_before_dying_is_acted_on(
    the_keeper: keeper.Keeper,
) -> None:
    r, w = os.pipe()
    os.close(r)
    the_keeper.store["session-abc"] = [w]
    the_keeper.holder = _holder_sends_and_dies(
        the_keeper.notify_path, b"FDSTOREREMOVE=1\nFDNAME=session-abc", [])
    the_keeper._reap()
    the_keeper._messages()
    assert "session-abc" not in the_keeper.store
    with pytest.raises(OSError):
        os.fstat(w)  # the keeper closed its copy
