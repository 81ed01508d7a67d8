"""The holder's half of a handoff, in-process: `escrowd.handoff.retrieve` on a real PTY.

The holder process cannot be made to stop between two lines of the handoff, and some of its
branches need an order of events that a real client cannot force: output written before the
drain task ever ran, a terminal that hung up just before the retrieve, a holder shutting down
(cancelled) while it waits for the ack, a hang-up seen by a drain task that a retrieve is
stopping. Here the handoff runs under trio in the test's own process, on a real PTY, with a
*recording connection* in place of the client's socket: it records what the holder sends
(the fd it hands over is duplicated, as SCM_RIGHTS would), and answers with an `ack`, or
never answers, as each test needs.
"""

from __future__ import annotations

import os
import select
import tty
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio
import trio.testing

from escrow_client import protocol
from escrowd import handoff
from escrowd.config import Config
from escrowd.registry import Registry
from escrowd.session import Session

OWNER = "com.example.term"
SID = "tab-1"
RETRIEVE = protocol.Retrieve(id=SID)
CONFIG = Config(socket_path="unused", drain_stop_budget=2.0, send_deadline=1.0,
                ack_deadline=2.0)


class RecordingConnection:
    """Stands in for `escrowd.connection.Connection`. `reply` decides how the "app" answers
    the handoff: by default with the right `ack`."""

    def __init__(self, reply: Callable[[RecordingConnection], Awaitable[protocol.Request]]
                 | None = None) -> None:
        self.owner = OWNER
        self.number = 1
        self.peer_pid = os.getpid()
        self.client_timeout = 0.0
        self.sent: list[protocol.Message] = []
        self.app_fds: list[int] = []  # the app's copies of what was handed over
        self._reply = reply or RecordingConnection.ack

    async def send(self, message: protocol.Message, fd: int | None = None) -> None:
        self.sent.append(message)
        if fd is not None:
            self.app_fds.append(os.dup(fd))

    async def send_error(self, code: str, message: str, sid: str | None = None) -> None:
        await self.send(protocol.Error(code=code, message=message, id=sid))

    def widen_send_buffer(self) -> None:
        pass

    async def receive(self, max_body: int) -> tuple[protocol.Request, int | None]:
        return await self._reply(self), None

    async def ack(self) -> protocol.Request:
        return protocol.Ack(id=SID, handoff_id=self.handoff().handoff_id)

    def handoff(self) -> protocol.Handoff:
        (sent,) = [m for m in self.sent if isinstance(m, protocol.Handoff)]
        return sent

    def close_app_fds(self) -> None:
        for fd in self.app_fds:
            os.close(fd)
        self.app_fds.clear()


@contextmanager
def raw_pty() -> Iterator[tuple[int, int]]:
    """A real PTY, raw (bytes pass unchanged); the test's own master and slave."""
    master, slave = os.openpty()
    tty.setraw(slave)
    try:
        yield master, slave
    finally:
        for fd in (master, slave):
            try:
                os.close(fd)
            except OSError:
                pass  # the test closed it already


def escrowed(master: int, ring_bytes: int = 1 << 20) -> tuple[Registry, Session]:
    """A registry holding one session on a duplicate of `master` (custody already ended:
    the caller starts the drain)."""
    registry = Registry(max_sessions=8, ring_bytes=ring_bytes, total_ring_bytes=1 << 30,
                        max_tombstones=8)
    session = Session(OWNER, protocol.Deposit(id=SID), os.dup(master), registry.new_ring(),
                      custodian=None, custodian_pid=None, child_start_time=None)
    registry.add(session)
    return registry, session


@contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    """Cancel the block after `seconds` and fail, saying that `what` did not happen (a
    step that never ends would otherwise wait for pytest's own timeout, saying nothing)."""
    with trio.move_on_after(seconds) as scope:
        yield
    if scope.cancelled_caught:
        raise AssertionError(f"timed out after {seconds}s waiting for {what}")


async def until(condition: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Poll `condition` under a deadline, letting the drain task run meanwhile."""
    with within(timeout, what):
        while not condition():
            await trio.sleep(0.001)


def read_all(fd: int) -> bytes:
    """Everything readable on `fd` now (the PTY pushes pending bytes before poll answers)."""
    out = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out


# --- step 2: the sweep -----------------------------------------------------------------------


async def test_the_sweep_takes_what_the_drain_task_never_read() -> None:
    """Incident pinned (issue 9, item 3): an app relaunched within moments of handing off
    got a replay without the child's last output: it had been written after custody ended
    but before the drain task first ran, and the retrieve stopped that task before it read.
    The sweep after the stop reads it into the replay."""
    data = bytes(range(256)) * 12
    with raw_pty() as (master, slave):
        os.write(slave, data)
        registry, session = escrowed(master)
        conn = RecordingConnection()
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")  # scheduled, not run yet
            assert await handoff.retrieve(conn, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
        sent = conn.handoff()
        assert (sent.replay, sent.dropped_bytes) == (data, 0)
        assert conn.sent[-1] == protocol.Done(id=SID)
        assert read_all(master) == b""  # delivered once, in the replay
        conn.close_app_fds()


async def test_the_sweep_fills_free_space_only_and_leaves_the_rest_in_the_kernel() -> None:
    """Incident pinned (issue 9, item 3): a sweep that read like the drain (overwriting the
    oldest bytes of a full ring) threw away replay that nobody had seen, and counted it as
    dropped, although the new reader could have read it from the terminal itself. With a full
    ring and more waiting, the sweep reads nothing: `dropped_bytes` stays 0, the replay is
    the ring as it was, and the rest is still in the kernel for the app."""
    limit = 1024
    first, rest = b"a" * limit, bytes(range(200)) * 2
    with raw_pty() as (master, slave):
        registry, session = escrowed(master, ring_bytes=limit)
        conn = RecordingConnection()
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            os.write(slave, first)
            await until(lambda: session.ring.size == limit, "the ring full")
            assert session.ring.dropped == 0
            os.write(slave, rest)  # no checkpoint until the retrieve stops the drain
            assert await handoff.retrieve(conn, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
        sent = conn.handoff()
        assert (sent.replay, sent.dropped_bytes) == (first, 0)
        assert read_all(master) == rest
        conn.close_app_fds()


async def test_a_terminal_that_hung_up_before_the_drain_ran_is_handed_off_exited() -> None:
    """Incident pinned (issue 9, item 4): a build finished (its terminal hung up) just after
    its app handed off, before the drain task first ran; the relaunched app was told the
    session was still `draining` and waited for output that could never come. The sweep
    sees the hang-up after reading the whole tail, and the handoff says `exited`."""
    tail = b"build done\r\n" * 50
    with raw_pty() as (master, slave):
        os.write(slave, tail)
        os.close(slave)
        registry, session = escrowed(master)
        conn = RecordingConnection()
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            assert await handoff.retrieve(conn, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
        sent = conn.handoff()
        assert sent.session.state == "exited"
        assert sent.replay == tail
        conn.close_app_fds()


async def test_the_gaps_of_a_trimmed_replay_are_where_its_bytes_are() -> None:
    """A replay whose ring wrapped starts at the next whole line (`replay_trimmed` bytes
    cut), and the spots where a read may be missing are offsets into the replay as sent:
    shifted by what was cut. Unshifted, an app would mark the gap that many bytes too far
    on, in the middle of output that is whole."""
    limit = 4096
    data = b"".join(f"line {i:05d} of the build\r\n".encode() for i in range(300))
    assert data[-limit - 1] != ord("\n")  # the oldest byte the ring keeps is mid-line
    head, tail = data[:-100], data[-100:]
    with raw_pty() as (master, slave):
        registry, session = escrowed(master, ring_bytes=limit)
        conn = RecordingConnection()
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            for start in range(0, len(head), 2000):  # (each write fits the PTY's buffer)
                chunk = head[start : start + 2000]
                os.write(slave, chunk)
                await until(lambda: session.ring.total == start + len(chunk),  # noqa: B023
                            "the drain to read the head")
            # Where a holder adopting the session after an unclean stop marks a gap
            # (escrowd.adoption): one read's bytes may be missing here.
            session.gap_totals.append(session.ring.total)
            os.write(slave, tail)
            await until(lambda: session.ring.total == len(data), "the drain to read the tail")
            assert await handoff.retrieve(conn, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
        sent = conn.handoff()
        assert sent.replay_trimmed > 0 and sent.replay.startswith(b"line ")
        assert sent.replay == data[len(data) - len(sent.replay):]
        assert sent.session.replay_gaps == [len(sent.replay) - 100], \
            "the gap is not 100 bytes before the end of the replay as sent"
        assert sent.session.replay_gap_at == len(sent.replay) - 100
        conn.close_app_fds()


# --- cancelled mid-handoff -------------------------------------------------------------------


async def test_a_handoff_cancelled_while_waiting_for_the_ack_is_put_back() -> None:
    """Incident pinned (issue 9, item 13): the holder was shut down while it waited for an
    app's ack. Cancellation passes no except clause, so only the `finally` can put the
    session back: draining again on the same fd, ring untouched, handoff_id cleared, and a
    fresh drain reading on."""
    with raw_pty() as (master, slave):
        os.write(slave, b"before\r\n")
        registry, session = escrowed(master)
        cancelled = trio.CancelScope()

        async def shut_down(conn: RecordingConnection) -> protocol.Request:
            cancelled.cancel()  # as a holder stopping, while the app has not acked yet
            await trio.sleep_forever()
            raise AssertionError("not reached")

        conn = RecordingConnection(shut_down)
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            with cancelled:
                await handoff.retrieve(conn, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
                raise AssertionError("the retrieve was not cancelled")
            assert conn.handoff().replay == b"before\r\n"
            assert session.state == "draining"
            assert session.handoff_id is None
            assert registry.handoffs_failed == 1 and registry.handoffs == 0
            assert session.has_drain()
            os.write(slave, b"after\r\n")
            await until(lambda: session.ring.size == len(b"before\r\nafter\r\n"), "a new drain")
            assert session.ring.contents() == b"before\r\nafter\r\n"
            await session.stop_drain()
        session.close()
        conn.close_app_fds()


# --- the drain task --------------------------------------------------------------------------


async def test_a_hang_up_seen_while_handing_off_leaves_the_state_to_the_handoff() -> None:
    """Incident pinned (issue 9, item 13): trio's cancel cannot stop a drain task that the
    I/O manager already woke, so a retrieve that has set `handing_off` can meet a drain that
    reads on and sees the terminal hang up. Were the drain to mark the session `exited`
    then, a second retrieve could hand the same terminal out while the first handoff is
    still under way. The drain leaves the state alone and records the hang-up (`hung_up`),
    which the handoff reads; the whole tail is in the ring first.

    The order is forced by doing what retrieve does first (set `handing_off`) before the
    terminal hangs up, and letting the drain task see the hang-up before it is stopped."""
    tail = b"last words\r\n" * 20
    with raw_pty() as (master, slave):
        registry, session = escrowed(master)
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            await trio.testing.wait_all_tasks_blocked()  # the drain waits for output
            session.set_state("handing_off", "retrieve (under way)")
            os.write(slave, tail)
            os.close(slave)
            await until(lambda: session.hung_up, "the drain to see the hang-up")
            assert session.state == "handing_off"
            assert session.ring.contents() == tail
            await session.stop_drain()
        session.close()


async def test_a_batch_records_each_handoff_only_as_its_fd_leaves() -> None:
    """Found in review: a holder killed in the middle of a `retrieve_many` left every
    claimed session recorded `handing_off`, and the next holder waited for acks (while the
    app lived) for fds that had never been sent: unread terminals. Each session's state
    file says `handing_off` only from just before its own fd goes; until then a holder
    adopting it drains it."""
    registry = Registry(max_sessions=8, ring_bytes=1 << 16, total_ring_bytes=1 << 30,
                        max_tombstones=8)
    ptys = [os.openpty() for _ in range(3)]
    sessions = []
    for i, (master, _) in enumerate(ptys):
        s = Session(OWNER, protocol.Deposit(id=f"s{i}"), os.dup(master), registry.new_ring(),
                    custodian=None, custodian_pid=None, child_start_time=None)
        registry.add(s)
        sessions.append(s)
    recorded: list[list[str]] = []  # the states on file as each handoff is sent

    class Watching(RecordingConnection):
        async def send(self, message: protocol.Message, fd: object = None) -> None:
            if isinstance(message, protocol.Handoff):
                recorded.append([s.ring.state.record().state for s in sessions])  # type: ignore[union-attr]
            await super().send(message, None)

    async def ack_all(conn: RecordingConnection) -> protocol.Request:
        return protocol.AckMany(acks={m.session.id: m.handoff_id for m in conn.sent
                                      if isinstance(m, protocol.Handoff)})

    conn = Watching(ack_all)
    try:
        async with trio.open_nursery() as nursery:
            for s in sessions:
                s.start_drain(nursery, "custodian gone")
            request = protocol.RetrieveMany(ids=[s.id for s in sessions])
            assert await handoff.retrieve(conn, request, registry, CONFIG, nursery)  # type: ignore[arg-type]
        assert recorded == [["handing_off", "draining", "draining"],
                            ["handing_off", "handing_off", "draining"],
                            ["handing_off", "handing_off", "handing_off"]]
    finally:
        for master, slave in ptys:
            os.close(master)
            os.close(slave)


# --- many sessions, a chunk at a time ------------------------------------------------------


@contextmanager
def many_escrowed(count: int) -> Iterator[tuple[Registry, list[Session], list[int]]]:
    """A registry of `count` sessions "m0".. on real PTYs (raw), and the slaves."""
    registry = Registry(max_sessions=count, ring_bytes=1 << 16, total_ring_bytes=1 << 30,
                        max_tombstones=count)
    ptys = [os.openpty() for _ in range(count)]
    sessions = []
    try:
        for i, (master, slave) in enumerate(ptys):
            tty.setraw(slave)
            s = Session(OWNER, protocol.Deposit(id=f"m{i}"), os.dup(master),
                        registry.new_ring(), custodian=None, custodian_pid=None,
                        child_start_time=None)
            registry.add(s)
            sessions.append(s)
        yield registry, sessions, [slave for _, slave in ptys]
    finally:
        for master, slave in ptys:
            os.close(master)
            os.close(slave)


async def test_a_refusal_that_cannot_be_sent_leaves_every_claim_draining() -> None:
    """Found in review: a `retrieve_many` claims a chunk's sessions (telling their drains to
    stop) before it sends the chunk's refusals; a refusal whose send failed (the app hung
    up) put the claimed sessions back `draining` with their drain stopped and none started:
    nobody read those terminals any more, and their programs blocked once they filled."""

    class HungUp(RecordingConnection):
        async def send(self, message: protocol.Message, fd: int | None = None) -> None:
            raise BrokenPipeError("the app hung up")

    with many_escrowed(2) as (registry, sessions, slaves):
        async with trio.open_nursery() as nursery:
            for s in sessions:
                s.start_drain(nursery, "custodian gone")
            request = protocol.RetrieveMany(ids=["nope", "m0", "m1"])
            try:
                await handoff.retrieve(HungUp(), request, registry, CONFIG, nursery)  # type: ignore[arg-type]
            except BrokenPipeError:
                pass
            assert [s.state for s in sessions] == ["draining", "draining"]
            for slave in slaves:
                os.write(slave, b"still read\n")
            await until(lambda: all(s.ring.contents() == b"still read\n" for s in sessions),
                        "a drain to read each terminal again")
            nursery.cancel_scope.cancel()


async def test_a_holder_that_starts_stopping_answers_busy_for_chunks_not_begun() -> None:
    """Once the holder is stopping in order, a `retrieve_many` claims no more: the ids of
    chunks not begun are answered `busy`, and the handoffs already sent go on to their
    acks."""
    asked = []

    def stopping() -> bool:
        asked.append(True)
        return len(asked) > 1  # from the second chunk on

    async def ack_all(conn: RecordingConnection) -> protocol.Request:
        return protocol.AckMany(acks={m.session.id: m.handoff_id for m in conn.sent
                                      if isinstance(m, protocol.Handoff)})

    with many_escrowed(40) as (registry, sessions, _):
        conn = RecordingConnection(ack_all)
        async with trio.open_nursery() as nursery:
            for s in sessions:
                s.start_drain(nursery, "custodian gone")
            request = protocol.RetrieveMany(ids=[s.id for s in sessions])
            assert await handoff.retrieve(conn, request, registry, CONFIG, nursery,  # type: ignore[arg-type]
                                          stopping)
            handed = [m.session.id for m in conn.sent if isinstance(m, protocol.Handoff)]
            busy = [m.id for m in conn.sent if isinstance(m, protocol.Error)]
            assert handed == [f"m{i}" for i in range(32)]
            assert busy == [f"m{i}" for i in range(32, 40)]
            assert {e.code for e in conn.sent if isinstance(e, protocol.Error)} == {"busy"}
            assert [s.state for s in sessions[32:]] == ["draining"] * 8
            assert all(s.has_drain() for s in sessions[32:])
            nursery.cancel_scope.cancel()
        conn.close_app_fds()


async def test_a_drain_stops_at_once_whatever_the_drain_stop_budget() -> None:
    """A drain stops synchronously (escrowd.drain: the terminal leaves the drain loop's set,
    and no read is ever in flight while another task runs), so no stop can outlast even a
    drain-stop budget of a microsecond: every session of a `retrieve_many` is handed off,
    none answered `drain_stop_timeout`."""
    config = Config(socket_path="unused", drain_stop_budget=0.000001, send_deadline=1.0,
                    ack_deadline=2.0)

    async def ack_all(conn: RecordingConnection) -> protocol.Request:
        return protocol.AckMany(acks={m.session.id: m.handoff_id for m in conn.sent
                                      if isinstance(m, protocol.Handoff)})

    with many_escrowed(40) as (registry, sessions, slaves):
        for i, slave in enumerate(slaves):
            os.write(slave, b"printed by %d\n" % i)
        conn = RecordingConnection(ack_all)
        async with trio.open_nursery() as nursery:
            for s in sessions:
                s.start_drain(nursery, "custodian gone")
            request = protocol.RetrieveMany(ids=[s.id for s in sessions])
            assert await handoff.retrieve(conn, request, registry, config, nursery)  # type: ignore[arg-type]
            assert not [m for m in conn.sent if isinstance(m, protocol.Error)]
            handed = {m.session.id: m.replay for m in conn.sent
                      if isinstance(m, protocol.Handoff)}
            assert handed == {f"m{i}": b"printed by %d\n" % i for i in range(40)}
            assert not any(s.has_drain() for s in sessions)
        conn.close_app_fds()


async def test_an_adopted_handoff_asked_for_again_by_its_client_is_handed_off_anew() -> None:
    """Seen in a chaos run: a holder recorded `handing_off` and was SIGKILLed before the
    fd left; the next holder waited for an ack from that client, which was alive, never
    got the fd and so could never ack: every retrieve it made was answered `busy`, and
    nothing read the terminal. The same process asking again ends that handoff; another
    process still gets `busy`."""
    with raw_pty() as (master, slave):
        registry, session = escrowed(master)
        session.set_state("handing_off", "adopted")
        session.adopted_handoff = True
        session.handoff_id, session.handoff_peer_pid = "begun-by-the-dead-holder", os.getpid()
        os.write(slave, b"printed meanwhile\n")
        other = RecordingConnection()
        other.peer_pid = 1
        conn = RecordingConnection()
        try:
            async with trio.open_nursery() as nursery:
                assert await handoff.retrieve(other, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
                assert [(m.code, m.id) for m in other.sent] == [("busy", SID)]  # type: ignore[attr-defined]
                assert session.adopted_handoff and session.state == "handing_off"
                assert await handoff.retrieve(conn, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
            sent = conn.handoff()
            assert sent.handoff_id != "begun-by-the-dead-holder"
            assert sent.replay == b"printed meanwhile\n"
            assert registry.tombstone(OWNER, SID).state == "handed_off"  # type: ignore[union-attr]
            assert registry.handoffs_failed == 1
        finally:
            conn.close_app_fds()


# --- more than one retrieve at a time -------------------------------------------------------


async def test_two_retrieves_put_back_in_turn_leave_one_drain() -> None:
    """Found in review, when each drain was a task of its own: two retrieves that both ran
    out of the drain-stop budget on one slow drain each left a task to drain again, and two
    drain tasks read one fd. A drain is now an fd in the drain loop's set, started and
    stopped synchronously: two retrieves put back one after the other leave it there once,
    and every byte is read once."""
    async def wrong(conn: RecordingConnection) -> protocol.Request:
        return protocol.List()

    with raw_pty() as (master, slave):
        registry, session = escrowed(master)
        async with trio.open_nursery() as nursery:
            session.start_drain(nursery, "custodian gone")
            for _ in range(2):
                conn = RecordingConnection(wrong)
                await handoff.retrieve(conn, RETRIEVE, registry, CONFIG, nursery)  # type: ignore[arg-type]
                conn.close_app_fds()
                assert session.state == "draining" and session.has_drain()
            os.write(slave, b"read once\n")
            await until(lambda: session.ring.contents() == b"read once\n", "the one drain")
            await session.stop_drain()


async def test_a_second_put_back_leaves_another_retrieves_handoff_alone() -> None:
    """Found in review: a retrieve answered with a wrong message puts its session back, and
    answers `bad_request`; while that answer waited for the app, another retrieve claimed
    the session, and the first one's final put-back took that handoff from it (the session
    drained while its fd was on the way, and the right ack was refused)."""
    sent_error = trio.Event()
    go_on = trio.Event()

    class SlowToTakeErrors(RecordingConnection):
        async def send(self, message: protocol.Message, fd: int | None = None) -> None:
            await super().send(message, fd)
            if isinstance(message, protocol.Error):
                sent_error.set()
                await go_on.wait()  # the app does not read

    async def wrong(conn: RecordingConnection) -> protocol.Request:
        return protocol.List()

    async def ack_after_the_first_is_done(conn: RecordingConnection) -> protocol.Request:
        go_on.set()
        await trio.testing.wait_all_tasks_blocked()  # the first retrieve ends meanwhile
        return protocol.Ack(id=SID, handoff_id=conn.handoff().handoff_id)

    with raw_pty() as (master, slave):
        registry, session = escrowed(master)
        second = RecordingConnection(ack_after_the_first_is_done)
        second.peer_pid = 4242
        try:
            with within(5.0, "the retrieves to end and the session's drain with them"):
                async with trio.open_nursery() as nursery:
                    session.start_drain(nursery, "custodian gone")
                    nursery.start_soon(handoff.retrieve, SlowToTakeErrors(wrong), RETRIEVE,
                                       registry, CONFIG, nursery)
                    with within(5.0, "the first retrieve to answer bad_request"):
                        await sent_error.wait()
                    assert session.state == "draining"  # put back at once
                    with within(5.0, "the second retrieve to end"):
                        assert await handoff.retrieve(second, RETRIEVE, registry, CONFIG,  # type: ignore[arg-type]
                                                      nursery)
                    answered = second.sent[-1]
                    if not isinstance(answered, protocol.Done):
                        # Its handoff was taken from it: the session drains on, and this
                        # nursery would never end.
                        nursery.cancel_scope.cancel()
            assert isinstance(answered, protocol.Done), (
                f"the second retrieve's ack was refused ({answered!r}): the first "
                "retrieve's put-back took its handoff")
            assert registry.tombstone(OWNER, SID).state == "handed_off"  # type: ignore[union-attr]
        finally:
            second.close_app_fds()
