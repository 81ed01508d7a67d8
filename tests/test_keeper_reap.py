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

import pytest

from escrowd import keeper
from escrowd.fdstore import rights_for


def _holder_sends_and_dies(end: socket.socket, message: bytes, fds: list[int]) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            end.sendmsg([message], rights_for(fds))
            code = 0
        finally:
            os._exit(code)
    # Dead, not yet reaped: the keeper reaps it.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    return pid


@pytest.fixture
def the_keeper() -> Iterator[tuple[keeper.Keeper, socket.socket]]:
    """A keeper and the holder's end of its channel, as a started holder has them."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    k = keeper.Keeper(listener, [])
    k.channel, holder_end = keeper.channel_pair()
    k.poller.register(k.channel)
    yield k, holder_end
    k._close_channel()
    holder_end.close()
    k._close_store()
    listener.close()


def test_a_store_message_sent_just_before_dying_is_kept(
    the_keeper: tuple[keeper.Keeper, socket.socket],
) -> None:
    k, holder_end = the_keeper
    r, w = os.pipe()
    try:
        k.holder = _holder_sends_and_dies(
            holder_end, b"FDSTORE=1\nFDNAME=session-abc\nFDPOLL=0", [r])
        k._reap()
        assert k.holder is None
        (stored,) = k.store["session-abc"]
        assert os.path.samestat(os.fstat(stored), os.fstat(r))
    finally:
        os.close(r)
        os.close(w)


def test_a_remove_message_sent_just_before_dying_is_acted_on(
    the_keeper: tuple[keeper.Keeper, socket.socket],
) -> None:
    k, holder_end = the_keeper
    r, w = os.pipe()
    os.close(r)
    k.store["session-abc"] = [w]
    k.holder = _holder_sends_and_dies(holder_end, b"FDSTOREREMOVE=1\nFDNAME=session-abc", [])
    k._reap()
    assert "session-abc" not in k.store
    with pytest.raises(OSError):
        os.fstat(w)  # the keeper closed its copy
