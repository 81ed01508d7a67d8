"""Adoption (escrowd.adoption), in-process: what a restarted holder makes of the fd store.

A SIGKILL cannot be aimed between two lines of the holder, so what a killed holder leaves is
made here by hand (real memfd state files and real PTY masters) and adopted by `adopt` under
trio, as a restarted holder does with what the fd store passed it; the fd store is a
datagram socket the test owns and reads.

Incidents pinned:
- a holder killed while a handoff swept the terminal (the session recorded `handing_off`)
  lost the bytes of the sweep's read in flight, and the next holder marked no gap: the
  replay ran on as if seamless;
- a holder took its own state file (its restart counters) out of the store at the start of
  adoption, to store it again at the end: killed in between (seen in `bench/chaos.py
  --kill-holder`), it lost the file, and the next holder reported 0 restarts, 0 unclean.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest
import trio

from escrowd.adoption import Adoption, adopt
from escrowd.config import Config
from escrowd.fdstore import HOLDER_NAME, FdStore, session_name
from escrowd.server import Holder
from escrowd.statefile import HolderRecord, Record, StateFile

OWNER = "com.example.term"
REPLAY = b"L1\r\nL2\r\nL3\r\n"


@pytest.mark.parametrize("state, clean, marked", [
    ("draining", False, True),
    ("handing_off", False, True),  # the sweep before the handoff reads too
    ("exited", False, False),  # hung up: nothing was being read
    ("held", False, False),  # the app reads it, never the holder
    ("draining", True, False),
    ("handing_off", True, False),
])
async def test_a_gap_is_marked_where_a_read_may_have_been_in_flight(
    state: str, clean: bool, marked: bool, tmp_path: Path
) -> None:
    master, slave = os.openpty()
    file = StateFile.create(Record, 1 << 20, "test")
    token = uuid.uuid4().hex
    holder = Holder(Config(socket_path=str(tmp_path / "escrowd.sock")))
    try:
        file.data[: len(REPLAY)] = REPLAY
        file.set_total(len(REPLAY))
        file.write(Record(token=token, owner=OWNER, id="tab", state=state, clean=clean,
                          handoff_id="h1" if state == "handing_off" else None,
                          capacity=16 * 1024, saturated=False))
        async with trio.open_nursery() as nursery:
            holder._nursery = nursery
            report = await adopt(holder, {session_name(token): [os.dup(master),
                                                                os.dup(file.fd)]})
            assert report.adopted == 1 and report.refused == 0
            session = holder.registry.live[(OWNER, "tab")]
            assert session.ring.contents() == REPLAY  # nothing dropped: the ring had room
            assert session.replay_gap_at == (len(REPLAY) if marked else None)
            nursery.cancel_scope.cancel()
    finally:
        for session in holder.registry.live.values():
            session.forget_drain()
            session.close()
        file.close()
        os.close(master)
        os.close(slave)



def store_messages(store: socket.socket) -> list[tuple[str, int]]:
    """The messages the holder sent to the store since last asked: (text, fds attached);
    the fds are closed."""
    got = []
    while True:
        try:
            data, ancdata, _, _ = store.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
        except BlockingIOError:
            return got
        fds = [fd for _, _, raw in ancdata for fd in memoryview(raw).cast("i")]
        for fd in fds:
            os.close(fd)
        got.append((data.decode(), len(fds)))


async def adopt_with_store(tmp_path: Path, stored: dict[str, list[int]],
                           store: socket.socket) -> Adoption:
    holder = Holder(Config(socket_path=str(tmp_path / "escrowd.sock")),
                    FdStore(store.getsockname()))
    try:
        async with trio.open_nursery() as nursery:
            holder._nursery = nursery
            report = await adopt(holder, stored)
            nursery.cancel_scope.cancel()
    finally:
        holder.store.close()
    assert report.holder_state is not None
    return report


async def test_the_holders_own_state_file_never_leaves_the_store(tmp_path: Path) -> None:
    store = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    store.bind(str(tmp_path / "notify"))
    store.setblocking(False)
    first = second = None
    try:
        # A first start: a new state file, stored at once, before any session is taken up.
        first = await adopt_with_store(tmp_path, {}, store)
        assert first.holder_state is not None and first.restarts == 0
        assert store_messages(store) == [("FDSTORE=1\nFDNAME=holder\nFDPOLL=0", 1)]
        # The next start is passed that file (the store's copy: the same file). It counts
        # itself in it, and neither takes it out of the store nor stores it again.
        second = await adopt_with_store(
            tmp_path, {HOLDER_NAME: [os.dup(first.holder_state.fd)]}, store)
        assert (second.restarts, second.unclean_restarts) == (1, 1)
        assert store_messages(store) == []
        seen = StateFile(os.dup(first.holder_state.fd), HolderRecord)
        record = seen.record()
        seen.close()
        assert record is not None and record.restarts == 1
    finally:
        for report in (first, second):
            if report is not None and report.holder_state is not None:
                report.holder_state.close()
        store.close()
