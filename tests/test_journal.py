"""The journal's hand-over, in-process (docs/design.md §12): an app writes its journal file with
`JournalWriter` while it holds custody, the holder copies it into the replay when custody
ends. Real journal files (memfd), real PTYs; the app's death in the middle of a write is
made by hand, byte by byte, since a SIGKILL cannot be aimed between two stores."""

from __future__ import annotations

import os
import threading
import tty
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from conftest import wait_for
from escrow_client import protocol
from escrow_client.journal import MAX_WRITE, JournalWriter
from escrowd import journal
from escrowd.registry import Registry
from escrowd.session import Session

RING = 16 * 1024


@contextmanager
def escrowed() -> Iterator[Session]:
    """A session with a journal, in a registry of its own (a holder of its own)."""
    registry = Registry(max_sessions=4, ring_bytes=RING, total_ring_bytes=1 << 30,
                        max_tombstones=4)
    master, slave = os.openpty()
    s = Session("o", protocol.Deposit(id="tab", journal=True), os.dup(master),
                registry.new_ring(), custodian=None, custodian_pid=None, child_start_time=None)
    registry.add(s)
    try:
        yield s
    finally:
        journal.close_journal(s)
        s.ring.release()  # (Session.close also tells trio's loop, which is not running here)
        os.close(s.fd)
        os.close(master)
        os.close(slave)


@pytest.fixture
def session() -> Iterator[Session]:
    with escrowed() as s:
        yield s


def writer_for(session: Session) -> JournalWriter:
    granted = journal.grant(session)
    assert granted is not None and granted[0].capacity == RING  # the ring's limit, at once
    journal.begin(session)
    return JournalWriter(os.dup(granted[1]), granted[0])


def counters(session: Session) -> memoryview:
    """The journal file's counters (`total`, `writing`, `reading`), as the app writes them."""
    assert session.journal is not None
    return session.journal._counters  # noqa: SLF001 (the app's side of the file, by hand)


def test_the_holder_takes_over_exactly_what_the_app_recorded(session: Session) -> None:
    writer = writer_for(session)
    data = bytes(range(256)) * 100  # 25,600 bytes: wraps the 16 KiB ring
    for start in range(0, len(data), 3000):
        writer.record(data[start : start + 3000])
    writer.close()
    journal.end(session)
    ring = session.ring
    assert ring.contents() == data[-RING:]
    assert (ring.total, ring.dropped) == (len(data), len(data) - RING)
    assert journal.journaled(session, ring.total - ring.size) == RING
    assert session.replay_gaps == []


def test_a_record_longer_than_the_ring_keeps_its_newest_bytes(session: Session) -> None:
    writer = writer_for(session)
    writer.record(b"old" * 10)
    data = os.urandom(RING * 2 + 5)
    writer.record(data)
    writer.close()
    journal.end(session)
    assert session.ring.contents() == data[-RING:]
    assert session.ring.total == 30 + len(data)


def test_a_second_mapping_goes_on_where_the_first_stopped(session: Session) -> None:
    """A custody that takes a session back from a restarted holder maps the file again,
    with a layout said at another moment: the bytes still follow each other."""
    first = writer_for(session)
    granted = journal.grant(session)  # asked again (a resume) before more is written
    first.record(b"a" * 5000)
    assert granted is not None
    second = JournalWriter(os.dup(granted[1]), granted[0])
    first.close()
    second.record(b"b" * 5000)
    second.close()
    journal.end(session)
    assert session.ring.contents() == b"a" * 5000 + b"b" * 5000


def test_an_app_killed_in_the_middle_of_a_write_leaves_no_torn_bytes(
    session: Session,
) -> None:
    """The app stored `writing`, copied part of its bytes over the oldest ones, and died
    before it stored `total`. The holder drops the oldest bytes that write may have
    overwritten and marks the spot where its bytes are missing: the replay holds nothing
    the terminal did not print in that order."""
    writer = writer_for(session)
    data = b"".join(f"L{i:06d}\n".encode() for i in range(4000))  # 32,000 bytes
    writer.record(data)
    # The torn write, as the app's writer makes it: `writing` first, then the bytes.
    file, app = session.journal, counters(session)
    assert file is not None
    total = app[0]
    position = total % RING
    torn = b"X" * MAX_WRITE
    view = file.data
    app[1] = total + len(torn)
    half = len(torn) // 2
    first = min(half, RING - position)
    view[position : position + first] = torn[:first]
    view[: half - first] = torn[first:half]
    writer.close()

    journal.end(session)
    replay = session.ring.contents()
    assert b"X" not in replay
    assert replay == data[-(RING - MAX_WRITE):]
    assert session.replay_gaps == [len(replay)]  # the torn write's bytes: after the last
    assert session.journal is None  # let go of: nothing the app writes now is read


@pytest.mark.parametrize("read_marker", [True, False])
def test_a_read_through_the_journal_records_exactly_what_it_returns(session: Session,
                                                                    read_marker: bool) -> None:
    """`Custody.read` records what it reads from the terminal: what the app gets and what
    the replay holds are the same bytes, in order, across the ring's end; with the
    `reading` mark (read, then record) and without (wait, then read into the ring)."""
    writer = writer_for(session)
    writer.read_marker = read_marker
    app = counters(session)
    master, slave = os.openpty()
    tty.setraw(slave)
    try:
        sent = b"".join(f"line {i:05d}\n".encode() for i in range(3000))  # 33,000 bytes
        got = bytearray()
        for start in range(0, len(sent), 1000):
            os.write(slave, sent[start : start + 1000])
            while len(got) < start + 1000:
                got += writer.read(master, 65536)
        assert bytes(got) == sent
        assert app[1] == app[0] == len(sent) and app[2] == 0
    finally:
        os.close(master)
        os.close(slave)
        writer.close()
    journal.end(session)
    assert session.ring.contents() == sent[-RING:]
    assert session.ring.total == len(sent) and session.replay_gaps == []


DRAINED = b"".join(f"drained {i:04d}\n".encode() for i in range(300))  # 3,900 bytes


@pytest.mark.parametrize("lie, drained_first", [
    ("backwards", False), ("backwards", True), ("huge", False), ("huge", True),
], ids=["backwards", "below_what_the_holder_drained", "huge", "huge_after_a_drain"])
def test_a_journal_that_lies_about_its_counter_is_not_believed(
    session: Session, lie: str, drained_first: bool,
) -> None:
    """The journal file is the app's to write: a counter that went back, or to an absurd
    value, copies only what it can vouch for (nothing, here) and marks a gap; the holder's
    own count and its own bytes (what it drained before the app took custody) are in a
    file no app is sent, and stay as they were."""
    drained = DRAINED if drained_first else b""
    if drained:
        r, w = os.pipe()
        try:
            os.write(w, drained)
            assert session.ring.read_from(r, len(drained), overwrite=True) == len(drained)
        finally:
            os.close(r)
            os.close(w)
    writer = writer_for(session)
    writer.record(b"x" * 1000)
    writer.close()
    app = counters(session)
    app[0] = {"backwards": 0, "huge": 1 << 63}[lie]
    before = session.ring.total
    assert before == len(drained)  # the holder's own count, from before custody
    journal.end(session)
    assert session.ring.total == before, "the app's counter was believed"
    assert session.ring.contents() == drained
    assert session.replay_gaps == [len(drained)], "no gap where the journal was not believed"


def test_an_app_killed_with_a_read_in_flight_leaves_a_gap_and_drops_nothing(
    session: Session,
) -> None:
    """A read from the terminal is marked in flight (`reading`) while the app waits in it:
    an app that died there may have taken bytes off the terminal that never reached the
    ring. The holder marks the spot, and keeps every byte the ring holds (the read did not
    touch it). The app's death is made here by closing its writer while its read waits."""
    writer = writer_for(session)
    data = b"".join(f"L{i:06d}\n".encode() for i in range(1000))  # 8,000 bytes
    writer.record(data)
    master, slave = os.openpty()
    tty.setraw(slave)
    app = counters(session)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(writer.read(master, 65536)))
    try:
        reader.start()
        wait_for(lambda: app[2], 10, "the read to be marked in flight")
        writer.close()  # the app is gone (its read is still waiting)
        journal.end(session)
        os.write(slave, b"lost\n")  # the read returns with bytes the ring never gets
        reader.join(10)
    finally:
        os.close(master)
        os.close(slave)
    assert got == [b"lost\n"]
    assert session.ring.contents() == data
    assert session.replay_gaps == [len(data)]


@pytest.mark.parametrize("read_marker", [True, False])
def test_a_read_that_fails_records_nothing_and_leaves_no_mark(session: Session,
                                                              read_marker: bool) -> None:
    writer = writer_for(session)
    writer.read_marker = read_marker
    writer.record(b"before")
    master, slave = os.openpty()
    os.set_blocking(master, False)
    try:
        with pytest.raises(BlockingIOError):
            writer.read(master, 65536)
    finally:
        os.close(master)
        os.close(slave)
        writer.close()
    app = counters(session)
    assert app[2] == 0 and app[1] == app[0] == 6
    journal.end(session)
    assert session.ring.contents() == b"before"
    assert session.replay_gaps == []


def test_the_mark_stays_while_another_read_is_in_flight(session: Session) -> None:
    """Found in review: with two threads reading, the first read to finish cleared the
    mark while the second was still waiting."""
    writer = writer_for(session)
    master, slave = os.openpty()
    tty.setraw(slave)
    app = counters(session)
    got: list[bytes] = []
    readers = [threading.Thread(target=lambda: got.append(writer.read(master, 1)))
               for _ in range(2)]
    try:
        for reader in readers:
            reader.start()
        wait_for(lambda: writer._reads == 2, 10, "both reads to start")  # noqa: SLF001
        os.write(slave, b"a")
        wait_for(lambda: got, 10, "a read to return")
        assert app[2]  # the other read is still in flight
        os.write(slave, b"b")
        for reader in readers:
            reader.join(10)
    finally:
        os.close(master)
        os.close(slave)
        writer.close()
    assert sorted(got) == [b"a", b"b"] and not app[2]
    journal.end(session)
    assert session.ring.contents() in (b"ab", b"ba") and session.replay_gaps == []


def test_a_read_in_flight_while_the_writer_moves_to_a_new_file_is_marked_there(
    session: Session,
) -> None:
    """A custody that takes its session back from a new holder maps the journal file that
    holder sends while a read waits in the old one: the new file must say a read is in
    flight, or an app that died before the read returned would leave the new holder a
    replay with those bytes gone and no gap marked. The read's bytes, once back, are
    recorded in the new file and the mark cleared."""
    writer = writer_for(session)
    master, slave = os.openpty()
    tty.setraw(slave)
    got: list[bytes | OSError] = []

    def read() -> None:
        try:
            got.append(writer.read(master, 65536))
        except OSError as exc:  # EIO, once the test has closed the terminal after a failure
            got.append(exc)

    reader = threading.Thread(target=read)
    try:
        with escrowed() as moved:
            reader.start()
            wait_for(lambda: counters(session)[2], 10, "the read to be marked in flight")
            granted = journal.grant(moved)
            assert granted is not None
            journal.begin(moved)
            writer.remap(os.dup(granted[1]), granted[0])
            assert counters(moved)[2], "the read in flight is not marked in the new file"
            os.write(slave, b"read across the move\n")
            reader.join(10)
            assert got == [b"read across the move\n"]
            assert not counters(moved)[2]
            writer.close()
            journal.end(moved)
            assert moved.ring.contents() == b"read across the move\n"
            assert moved.replay_gaps == []
    finally:
        os.close(slave)
        os.close(master)
        writer.close()
        if reader.is_alive():
            reader.join(10)


def test_a_read_cut_short_on_its_way_into_the_ring_stays_marked(
    session: Session, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: an exception inside the recording of a read's bytes (a signal's,
    say; here a str where bytes belong) let the next read clear the mark: the bytes were
    gone with no gap. Now the mark stays for good, and the holder marks the spot."""
    from escrow_client import journal as app_side

    writer = writer_for(session)
    reads = iter(["lost", b"later"])
    monkeypatch.setattr(app_side.os, "read", lambda fd, n: next(reads))
    with pytest.raises(TypeError):
        writer.read(0, 100)
    assert writer.read(0, 100) == b"later"
    assert counters(session)[2]
    writer.close()
    journal.end(session)
    assert session.ring.contents() == b"later"
    assert session.replay_gaps == [len(b"later")]


def test_a_copy_a_kill_cut_short_is_made_again_from_an_empty_ring(session: Session) -> None:
    """A holder killed in the middle of copying the journal into the ring (the record
    says `journal_copying`) left bytes of it in place, some counted, some maybe not, over
    the ring's oldest ones: the next holder cannot tell which of the ring's bytes are
    whole. It empties the ring where the copy began, marks the gap there, and copies the
    whole journal again: every byte the app recorded, once, and nothing torn."""
    r, w = os.pipe()
    try:
        os.write(w, DRAINED)
        session.ring.read_from(r, len(DRAINED), overwrite=True)
    finally:
        os.close(r)
        os.close(w)
    writer = writer_for(session)
    recorded = b"".join(f"rec {i:04d}\n".encode() for i in range(500))  # 5,000 bytes
    writer.record(recorded)
    writer.close()
    # The copy as a killed holder left it: begun, a part of it in place and counted.
    session.journal_copying = True
    session.ring.append(memoryview(recorded[:3000]))
    journal.end(session)
    assert session.ring.contents() == recorded
    assert session.replay_gaps == [0], "no gap where the ring's bytes could not be told"
    assert not session.journal_copying and session.journal is None


def test_a_journal_counter_that_would_carry_the_ring_past_its_bounds_is_not_believed(
    session: Session,
) -> None:
    """Found in review: the journal's `total` was held to its bound alone, not added to the
    ring's own count: a few custodies that each claimed 2^62 - 1 bytes carried the ring's
    counter past what its record may say (the next holder refused the record) and then past
    64 bits (an exception on the path that drains a session whose app died)."""
    session.ring.skip((1 << 62) - 1000)
    before = session.ring.total
    writer = writer_for(session)
    writer.record(b"x" * 100)
    writer.close()
    counters(session)[0] = counters(session)[1] = 5000
    journal.end(session)
    assert session.ring.total == before and session.replay_gaps == [0]
