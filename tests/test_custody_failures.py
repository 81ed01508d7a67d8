"""Custody when the holder is caught between two states (docs/design.md §3, §11, §12): a `done` that
never comes for a retrieve into custody, a holder that restarted before it saw custody end
and lists the session as still held by the app. A real holder does not take these paths on
cue; a fake one (tests/fakeholder.py, a real Unix socket server speaking the real protocol)
does, with `Holder` below as the script of every connection.

The terminals are real PTYs and the journal file is a real one (made as the holder makes
one, `escrowd.journal`); whether the client kept or closed its copies is read from
/proc/self/fd.
"""

from __future__ import annotations

import os
import threading
import tty
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from fakeholder import OWNER, SID, WELCOME, FakeHolder, Peer, fds_open_on

from conftest import wait_for
from escrow_client import breaker, errors, protocol
from escrow_client.platform import pty_number
from escrowd.journal import JournalFile
from escrowd.ring import RingBudget

HANDOFF_ID = "a" * 32
DEPOSITED_AT = 1767225600.25
RING = 64 * 1024
LAYOUT = protocol.Journal(capacity=RING, total=0, position=0)
# A holder that can keep sessions in custody and journal them; small budgets, so that a
# client timeout short enough for a short test is still above them.
KEEPING = msgspec.structs.replace(WELCOME, features=["keep", "journal", "journal_reading"],
                                  drain_stop_budget=0.05, send_deadline=0.05)
STATUS = protocol.HolderStatus(pid=1, version="fake", started_at=0.0, socket="fake")


@pytest.fixture(autouse=True)
def fresh_breaker() -> Iterator[None]:
    breaker.reset()
    yield
    breaker.reset()


@pytest.fixture
def terminal() -> Iterator[tuple[int, int]]:
    """A real PTY (master, slave), raw; the test's own copies."""
    master, slave = os.openpty()
    tty.setraw(slave)
    yield master, slave
    os.close(master)
    os.close(slave)


@pytest.fixture
def journal_file() -> Iterator[JournalFile]:
    """A journal file as the holder makes one, for a journal the fake holder grants."""
    state = JournalFile.create(RING, RingBudget(1 << 30))
    yield state
    state.close()


class Holder:
    """The script of every connection: what the client asks first says what it is.

    - `list`: answered with the next of `listed` (the last one repeats): SID in that state
      (`held` is held by this process), or not listed (None). `on_list` runs first, in the
      fake holder's thread, while the client waits for the answer.
    - `retrieve{keep}`: `master` handed over; the ack is taken and never answered with
      `done`. Then it goes on as a custody connection.
    - `deposit`: a custody connection. Each deposit is answered `deposited` (the first
      one only once `answer_first_deposit` is set, if given) (with
      `journal_file` as its journal, if one is asked for and given), `status` (a client
      putting the stream back in step) `holder_status`, `release` `released`, until the
      client hangs up; with `refuse_deposits`, every deposit after a dropped first one
      is answered `limit`.
    `custodies` has, per custody connection, the number of each terminal deposited on it."""

    def __init__(self, listed: list[str | None], master: int | None = None,
                 journal_file: JournalFile | None = None,
                 answer_first_deposit: threading.Event | None = None,
                 drop_first_deposit: bool = False, refuse_deposits: bool = False) -> None:
        self.listed = listed
        self.refuse_deposits = refuse_deposits
        self.answer_first_deposit = answer_first_deposit
        self.drop_first_deposit = drop_first_deposit
        self.lists = 0
        self.master = master
        self.journal_file = journal_file
        self.on_list: Callable[[], None] = lambda: None
        self.custodies: list[list[int | None]] = []

    def __call__(self, peer: Peer) -> None:
        message, terminal = peer.receive_carrying()
        if isinstance(message, protocol.List):
            self.on_list()
            state = self.listed[min(self.lists, len(self.listed) - 1)]
            self.lists += 1
            peer.send(protocol.Sessions(sessions=[] if state is None else [protocol.SessionInfo(
                owner=OWNER, id=SID, state=state,  # type: ignore[arg-type]
                custodian_pid=os.getpid() if state == "held" else None,
                deposited_at=DEPOSITED_AT)]))
            return
        deposited: list[int | None] = []
        self.custodies.append(deposited)
        while True:
            if isinstance(message, protocol.Retrieve) and message.keep:
                assert self.master is not None
                info = protocol.SessionInfo(owner=OWNER, id=SID, state="draining",
                                            deposited_at=DEPOSITED_AT)
                peer.send(protocol.Handoff(handoff_id=HANDOFF_ID, session=info, replay=b"R"),
                          fd=self.master)
                peer.expect(protocol.Ack)  # and no `done`
            elif isinstance(message, protocol.Deposit):
                deposited.append(terminal)
                if self.drop_first_deposit:
                    self.drop_first_deposit = False
                    return  # taken, and never answered: the holder went away
                if self.answer_first_deposit is not None:
                    # Late: the client has given up waiting by the time this goes out.
                    assert self.answer_first_deposit.wait(30)
                    self.answer_first_deposit = None
                if self.refuse_deposits:
                    peer.send(protocol.Error(code="limit", message="refused, as asked"))
                elif message.journal and self.journal_file is not None:
                    peer.send(protocol.Deposited(id=message.id, journal=LAYOUT),
                              fd=self.journal_file.fd)
                else:
                    peer.send(protocol.Deposited(id=message.id))
            elif isinstance(message, protocol.Status):
                peer.send(STATUS)
            elif isinstance(message, protocol.Release):
                peer.send(protocol.Released(id=message.id))
            else:
                raise AssertionError(f"not asked on a custody connection: {message!r}")
            try:
                message, terminal = peer.receive_carrying()
            except (EOFError, ConnectionResetError):
                return  # custody ended


def whole(state: JournalFile) -> bytes:
    """Every byte of the journal file: its header, its counters and its ring."""
    return os.pread(state.fd, os.fstat(state.fd).st_size, 0)


def fake_holder(socket_dir: Path, holder: Holder) -> FakeHolder:
    return FakeHolder(socket_dir, [holder], welcome=KEEPING, repeat_last=True, concurrent=True)


def test_a_retrieve_into_custody_without_done_deposits_again_what_the_holder_lost(
    socket_dir: Path, terminal: tuple[int, int],
) -> None:
    """The holder took the ack of a retrieve into custody and never answered `done`; asked
    on a fresh connection, it no longer lists the session (it lost it). The app's copy of
    the master is then the only one: custody keeps it and deposits it again at once, on
    its own connection, so that the session is escrowed again (not only the app's, for a
    crash to take with it)."""
    master, _ = terminal
    holder = Holder(listed=[None, "draining"], master=master)
    with fake_holder(socket_dir, holder) as fake:
        custody = fake.client(timeout=0.5).custody()  # `done` is awaited this long
        try:
            got = custody.retrieve(SID)
            copies = fds_open_on(master)  # ours, the app's, and the one custody keeps
        finally:
            breaker.reset()  # the retrieve's timeout opened it; close() must ask the holder
            custody.close()
    try:
        assert got.confirmed and got.replay == b"R"
        assert holder.custodies == [[pty_number(master)]], (
            "the session the holder no longer listed was not deposited again from the "
            f"app's copy (deposited on each custody connection: {holder.custodies})")
        assert len(copies) == 3, copies
    finally:
        os.close(got.fd)
    assert fds_open_on(master) == {master}


def test_close_waits_while_the_holder_lists_the_session_held_by_this_process(
    socket_dir: Path, terminal: tuple[int, int],
) -> None:
    """A holder that restarted before it saw custody end (and adopted the session, held
    by this process, from its store) lists it `held` by us, waiting for a custody that
    no longer exists: nobody reads the terminal, and another instance of the app is
    refused it. close() must not return on that answer: it takes custody back, ends it
    again, and returns once the holder lists the session draining."""
    master, _ = terminal
    holder = Holder(listed=["held", "draining"])
    with fake_holder(socket_dir, holder) as fake:
        custody = fake.client().custody()
        custody.deposit(SID, master)
        custody.close()
    assert holder.lists == 2, (
        "close() returned while the holder listed the session as held by this process")
    assert holder.custodies == [[pty_number(master)]] * 2, holder.custodies  # taken back
    assert fds_open_on(master) == {master}


def test_the_app_records_nothing_once_custody_is_ending(
    socket_dir: Path, terminal: tuple[int, int], journal_file: JournalFile,
) -> None:
    """close() stops the app's journal writes before custody ends: from then on the holder
    drains into that ring, and a record of the app's (a reader thread still at work while
    another closes) would be a second writer in it. Here the holder also restarted before
    it saw the end, so close() takes custody back, and the holder's answer carries the
    state file again. At each list the holder answers while close() runs, the session is
    not journaled and `record` leaves the journal file alone."""
    master, _ = terminal
    holder = Holder(listed=["held", "draining"], journal_file=journal_file)
    seen: list[tuple[bool, bool]] = []  # at each list: journaled, the file changed
    ours = fds_open_on(journal_file.fd)  # (its mapping has a copy of its own)
    with fake_holder(socket_dir, holder) as fake:
        custody = fake.client().custody()

        def during_the_end() -> None:
            before = whole(journal_file)
            custody.record(SID, b"read while custody ends\r\n")
            seen.append((custody.journaled(SID), whole(journal_file) != before))

        holder.on_list = during_the_end
        custody.deposit(SID, master, journal=True)
        custody.record(SID, b"read in custody\r\n")  # the journal works: this one is in
        assert journal_file.counters()[0] == len(b"read in custody\r\n")
        custody.close()
    assert seen == [(False, False)] * 2, (
        f"the app recorded into the ring while custody was ending (journaled, wrote): {seen}")
    assert holder.custodies == [[pty_number(master)]] * 2, holder.custodies
    assert journal_file.counters()[0] == len(b"read in custody\r\n")
    assert fds_open_on(journal_file.fd) == ours and fds_open_on(master) == {master}  # no copy kept


def test_a_deposit_that_timed_out_is_settled_on_its_connection(
    socket_dir: Path, terminal: tuple[int, int],
) -> None:
    """A holder too slow to answer a deposit within the client's timeout: the deposit may
    well have arrived. The app is told the outcome is unknown (DepositIndeterminate), not
    that nothing was escrowed; custody keeps its copy, is not protected, and settles it on
    the same connection (closing it would end custody of everything on it): the holder's
    list says the session is held by this process, so it is, and custody is protected."""
    master, _ = terminal
    late = threading.Event()
    holder = Holder(listed=["held", "draining"], answer_first_deposit=late)
    with fake_holder(socket_dir, holder) as fake:
        custody = fake.client(timeout=0.5).custody()
        try:
            with pytest.raises(errors.DepositIndeterminate) as unknown:
                custody.deposit(SID, master)
            assert isinstance(unknown.value.cause, errors.HolderUnresponsive)
            assert custody.pending() == {SID} and not custody.protected
            assert len(fds_open_on(master)) == 2, "custody did not keep its copy"
            late.set()
            breaker.reset()  # (the timeout opened it: a wedged holder would keep it open)
            wait_for(lambda: custody.protected, 10.0, "the deposit to be settled")
            assert custody.pending() == set() and holder.lists >= 1
            assert holder.custodies == [[pty_number(master)]], holder.custodies
        finally:
            custody.close()
    assert fds_open_on(master) == {master}


def test_a_hand_off_whose_deposit_got_no_answer_is_settled_and_ended(
    socket_dir: Path, terminal: tuple[int, int],
) -> None:
    """Found by a test that upgrades under load: a hand-off whose deposit the holder took
    and went away before answering raised DepositIndeterminate to the app, though the
    hand-off can settle it itself: its custody deposits the terminal again on the next
    connection and ends it there, confirmed. The app's hand-off returns as done."""
    master, _ = terminal
    holder = Holder(listed=[None, "draining"], drop_first_deposit=True)
    with fake_holder(socket_dir, holder) as fake:
        fake.client().hand_off(SID, master)
    assert holder.custodies[:2] == [[pty_number(master)]] * 2, holder.custodies
    assert holder.lists == 2
    assert fds_open_on(master) == {master}


def test_a_hand_off_whose_deposit_never_arrived_is_not_confirmed_by_a_tombstone(
    socket_dir: Path, terminal: tuple[int, int],
) -> None:
    """A hand-off's deposit got no answer, and the holder lists the id only as a tombstone
    (an earlier session's: the app reclaimed a `tab-1` before), then refuses the deposit
    again. The tombstone is not the deposit arriving: the hand-off raises, so the app keeps
    its terminal, rather than returning as done and letting the app close the only copy."""
    master, _ = terminal
    holder = Holder(listed=["handed_off"], drop_first_deposit=True, refuse_deposits=True)
    with fake_holder(socket_dir, holder) as fake:
        with pytest.raises(errors.HolderUnavailable):
            fake.client().hand_off(SID, master)
    assert fds_open_on(master) == {master}
