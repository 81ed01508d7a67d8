"""Replays by reference (escrowd/replay_file.py, client/replay_map.py; PROTOCOL.md 12.8): the
bytes are the frame's, nobody can change them (the app included, and the session draining
again), a range or a file the client cannot believe is an error, never a crash, and every
fd is closed on both sides whatever happens."""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import re
import signal
import subprocess
import sys
import textwrap
import tty
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rawclient import RawClient

from conftest import HolderProcess, wait_for
from escrow_client import EscrowClient, ProtocolViolation, protocol
from escrow_client import retrieve as escrow_retrieve
from escrow_client.platform import REPLAY_FILES, sealed_file
from escrow_client.replay_map import ReplayMaps

pytestmark = pytest.mark.skipif(not REPLAY_FILES, reason="replays by reference need a memfd")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _deposit(client: EscrowClient, count: int, prefix: str = "s") -> tuple[dict[str, bytes],
                                                                         list[int]]:
    """`count` draining sessions on raw ptys, each with output of its own drained into its
    ring: what each replay must be, and the slaves (the caller closes them)."""
    wanted, slaves = {}, []
    for i in range(count):
        master, slave = os.openpty()
        tty.setraw(slave)  # the bytes as written: no output processing
        sid = f"{prefix}{i}"
        client.hand_off(sid, master)
        os.close(master)
        data = f"{sid}: ".encode() + bytes(range(256)) * (i % 5 + 1) + b"\r\n"
        os.write(slave, data)
        wanted[sid] = data
        slaves.append(slave)
    wait_for(lambda: {s.id: s.buffered_bytes for s in client.list() if s.id in wanted}
             == {sid: len(data) for sid, data in wanted.items()}, what="every replay drained")
    return wanted, slaves


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _holder_fds(holder: HolderProcess) -> list[str]:
    """What the holder has open but its connections (which come and go with each call)."""
    where = f"/proc/{holder.serving_pid()}/fd"
    names = []
    for fd in os.listdir(where):
        try:
            names.append(os.readlink(f"{where}/{fd}"))
        except FileNotFoundError:
            continue  # closed since the listing
    return sorted(name for name in names if not name.startswith("socket:"))


def _holder_fds_back_to(holder: HolderProcess, fds: list[str]) -> None:
    try:
        wait_for(lambda: _holder_fds(holder) == fds, what="the holder's fds as they were")
    except AssertionError:
        raise AssertionError(f"holder fds: {_holder_fds(holder)}, before: {fds}") from None


def _own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def slaves() -> Iterator[list[int]]:
    kept: list[int] = []
    yield kept
    _close(kept)


def test_reclaim_all_reads_each_replay_in_place_from_a_sealed_file(
    holder: HolderProcess, slaves: list[int]
) -> None:
    """Forty sessions (two chunks): each replay is a read-only view of the file its chunk
    came in, byte for byte what the copy path gives; the replay files' fds are closed as
    they come (what is left is one fd a mapping, Python's mmap's own, gone with its last
    replay)."""
    client = holder.client()
    wanted, more = _deposit(client, 40)
    slaves += more
    before = _own_fds()
    report = client.reclaim_all()
    try:
        assert report.failed == {}
        got = {sid: r.replay for sid, r in report.retrieved.items()}
        assert all(isinstance(r, memoryview) and r.readonly for r in got.values())
        assert got == wanted
        assert _own_fds() == before + 40 + 2  # the masters, and the two chunks' mappings
        assert not holder.log_lines("replay_file_failed")
        del got
        for result in report.retrieved.values():
            result.replay = b""
        gc.collect()
        assert _own_fds() == before + 40
    finally:
        _close([r.fd for r in report.retrieved.values()])
    # Sessions like them on the copy path: the same bytes, in bytes.
    again, more = _deposit(client, 3, prefix="c")
    slaves += more
    saved = escrow_retrieve.REPLAY_FILES
    escrow_retrieve.REPLAY_FILES = False
    try:
        copied = client.reclaim_all()
    finally:
        escrow_retrieve.REPLAY_FILES = saved
    try:
        assert {sid: r.replay for sid, r in copied.retrieved.items()
                if sid in again} == again
        assert all(type(r.replay) is bytes for r in copied.retrieved.values())
    finally:
        _close([r.fd for r in copied.retrieved.values()])
    holder.wait_fds_at_baseline()


def _handoffs_by_file(raw: RawClient, ids: list[str]) -> list[tuple[protocol.Handoff, list[int]]]:
    """retrieve_many{replay_file} on `raw`, and every handoff with the fds it carried (no
    ack sent)."""
    welcome = raw.hello(timeout=5.0)
    assert "replay_file" in welcome.features
    raw.send(protocol.RetrieveMany(ids=ids, replay_file=True))
    got = []
    for _ in ids:
        before = len(raw.fds)
        reply, _ = raw.receive()
        assert isinstance(reply, protocol.Handoff), reply
        got.append((reply, raw.fds[before:]))
    return got


def test_the_app_cannot_write_into_the_replay_file(holder: HolderProcess,
                                                   slaves: list[int]) -> None:
    """Through the fd it is sent, the app can neither write the file, nor grow or shrink
    it, nor map it writable, nor make a read-only mapping writable; nor through a new
    description of it opened read-write by /proc. And the holder, which never acked, puts
    the session back with its fds closed."""
    client = holder.client()
    wanted, more = _deposit(client, 1)
    slaves += more
    holder_fds = _holder_fds(holder)
    with RawClient(holder.socket) as raw:
        ((reply, fds),) = _handoffs_by_file(raw, ["s0"])
        assert len(fds) == 2 and reply.replay == b"" and reply.replay_file is not None
        replay_fd = fds[1]
        assert os.fstat(replay_fd).st_size == len(wanted["s0"])
        with pytest.raises(OSError):
            os.write(replay_fd, b"x")
        with pytest.raises(OSError):
            os.pwrite(replay_fd, b"x", 0)
        with pytest.raises(OSError):
            os.ftruncate(replay_fd, 0)
        with pytest.raises(OSError):
            os.ftruncate(replay_fd, 1 << 20)
        with pytest.raises(OSError):
            mmap.mmap(replay_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        size = os.fstat(replay_fd).st_size
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, replay_fd, 0)
        assert addr not in (None, _MAP_FAILED)
        try:
            assert _libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) == -1
            assert ctypes.get_errno() in (errno.EACCES, errno.EPERM)
            assert ctypes.string_at(addr, size) == wanted["s0"]
        finally:
            _libc.munmap(addr, size)
        try:
            again = os.open(f"/proc/self/fd/{replay_fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            pass  # refused outright: as good
        else:
            try:
                with pytest.raises(OSError) as refused:
                    os.pwrite(again, b"x", 0)
                assert refused.value.errno == errno.EPERM
                with pytest.raises(OSError):
                    mmap.mmap(again, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(again)
        assert os.pread(replay_fd, size, 0) == wanted["s0"]
    wait_for(lambda: client.list()[0].state == "draining", what="put back, unacked")
    _holder_fds_back_to(holder, holder_fds)


def test_a_replay_given_never_changes_when_its_session_drains_again(
    make_holder: object, slaves: list[int]
) -> None:
    """A replay mapped from a handoff whose ack never came, and one taken back into
    custody that then ended: both sessions drain again and their rings (16 KiB) wrap past
    every byte the app was given, and the replays the app holds are what they were."""
    holder = make_holder("--ring-bytes", "16384")  # type: ignore[operator]
    client = holder.client()
    wanted, more = _deposit(client, 2)
    slaves += more
    holder_fds = _holder_fds(holder)
    with RawClient(holder.socket) as raw:
        ((reply, fds),) = _handoffs_by_file(raw, ["s0"])
        assert reply.replay_file is not None
        unacked = ReplayMaps().take(fds[1], reply.replay_file)
        raw.fds.remove(fds[1])  # (take closed it)
    wait_for(lambda: {s.id: s.state for s in client.list()}["s0"] == "draining",
             what="s0 put back")
    custody = client.custody()
    got = custody.reclaim_all().retrieved["s1"]
    kept = got.replay
    assert isinstance(kept, memoryview) and kept == wanted["s1"]
    custody.close()  # s1 drains again
    os.close(got.fd)
    flood = b"y" * 4096
    for _ in range(8):
        for slave in slaves:
            os.write(slave, flood)
    wait_for(lambda: all(s.dropped_bytes > 0 for s in client.list() if s.id in wanted),
             what="both rings wrapped")
    assert unacked == wanted["s0"]
    assert kept == wanted["s1"]
    _holder_fds_back_to(holder, holder_fds)


def test_every_replay_file_is_closed_when_the_client_dies_mid_reclaim(
    holder: HolderProcess, slaves: list[int]
) -> None:
    """A client that asks for replays by reference and is killed once its first handoff
    came: every session goes back to draining, and the holder has every fd it had before
    (its copies of the replay files closed, what was queued for the dead client dropped)."""
    client = holder.client()
    wanted, more = _deposit(client, 70)
    slaves += more
    holder_fds = _holder_fds(holder)
    program = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from rawclient import RawClient
        from escrow_client import protocol
        raw = RawClient({holder.socket!r})
        raw.hello(timeout=5.0)
        raw.send(protocol.RetrieveMany(ids={sorted(wanted)!r}, replay_file=True))
        raw.receive()
        print("got one", flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"got one\n"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()
    wait_for(lambda: {s.state for s in client.list()} == {"draining"},
             what="every session put back")
    _holder_fds_back_to(holder, holder_fds)
    assert not holder.log_lines("replay_file_failed")


def test_a_failed_send_closes_the_replay_file(holder: HolderProcess,
                                              slaves: list[int]) -> None:
    """A client that hangs up right after asking: the holder's sends fail (or, when the
    holder was quicker than the hang-up, every frame went into the socket's buffer and no
    ack comes), every session goes back, and no fd of a replay file is left in the holder."""
    client = holder.client()
    wanted, more = _deposit(client, 40)
    slaves += more
    holder_fds = _holder_fds(holder)
    with RawClient(holder.socket) as raw:
        raw.hello(timeout=5.0)
        raw.send(protocol.RetrieveMany(ids=sorted(wanted), replay_file=True))
    wait_for(lambda: re.search(r"reason=\"(handoff send failed|no ack): ", holder.logs()),
             what="the sends failed, or the acks never came")
    wait_for(lambda: {s.state for s in client.list()} == {"draining"},
             what="every session put back")
    _holder_fds_back_to(holder, holder_fds)


# --- what the client believes -------------------------------------------------------------

_FILE = b"".join(bytes([i]) * 100 for i in range(40))  # 4,000 bytes


@settings(max_examples=300, deadline=None)
@given(offset=st.one_of(st.integers(-10, 4100), st.integers(-(2**63), 2**63)),
       length=st.one_of(st.integers(-10, 4100), st.integers(-(2**63), 2**63)))
def test_a_range_outside_the_file_is_a_protocol_violation(offset: int, length: int) -> None:
    """Any range a holder may send: inside the file it is that slice, read in place;
    outside it (negative, past the end, overflowing) it is ProtocolViolation. Either way
    the fd is closed and nothing else is left open."""
    gc.collect()  # (mappings an earlier test left to the collector)
    before = _own_fds()
    fd = sealed_file("test", [_FILE])
    maps = ReplayMaps()
    try:
        view = maps.take(fd, protocol.ReplayFile(offset=offset, length=length))
    except ProtocolViolation:
        assert not (0 <= offset and 0 <= length and offset + length <= len(_FILE))
    else:
        assert 0 <= offset and 0 <= length and offset + length <= len(_FILE)
        assert view == _FILE[offset : offset + length] and view.readonly
        del view
    with pytest.raises(OSError):
        os.fstat(fd)
    del maps
    gc.collect()
    assert _own_fds() == before


def test_a_file_that_is_not_sealed_is_not_believed() -> None:
    """An unsealed memfd (its bytes could change, or it could shrink under the mapping and
    fault), a pipe, a regular file: ProtocolViolation, the fd closed."""
    r, w = os.pipe()
    os.close(w)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.write(unsealed, b"x" * 100)
    plain = os.open("/proc/self/cmdline", os.O_RDONLY | os.O_CLOEXEC)
    for fd in (r, unsealed, plain):
        with pytest.raises(ProtocolViolation):
            ReplayMaps().take(fd, protocol.ReplayFile(offset=0, length=1))
        with pytest.raises(OSError):
            os.fstat(fd)


def test_one_file_is_mapped_once_for_all_its_replays() -> None:
    """Each handoff brings its own fd of the chunk's file: one mapping serves them all."""
    fd = sealed_file("test", [b"abc", b"defg"])
    maps = ReplayMaps()
    first = maps.take(os.dup(fd), protocol.ReplayFile(offset=0, length=3))
    second = maps.take(fd, protocol.ReplayFile(offset=3, length=4))
    assert (first, second) == (b"abc", b"defg")
    assert first.obj is second.obj  # one mapping
