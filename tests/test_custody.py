"""Custody (docs/design.md §3): while the depositing connection lives, the app is the reader.

The holder must not read the fd, must not change its flags (O_NONBLOCK lives on the open file
description the app shares), and must refuse to hand it to anyone else. When custody ends,
the holder drains (and may set O_NONBLOCK meanwhile); a retrieve gives the fd back with the
flags the app had when draining started.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading

import pytest

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import CustodyHeld, EscrowClient, SessionInfo

LINES = 300


def _info(client: EscrowClient, sid: str) -> SessionInfo:
    (info,) = [s for s in client.list() if s.id == sid]
    return info


def _pty_masters(pid: int) -> int:
    """How many PTY masters process `pid` has open."""
    count = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{name}") in ("/dev/ptmx", "/dev/pts/ptmx")
        except FileNotFoundError:
            pass  # closed while we looked
    return count


def _nonblock(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK


def _set_nonblock(fd: int, on: bool) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK if on else flags & ~os.O_NONBLOCK)


def test_holder_does_not_read_while_custody_lives(holder: HolderProcess, pty_children) -> None:
    """Incident: the holder drained a session from the moment it was deposited, while the
    app was still reading it; the two readers split the output and the user's screen lost
    lines. While custody lives, every byte the child writes must reach the app."""
    child: PtyChild = pty_children([
        "bash", "-c",
        f'stty -echo; echo READY; read -r line; for i in $(seq 1 {LINES}); do echo "M$i"; done;'
        " exec sleep 60",
    ])
    assert b"READY" in child.read_available(until=b"READY\r\n")
    client = holder.client()
    with client.custody() as custody:
        custody.deposit("tab-1", child.master, child_pid=child.pid, label="bash")
        assert _info(client, "tab-1").state == "held"
        os.write(child.master, b"go\n")
        out = child.read_available(until=b"M%d\r\n" % LINES)
        got = [line for line in out.decode().split("\r\n") if line.startswith("M")]
        assert got == [f"M{i}" for i in range(1, LINES + 1)], "the app lost output to the holder"
        info = _info(client, "tab-1")
        assert info.state == "held"
        assert info.buffered_bytes == 0 and info.dropped_bytes == 0
        with pytest.raises(CustodyHeld) as refused:
            client.retrieve("tab-1")
        assert refused.value.code == "custody_held"
        assert _info(client, "tab-1").state == "held"


@pytest.mark.parametrize(
    "at_deposit,at_drain",
    [(False, False), (True, True), (False, True), (True, False)],
    ids=["blocking", "nonblocking", "blocking-then-nonblocking", "nonblocking-then-blocking"],
)
def test_flags_untouched_in_custody_and_restored_at_retrieve(
    holder: HolderProcess, pty_children, at_deposit: bool, at_drain: bool
) -> None:
    """Incident: the holder set O_NONBLOCK on the shared open file description at deposit
    (or never put it back), so the app's blocking reads failed with EAGAIN and a relaunched
    app got a non-blocking fd it did not ask for. The holder must leave the flags alone while
    custody lives and hand the fd back with the flags the app had when draining started."""
    child: PtyChild = pty_children(["sh", "-c", "echo hi; exec sleep 60"])
    assert b"hi" in child.read_available(until=b"hi")
    _set_nonblock(child.master, at_deposit)
    before = fcntl.fcntl(child.master, fcntl.F_GETFL)
    assert bool(before & os.O_NONBLOCK) == at_deposit
    client = holder.client()
    custody = client.custody()
    try:
        custody.deposit("tab-1", child.master, child_pid=child.pid)
        assert fcntl.fcntl(child.master, fcntl.F_GETFL) == before, "deposit changed the flags"
        with pytest.raises(CustodyHeld):
            client.retrieve("tab-1")
        assert fcntl.fcntl(child.master, fcntl.F_GETFL) == before, "a refused retrieve did"
        assert _info(client, "tab-1").state == "held"
        assert fcntl.fcntl(child.master, fcntl.F_GETFL) == before, "list did"
        # The app may change its own flags while it is the reader; draining starts from them.
        _set_nonblock(child.master, at_drain)
        at_drain_start = fcntl.fcntl(child.master, fcntl.F_GETFL)
    finally:
        custody.close()
    assert _info(client, "tab-1").state == "draining"
    # Draining: the holder reads the shared description non-blocking (docs/design.md §3).
    assert _nonblock(child.master), "the holder drains without O_NONBLOCK"
    got = client.retrieve("tab-1")
    try:
        assert got.confirmed
        assert fcntl.fcntl(got.fd, fcntl.F_GETFL) == at_drain_start
        assert bool(_nonblock(got.fd)) == at_drain
        # Same open file description: the app's old copy sees the restored flags too.
        assert fcntl.fcntl(child.master, fcntl.F_GETFL) == at_drain_start
    finally:
        os.close(got.fd)


def test_closing_custody_starts_draining(holder: HolderProcess, pty_children) -> None:
    """Incident: an app that closed its custody connection before a planned restart left its
    sessions `held` with no reader, so the child blocked on a full terminal. Closing custody
    must make the session `draining` by the time close() returns, and the holder then reads."""
    child: PtyChild = pty_children(["sh", "-c", "echo first; read x; echo after-close; "
                                    "exec sleep 60"])
    assert b"first" in child.read_available(until=b"first\r\n")
    client = holder.client()
    custody = client.custody()
    custody.deposit("tab-1", child.master, child_pid=child.pid)
    assert _info(client, "tab-1").state == "held"
    custody.close()
    info = _info(client, "tab-1")
    assert info.state == "draining"
    assert info.custodian_pid is None
    # The holder is the reader now: what the child writes goes into the replay.
    os.write(child.master, b"\n")
    wait_for(lambda: _info(client, "tab-1").buffered_bytes > len("after-close"), 5.0,
             "the holder to drain the child's output")
    os.close(child.master)
    child.master = -1
    got = client.retrieve("tab-1")
    try:
        assert b"after-close\r\n" in got.replay
        assert got.session.state == "draining"
    finally:
        os.close(got.fd)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_closing_custody_waits_for_a_slow_holder(holder: HolderProcess, pty_children) -> None:
    """Incident pinned (issue 9, item 12): `hand_off()` returned as soon as the app's side of
    the custody connection was closed, before the holder had even seen it; an app that
    then listed its sessions (or exited at once, trusting the docstring) saw them still
    `held`. With the holder slowed on purpose (stopped), `close()` must keep waiting; once
    the holder runs again and `close()` returns, one `list()`, with no waiting, says
    `draining`."""
    child: PtyChild = pty_children(["sh", "-c", "exec sleep 60"])
    client = holder.client()
    custody = client.custody()
    custody.deposit("tab-1", child.master, child_pid=child.pid)
    returned = threading.Event()

    def close() -> None:
        custody.close()
        returned.set()

    closer = threading.Thread(target=close)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _stopped(holder.pid), 5.0, "the holder stopped")
        closer.start()
        # The behaviour under test: close() does not return while the holder cannot act.
        assert not returned.wait(0.5), "close() returned before the holder saw custody end"
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    closer.join(10)
    assert returned.is_set()
    info = _info(client, "tab-1")
    assert (info.state, info.custodian_pid) == ("draining", None)


def test_release_in_custody(holder: HolderProcess, pty_children) -> None:
    """Incident: the user closed a tab and the app released it through its custody
    connection, but the holder kept (and later drained) the master, keeping the shell alive
    after its tab was gone. `custody.release(id)` must end the session as `released`."""
    child: PtyChild = pty_children(["sh", "-c", "exec sleep 60"])
    client = holder.client()
    with client.custody() as custody:
        custody.deposit("tab-1", child.master, child_pid=child.pid)
        assert _info(client, "tab-1").state == "held"
        assert _pty_masters(holder.pid) == 1
        custody.release("tab-1")
        # `released` is answered after the holder closed its copy of the master.
        assert _pty_masters(holder.pid) == 0
        info = _info(client, "tab-1")
        assert info.state == "released"
        assert info.buffered_bytes == 0
    # Ending custody afterwards does not bring it back.
    assert _info(client, "tab-1").state == "released"
