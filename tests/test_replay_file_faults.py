"""A replay file the client cannot believe, or cannot map, costs that one session and
nothing else (PROTOCOL.md 12.7's table, 12.8): the other sessions of the reclaim are taken
back, the one refused goes back to draining at once on the same fd, and the connection is
in step for what the app asks next: above all a custody's next deposit, which once read a
stale handoff as its answer and called a session protected that the holder never took.

A real holder sends the files; the client is made to find one of them unsealed (or its
mapping to fail) by replacing the check (or mmap) in escrow_client.replay_map for the
test, since a real holder only ever sends sealed files.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import mmap
import os
from collections.abc import Iterator

import pytest
from test_replay_file import _deposit

from conftest import HolderProcess, wait_for
from escrow_client import ProtocolViolation, protocol, replay_map
from escrow_client.platform import REPLAY_FILES, is_sealed

pytestmark = pytest.mark.skipif(not REPLAY_FILES, reason="replays by reference need a memfd")


@pytest.fixture
def slaves() -> Iterator[list[int]]:
    kept: list[int] = []
    yield kept
    for fd in kept:
        os.close(fd)


def _own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _second_file_unsealed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on the client finds the second replay file it is sent unsealed. Returns
    the inodes seen, in order."""
    seen: list[int] = []

    def check(fd: int) -> bool:
        ino = os.fstat(fd).st_ino
        if ino not in seen:
            seen.append(ino)
        return is_sealed(fd) and seen.index(ino) != 1

    monkeypatch.setattr(replay_map, "is_sealed", check)
    return seen


def test_a_replay_file_not_believed_fails_its_sessions_alone_and_custody_stays_in_step(
    holder: HolderProcess, slaves: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Custody.reclaim_all of 40 sessions (two chunks, two files), the second file not
    believed: the 32 of the first are taken back, the 8 of the second fail alone, and are
    draining again by the time reclaim_all returns (not at the ack deadline); the app has
    no fd of theirs. Then a deposit is answered as a deposit: the new session is held by
    this process, and custody is protected."""
    client = holder.client()
    wanted, more = _deposit(client, 40)
    slaves += more
    seen = _second_file_unsealed(monkeypatch)
    custody = client.custody()
    try:
        gc.collect()
        before = _own_fds()
        report = custody.reclaim_all()
        assert len(seen) == 2
        assert len(report.retrieved) == 32, sorted(report.failed)
        assert len(report.failed) == 8
        assert all(isinstance(e, ProtocolViolation) for e in report.failed.values())
        assert {sid: bytes(r.replay) for sid, r in report.retrieved.items()} == {
            sid: data for sid, data in wanted.items() if sid in report.retrieved}
        states = {s.id: s.state for s in client.list()}
        assert {states[sid] for sid in report.failed} == {"draining"}
        assert {states[sid] for sid in report.retrieved} == {"held"}
        # The masters retrieved, custody's duplicates of them, the first file's mapping.
        assert _own_fds() == before + 32 + 32 + 1
        assert custody.protected

        master, slave = os.openpty()
        slaves.append(slave)
        try:
            custody.deposit("newtab", master)
        finally:
            os.close(master)
        listed = {s.id: s for s in client.list()}
        assert listed["newtab"].state == "held"
        assert listed["newtab"].custodian_pid == os.getpid()
        assert custody.protected
        custody.update("newtab", cols=100, rows=30)
        assert {s.id: s.cols for s in client.list()}["newtab"] == 100
    finally:
        custody.close()
        for result in report.retrieved.values():
            os.close(result.fd)
    wait_for(lambda: {s.state for s in client.list()} == {"draining"},
             what="every session draining once custody ended")


def test_a_replay_file_that_cannot_be_mapped_is_read_instead(
    holder: HolderProcess, slaves: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sealed file whose mmap fails (ENOMEM: out of address space, or of map count) is
    read with pread: every replay is still the holder's, byte for byte, and no session
    fails for it."""
    client = holder.client()
    wanted, more = _deposit(client, 3)
    slaves += more

    def no_mapping(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(replay_map.mmap, "mmap", no_mapping)
    report = client.reclaim_all()
    try:
        assert report.failed == {}
        assert {sid: r.replay for sid, r in report.retrieved.items()} == wanted
        assert all(isinstance(r.replay, memoryview) and r.replay.readonly
                   for r in report.retrieved.values())
    finally:
        for result in report.retrieved.values():
            os.close(result.fd)


_FIXING = {"F_SEAL_WRITE": fcntl.F_SEAL_WRITE, "F_SEAL_SHRINK": fcntl.F_SEAL_SHRINK,
           "F_SEAL_GROW": fcntl.F_SEAL_GROW}


@pytest.mark.parametrize("missing", [None, *_FIXING])
def test_the_seals_believed_are_those_protocol_md_names(missing: str | None) -> None:
    """PROTOCOL.md 12.8: the client asks for F_SEAL_WRITE, F_SEAL_SHRINK and F_SEAL_GROW,
    no more (a seal is never removed, so F_SEAL_SEAL adds nothing a mapping needs): a file
    with those three, and no F_SEAL_SEAL, is read; one without any of them is not."""
    fd = os.memfd_create("replay", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, b"abcdef")
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sum(v for k, v in _FIXING.items() if k != missing))
    assert not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL
    where = protocol.ReplayFile(offset=1, length=3)
    if missing is None:
        assert replay_map.ReplayMaps().take(fd, where) == b"bcd"
    else:
        with pytest.raises(ProtocolViolation):
            replay_map.ReplayMaps().take(fd, where)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed either way
