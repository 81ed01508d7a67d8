"""The handoff when it goes wrong (docs/design.md §4 steps 5-8).

Every failure after the holder has stopped the drain (the send fails, the peer hangs up, the
ack never comes, comes late, or something else comes instead) must put the session back as it
was: same fd, ring untouched, draining again. Nothing is lost, nothing is delivered twice, the
session is never marked handed off without an ack, and at no moment are there two readers.

Most tests stop a raw protocol client (tests/rawclient.py) at one step of the exchange, against
the real holder process, and then take the session back with the real client library: its
replay must still begin with what the session held before the failed attempt, and replay plus
live output must be one gap-free stream.
"""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hostile import assert_gap_free_from_1, log_fields, read_more_lines
from rawclient import RawClient

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import Busy, EscrowClient, protocol

SID = "tab-1"
# Numbered lines, one every ~10 ms, for as long as any test can last.
COUNTER = "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); echo L$i; sleep 0.01; done"
FIRST_LINES = b"L1\r\nL2\r\nL3\r\n"

SpawnPty = Callable[..., PtyChild]


# --- helpers --------------------------------------------------------------------------------


def info_of(client: EscrowClient, sid: str = SID) -> protocol.SessionInfo | None:
    return next((s for s in client.list() if s.id == sid), None)


def wait_state(
    client: EscrowClient, state: str, sid: str = SID, min_buffered: int = 0, timeout: float = 10.0
) -> protocol.SessionInfo:
    def check() -> protocol.SessionInfo | None:
        info = info_of(client, sid)
        if info is not None and info.state == state and info.buffered_bytes >= min_buffered:
            return info
        return None

    return wait_for(check, timeout, f"{sid} {state} with >= {min_buffered} bytes buffered")


def hand_off(holder: HolderProcess, pty_children: SpawnPty, script: str) -> EscrowClient:
    """Start `sh -c script` in a PTY, hand its master to the holder and close ours."""
    child = pty_children(["sh", "-c", script])
    client = holder.client()
    client.hand_off(SID, child.master, child_pid=child.pid, label="sh")
    os.close(child.master)
    child.master = -1
    return client


def counter_session(
    holder: HolderProcess, pty_children: SpawnPty
) -> tuple[EscrowClient, protocol.SessionInfo]:
    """A session whose child prints L1, L2, ... forever, draining with a few lines in its ring."""
    client = hand_off(holder, pty_children, COUNTER)
    return client, wait_state(client, "draining", min_buffered=len(FIRST_LINES))


def read_until(fd: int, marker: bytes, timeout: float = 10.0) -> bytes:
    out = bytearray()
    deadline = time.monotonic() + timeout
    while marker not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"{marker!r} did not come within {timeout}s; got {bytes(out)[-200:]!r}"
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 65536)
            assert chunk, "end of file on a live master"
            out += chunk
    return bytes(out)


def state_changes(holder: HolderProcess, sid: str = SID) -> list[tuple[str, str]]:
    """(state, reason) of every logged state change of the session, in order."""
    name = f"{OWNER}/{sid}"
    fields = (log_fields(line) for line in holder.log_lines("state"))
    return [(f["state"], f.get("reason", "")) for f in fields if f.get("session") == name]


def wait_state_logged(holder: HolderProcess, state: str, reason_prefix: str) -> None:
    wait_for(
        lambda: any(s == state and why.startswith(reason_prefix)
                    for s, why in state_changes(holder)),
        10.0, f"a logged change to {state} with reason {reason_prefix!r}",
    )


def assert_holder_serving(holder: HolderProcess, client: EscrowClient) -> None:
    assert holder.alive(), holder.logs()
    assert client.status().pid == holder.pid


def wait_closed_by_holder(raw: RawClient) -> None:
    """Read (and drop) until the holder ends the connection."""
    try:
        while raw.sock.recv(65536):
            pass
    except ConnectionResetError:
        pass  # the holder closed with bytes of ours still unread


def take_back_and_check(
    client: EscrowClient, head: bytes, min_replay: int = 0
) -> protocol.SessionInfo:
    """Retrieve the counter session normally: its replay starts with `head` (what it held
    before), replay plus live output is gap-free from L1, and the fd is a working master."""
    got = client.retrieve(SID)
    try:
        assert got.confirmed
        assert got.session.state == "draining"
        assert os.isatty(got.fd)
        assert got.dropped_bytes == 0
        assert got.replay.startswith(head), (got.replay[:80], head[:80])
        assert len(got.replay) >= min_replay
        assert_gap_free_from_1(read_more_lines(got.fd, got.replay, 3))
    finally:
        os.close(got.fd)
    return got.session


# --- step 5/6: the send fails ---------------------------------------------------------------


def test_peer_hung_up_before_the_handoff_send(holder: HolderProcess, pty_children) -> None:
    """Incident: an app sent `retrieve` and hung up before the holder sent the fd (it was
    killed mid-launch). The send got EPIPE. The holder must survive it (no SIGPIPE death, no
    crash), must not mark the session handed off, and must put it back draining on the same
    fd with its ring untouched, so the next launch gets the whole replay from L1."""
    client, before = counter_session(holder, pty_children)
    with RawClient(holder.socket) as raw:
        raw.hello()
        # Hang up our receiving side before asking: the holder's send of the handoff then
        # fails with EPIPE for certain, as after a close, without racing a close against it.
        raw.sock.shutdown(socket.SHUT_RD)
        raw.send(protocol.Retrieve(id=SID))
    # Asserted as state, not as a log line: the failed handoff is counted, the session is
    # draining with no handoff under way and its ring untouched, and a fresh drain reads on
    # (the ring grows after the put-back, with nothing dropped).
    wait_for(lambda: client.status().counters["handoffs_failed"] == 1, 10.0,
             "the failed handoff counted")
    put_back = wait_state(client, "draining")
    assert put_back.handoff_id is None
    assert put_back.buffered_bytes >= before.buffered_bytes
    after = wait_state(client, "draining", min_buffered=put_back.buffered_bytes + 1)
    assert after.dropped_bytes == 0
    assert_holder_serving(holder, client)
    assert client.status().counters["handoffs"] == 0
    assert [s for s, _ in state_changes(holder)] == ["held", "draining", "handing_off", "draining"]
    take_back_and_check(client, FIRST_LINES, min_replay=before.buffered_bytes)


def _sigign_has_sigpipe(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(int(line.split()[1], 16) for line in status.splitlines()
                if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGPIPE - 1)))


def test_holder_ignores_sigpipe(holder: HolderProcess, socket_dir: Path) -> None:
    """Incident: a send to a peer that had hung up raised SIGPIPE, whose default action killed
    the holder and every escrowed session with it. Layer 1: SIGPIPE is ignored process-wide.

    CPython ignores SIGPIPE at start-up by itself, so the fixture holder alone cannot show that
    escrowd does it: a second holder is started through `escrowd.__main__.main` from a process
    that reset SIGPIPE to its default first (as an embedding, or a wrapper that restores
    signal dispositions, would). Its `main()` must ignore it again before any socket work."""
    assert _sigign_has_sigpipe(holder.pid)

    sock = str(socket_dir / "embedded.sock")
    log_path = socket_dir / "embedded.log"
    wrapper = textwrap.dedent("""
        import signal, sys
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        status = open("/proc/self/status").read()
        mask = int(status.split("SigIgn:")[1].split()[0], 16)
        print("before_main_sigpipe_ignored=%s" % bool(mask & (1 << (signal.SIGPIPE - 1))),
              file=sys.stderr, flush=True)
        from escrowd.__main__ import main
        sys.exit(main(sys.argv[1:]))
    """)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", wrapper, "--socket", sock],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return " event=ready " in log_path.read_text()

        wait_for(ready, 15.0, "the wrapped escrowd to be ready")
        # Control: the disposition really was the default when main() started.
        assert "before_main_sigpipe_ignored=False" in log_path.read_text()
        assert _sigign_has_sigpipe(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_script(body: str) -> subprocess.CompletedProcess[str]:
    """Run `body` in a fresh Python with SIGPIPE at its default action (death)."""
    script = "import signal\nsignal.signal(signal.SIGPIPE, signal.SIG_DFL)\n" + textwrap.dedent(
        body
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)


_CLIENT_SEND = """
    import os, socket, sys
    from escrow_client import fdpass, protocol
    a, b = socket.socketpair()
    b.close()
    r, w = os.pipe()
    try:
        {send}
    except BrokenPipeError:
        print("EPIPE")
        sys.exit(0)
    print("the send to a closed peer did not fail")
    sys.exit(1)
"""


@pytest.mark.parametrize("send", [
    "fdpass.send_frame(a, protocol.encode(protocol.Status()))",
    "fdpass.send_frame(a, protocol.encode(protocol.Status()), r)",
], ids=["frame", "frame+fd"])
def test_client_send_to_a_closed_peer_is_epipe_not_sigpipe(send: str) -> None:
    """Incident: an app that had reset SIGPIPE to its default (many do) died of SIGPIPE when
    its holder hung up mid-call. Layer 2, client side: every send passes MSG_NOSIGNAL, so a
    closed peer is a BrokenPipeError the library can map, whatever the app's disposition."""
    result = _run_script(_CLIENT_SEND.format(send=send))
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert result.stdout.strip() == "EPIPE"


def test_client_send_control_plain_send_dies_of_sigpipe() -> None:
    """Control for the test above: the same script with a plain send (no MSG_NOSIGNAL) dies of
    SIGPIPE, so the test would catch a send path that lost the flag."""
    result = _run_script(_CLIENT_SEND.format(send="a.send(b'x')"))
    assert result.returncode == -signal.SIGPIPE, (result.returncode, result.stdout, result.stderr)


_HOLDER_SEND = """
    import os, sys
    import trio
    from escrow_client import protocol
    from escrowd.connection import Connection

    async def main():
        a, b = trio.socket.socketpair()
        b.close()
        conn = Connection(a, 1)
        master, slave = os.openpty()
        info = protocol.SessionInfo(owner="com.example.term", id="tab-1", state="draining")
        try:
            {send}
        except BrokenPipeError:
            print("EPIPE")
            return 0
        finally:
            conn.close()
            os.close(master)
            os.close(slave)
        print("the send to a closed peer did not fail")
        return 1

    sys.exit(trio.run(main))
"""


@pytest.mark.parametrize("send", [
    'await conn.send_error("busy", "x")',
    'await conn.send(protocol.Handoff(handoff_id="h", session=info, replay=b"L1" * 50000),'
    " fd=master)",
], ids=["error", "handoff+fd"])
def test_holder_send_to_a_closed_peer_is_epipe_not_sigpipe(send: str) -> None:
    """Incident: the holder was killed by SIGPIPE when an app hung up just before its handoff
    was sent. Layer 2, holder side: `Connection.send` passes MSG_NOSIGNAL, so even with
    SIGPIPE at its default action a closed peer is a BrokenPipeError, never a death."""
    result = _run_script(_HOLDER_SEND.format(send=send))
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert result.stdout.strip() == "EPIPE"


def test_holder_send_control_plain_trio_send_dies_of_sigpipe() -> None:
    """Control for the test above: a trio socket send without MSG_NOSIGNAL dies of SIGPIPE."""
    result = _run_script(_HOLDER_SEND.format(send="await a.send(b'x')"))
    assert result.returncode == -signal.SIGPIPE, (result.returncode, result.stdout, result.stderr)


BURST_LINES = 120_000  # about 0.95 MB through the PTY: several times the socket buffers
BURST = b"".join(b"L%d\r\n" % i for i in range(1, BURST_LINES + 1))
BURST_THEN_ECHO = f"seq -f L%.0f 1 {BURST_LINES}; while read x; do echo got-$x; done"


def wait_burst_drained(client: EscrowClient) -> protocol.SessionInfo:
    """Wait until the whole burst went through the holder (into its ring, or dropped)."""
    return wait_for(
        lambda: next((s for s in client.list() if s.id == SID and s.state == "draining"
                      and s.buffered_bytes + s.dropped_bytes == len(BURST)), None),
        20.0, "the whole burst drained",
    )


def test_handoff_send_deadline(make_holder: Callable[..., HolderProcess], pty_children) -> None:
    """Incident: an app asked for its session and then stopped reading (wedged on start-up),
    so the handoff, a replay far larger than the socket buffers, could not be sent. The send
    must give up at `send_deadline` and put the session back draining on the same fd with its
    ring untouched, the holder still serving, never marking it handed off; the next retrieve
    gets exactly the replay the session held before."""
    holder = make_holder("--send-deadline", "0.3", "--ring-bytes", str(4 << 20))
    client = hand_off(holder, pty_children, BURST_THEN_ECHO)
    before = wait_burst_drained(client)
    # What the ring holds is the newest `buffered_bytes` of the burst (see the ring test
    # below for why anything was dropped at all).
    held = BURST[before.dropped_bytes:]
    assert len(held) == before.buffered_bytes > 4 * 212992
    with RawClient(holder.socket, rcvbuf=4096) as raw:
        assert raw.hello().send_deadline == 0.3
        raw.send(protocol.Retrieve(id=SID))
        # We never read; the holder's send runs into its deadline while we stay connected.
        wait_state_logged(holder, "draining", "handoff send failed: deadline")
        after = wait_state(client, "draining")
        assert (after.buffered_bytes, after.dropped_bytes) == (
            before.buffered_bytes, before.dropped_bytes)
        assert_holder_serving(holder, client)
        # What reached us is a frame cut short, never a handoff an app could act on; the fd
        # that rode on its first byte is closed by the frame reader.
        with pytest.raises(protocol.FrameError):
            raw.receive()
        assert raw.fds == []
    assert [s for s, _ in state_changes(holder)] == ["held", "draining", "handing_off", "draining"]

    got = client.retrieve(SID)
    try:
        assert got.confirmed and os.isatty(got.fd)
        assert got.replay == held
        assert got.dropped_bytes == before.dropped_bytes
        # Same terminal, same child: it answers on the fd we got back.
        os.write(got.fd, b"ping\n")
        assert b"got-ping" in read_until(got.fd, b"got-ping")
    finally:
        os.close(got.fd)


def test_burst_below_the_ring_limit_is_replayed_whole(
    make_holder: Callable[..., HolderProcess], pty_children
) -> None:
    """Found while writing the send-deadline test: a ~0.95 MB burst into a 4 MiB ring came
    back without its first lines (dropped_bytes > 0), although the ring never reached its
    limit. A ring below `--ring-bytes` must drop nothing (docs/design.md §3: only an overflow drops
    the oldest bytes), or a relaunched app loses the start of what its child printed."""
    holder = make_holder("--ring-bytes", str(4 << 20))
    client = hand_off(holder, pty_children, BURST_THEN_ECHO)
    drained = wait_burst_drained(client)
    assert drained.dropped_bytes == 0
    got = client.retrieve(SID)
    try:
        assert got.replay == BURST
    finally:
        os.close(got.fd)


# --- step 4: the drain does not stop in time --------------------------------------------------


def test_a_drain_stops_within_any_budget_and_the_app_is_the_only_reader(
    make_holder: Callable[..., HolderProcess], pty_children
) -> None:
    """Incident pinned (issue 9, item 13): a retrieve whose drain could not be stopped within
    `drain_stop_budget` must not hand the fd over (two readers). A drain now stops at once
    (the terminal leaves the drain loop's set: escrowd.drain), so even a budget of a
    microsecond hands it off, and from then on the holder reads nothing of it: the replay
    and what the app reads after it run on from L1 with no line missing."""
    holder = make_holder("--drain-stop-budget", "0.000001")
    client, _ = counter_session(holder, pty_children)
    take_back_and_check(client, FIRST_LINES)
    status = client.status()
    assert (status.counters["handoffs_failed"], status.counters["handoffs"]) == (0, 1)
    assert [s for s, _ in state_changes(holder)] == ["held", "draining", "handing_off",
                                                     "handed_off"]


# --- step 7: the ack ------------------------------------------------------------------------


def test_no_ack_then_eof(holder: HolderProcess, pty_children) -> None:
    """Incident: an app received its handoff and crashed before acking. A sendmsg that
    succeeded proves only that the kernel queued the fd, so the holder must not mark the
    session handed off: on EOF without an ack it re-drains the same fd with the ring intact."""
    client, _ = counter_session(holder, pty_children)
    with RawClient(holder.socket) as raw:
        raw.hello()
        handoff, fd = raw.retrieve_handoff(SID)
        assert os.isatty(fd)
        assert handoff.session.state == "draining"
        assert handoff.replay.startswith(FIRST_LINES)
        assert info_of(client).state == "handing_off"
        stale_id = handoff.handoff_id
    # Closed without an ack; our copy of the fd was closed unread.
    wait_state_logged(holder, "draining", "no ack")
    wait_state(client, "draining")
    assert_holder_serving(holder, client)
    changes = state_changes(holder)
    assert [s for s, _ in changes] == ["held", "draining", "handing_off", "draining"]
    assert changes[2][1].startswith(f"retrieve handoff_id={stale_id}")
    assert changes[3][1] == "no ack: peer closed"

    take_back_and_check(client, handoff.replay)
    states = [s for s, _ in state_changes(holder)]
    assert states.count("handed_off") == 1 and states[-1] == "handed_off"
    assert f"acked handoff_id={stale_id}" not in holder.logs()


def test_ack_deadline_then_late_ack(make_holder: Callable[..., HolderProcess],
                                    pty_children) -> None:
    """Incident: an app received its handoff and hung (no ack, connection still open). At the
    ack deadline the holder must take the session back and drain it again while the app still
    holds its copy, unread, so output keeps flowing into the ring; the app's late ack then
    answers `ack_late` and changes nothing. Replay plus live output stays gap-free: at no
    moment were there two readers, and nothing was lost."""
    holder = make_holder("--ack-deadline", "0.5")
    client, _ = counter_session(holder, pty_children)
    with RawClient(holder.socket) as raw:
        # No timeout in the hello: the holder waits max(ack_deadline, hello.timeout).
        assert raw.hello(timeout=None).ack_deadline == 0.5
        handoff, fd = raw.retrieve_handoff(SID)
        assert os.isatty(fd)
        assert handoff.replay.startswith(FIRST_LINES)
        # We hold the fd, unread, and do not ack.
        wait_state_logged(holder, "draining", "no ack: deadline")
        back = wait_state(client, "draining")
        # The holder is the reader again: the child's new output lands in its ring.
        wait_state(client, "draining", min_buffered=back.buffered_bytes + len(b"L999\r\n") * 3)
        assert_holder_serving(holder, client)

        raw.send(protocol.Ack(id=SID, handoff_id=handoff.handoff_id))
        reply, reply_fd = raw.receive()
        assert isinstance(reply, protocol.Error) and reply_fd is None
        assert (reply.code, reply.id) == ("ack_late", SID)
        assert any(log_fields(line).get("handoff_id") == handoff.handoff_id
                   for line in holder.log_lines("ack_late"))
        assert wait_state(client, "draining").handoff_id is None
        raw.close_fd(fd)  # as the client library does on ack_late: never read, closed

    assert "handed_off" not in [s for s, _ in state_changes(holder)]
    take_back_and_check(client, handoff.replay)


def test_the_ack_deadline_stretches_to_the_clients_timeout(
    make_holder: Callable[..., HolderProcess], pty_children
) -> None:
    """Incident pinned (issue 9, item 6): a holder run with a short ack deadline took a
    session back from an app that was still inside its own (longer) timeout, so the app's
    ack, on time by its own clock, got `ack_late`, and the relaunch failed for no reason.
    The holder waits for the ack at least as long as the timeout the hello announced: an
    ack after 1 s, past `--ack-deadline 0.3` but inside the hello's 2 s, gets `done`."""
    holder = make_holder("--ack-deadline", "0.3")
    client, _ = counter_session(holder, pty_children)
    with RawClient(holder.socket) as raw:
        assert raw.hello(timeout=2.0).ack_deadline == 0.3
        handoff, fd = raw.retrieve_handoff(SID)
        time.sleep(1.0)  # the behaviour under test: an ack late by the holder's own deadline
        raw.send(protocol.Ack(id=SID, handoff_id=handoff.handoff_id))
        reply, _ = raw.receive()
        assert reply == protocol.Done(id=SID)
        tomb = info_of(client)
        assert (tomb.state, tomb.handoff_id) == ("handed_off", handoff.handoff_id)
        assert_gap_free_from_1(read_more_lines(fd, handoff.replay, 3))
    assert client.status().counters["handoffs_failed"] == 0


def test_a_repeated_ack_gets_done_and_an_ack_for_another_handoff_gets_ack_late(
    holder: HolderProcess, pty_children
) -> None:
    """Incident pinned (issue 9, item 7): an app whose first `done` was lost (its connection
    dropped after the ack) acked again and was told `ack_late`, so it closed a terminal it
    owned: the holder had already closed its copy, and the session hung up. PROTOCOL.md
    promises `done` to an ack repeated after the handoff completed, on the same connection
    or a new one; an ack naming any other handoff still gets `ack_late`."""
    client, _ = counter_session(holder, pty_children)
    with RawClient(holder.socket) as raw:
        raw.hello()
        handoff, fd = raw.retrieve_handoff(SID)
        ack = protocol.Ack(id=SID, handoff_id=handoff.handoff_id)
        for _ in range(2):
            raw.send(ack)
            assert raw.receive() == (protocol.Done(id=SID), None)
        raw.send(protocol.Ack(id=SID, handoff_id="0" * 32))
        reply, _ = raw.receive()
        assert isinstance(reply, protocol.Error)
        assert (reply.code, reply.id) == ("ack_late", SID)
        with RawClient(holder.socket) as again:
            again.hello()
            again.send(ack)
            assert again.receive() == (protocol.Done(id=SID), None)
        # Ownership moved at the first `done`: the fd is ours and carries on.
        assert_gap_free_from_1(read_more_lines(fd, handoff.replay, 3))
    assert info_of(client).state == "handed_off"
    assert client.status().counters["handoffs"] == 1


def test_retrieve_and_release_are_busy_during_a_handoff(holder: HolderProcess,
                                                        pty_children) -> None:
    """Incident: two instances of an app launched at once; the second asked for a session the
    first had just been handed (not acked yet). The second must get `busy` for both retrieve
    and release, never a second fd, and the first one's ack still completes the handoff."""
    client, _ = counter_session(holder, pty_children)
    with RawClient(holder.socket) as raw:
        raw.hello()
        handoff, fd = raw.retrieve_handoff(SID)
        assert info_of(client).state == "handing_off"

        with pytest.raises(Busy) as retrieving:
            client.retrieve(SID)
        assert retrieving.value.code == "busy"
        with pytest.raises(Busy) as releasing:
            client.release(SID)
        assert releasing.value.code == "busy"
        assert info_of(client).state == "handing_off"

        raw.send(protocol.Ack(id=SID, handoff_id=handoff.handoff_id))
        done, _ = raw.receive()
        assert done == protocol.Done(id=SID)
        tomb = info_of(client)
        assert (tomb.state, tomb.handoff_id) == ("handed_off", handoff.handoff_id)
        # Ownership moved at `done`: the fd is ours, and it carries on where the replay ended.
        assert_gap_free_from_1(read_more_lines(fd, handoff.replay, 3))
    assert [s for s, _ in state_changes(holder)] == [
        "held", "draining", "handing_off", "handed_off"]


# --- step 7: something else instead of the ack ----------------------------------------------


def _wrong_replies(handoff_id: str, pty_fd: int) -> dict[str, tuple[protocol.Message, int | None]]:
    return {
        "status": (protocol.Status(), None),
        "ack_other_handoff": (protocol.Ack(id=SID, handoff_id="0" * 32), None),
        "ack_other_session": (protocol.Ack(id="tab-2", handoff_id=handoff_id), None),
        "deposit_with_fd": (protocol.Deposit(id="tab-2"), pty_fd),
    }


@pytest.mark.parametrize(
    "wrong", ["status", "ack_other_handoff", "ack_other_session", "deposit_with_fd"]
)
def test_wrong_message_instead_of_ack(holder: HolderProcess, pty_children, wrong: str) -> None:
    """Incident: a buggy app answered a handoff with another request (or an ack for some other
    handoff) instead of its ack. That is not an ack: the app gets `bad_request`, the session
    goes back to draining and is never handed off, and nothing that came with the wrong
    message (an fd) stays open in the holder."""
    client, _ = counter_session(holder, pty_children)
    spare_master, spare_slave = os.openpty()
    try:
        with RawClient(holder.socket) as raw:
            raw.hello()
            handoff, fd = raw.retrieve_handoff(SID)
            message, extra_fd = _wrong_replies(handoff.handoff_id, spare_master)[wrong]
            raw.send(message, fd=extra_fd)
            reply, _ = raw.receive()
            assert isinstance(reply, protocol.Error)
            assert reply.code == "bad_request"
            # The frame was whole, so the connection goes on (a custodian connection
            # closed by the holder would end its custody while its app still reads).
            raw.send(protocol.Status())
            status, _ = raw.receive()
            assert isinstance(status, protocol.HolderStatus)
            raw.close_fd(fd)
    finally:
        os.close(spare_master)
        os.close(spare_slave)
    wait_state_logged(holder, "draining", "expected ack")
    wait_state(client, "draining")
    assert_holder_serving(holder, client)
    assert "handed_off" not in [s for s, _ in state_changes(holder)]
    take_back_and_check(client, handoff.replay)
    # Back to the baseline once the session is gone: no fd of the wrong message was kept.
    holder.wait_fds_at_baseline()


_FRAMED_NOT_MSGPACK = protocol.HEADER.pack(1) + b"\xc1"
_UNKNOWN_TYPE = msgspec.msgpack.encode({"type": "gimme", "id": SID})


@pytest.mark.parametrize("garbage", [
    random.Random(20240611).randbytes(4096),
    _FRAMED_NOT_MSGPACK,
    protocol.HEADER.pack(len(_UNKNOWN_TYPE)) + _UNKNOWN_TYPE,
    protocol.HEADER.pack(100) + b"cut short",
], ids=["random", "not_msgpack", "unknown_type", "cut_short"])
def test_garbage_instead_of_ack(holder: HolderProcess, pty_children, garbage: bytes) -> None:
    """Incident: an app (or something pretending to be one) answered a handoff with bytes that
    are not a message. No ack came: the session goes back to draining, the holder stays up,
    and once the session is released its fd count is back to the baseline."""
    client, _ = counter_session(holder, pty_children)
    with RawClient(holder.socket) as raw:
        raw.hello()
        handoff, fd = raw.retrieve_handoff(SID)
        raw.send_bytes(garbage)
        try:
            raw.sock.shutdown(socket.SHUT_WR)  # a frame cut short ends here, not at a timeout
        except OSError:
            pass  # the holder may already have closed: that is what we wait for next
        wait_closed_by_holder(raw)
        raw.close_fd(fd)
    wait_state_logged(holder, "draining", "no ack")
    wait_state(client, "draining")
    assert_holder_serving(holder, client)
    assert "handed_off" not in [s for s, _ in state_changes(holder)]
    take_back_and_check(client, handoff.replay)
    holder.wait_fds_at_baseline()
