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

Behaviours pinned: what a restarted holder must refuse, while it adopts the sound pairs
beside it all the same, closes every fd it refuses and takes its name out of the store:
- a master stored beside another session's state file (it would come back under the other
  session's name, with the other's replay);
- a session whose record says `handed_off` or `released` (the app reads that terminal now);
- a PTY slave stored in place of the master (draining it would take the user's keystrokes);
and of two deposits stored under one owner and id, the newer is the session kept.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import time
import tty
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from escrow_client.platform import terminal_identity
from escrowd.adoption import Adoption, adopt
from escrowd.config import Config
from escrowd.drain import DrainLoop
from escrowd.fdstore import HOLDER_NAME, FdStore, StoreError, journal_name, session_name
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



@pytest.fixture
def store(tmp_path: Path) -> Iterator[socket.socket]:
    """The fd store, as the holder reaches it: a datagram socket the test reads."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    yield sock
    sock.close()


def store_messages(store: socket.socket) -> list[tuple[str, int]]:
    """The messages the holder sent to the store since last asked: (text, fds attached);
    the fds are closed."""
    got: list[tuple[str, int]] = []
    while True:
        try:
            data, ancdata, _, _ = store.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
        except BlockingIOError:
            return got
        fds = [fd for _, _, raw in ancdata for fd in memoryview(raw).cast("i")]
        for fd in fds:
            os.close(fd)
        got.append((data.decode(), len(fds)))


def holder_with_store(tmp_path: Path, store: socket.socket) -> Holder:
    return Holder(Config(socket_path=str(tmp_path / "escrowd.sock")),
                  FdStore(store.getsockname()))


async def adopt_now(holder: Holder, stored: dict[str, list[int]]) -> Adoption:
    """`adopt`, as the holder runs it at its start; once every drain it started has read
    what was there to read, its nursery ends (nothing reads any more)."""
    async with trio.open_nursery() as nursery:
        holder._nursery = nursery
        try:
            report = await adopt(holder, stored)
        except Exception as exc:
            # The holder's start fails with it: every stored session is lost.
            raise AssertionError(f"the holder could not start: adoption raised {exc!r}"
                                 ) from exc
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert report.holder_state is not None
    return report


def let_go(holder: Holder) -> None:
    """Close what the holder kept (its sessions, its store, its spare fd), but its own
    state file (the report's)."""
    for session in holder.registry.live.values():
        session.forget_drain()
        session.close()
    holder.store.close()
    if holder._reserve_fd is not None:
        os.close(holder._reserve_fd)
        holder._reserve_fd = None


async def adopt_with_store(tmp_path: Path, stored: dict[str, list[int]],
                           store: socket.socket) -> Adoption:
    """Adopt `stored`; the holder's own state file (`holder_state`) is the caller's to
    close."""
    holder = holder_with_store(tmp_path, store)
    try:
        return await adopt_now(holder, stored)
    finally:
        let_go(holder)


@asynccontextmanager
async def adopting(tmp_path: Path, stored: dict[str, list[int]], store: socket.socket
                   ) -> AsyncIterator[tuple[Adoption, Holder]]:
    """Adopt `stored`, and let the test look at the holder; then close everything it kept."""
    holder = holder_with_store(tmp_path, store)
    report: Adoption | None = None
    try:
        report = await adopt_now(holder, stored)
        yield report, holder
    finally:
        let_go(holder)
        if report is not None and report.holder_state is not None:
            report.holder_state.close()


async def test_the_holders_own_state_file_never_leaves_the_store(
    store: socket.socket, tmp_path: Path
) -> None:
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


# --- what a restarted holder refuses, and which of two it keeps ------------------------------


@dataclass
class StoredPair:
    """A session as a killed holder left it in the store: a real PTY whose two ends the
    test keeps (the master as the app's copy, the slave as the child's), and its state
    file. `stored()` is what the store passes the next holder: copies of the master and of
    the state file."""

    token: str
    master: int
    slave: int
    file: StateFile[Record]

    @property
    def name(self) -> str:
        return session_name(self.token)

    def stored(self) -> list[int]:
        return [os.dup(self.master), os.dup(self.file.fd)]

    def close(self) -> None:
        self.file.close()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def pairs() -> Iterator[Callable[..., StoredPair]]:
    """`pairs(sid, replay, **record_fields)`: a stored pair whose record names OWNER/sid
    (draining, cleanly stopped, unless the fields say otherwise) with `replay` in its ring;
    every one is closed at teardown."""
    made: list[StoredPair] = []

    def make(sid: str = "tab", replay: bytes = REPLAY, **fields: Any) -> StoredPair:
        master, slave = os.openpty()
        tty.setraw(slave)  # bytes cross the terminal as they are, in both directions
        file = StateFile.create(Record, 1 << 20, "test")
        pair = StoredPair(uuid.uuid4().hex, master, slave, file)
        made.append(pair)
        file.data[: len(replay)] = replay
        file.set_total(len(replay))
        fields = {"state": "draining", "clean": True, **fields}
        file.write(Record(token=pair.token, owner=OWNER, id=sid, capacity=16 * 1024,
                          saturated=False, **fields))
        return pair

    yield make
    for pair in made:
        pair.close()


def removals(store: socket.socket) -> list[str]:
    """The names the holder took out of the store since last asked."""
    prefix = "FDSTOREREMOVE=1\nFDNAME="
    return [text.removeprefix(prefix) for text, _ in store_messages(store)
            if text.startswith(prefix)]


def open_fds() -> set[int]:
    """The fds open in this process (not the one the listing was read with: closed). The
    drain loop's readiness set is made first: it is the trio run's, kept for the run, as a
    holder makes it as it starts."""
    DrainLoop.current().prepare()
    return {int(fd) for fd in os.listdir("/proc/self/fd") if is_open(int(fd))}


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def assert_unread(fd: int, data: bytes, what: str) -> None:
    """`data` is still waiting to be read on `fd`: nobody else read it."""
    got = b""
    deadline = time.monotonic() + 5.0
    while len(got) < len(data) and select.select(
            [fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        got += os.read(fd, 4096)
    assert got == data, f"{what} was read by someone else: {got!r} left of {data!r}"


async def assert_refused(tmp_path: Path, name: str, fds: list[int], store: socket.socket,
                         why: str, bystander: StoredPair) -> None:
    """The pair `fds` stored as `name` is refused: not adopted, its fds closed, its name
    taken out of the store; and `bystander`, a sound pair stored beside it, is adopted all
    the same."""
    before = open_fds() - set(fds)
    stored = {name: fds, bystander.name: bystander.stored()}
    async with adopting(tmp_path, stored, store) as (report, holder):
        assert [s.token for s in holder.registry.live.values()] == [bystander.token], \
            f"adopted, though {why}"
        assert (report.adopted, report.refused) == (1, 1)
    assert removals(store) == [name], f"left in the store, though {why}"
    assert open_fds() == before, "a refused pair's fds were left open"


async def test_a_state_file_of_another_session_is_not_believed(
    pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path
) -> None:
    """A master stored beside a state file that names another session's token (two pairs
    mixed up in the store) is not taken up under that other session's name, nor with its
    replay (the wrong screen in the wrong tab). Nor is it closed (its shell would get
    SIGHUP): a valid PTY master is a session, adopted with what can be proven, under a
    name that says its record is lost, its replay marked lost from the start. It is stored
    apart, under its own name, and the mixed-up group taken out of the store."""
    mine, theirs = pairs("mine"), pairs("theirs", b"their screen\r\n")
    bystander = pairs("other")
    os.write(mine.slave, b"my output")
    stored = {mine.name: [os.dup(mine.master), os.dup(theirs.file.fd)],
              bystander.name: bystander.stored()}
    async with adopting(tmp_path, stored, store) as (report, holder):
        live = holder.registry.live
        assert (OWNER, "theirs") not in live, "adopted under the other session's name"
        (lost,) = [s for s in live.values() if s.token != bystander.token]
        assert lost.owner == "escrowd" and lost.id.startswith("lost-pts"), lost.name
        assert b"their screen" not in lost.ring.contents(), "with the other session's replay"
        assert lost.replay_gaps[:1] == [0] and lost.state == "draining"
        assert terminal_identity(lost.fd) == terminal_identity(mine.master)
        assert (report.adopted, report.without_record, report.refused) == (2, 1, 0)
    assert mine.name in removals(store)


@pytest.mark.parametrize("ended", ["handed_off", "released"])
async def test_a_session_that_ended_is_refused_and_never_escrowed_again(
    ended: str, pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path
) -> None:
    """A session whose record says it was handed off (or released), whose removal from the
    store a kill kept from reaching it, is refused: the app reads that terminal now, and a
    holder draining it again would take the output from under the app."""
    pair = pairs(state=ended)
    os.write(pair.slave, b"for the app")
    await assert_refused(tmp_path, pair.name, pair.stored(), store,
                         f"its record says {ended}", pairs("other"))
    assert_unread(pair.master, b"for the app", "the app's terminal output")


async def test_a_stored_pty_slave_is_refused_never_drained(
    pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path
) -> None:
    """A PTY slave stored in place of the master is refused ("not a PTY master"), never
    drained: reading the slave, the holder would take the user's keystrokes from the
    program they are typed to."""
    pair = pairs()
    os.write(pair.master, b"my password\r")  # typed by the user
    await assert_refused(tmp_path, pair.name, [os.dup(pair.slave), os.dup(pair.file.fd)],
                         store, "the stored terminal is a PTY slave", pairs("other"))
    assert_unread(pair.slave, b"my password\r", "the user's keystrokes")


@pytest.mark.parametrize("newer_first", [True, False])
async def test_of_two_deposits_under_one_name_both_stay(
    newer_first: bool, pairs: Callable[..., StoredPair], store: socket.socket,
    tmp_path: Path
) -> None:
    """Two stored pairs under one owner and id, on two terminals (a record forged or
    written wrong, or an app that deposited again): the newer deposit keeps the name,
    whatever the order the store passes them in, and the older is not closed (its shell
    would get SIGHUP) but renamed, both reported."""
    older = pairs("tab", b"the old screen\r\n", deposited_at=1000.0)
    newer = pairs("tab", b"the new screen\r\n", deposited_at=2000.0)
    stored = [(pair.name, pair.stored()) for pair in (older, newer)]
    before = open_fds() - {fd for _, fds in stored for fd in fds}
    async with adopting(tmp_path, dict(stored[::-1] if newer_first else stored),
                        store) as (report, holder):
        kept = holder.registry.live[(OWNER, "tab")]
        assert kept.token == newer.token, "the older deposit kept the name"
        assert kept.ring.contents() == b"the new screen\r\n"
        assert terminal_identity(kept.fd) == terminal_identity(newer.master)
        assert report.adopted == 2
        # What becomes of the older pair, said once: renamed, kept, still stored.
        renamed = holder.registry.live[(OWNER, f"tab.dup-{older.token[:8]}")]
        assert renamed.ring.contents() == b"the old screen\r\n"
        assert (report.renamed, report.refused, removals(store)) == (1, 0, [])
    # Every fd the holder was passed is closed, once it has let go of what it kept.
    assert open_fds() == before, "fds of a stored pair were left open"


async def test_two_copies_of_one_terminal_are_one_session(
    pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path
) -> None:
    """A group stored again under a new name, and the old one whose removal a kill cut
    off: two copies of one terminal. The one whose record is believed is the session; the
    other copy is closed (the terminal stays open through the first: its shell gets no
    SIGHUP) and taken out of the store."""
    pair = pairs("tab", b"the screen\r\n")
    spoilt = StateFile.create(Record, 1 << 20, "test")
    try:
        stray = session_name(uuid.uuid4().hex)
        stored = {stray: [os.dup(pair.master), os.dup(spoilt.fd)], pair.name: pair.stored()}
        async with adopting(tmp_path, stored, store) as (report, holder):
            assert list(holder.registry.live) == [(OWNER, "tab")]
            assert holder.registry.live[(OWNER, "tab")].ring.contents() == b"the screen\r\n"
            assert report.refused == 1
        assert stray in removals(store)
    finally:
        spoilt.close()


@pytest.mark.parametrize("kept", ["nothing", "a file of another size"])
async def test_a_journal_the_store_did_not_keep_is_a_gap(
    kept: str, pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path
) -> None:
    """An app journaled a held session, and the next holder finds no journal file it can
    take (the store did not keep it, or kept something else under its name): what the app
    recorded is missing, and the replay says where, rather than running on as if seamless.
    A resume of the journal starts afresh."""
    pair = pairs("tab", state="held", custodian_pid=os.getpid(), journal_from=len(REPLAY),
                 journal_capacity=16 * 1024)
    stored = {pair.name: pair.stored()}
    if kept != "nothing":
        other = os.memfd_create("not-a-journal")
        os.ftruncate(other, 100)
        stored[journal_name(pair.token)] = [other]
    async with adopting(tmp_path, stored, store) as (report, holder):
        session = holder.registry.live[(OWNER, "tab")]
        assert session.journal is None and session.journal_from is None
        assert session.replay_gaps == [len(REPLAY)], "no gap where the journal was lost"
        assert session.ring.contents() == REPLAY
    if kept != "nothing":
        assert journal_name(pair.token) in removals(store)


class RefusingStore(FdStore):
    """A store that takes nothing new (as one at its limit), and records the removals it
    is sent."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.removed: list[str] = []

    async def store(self, name: str, fds: list[int]) -> None:
        raise StoreError("the store refused")

    def remove(self, name: str) -> None:
        self.removed.append(name)


async def test_a_session_not_stored_apart_keeps_the_name_it_is_stored_under(
    store: socket.socket, tmp_path: Path
) -> None:
    """Found in review: a session taken up without its record got a new token, which was
    never stored when the store refused it: its release then removed a name the store did
    not have, and the group holding its master stayed stored for good (a released terminal
    that never hangs up, adopted again by the next holder)."""
    master, slave = os.openpty()
    spoilt = StateFile.create(Record, 1 << 20, "test")
    group = session_name(uuid.uuid4().hex)
    holder = Holder(Config(socket_path=str(tmp_path / "escrowd.sock")),
                    RefusingStore(store.getsockname()))
    try:
        report = await adopt_now(holder, {group: [os.dup(master), os.dup(spoilt.fd)]})
        (session,) = holder.registry.live.values()
        assert session.store_name == group and report.without_record == 1
        holder.registry.bury(session, "released", "test")
        assert group in holder.store.removed, holder.store.removed  # type: ignore[attr-defined]
        if report.holder_state is not None:
            report.holder_state.close()
    finally:
        let_go(holder)
        spoilt.close()
        os.close(master)
        os.close(slave)


async def test_a_group_another_session_still_lives_in_is_not_removed(
    pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path
) -> None:
    """Found in review: of a group holding a copy of one terminal and the only copy of
    another, the copy was dropped (the first terminal's believed session was elsewhere),
    and with it the whole group, though the second terminal's session still lived there
    (the store could not take it apart): at the next kill that terminal hung up."""
    believed = pairs("tab", b"the screen\r\n")
    other_master, other_slave = os.openpty()
    group = session_name(uuid.uuid4().hex)
    holder = Holder(Config(socket_path=str(tmp_path / "escrowd.sock")),
                    RefusingStore(store.getsockname()))
    try:
        report = await adopt_now(holder, {
            believed.name: believed.stored(),
            group: [os.dup(believed.master), os.dup(other_master)]})
        names = {s.name: s for s in holder.registry.live.values()}
        assert (OWNER, "tab") in holder.registry.live and len(names) == 2, names
        assert group not in holder.store.removed, "a group a session lives in was removed"  # type: ignore[attr-defined]
        if report.holder_state is not None:
            report.holder_state.close()
    finally:
        let_go(holder)
        os.close(other_master)
        os.close(other_slave)


async def test_of_two_claims_to_a_name_the_believed_one_keeps_it(
    pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path
) -> None:
    """Found in review: a copy taken up without its record but named by a whole slot is
    dated now, so it took the name from the session whose record was believed."""
    believed = pairs("tab", b"the screen\r\n", deposited_at=1000.0)
    master, slave = os.openpty()
    named = StateFile.create(Record, 1 << 20, "test")
    token = uuid.uuid4().hex
    named.write(Record(token=token, owner=OWNER, id="tab", state="bogus"))
    try:
        stored = {believed.name: believed.stored(),
                  session_name(token): [os.dup(master), os.dup(named.fd)]}
        async with adopting(tmp_path, stored, store) as (report, holder):
            assert holder.registry.live[(OWNER, "tab")].token == believed.token
            assert report.renamed == 1
    finally:
        named.close()
        os.close(master)
        os.close(slave)


def test_a_ring_with_no_storage_that_counted_bytes_is_believed() -> None:
    """Found in review: a ring that got no storage (its owner's share used up) still
    counts what it drains, with no layout to say so: its record was refused at the next
    start, and the session taken up without it."""
    from escrowd.bounds import record_doubt

    record = Record(token=uuid.uuid4().hex, owner=OWNER, id="tab", capacity=0)
    assert record_doubt(record, 1 << 20, 5000) is None


async def test_a_master_that_cannot_be_taken_up_now_is_taken_up_later(
    store: socket.socket, tmp_path: Path
) -> None:
    """Found in review: a master for which no state file could be made at adoption (the
    holder out of fds) was kept open, but never read, listed or tried again. Now it is
    tried again until it is a session, listed and drained; never closed."""
    master, slave = os.openpty()
    group = session_name(uuid.uuid4().hex)
    holder = holder_with_store(tmp_path, store)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    report: Adoption | None = None
    try:
        async with trio.open_nursery() as nursery:
            holder._nursery = nursery
            stored = {group: [os.dup(master)]}
            # Out of fds for real: a limit at what is open, and every hole below it filled.
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")),
                                                        limits[1]))
            filler: list[int] = []
            try:
                while True:
                    filler.append(os.dup(0))
            except OSError:
                pass
            try:
                report = await adopt(holder, stored)
            finally:
                for fd in filler:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            assert report.held_back and not holder.registry.live, "taken up without fds?"
            with trio.fail_after(10):
                while not holder.registry.live:
                    await trio.sleep(0.05)
            (session,) = holder.registry.live.values()
            assert session.store_name == group and session.replay_gaps == [0]
            os.write(slave, b"read at last")
            with trio.fail_after(10):
                while session.ring.contents() != b"read at last":
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        let_go(holder)
        if report is not None and report.holder_state is not None:
            report.holder_state.close()
        os.close(master)
        os.close(slave)


async def test_a_handoff_recorded_complete_but_never_logged_is_logged_at_adoption(
    pairs: Callable[..., StoredPair], store: socket.socket, tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A holder killed between recording a handoff complete and logging it left no line
    to say who has the terminal (`bench/chaos.py --kill-holder` counted that session lost).
    The next holder, which finds it recorded so, logs it with its handoff id."""
    pair = pairs(state="handed_off", handoff_id="5f0c6a1e9b2d4c7f8a3e6b1d0c9f2a74")
    async with adopting(tmp_path, {pair.name: pair.stored()}, store) as (report, _):
        assert report.refused == 1
    refused = [line for line in capfd.readouterr().err.splitlines()
               if "event=adopt_refused" in line]
    assert any(" state=handed_off handoff_id=5f0c6a1e9b2d4c7f8a3e6b1d0c9f2a74" in line
               for line in refused), refused
