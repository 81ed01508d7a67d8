"""The shortest path through a handoff, end to end."""

import os

from conftest import HolderProcess, PtyChild


def test_hand_off_and_retrieve(holder: HolderProcess, pty_children) -> None:
    child: PtyChild = pty_children(["sh", "-c", "echo hello-escrow; exec sleep 60"])
    assert b"hello-escrow" in child.read_available(until=b"hello-escrow")
    client = holder.client()
    client.hand_off("tab-1", child.master, child_pid=child.pid, label="sh")
    os.close(child.master)
    child.master = -1
    got = client.retrieve("tab-1")
    try:
        assert got.confirmed
        assert got.session.state == "draining"
        assert got.session.child_pid == child.pid
        assert got.session.child_alive is True
        assert os.isatty(got.fd)
    finally:
        os.close(got.fd)
