"""Adoption after an unclean stop, in-process: which sessions are marked `replay_gap_at`.

A SIGKILL cannot be aimed between two lines of the holder, so the state file a killed holder
leaves is made here by hand (a real memfd state file and a real PTY master) and adopted by
`escrowd.adoption.adopt` under trio, as a restarted holder does with what the fd store
passed it.

Incident pinned: a holder killed while a handoff swept the terminal (the session recorded
`handing_off`) lost the bytes of the sweep's read in flight, and the next holder marked no
gap: the replay ran on as if seamless.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import trio

from escrowd.adoption import adopt
from escrowd.config import Config
from escrowd.fdstore import session_name
from escrowd.server import Holder
from escrowd.statefile import Record, StateFile

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
